"""The execution plan: (RuntimeConfig, device, manifest, memory) -> one backend.

`resolve` runs once, at load (and for `moestream plan`): it asks which device
this is, whether the extension runs here, whether its CPU kernel is exact,
which memory plan fits, and names one backend of a closed set with its
parameters. Nothing downstream asks again: the streaming layers, the engines,
the bench and the server read the plan.

Backends:
- cpu-slots: the native engine on a CPU; experts copied into resident slots,
  computed by the exact CPU kernel where it covers the layer.
- cpu-mapped: the native engine on a CPU; no slots, the CPU kernel computes
  each routed expert where its record lies in the page cache.
- cuda-tiered: the native engine on an NVIDIA GPU; slots on the device, a
  pinned host tier of records between the disk and them.
- python: the reference path (one host sync per MoE layer), and the fallback
  where the extension cannot run (macOS builds none).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn

from ..formats import Manifest
from ..units import count, human_bytes, parse_size
from . import native
from .config import RuntimeConfig, Tuning
from .memory import (
    STAGING_RECORDS,
    BudgetError,
    MemoryPlan,
    available_memory,
    mapped_window,
    plan_memory,
    reserve_for,
)

log = logging.getLogger(__name__)

CPU_SLOTS, CPU_MAPPED, CUDA_TIERED, PYTHON = (
    "cpu-slots",
    "cpu-mapped",
    "cuda-tiered",
    "python",
)
BACKENDS = (CPU_SLOTS, CPU_MAPPED, CUDA_TIERED, PYTHON)

# MLX's CUDA gather_qmm (and quantized_matmul) runs its vector kernel (qmv)
# on a call of fewer than 8 rows, its matrix kernel (qmm_sm80 for 4/8-bit
# float16/bfloat16, else qmm_naive) on more; each kernel computes every row
# alone, the same bits whatever the call's other rows (mlx
# backend/cuda/quantized/quantized.cpp, GatherQMM::eval_gpu). A prefill
# group's call, a part of the resident model's, must take its path: short
# groups are padded to 8 rows. A CPU computes each row alone at any count.
GPU_GROUP_ROWS = 8


@dataclass(frozen=True)
class ExecutionPlan:
    """Which backend runs, with every default resolved."""

    backend: str
    gpu: bool
    compute: str  # the compute dtype's name
    memory: MemoryPlan
    cpu_kernel: bool  # routed experts and dense matmuls on the exact CPU kernel
    prefetch: bool  # the next layer's experts predicted and read ahead
    group_rows: int  # the fewest rows a prefill group's call runs (padded)
    fill_tier: bool  # the host tier holds every record: read at load
    tuning: Tuning
    fast: bool = False  # prefill-sized expert calls on dequantized weights
    blocked_records: bool = False  # records stored blocked (--layout blocked)

    @property
    def native(self) -> bool:
        return self.backend != PYTHON

    @property
    def mapped(self) -> bool:
        return self.backend == CPU_MAPPED

    @property
    def device_resolve(self) -> bool:
        """A GPU kernel resolves each call's slots (the host cannot read them)."""
        return self.gpu and self.native and self.tuning.device_resolve

    @property
    def device(self) -> str:
        return "gpu" if self.gpu else "cpu"

    def parts(self) -> list[str]:
        """The plan in words, part by part: the same words everywhere."""
        m = self.memory
        words = [self.backend]
        if self.mapped:
            words.append(
                f"experts mapped, {m.window} a layer kept in the page tables"
                if m.window
                else "experts mapped (the page cache holds them)"
            )
            if not self.blocked_records:  # what the kernel reads faster
                words.append("records as rows (convert-moe --layout blocked: faster)")
        else:
            words.append(f"{m.capacity}/{m.num_experts} slots per layer")
        if m.host_records:
            words.append(f"host tier {m.host_records} records")
        if self.cpu_kernel:
            threads = self.tuning.kernel_threads or "all"
            words.append(f"CPU kernel ({threads} threads)")
        if self.prefetch:
            words.append(f"prefetch top-k + {self.tuning.prefetch_extra}")
        if self.device_resolve:
            words.append("device-resolved calls")
        if self.fast:
            words.append(
                f"fast arithmetic (calls of {self.tuning.fast_rows}+ rows per "
                "expert on dequantized weights)"
            )
        words.append(self.compute)
        return words

    def describe(self) -> str:
        return "backend " + ", ".join(self.parts())

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "device": self.device,
            "compute": self.compute,
            "cpu_kernel": self.cpu_kernel,
            "prefetch": self.prefetch,
            "device_resolve": self.device_resolve,
            "arithmetic": "fast" if self.fast else "exact",
            "describe": self.describe(),
        }


def on_gpu() -> bool:
    """Whether MLX runs on a GPU here: the one place that asks."""
    return mx.default_device() != mx.cpu


def compute_dtype(dtype: str, stored: str, gpu: bool | None = None) -> str:
    """RuntimeConfig.dtype resolved: float32 on a CPU, the stored one on a GPU."""
    if dtype != "auto":
        return dtype
    return stored if (on_gpu() if gpu is None else gpu) else "float32"


def resolve(
    cfg: RuntimeConfig,
    manifest: Manifest,
    model_config: dict,
    model: nn.Module,
    switches: Iterable[nn.Module],
    process: Callable[[], int],
    dense: int,
) -> ExecutionPlan:
    """The one execution plan of `cfg` for this model on this machine;
    `process()` sizes this process (after the kernel's first-use check)."""
    gpu, t = on_gpu(), cfg.tuning
    compute = compute_dtype(cfg.dtype, manifest.dtype, gpu)
    engine = _engine(t, gpu)
    _check_python(cfg, engine)
    _check_records(manifest, engine, gpu)
    kernel = _kernel_runs(t, engine, gpu)
    _check_fast(cfg, gpu, compute)
    args = (manifest, model_config, dense, getattr(mx, compute), process())
    memory = _plan_memory(cfg, args, engine, gpu, compute, kernel, switches)
    name = _name(engine, memory.mapped, gpu)
    every = sum(layer.num_experts for layer in manifest.layers)
    fill = memory.host_records >= every > 0
    prefetch = _prefetches(t, engine, gpu)
    rows = GPU_GROUP_ROWS if gpu else 1
    fast = cfg.arithmetic == "fast"
    return ExecutionPlan(
        name,
        gpu,
        compute,
        memory,
        kernel,
        prefetch,
        rows,
        fill,
        t,
        fast,
        manifest.blocked,
    )


def _plan_memory(
    cfg: RuntimeConfig,
    args: tuple,
    engine: str,
    gpu: bool,
    compute: str,
    kernel: bool,
    switches: Iterable[nn.Module],
) -> MemoryPlan:
    """The memory plan of `cfg`'s backend (`args`: the planners' arguments):
    mapped, slots, or under `auto` mapped where a slot for every expert does
    not fit; the native engine's slots gain a host tier."""
    if cfg.backend == "mapped":
        _require_mapped(gpu, compute, kernel)
        return _plan_mapped(cfg, *args)
    # The CPU kernel's slots are blocked where it computes every call of a
    # layer (StreamingSwitchGLU._blocks); counted so only where it covers
    # every layer, else as row slots (more bytes, never fewer than held).
    blocked = (
        kernel
        and not gpu
        and compute == "float32"
        and cfg.arithmetic == "exact"
        and all(native.covers(inner) for inner in switches)
    )
    staging = _staging(cfg, in_place=blocked and engine == "native")
    memory = _plan_slots(cfg, *args, blocked=blocked, staging_records=staging)
    if cfg.backend == "auto" and _mapped_by_default(
        cfg, memory, engine, gpu, compute, kernel, switches, args[0].blocked
    ):
        log.info(
            "a slot for every expert does not fit: the experts stay mapped, "
            "the page cache holds them (--backend slots: slots)"
        )
        return _plan_mapped(cfg, *args)
    if engine == "native":
        memory = _plan_host_tier(memory, args[0], cfg, gpu)
    return memory


def _name(engine: str, mapped: bool, gpu: bool) -> str:
    if engine == "python":
        return PYTHON
    if mapped:
        return CPU_MAPPED
    return CUDA_TIERED if gpu else CPU_SLOTS


def _engine(t: Tuning, gpu: bool) -> str:
    """Tuning.engine resolved: native wherever it is built and can run here."""
    if t.engine == "native":
        native.require(gpu)
        return "native"
    if t.engine == "python":
        return "python"
    reason = native.fallback_reason(gpu)
    if native.runs_here(gpu):
        return "native"
    if reason:  # a slower engine than expected: never silently
        log.warning("the python engine runs instead of the native one: %s", reason)
    return "python"


def _check_python(cfg: RuntimeConfig, engine: str) -> None:
    """What only the native engine has, asked of the python one."""
    if engine != "python":
        return
    t = cfg.tuning
    clashes = [
        (t.prefetch, "prefetch (it measured slower with it)"),
        (cfg.host_budget is not None, "host_budget (the native engine's tier)"),
    ]
    for clash, what in clashes:
        if clash:
            raise ValueError(
                f"The python engine has no {what}; use engine='native' or leave "
                "it unset."
            )


def _check_records(manifest: Manifest, engine: str, gpu: bool) -> None:
    """The native engine's GPU path copies records to its slots as they are
    stored, in rows: records stored blocked (format v2) are the CPU's. The
    python engine unblocks them as it fills its slots (store.SlotFiller)."""
    if gpu and engine == "native" and manifest.blocked:
        raise native.NativeEngineError(
            "This model's expert records are blocked for the CPU kernel "
            "(convert-moe --layout blocked); a GPU reads row-major records: "
            "convert-moe OUT OUT-ROWS --layout rows writes them so."
        )


def _check_fast(cfg: RuntimeConfig, gpu: bool, compute: str) -> None:
    """The fast arithmetic runs MLX's gather_mm, which on a CPU takes float32
    alone."""
    if cfg.arithmetic == "fast" and not gpu and compute != "float32":
        raise ValueError(
            f"The fast arithmetic on a CPU computes in float32, not {compute}; "
            "use dtype='float32' or 'auto'."
        )


def _kernel_runs(t: Tuning, engine: str, gpu: bool) -> bool:
    """Tuning.cpu_kernel resolved: None runs the kernel with the native engine
    where it is exact (the python engine is the reference path: MLX's ops)."""
    if t.cpu_kernel is False or gpu:
        return False
    if t.cpu_kernel is None:
        return engine == "native" and native.kernel_matches_mlx()
    native.require(gpu)
    if not native.kernel_matches_mlx():
        raise native.NativeEngineError(
            f"moestream's CPU kernel does not reproduce MLX {mx.__version__}'s "
            "quantized matmuls bit for bit here; use cpu_kernel=False."
        )
    return True


def _require_mapped(gpu: bool, compute: str, kernel: bool) -> None:
    """The mapped backend needs the CPU kernel in float32: one line where not."""
    if gpu:
        raise native.NativeEngineError(
            "mapped runs on the CPU kernel; on a GPU, use --backend slots."
        )
    if compute != "float32":
        raise native.NativeEngineError(
            f"mapped computes in float32 (the CPU kernel's), not {compute}; "
            "use dtype='auto' or 'float32'."
        )
    if not kernel:
        raise native.NativeEngineError(
            "mapped needs moestream's CPU kernel, which does not reproduce this "
            "MLX's quantized matmuls exactly; use --backend slots."
        )


def _mapped_by_default(
    cfg: RuntimeConfig,
    memory: MemoryPlan,
    engine: str,
    gpu: bool,
    compute: str,
    kernel: bool,
    switches: Iterable[nn.Module],
    blocked_records: bool,
) -> bool:
    """backend "auto": mapped where a CPU's slots (the default's, or a
    budget's over blocked records) cannot hold every expert and the kernel
    covers every layer (nothing slot-bound was asked); docs/options.md."""
    return (
        memory.capacity < memory.num_experts
        and cfg.arithmetic == "exact"
        and (cfg.memory_budget is None or blocked_records)
        and cfg.cache_experts is None
        and cfg.host_budget is None
        and engine == "native"
        and not gpu
        and compute == "float32"
        and kernel
        and all(native.covers(inner) for inner in switches)
    )


def _staging(cfg: RuntimeConfig, in_place: bool) -> int:
    """Records read, or mapped in, at once: a call past a layer's blocked CPU
    slots, or past a mapped layer's window (`in_place`), maps one record per
    kernel thread."""
    if not in_place:
        return STAGING_RECORDS
    return max(STAGING_RECORDS, cfg.tuning.kernel_threads or os.cpu_count() or 1)


def _plan_slots(
    cfg: RuntimeConfig,
    manifest: Manifest,
    model_config: dict,
    dense: int,
    compute: mx.Dtype,
    process: int,
    budget: int | None = None,
    blocked: bool = False,
    staging_records: int = STAGING_RECORDS,
) -> MemoryPlan:
    if budget is None and cfg.memory_budget is not None:
        budget = parse_size(cfg.memory_budget)
    return plan_memory(
        manifest,
        model_config,
        dense,
        compute,
        process,
        cfg.context,
        budget,
        cfg.cache_experts,
        cfg.concurrency,
        fast=cfg.arithmetic == "fast",
        blocked=blocked,
        staging_records=staging_records,
    )


def _plan_mapped(
    cfg: RuntimeConfig, manifest: Manifest, model_config: dict, *args: object
) -> MemoryPlan:
    """The mapped backend: no slots; under a budget, what it holds past the
    rest is the records each layer keeps mapped (MemoryPlan.window)."""
    budget = parse_size(cfg.memory_budget) if cfg.memory_budget is not None else None
    unbounded = replace(cfg, memory_budget=None)
    staging = _staging(cfg, in_place=budget is not None)  # the window's prefill
    plan = _plan_slots(
        unbounded,
        manifest,
        model_config,
        *args,  # type: ignore[arg-type]
        staging_records=staging,
    )
    record = sum(layer.record_nbytes for layer in manifest.layers)
    plan = replace(plan, capacity=0, budget=budget, mapped=True, slot_bytes=record)
    if budget is None:
        return plan
    plan = replace(plan, reserve=reserve_for(budget))  # as the slots' plan keeps
    if plan.total > budget:
        raise BudgetError(
            f"Dense weights, KV cache and activations need "
            f"{human_bytes(plan.total, up=True)}, more than the budget "
            f"{human_bytes(budget)}; give --memory-budget "
            f"{human_bytes(plan.total, up=True)} or more, or a shorter --context."
        )
    return replace(plan, window=mapped_window(plan, model_config)) if record else plan


def _plan_host_tier(
    plan: MemoryPlan, manifest: Manifest, cfg: RuntimeConfig, gpu: bool
) -> MemoryPlan:
    """A GPU's pinned host tier under `cfg.host_budget` (the records a call
    copies to its slots live there; default: every record if that fits in half
    the memory available now, else that half). A CPU has none: a tier there
    measured 0.73x cold, 0.52x in RAM warm (deleted 2026-12-04)."""
    if not gpu:
        if cfg.host_budget is not None:
            raise ValueError(
                "host_budget sizes a GPU's pinned host tier; on a CPU the page "
                "cache is the tier: leave it unset."
            )
        return plan
    if plan.capacity >= plan.num_experts:
        return plan
    record = max(layer.record_nbytes for layer in manifest.layers)
    every = sum(layer.num_experts for layer in manifest.layers)
    if cfg.host_budget is None:
        budget = min(every * record, available_memory() // 2)
    else:
        budget = parse_size(cfg.host_budget)
    records = min(every, budget // record)
    if records < plan.capacity:  # one call's misses are read into it at once
        need = human_bytes(plan.capacity * record, up=True)
        raise BudgetError(
            f"Host budget {human_bytes(budget)} holds "
            f"{count(records, 'expert record')}; one call of "
            f"{count(plan.capacity, 'slot')} needs {plan.capacity} ({need}): "
            f"give --host-budget {need} or more."
        )
    return replace(
        plan,
        host_records=records,
        host_record=record,
        host_budget=budget if cfg.host_budget is not None else None,
        host_pinned=True,
    )


def _prefetches(t: Tuning, engine: str, gpu: bool) -> bool:
    """Tuning.prefetch resolved: off unless asked for. Next-layer hints
    measured slower on every backend, in RAM and larger than RAM (a GPU's
    read-ahead was deleted; docs/options.md has the runs)."""
    if gpu:
        if t.prefetch:
            raise ValueError(
                "a GPU does not read ahead: it measured slower "
                "(docs/nvidia-gpu.md); leave prefetch unset."
            )
        return False
    if engine != "native":
        return False
    return bool(t.prefetch)
