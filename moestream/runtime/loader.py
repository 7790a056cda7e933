"""manifest -> an mlx-lm model whose routed experts stream from disk."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_config, load_tokenizer
from tqdm import tqdm

from ..families import (
    build_model,
    cast_floating,
    layer_index,
    quantize_as_configured,
    replace_module,
    switch_modules,
)
from ..formats import ExpertLayer, FormatError, Manifest, load_manifest
from ..formats.manifest import inside
from ..formats.verify import check_files, check_safetensors
from ..units import human_bytes, parse_size
from . import native
from .config import RuntimeConfig
from .memory import (  # noqa: F401  (re-exported: the plan's old home)
    PREFILL_STEP,
    RESERVE_BYTES,
    RESERVE_FRACTION,
    BudgetError,
    MemoryPlan,
    _budget_holding,
    _process_bytes,
    available_memory,
    plan_memory,
)
from .prefetch import chain_prefetch, router_predictor  # noqa: F401  (old home)
from .stats import RuntimeStats
from .store import ExpertStore, check_layers
from .switch import Outstanding, StreamingSwitchGLU

log = logging.getLogger(__name__)

# O_DIRECT's alignment of a destination (RuntimeConfig.direct_io): 4 KiB
# covers every Linux block size (csrc ExpertCache::kDirectAlign).
DIRECT_ALIGN = 4096
# glibc's mallopt parameter number, and the threshold set under a budget.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


# Cuts a lazily built model to the decoder layers one process runs; returns them.
Shard = Callable[[nn.Module], range]


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

    def drop_cache(self) -> None:
        """Drop the blobs from the page cache (a cold start). A mapped layer's
        pages leave its mapping first: a page some process maps is not dropped."""
        for cache in self.stats.native_layers.values():
            if cache.mapped:  # type: ignore[attr-defined]
                cache.unmap_pages()  # type: ignore[attr-defined]
        self.store.drop_cache()


def load(
    path: str | Path,
    config: RuntimeConfig | None = None,
    tokenizer: TokenizerWrapper | None = None,
    tokenizer_config: dict | None = None,
    progress: bool = False,
    shard: Shard | None = None,
    **options: object,
) -> tuple[nn.Module, TokenizerWrapper]:
    """Load a converted model for `mlx_lm.generate` / `mlx_lm.stream_generate`.

    config: the runtime options (`RuntimeConfig`); keyword `options` override
        its fields, e.g. `load(out, memory_budget="8G", policy="lru")`.
    tokenizer: reuse one already loaded from `path` (its memory counts as process).
    tokenizer_config: extra tokenizer options, as `mlx_lm.load` takes them,
        e.g. {"chat_template": "..."} (ignored with `tokenizer`).
    progress: progress bars (stderr) for the checksums and the first reads.
    shard: cuts the lazily built model to the range of decoder layers it
        returns, before any weight is read (a pipeline rank's share).
    """
    cfg = replace(config or RuntimeConfig(), **options)  # validates the options
    _warn_fallback(cfg)
    directory = Path(path)
    manifest = load_manifest(directory)
    if cfg.verify:  # dense, config and tokenizer files, before any is used
        check_files(directory, manifest, progress=progress)
    compute = getattr(mx, resolve_dtype(cfg.dtype, manifest.dtype))
    model_config = load_config(directory)
    tokenizer = tokenizer or _tokenizer(directory, model_config, tokenizer_config)
    process = _process_bytes()
    model, manifest, model_config, switches, layers = _build(
        directory, manifest, model_config, compute, shard
    )
    plan, cfg = _plan_resolved(manifest, model_config, model, compute, process, cfg)
    log.info(plan.describe())
    _bound_allocators(plan)
    stats = RuntimeStats(recording=cfg.record_trace)
    store = ExpertStore(directory, manifest, verify=cfg.verify)
    tier = native.host_tier(plan, cfg.readers) if plan.host_records else None
    streaming = _stream(model, switches, layers, store, plan, compute, stats, cfg, tier)
    _start(model, streaming, tier, stats, manifest, plan, cfg, model_config, progress)
    stats.reset()
    model.eval()
    model.moestream = Runtime(directory, manifest, plan, stats, store, compute, cfg)
    return model, tokenizer


def _tokenizer(
    directory: Path, model_config: dict, extra: dict | None
) -> TokenizerWrapper:
    return load_tokenizer(
        directory,
        _tokenizer_options(extra),
        eos_token_ids=model_config.get("eos_token_id"),
    )


def _warn_fallback(cfg: RuntimeConfig) -> None:
    """A slower engine than expected: never silently."""
    if cfg.engine is None and cfg.engine_used == "python":
        reason = native.fallback_reason()
        if reason:
            log.warning("the python engine runs instead of the native one: %s", reason)


def _stream(
    model: nn.Module,
    switches: dict[str, nn.Module],
    layers: dict[str, ExpertLayer],
    store: ExpertStore,
    plan: MemoryPlan,
    compute: mx.Dtype,
    stats: RuntimeStats,
    cfg: RuntimeConfig,
    tier: object | None,
) -> dict[str, StreamingSwitchGLU]:
    """Put a streaming SwitchGLU in place of each of the model's SwitchGLUs."""
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
            tier,
        )
        replace_module(model, spath, streaming[spath])
    return streaming


def _start(
    model: nn.Module,
    streaming: dict[str, StreamingSwitchGLU],
    tier: object | None,
    stats: RuntimeStats,
    manifest: Manifest,
    plan: MemoryPlan,
    cfg: RuntimeConfig,
    model_config: dict,
    progress: bool,
) -> None:
    """Chain the read-ahead, read the dense weights, fill what all fits."""
    if tier is not None:  # counted after its layers (a GPU's fills count there)
        stats.native.append(tier)
    every = sum(layer.num_experts for layer in manifest.layers)
    full_tier = tier is not None and plan.host_records >= every
    # The native engine's read-ahead; by default none into a tier that holds
    # every record (read at load: nothing is left to read ahead), nor on a GPU
    # whose kernels resolve the tier unless its reads are direct (buffered,
    # reads ahead lost beyond RAM; docs/gpu.md measures both).
    on_device = tier is not None and plan.host_pinned and cfg.device_resolve
    on_device = on_device and not cfg.direct_io
    # Nor, with direct_io and no tier, as kernel readahead into a page cache
    # that direct reads skip.
    no_target = cfg.direct_io and tier is None
    if cfg.prefetches and not (
        (full_tier or on_device or no_target) and cfg.prefetch is None
    ):
        chain_prefetch(model, streaming, model_config, cfg.prefetch_extra)
    native.use_dense_kernel(model, cfg)  # cpu_kernel: attention, router, lm_head
    mx.eval(model.parameters())
    all_fit = plan.capacity >= plan.num_experts
    bar = tqdm(
        streaming.values(),
        "experts",
        unit="layer",
        delay=1.0,  # only a step that takes more than a second shows a bar
        disable=not (progress and all_fit),
    )
    for layer in bar:
        layer.fill_if_all_fit()  # then decode never waits on the host
    if full_tier:
        _fill_tier(tier, streaming.values(), progress)


def _fill_tier(tier: object, layers: object, progress: bool) -> None:
    """A host tier that holds every record reads them all now, in file order on
    its reader threads, so no routed miss waits for a first read (a failed one
    is read again, and raises, when routed)."""
    layers = list(layers)
    bar = tqdm(layers, "host tier", unit="layer", delay=1.0, disable=not progress)
    for layer in bar:
        layer.preload_tier()
        tier.drain()  # type: ignore[attr-defined]


def _tokenizer_options(extra: dict | None) -> dict:
    if (extra or {}).get("trust_remote_code"):
        raise ValueError(
            "moestream never runs a model's own code: drop trust_remote_code "
            "from the tokenizer options."
        )
    return {**(extra or {}), "trust_remote_code": False}


def _plan_model(
    manifest: Manifest,
    config: dict,
    model: nn.Module,
    compute: mx.Dtype,
    process: int,
    cfg: RuntimeConfig,
) -> MemoryPlan:
    budget = parse_size(cfg.memory_budget) if cfg.memory_budget is not None else None
    plan = plan_memory(
        manifest,
        config,
        _nbytes(model),
        compute,
        process,
        cfg.context,
        None if cfg.mapped else budget,
        cfg.cache_experts,
        cfg.spare_slot,
        cfg.concurrency,
    )
    if cfg.mapped:
        return _plan_mapped(plan, budget)
    return plan_host_tier(plan, manifest, cfg)


def _plan_resolved(
    manifest: Manifest,
    config: dict,
    model: nn.Module,
    compute: mx.Dtype,
    process: int,
    cfg: RuntimeConfig,
) -> tuple[MemoryPlan, RuntimeConfig]:
    """The plan, and `cfg` with `mapped` decided: left unset, on where a CPU's
    default slots cannot hold every expert and the kernel covers every layer."""
    if cfg.mapped:
        native.require_mapped(cfg, compute)
    plan = _plan_model(manifest, config, model, compute, process, cfg)
    if cfg.mapped is not None:
        return plan, cfg
    auto = (
        plan.capacity < plan.num_experts
        and cfg.memory_budget is None
        and cfg.cache_experts is None
        and cfg.host_budget is None
        and not cfg.direct_io
        and cfg.engine_used == "native"
        and mx.default_device() == mx.cpu
        and compute == mx.float32
        and native.covers_every_layer(switch_modules(model).values(), cfg)
    )
    cfg = replace(cfg, mapped=auto)
    if not auto:
        return plan, cfg
    log.info(
        "a slot for every expert does not fit: the experts stay mapped, the "
        "page cache holds them (--no-mapped: slots)"
    )
    return _plan_model(manifest, config, model, compute, process, cfg), cfg


def _plan_mapped(plan: MemoryPlan, budget: int | None) -> MemoryPlan:
    """RuntimeConfig.mapped: no slots; the budget holds the rest."""
    plan = replace(plan, capacity=0, budget=budget, mapped=True)
    if budget is not None and plan.total > budget:
        raise BudgetError(
            f"Dense weights, KV cache and activations need "
            f"{human_bytes(plan.total, up=True)}, more than the budget "
            f"{human_bytes(budget)}; give --memory-budget "
            f"{human_bytes(plan.total, up=True)} or more, or a shorter --context."
        )
    return plan


def plan_host_tier(
    plan: MemoryPlan, manifest: Manifest, cfg: RuntimeConfig
) -> MemoryPlan:
    """The native engine's host tier under `cfg.host_budget`: on a GPU always
    (the records a call copies to its slots live there; default: every record
    if that fits in half the memory available now, else that half), on a CPU
    only when a budget is given (the page cache is its host tier)."""
    if cfg.engine_used != "native" or plan.capacity >= plan.num_experts:
        return plan
    on_gpu = mx.default_device() != mx.cpu
    if cfg.host_budget is None and not on_gpu:
        return plan
    record = max(layer.record_nbytes for layer in manifest.layers)
    if cfg.direct_io:  # each record block-aligned, for O_DIRECT reads into it
        record = -(-record // DIRECT_ALIGN) * DIRECT_ALIGN
    every = sum(layer.num_experts for layer in manifest.layers)
    if cfg.host_budget is None:
        budget = min(every * record, available_memory() // 2)
    else:
        budget = parse_size(cfg.host_budget)
    records = min(every, budget // record)
    if records < plan.capacity:  # one call's misses are read into it at once
        raise BudgetError(
            f"Host budget {human_bytes(budget)} holds {records} expert records; "
            f"one call of {plan.capacity} slots needs {plan.capacity} "
            f"({human_bytes(plan.capacity * record, up=True)}): give --host-budget "
            f"{human_bytes(plan.capacity * record, up=True)} or more."
        )
    return replace(
        plan,
        host_records=records,
        host_record=record,
        host_budget=budget if cfg.host_budget is not None else None,
        host_pinned=on_gpu,
    )


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
    shard: Shard | None = None,
) -> int:
    """The smallest --memory-budget that holds `capacity` slots per layer (the
    process's size is rounded up: its growth before `load` moves nothing).

    Plans on a lazily loaded model: no weight is read.
    """
    cfg = replace(
        options or RuntimeConfig(),
        memory_budget=None,
        cache_experts=capacity,
        context=context,
    )
    plan = plan_for(path, cfg, shard)
    return _budget_holding(plan.total - plan.reserve)


def plan_for(
    path: str | Path, config: RuntimeConfig | None = None, shard: Shard | None = None
) -> MemoryPlan:
    """The memory plan `load(path, config, shard=shard)` would make, without
    reading a weight.

    Raises BudgetError as `load` would.
    """
    cfg = config or RuntimeConfig()
    directory = Path(path)
    manifest = load_manifest(directory)
    model_config = load_config(directory)
    compute = getattr(mx, resolve_dtype(cfg.dtype, manifest.dtype))
    model, manifest, model_config, _, _ = _build(
        directory, manifest, model_config, compute, shard
    )
    process = _process_bytes()
    return _plan_resolved(manifest, model_config, model, compute, process, cfg)[0]


def _build(
    directory: Path,
    manifest: Manifest,
    model_config: dict,
    compute: mx.Dtype,
    shard: Shard | None,
) -> tuple[nn.Module, Manifest, dict, dict, dict]:
    """What `load` and `plan_for` start from: mlx-lm's model of `model_config`,
    cut by `shard`, its dense weights loaded lazily and cast to `compute`, its
    expert tensors left unread; with the (cut) manifest and config, and the
    MoE modules and their manifest layers."""
    model = build_model(model_config)
    weights = dense_weights(directory, manifest)  # lazy: nothing is read yet
    # Quantized before the cut: every rank then draws the random numbers that
    # mlx-lm's load draws for the whole model, so a seed means the same to all.
    quantize_as_configured(model, model_config, weights)
    manifest, model_config, keep = _cut(model, manifest, model_config, shard)
    switches = switch_modules(model)
    layers = check_layers(manifest, switches)
    _load_dense(model, weights, keep)
    _check_expert_shapes(switches, layers)  # before sizing memory from the manifest
    cast_floating(model, compute)
    return model, manifest, model_config, switches, layers


def _cut(
    model: nn.Module, manifest: Manifest, config: dict, shard: Shard | None
) -> tuple[Manifest, dict, range | None]:
    """Apply `shard`: the manifest of its layers' experts only, a config whose
    layer count (what the KV cache is planned for) is its own, and its layers."""
    if shard is None:
        return manifest, config, None
    keep = shard(model)
    mine = tuple(x for x in manifest.layers if layer_index(x.module) in keep)
    n = {"num_hidden_layers": len(keep)}
    config = {**config, **n}
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **n}
    return replace(manifest, layers=mine), config, keep


def _bound_allocators(plan: MemoryPlan) -> None:
    """Keep freed memory from piling up outside the plan (process-wide settings).

    MLX keeps freed buffers for reuse: allow a quarter of the activations'
    share. glibc raises its mmap threshold after large frees, so freed
    buffers stay in the heap and in RSS: pin the threshold at 1 MiB.
    Measured at an 800 MB budget, 300-token prompt: peak RSS 806 -> 682 MB,
    same speed. Without a budget, nothing is bounded.
    """
    if plan.budget is None:
        return
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
    model: nn.Module, weights: dict[str, mx.array], keep: range | None = None
) -> None:
    if keep is not None:  # lazy: the other layers' tensors are never read
        weights = {k: v for k, v in weights.items() if _in_layers(k, keep)}
    # The expert tensors stream from blobs: keep the lazy, never-evaluated ones.
    placeholders = list(_expert_params(model).items())
    try:
        model.load_weights(list(weights.items()) + placeholders, strict=True)
    except ValueError as e:
        detail = " ".join(str(e).split())  # reliability: MLX lists one per line
        raise FormatError(
            f"Dense weights do not fit the model: {detail[:300]}; convert again."
        ) from e


def _in_layers(name: str, keep: range) -> bool:
    """A dense tensor of a kept decoder layer, or of none (embeddings, head)."""
    try:
        return layer_index(name) in keep
    except ValueError:
        return True


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
