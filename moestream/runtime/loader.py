"""manifest -> an mlx-lm model whose routed experts stream from disk."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import resource
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer

from ..families import (
    build_model,
    cast_floating,
    quantize_as_configured,
    replace_module,
    switch_modules,
)
from ..formats import ExpertLayer, FormatError, Manifest, load_manifest
from ..formats.manifest import inside
from ..formats.verify import check_files, check_safetensors
from ..units import parse_size
from .config import RuntimeConfig
from .plan import (  # noqa: F401  (their old home)
    RESERVE_BYTES,
    RESERVE_FRACTION,
    BudgetError,
    MemoryPlan,
    plan_memory,
)
from .prefetch import chain_prefetch, router_predictor  # noqa: F401  (old home)
from .stats import RuntimeStats
from .store import ExpertStore, check_layers
from .switch import Outstanding, StreamingSwitchGLU

log = logging.getLogger(__name__)

# glibc's mallopt parameter number, and the threshold set under a budget.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


@dataclass
class Runtime:
    """What `load` attaches to the model: manifest, plan, stats, open blobs."""

    directory: Path
    manifest: Manifest
    plan: MemoryPlan
    stats: RuntimeStats
    store: ExpertStore
    compute_dtype: mx.Dtype
    config: RuntimeConfig


def load(
    path: str | Path,
    config: RuntimeConfig | None = None,
    tokenizer: TokenizerWrapper | None = None,
    **options: object,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a converted model for `mlx_lm.generate` / `mlx_lm.stream_generate`.

    config: the runtime options (`RuntimeConfig`); keyword `options` override
        its fields, e.g. `load(out, memory_budget="8G", policy="lru")`.
    tokenizer: reuse one already loaded from `path` (its memory counts as process).
    """
    cfg = replace(config or RuntimeConfig(), **options)  # validates the options
    directory = Path(path)
    manifest = load_manifest(directory)
    if cfg.verify:  # dense, config and tokenizer files, before any is used
        check_files(directory, manifest)
    compute = getattr(mx, resolve_dtype(cfg.dtype, manifest.dtype))
    model_config = load_config(directory)
    if tokenizer is None:
        tokenizer = load_tokenizer(
            directory,
            {"trust_remote_code": False},  # reliability: never run a model's code
            eos_token_ids=model_config.get("eos_token_id"),
        )
    process = _process_bytes()
    model = build_model(model_config)
    switches = switch_modules(model)
    layers = check_layers(manifest, switches)
    _load_dense(model, directory, manifest, model_config)
    _check_expert_shapes(switches, layers)
    cast_floating(model, compute)
    budget = cfg.memory_budget
    plan = plan_memory(
        manifest,
        model_config,
        _nbytes(model),
        compute,
        process,
        cfg.context,
        parse_size(budget) if budget is not None else None,
        cfg.cache_experts,
        cfg.spare_slot,
    )
    log.info(plan.describe())
    if plan.budget is not None:
        _bound_allocators(plan)
    stats = RuntimeStats(recording=cfg.record_trace)
    store = ExpertStore(directory, manifest, verify=cfg.verify)
    outstanding = Outstanding()
    streaming = {}
    for spath, module in switches.items():
        streaming[spath] = StreamingSwitchGLU(
            module,
            layers[spath],
            store,
            plan.capacity,
            compute,
            stats,
            outstanding,
            cfg,
        )
        replace_module(model, spath, streaming[spath])
    if cfg.prefetches:  # the native engine's read-ahead
        chain_prefetch(model, streaming, model_config, cfg.prefetch_extra)
    mx.eval(model.parameters())
    for layer in streaming.values():
        layer.fill_if_all_fit()  # then decode never waits on the host
    stats.reset()
    model.eval()
    model.moestream = Runtime(directory, manifest, plan, stats, store, compute, cfg)
    return model, tokenizer


def _check_expert_shapes(
    switches: dict[str, nn.Module], layers: dict[str, ExpertLayer]
) -> None:
    """Before expert memory is sized from the manifest: it holds what the model
    expects (a hostile manifest with a huge sparse blob is refused here)."""
    for spath, module in switches.items():
        layer = layers[spath]
        params = tree_flatten(module.parameters())
        want = {k: tuple(v.shape[1:]) for k, v in params}
        got = {s.name: s.shape for s in layer.segments}
        if want != got or any(v.shape[0] != layer.num_experts for _, v in params):
            raise FormatError(
                f"Layer {layer.layer}: the blob's {layer.num_experts} experts of "
                f"{sorted(got.items())[:4]} do not match the model's experts "
                f"{sorted(want.items())[:4]}; convert again."
            )


def budget_for(
    path: str | Path,
    capacity: int,
    context: int = 4096,
    options: RuntimeConfig | None = None,
) -> int:
    """A --memory-budget that holds `capacity` slots per layer: the smallest,
    plus 1 % for the process growing between this call and `load`.

    Plans on a lazily loaded model: no weight is read.
    """
    directory = Path(path)
    manifest = load_manifest(directory)
    config = load_config(directory)
    model = build_model(config)
    _load_dense(model, directory, manifest, config)
    compute = getattr(mx, resolve_dtype("auto", manifest.dtype))
    cast_floating(model, compute)
    plan = plan_memory(
        manifest,
        config,
        _nbytes(model),
        compute,
        _process_bytes(),
        context,
        None,
        capacity,
        (options or RuntimeConfig()).spare_slot,
    )
    unreserved = plan.total - plan.reserve + RESERVE_BYTES
    return math.ceil(1.01 * unreserved / (1 - RESERVE_FRACTION))


def _bound_allocators(plan: MemoryPlan) -> None:
    """Keep freed memory from piling up outside the plan (process-wide settings).

    MLX keeps freed buffers for reuse: allow a quarter of the activations'
    share. glibc raises its mmap threshold after large frees, so freed
    buffers stay in the heap and in RSS: pin the threshold at 1 MiB.
    Measured at an 800 MB budget, 300-token prompt: peak RSS 806 -> 682 MB,
    same speed.
    """
    mx.set_cache_limit(plan.activations // 4)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def stats(model: nn.Module) -> RuntimeStats:
    """The counters of a model returned by `load`."""
    return runtime_of(model).stats.collect()


def runtime_of(model: nn.Module) -> Runtime:
    rt = getattr(model, "moestream", None)
    if rt is None:
        raise ValueError("This model was not loaded by moestream.load.")
    return rt


def resolve_dtype(dtype: str, stored: str) -> str:
    if dtype != "auto":
        return dtype
    return "float32" if mx.default_device() == mx.cpu else stored


def dense_weights(directory: Path, manifest: Manifest) -> dict[str, mx.array]:
    """The dense safetensors files of a converted model, checked and opened lazily."""
    weights = {}
    for name in manifest.dense_files:
        f = inside(directory, name)
        if not f.is_file():
            raise FormatError(f"Dense weights {f} are missing; convert again.")
        # reliability: MLX's reader fails with bare RuntimeErrors; check first.
        for problem in check_safetensors(directory, name):
            raise FormatError(f"Dense weights {problem}; convert again.")
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise FormatError(f"Cannot read dense weights {f}: {e}") from e
    return weights


def _load_dense(
    model: nn.Module, directory: Path, manifest: Manifest, config: dict
) -> None:
    weights = dense_weights(directory, manifest)
    quantize_as_configured(model, config, weights)
    # The expert tensors stream from blobs: keep the lazy, never-evaluated ones.
    placeholders = list(_expert_params(model).items())
    try:
        model.load_weights(list(weights.items()) + placeholders, strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # reliability: MLX lists one per line
        raise FormatError(
            f"Dense weights do not fit the model: {detail[:300]}; convert again."
        ) from e


def _expert_params(model: nn.Module) -> dict[str, mx.array]:
    switches = switch_modules(model)
    return {
        k: v
        for k, v in tree_flatten(model.parameters())
        if any(k.startswith(s + ".") for s in switches)
    }


def _nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters other than the routed experts."""
    total = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    return total - sum(v.nbytes for v in _expert_params(model).values())


def _process_bytes() -> int:
    """Resident memory of this process now (interpreter, libraries)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss if sys.platform == "darwin" else rss * 1024
