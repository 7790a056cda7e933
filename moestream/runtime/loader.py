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
from ..units import count
from . import native
from .attention import use_exact_attention
from .backend import ExecutionPlan, compute_dtype, resolve
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

# glibc's mallopt parameter number, and the threshold set under a budget
# (what the kernels keep of a temporary, `kScratchKept` in csrc: smaller
# buffers come from the heap and are reused, larger ones are mapped and
# returned). docs/profile-cpu.md measures it.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 << 20


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
    execution: ExecutionPlan  # the backend that runs, every default resolved

    def drop_cache(self) -> None:
        """Drop the blobs from the page cache (a cold start). A mapped layer's
        pages leave its mapping first: a page some process maps is not dropped."""
        if self.execution.mapped:
            for cache in self.stats.native_layers.values():
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
        its fields or its Tuning's, e.g. `load(out, memory_budget="8G", policy="lru")`.
    tokenizer: reuse one already loaded from `path` (its memory counts as process).
    tokenizer_config: extra tokenizer options, as `mlx_lm.load` takes them,
        e.g. {"chat_template": "..."} (ignored with `tokenizer`).
    progress: progress bars (stderr) for the checksums and the first reads.
    shard: cuts the lazily built model to the range of decoder layers it
        returns, before any weight is read (a pipeline rank's share).
    """
    cfg = (config or RuntimeConfig()).with_options(**options)
    directory = Path(path)
    manifest = load_manifest(directory)
    if cfg.verify:  # dense, config and tokenizer files, before any is used
        check_files(directory, manifest, progress=progress)
    model_config = load_config(directory)
    tokenizer = tokenizer or _tokenizer(directory, model_config, tokenizer_config)
    execution, model, manifest, model_config, switches, layers = _planned(
        directory, manifest, model_config, cfg, shard
    )
    plan = execution.memory
    log.info(execution.describe())
    log.info(plan.describe())
    _bound_allocators(plan)
    stats = RuntimeStats(recording=cfg.tuning.record_trace)
    store = ExpertStore(directory, manifest, verify=cfg.verify)
    tier = native.host_tier(plan, cfg.tuning.readers) if plan.host_records else None
    streaming = _stream(model, switches, layers, store, execution, stats, tier)
    _start(model, streaming, tier, stats, execution, model_config, progress)
    compute = getattr(mx, execution.compute)
    model.moestream = Runtime(
        directory, manifest, plan, stats, store, compute, cfg, execution
    )
    return model, tokenizer


def _planned(
    directory: Path,
    manifest: Manifest,
    model_config: dict,
    cfg: RuntimeConfig,
    shard: Shard | None,
) -> tuple[ExecutionPlan, nn.Module, Manifest, dict, dict, dict]:
    """The lazily built model (`_build`) and its execution plan, which sizes
    this process as it is after the build and the kernel's first-use check:
    `load` and `plan_for` measure at the same point."""
    compute = getattr(mx, compute_dtype(cfg.dtype, manifest.dtype))
    model, manifest, model_config, switches, layers = _build(
        directory, manifest, model_config, compute, shard
    )
    execution = resolve(
        cfg,
        manifest,
        model_config,
        model,
        switches.values(),
        _process_bytes,
        _nbytes(model),
    )
    return execution, model, manifest, model_config, switches, layers


def _tokenizer(
    directory: Path, model_config: dict, extra: dict | None
) -> TokenizerWrapper:
    return load_tokenizer(
        directory,
        _tokenizer_options(extra),
        eos_token_ids=model_config.get("eos_token_id"),
    )


def _stream(
    model: nn.Module,
    switches: dict[str, nn.Module],
    layers: dict[str, ExpertLayer],
    store: ExpertStore,
    execution: ExecutionPlan,
    stats: RuntimeStats,
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
            execution.memory.capacity,
            getattr(mx, execution.compute),
            stats,
            outstanding,
            execution,
            tier,
        )
        replace_module(model, spath, streaming[spath])
    return streaming


def _start(
    model: nn.Module,
    streaming: dict[str, StreamingSwitchGLU],
    tier: object | None,
    stats: RuntimeStats,
    execution: ExecutionPlan,
    model_config: dict,
    progress: bool,
) -> None:
    """Chain the read-ahead, read the dense weights, fill what all fits, and
    start the counters from zero."""
    if tier is not None:  # counted after its layers (a GPU's fills count there)
        stats.native.append(tier)
    plan = execution.memory
    if streaming:
        streaming[max(streaming, key=layer_index)].last_in_model()
    if execution.prefetch:
        extra = execution.tuning.prefetch_extra
        chain_prefetch(model, streaming, model_config, extra)
    native.start_kernel_pool(execution)
    native.use_dense_kernel(model, execution)  # q/k/v/o, router, lm_head, norms
    if use_exact_attention(model, execution):  # q @ k.T, softmax, scores @ v
        _bound_allocators(plan, scores_written=False)
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
    if execution.fill_tier:
        _fill_tier(tier, streaming.values(), progress)
    stats.reset()  # what loading read is not the run's
    model.eval()


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
            experts = count(layer.num_experts, "expert")
            raise FormatError(
                f"Layer {layer.layer}: the blob's {experts} of "
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
        backend="slots",
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
    return execution_for(path, config, shard).memory


def execution_for(
    path: str | Path, config: RuntimeConfig | None = None, shard: Shard | None = None
) -> ExecutionPlan:
    """The execution plan `load(path, config, shard=shard)` would make, without
    reading a weight (BudgetError as `load` raises it)."""
    directory = Path(path)
    manifest = load_manifest(directory)
    model_config = load_config(directory)
    cfg = config or RuntimeConfig()
    return _planned(directory, manifest, model_config, cfg, shard)[0]


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


def _bound_allocators(plan: MemoryPlan, scores_written: bool = True) -> None:
    """Keep freed memory from piling up outside the plan (process-wide settings).

    MLX keeps freed buffers for reuse: allow a quarter of the activations'
    share, plus the attention scores' share where no scores are written (the
    CPU kernel's exact attention). glibc raises its mmap threshold after
    large frees, so freed buffers stay in the heap and in RSS: pin the
    threshold (MMAP_THRESHOLD). What each bound costs and saves:
    docs/profile-cpu.md.
    Without a budget, nothing is bounded.
    """
    if plan.budget is None:
        return
    mx.set_cache_limit(plan.activations // 4 + (0 if scores_written else plan.scores))
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def stats(model: nn.Module) -> RuntimeStats:
    """The counters of a model returned by `load`: of the calls that have run
    (the native engine counts a call when MLX runs it; synchronize the
    stream a step is computed on, such as mlx-lm's generation_stream, first
    to count the calls still in flight)."""
    return runtime_of(model).stats.collect()


def runtime_of(model: nn.Module) -> Runtime:
    rt = getattr(model, "moestream", None)
    if rt is None:
        raise ValueError("This model was not loaded by moestream.load.")
    return rt


def resolve_dtype(dtype: str, stored: str) -> str:
    return compute_dtype(dtype, stored)


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
