"""The native engine: slot lookup and expert reads inside MLX's stream.

`Tuning.engine="native"` (the default wherever the extension is built
and can run) hands each streaming layer an `ExpertCache` (csrc/, built by
`pip install`) whose `fetch` primitive turns routed expert ids into slot ids
while MLX evaluates the graph: misses are read on the stream (CPU); on a GPU
a kernel resolves them from the device's copies of the slot table and the
host tier's table, and only records the tier lacks are read, by a host thread
that serves the kernel's pinned mailbox (Tuning.device_resolve; a host
function in the CUDA stream is the reference path). A decode step never returns
to Python between MoE layers. A `HostTier` (RuntimeConfig.host_budget)
holds records in host memory between the blob and the slots: its reader
threads read a call's misses in parallel and the next layer's predicted
experts ahead; on a GPU it is pinned memory that a copy kernel reads from.
The Python engine (engines.py) is the reference path.

On a CPU, the plan's cpu_kernel computes a call's routed experts, and the
dense quantized matmuls, with the extension's exact kernel (csrc/cpu_experts.h):
MLX's own float arithmetic, bit for bit, with output rows in vector lanes and
split over threads. MLX's ops stay the reference path beside it.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU

from ..formats import ExpertLayer, Segment, max_abs, unblocked
from .store import ExpertReadError, blocked

if TYPE_CHECKING:  # the plan imports this module to choose the backend
    from .backend import ExecutionPlan

log = logging.getLogger(__name__)

_IMPORT_ERROR = "not imported"
try:  # mlx.core first: the extension links against the libmlx it loaded
    from .. import _native
except ImportError as e:  # not built (macOS, or an install without a compiler)
    _native = None
    _IMPORT_ERROR = str(e)
else:  # its read errors raise ExpertReadError, from mx.eval and its kin too
    _native.set_read_error_class(ExpertReadError)

# How a stored float segment becomes its slot dtype: the extension's Cast
# (csrc/cast.h), bit for bit MLX's astype.
CASTS = {
    ("bfloat16", mx.float32): 1,
    ("float16", mx.float32): 2,
    ("bfloat16", mx.float16): 3,
    ("float16", mx.bfloat16): 4,
    ("float32", mx.float16): 5,
    ("float32", mx.bfloat16): 6,
}


class NativeEngineError(ValueError):
    """The native engine cannot run here; engine='python' can."""


def available() -> bool:
    return _native is not None and _native.mlx_version == mx.__version__


def cuda_available() -> bool:
    return available() and _native.built_with_cuda()


def runs_here(gpu: bool) -> bool:
    """Whether the native engine can run on this device (the plan's question)."""
    return cuda_available() if gpu else available()


def require(gpu: bool = False) -> None:
    """Raise one clear line when the native engine cannot run in this process."""
    if _native is None:
        raise NativeEngineError(
            f"moestream's native engine is not built ({_IMPORT_ERROR}); "
            "reinstall with `pip install -e .` and a C++ compiler, or use "
            "engine='python'."
        )
    if _native.mlx_version != mx.__version__:
        raise NativeEngineError(
            f"moestream's native engine was built against MLX "
            f"{_native.mlx_version} but MLX {mx.__version__} is installed; "
            "reinstall moestream, or use engine='python'."
        )
    if gpu and not _native.built_with_cuda():
        raise NativeEngineError(
            "moestream's native engine has no implementation for "
            f"{mx.default_device()} here (it was built without CUDA); "
            "use engine='python'."
        )


def fallback_reason(gpu: bool) -> str | None:
    """Why the default engine falls back to python here, where a user would
    expect native (None when native runs, and on macOS, which builds none)."""
    if _native is None and sys.platform == "darwin":
        return None
    try:
        require(gpu)
    except NativeEngineError as e:
        return str(e)
    return None


def _cast(stored: str, slot: mx.Dtype) -> int:
    if stored == str(slot).removeprefix("mlx.core."):
        return 0
    if (stored, slot) not in CASTS:
        raise NativeEngineError(
            f"The native engine cannot turn records of {stored} into slots of {slot}; "
            "use engine='python' or the stored dtype."
        )
    return CASTS[(stored, slot)]


def expert_cache(
    path: Path,
    layer: ExpertLayer,
    slots: list[mx.array],
    capacity: int,
    plan: ExecutionPlan,
    *,
    verify: bool,
    tier: object | None = None,
    blocked_slots: bool = False,
) -> object:
    """The native cache of one MoE layer over its evaluated slot arrays (mapped:
    their dtypes only), with the plan's knobs; `blocked_slots`: it writes each
    segment blocked, as the CPU kernel reads blocked slots (`blocked`)."""
    t, mapped = plan.tuning, plan.mapped
    require(plan.gpu)
    max_pairs = capacity
    if mapped:  # no slots: every expert "resident", any pairs in one call
        capacity = max_pairs = layer.num_experts
    cache = _native.ExpertCache(
        path=str(path),
        layer=layer.layer,
        data_offset=layer.data_offset,
        stride=layer.stride,
        record_nbytes=layer.record_nbytes,
        num_experts=layer.num_experts,
        capacity=capacity,
        segments=[
            _segment(seg, a, blocked_slots)
            for seg, a in zip(layer.segments, slots, strict=True)
        ],
        checksums=[int(c, 16) for c in layer.checksums] if verify else [],
        verify=verify,
        policy=t.policy,
        decay=t.lrfu_decay,
        max_pairs=max_pairs,
        record_calls=t.record_trace,
    )
    if not mapped:
        cache.bind(slots, plan.gpu)
    window = plan.memory.window if mapped else 0
    _tune(cache, tier, t.device_resolve, t.readers, mapped, window)
    return cache


def _segment(seg: Segment, slots: mx.array, blocked: bool) -> tuple:
    """A segment as the native cache takes it: offset, stored bytes, cast,
    then where the slot or the record is blocked its rows and the slot bytes
    of one row ((0, 0) where neither is), whether the slot is, whether the
    record is."""
    head = (seg.offset, seg.nbytes, _cast(seg.dtype, slots.dtype))
    stored = seg.layout == "blocked"
    if not (blocked or stored):
        return (*head, 0, 0, False, False)
    rows, cols = seg.shape
    return (*head, rows, cols * slots.dtype.size, blocked, stored)


def _tune(
    cache: object,
    tier: object | None,
    device_resolve: bool,
    readers: int,
    mapped: bool,
    window: int = 0,
) -> None:
    """Set the plan's knobs on a new cache, its host tier too. With mapped it
    maps its blob, keeping `window` records mapped (0: all): one line where
    the blob is shorter than its records."""
    cache.device_resolve = device_resolve  # type: ignore[attr-defined]
    cache.readers = readers  # type: ignore[attr-defined]
    if mapped:
        try:
            cache.map_blob(window)  # type: ignore[attr-defined]
        except ValueError as e:
            raise ExpertReadError(str(e)) from None
    if tier is not None:
        cache.attach(tier)  # type: ignore[attr-defined]


def host_tier(plan: object, readers: int) -> object:
    """The host tier `plan` sizes (MemoryPlan.host_records), shared by every layer."""
    require()
    return _native.HostTier(
        capacity=plan.host_records,  # type: ignore[attr-defined]
        record_bytes=plan.host_record,  # type: ignore[attr-defined]
        readers=readers,
        pinned=plan.host_pinned,  # type: ignore[attr-defined]
    )


def check(cache: object) -> None:
    """Raise the error a call left that could not raise where it ran (a CUDA
    stream's host function): ExpertReadError for a record's, else
    NativeEngineError."""
    error = cache.take_error()  # type: ignore[attr-defined]
    if error:
        cls = ExpertReadError if _native.is_read_error(error) else NativeEngineError
        raise cls(error)


def fetch(
    cache: object, indices: mx.array, predicted: mx.array | None, call: int = -1
) -> mx.array:
    """Slot ids for `indices`; the misses are read when MLX evaluates them, and
    the call's counts recorded under `call` (RuntimeStats.next_step)."""
    return _native.fetch(cache, indices, predicted, call)


def waits_for_unneeded(waiter: mx.array) -> bool:
    """Whether `waiter` (an engine's one-element array that waits for its
    layer's output) and that output are unevaluated, and nothing but the
    waiter holds the output: it is never computed unless the waiter is."""
    return _native.waits_for_unneeded(waiter)


def take_uses(cache: object) -> list[int]:
    """Per expert of the cache's layer, the calls that routed to it since the
    last take (resolved on the host: a device kernel's are not counted)."""
    return _native.take_uses(cache)


def tier_filled(tier: object) -> int:
    """Records the host tier holds or is reading."""
    return _native.tier_filled(tier)


def agrees_with_mlx(what: str, pairs: Iterable[tuple[mx.array, mx.array]]) -> bool:
    """Whether each (ours, MLX's) pair is equal bit for bit, the pairs made
    one at a time; at the first that is not, a warning that `what` is not
    used here. Every kernel's first-use check."""
    for ours, theirs in pairs:
        if not mx.array_equal(ours, theirs).item():
            log.warning("the %s differs from MLX's here: not used", what)
            return False
    return True


def kernel_block() -> int:
    """The rows of one block of the blocked layout (slots, and records
    converted with --layout blocked): 16 on every CPU."""
    return _native.kernel_block()


def blocked_arrays(arrays: list[mx.array]) -> list[mx.array]:
    """Arrays `[..., rows, cols]` (stacked experts, or one layer's) as blocked
    slots hold them."""

    def turn(a: mx.array) -> mx.array:
        if a.dtype != mx.bfloat16:
            return mx.array(blocked(np.array(a), kernel_block()))
        words = blocked(np.array(a.view(mx.uint16)), kernel_block())  # numpy lacks it
        return mx.array(words).view(mx.bfloat16)

    return [turn(a) for a in arrays]


@functools.cache
def kernel_matches_mlx() -> bool:
    """Whether the kernel computes what this MLX computes, bit for bit, on a
    small case of every bit width, decode's rows and prefill's panels (seven
    tokens on one expert) both, on slots as MLX holds them and blocked (with
    float32 scales and biases, and with bfloat16 ones as blocked slots keep)
    (checked once; MLX's random state is left alone, so seeded sampling
    still draws what mlx-lm's does)."""
    x = mx.random.normal((8, 1, 1, 64), key=mx.random.key(1))
    inds = mx.array([[1]] * 7 + [[0]], mx.uint32)

    def pairs() -> Iterator[tuple[mx.array, mx.array]]:
        for bits in (2, 3, 4, 5, 6, 8):
            weights = []
            for p in range(3):
                w = mx.random.normal((2, 64, 64), key=mx.random.key(10 * bits + p))
                weights += mx.quantize(w, 32, bits)
            specs = [(bits, 32, False)] * 3
            theirs = _reference_mlp(x, inds, weights, bits)
            yield _native.expert_mlp(x, inds, weights, specs, 1), theirs
            rows = blocked_arrays(weights)
            yield _native.expert_mlp(x, inds, rows, specs, 1, blocked=True), theirs
            # blocked slots that keep bfloat16 scales and biases, as stored
            bf16 = mx.bfloat16
            kept = [a if i % 3 == 0 else a.astype(bf16) for i, a in enumerate(weights)]
            kept_rows = blocked_arrays(kept)
            ours = _native.expert_mlp(x, inds, kept_rows, specs, 1, blocked=True)
            widened = [
                a if i % 3 == 0 else a.astype(mx.float32) for i, a in enumerate(kept)
            ]
            yield ours, _reference_mlp(x, inds, widened, bits)
            dense = [a[0] for a in weights[:3]]
            yield (
                _native.quant_matmul(x, *dense, bits, 32, 1),
                mx.quantized_matmul(x, *dense, group_size=32, bits=bits),
            )

    return agrees_with_mlx("CPU kernel", pairs())


# float32's largest finite value.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def exact_fma(scales: Segment | None, bits: int) -> bool:
    """Whether every scale of a projection (its `scales` segment) times any q
    < 2**bits is exact in float32, so that the kernel may dequantize with one
    fused multiply-add (QuantSpec.fma): the same float as MLX's multiply and
    add. A scale stored as bfloat16 or float16 has at most 11 significant
    bits, so its product with q has at most 19 of float32's 24; only a
    product past float32's range could round, which the converter's record
    of the largest scale (Segment.max_abs) rules out. Older output has no
    such record: never fused."""
    return scales is not None and fma_exact(scales.dtype, scales.max_abs, bits)


def fma_exact(dtype: str, largest: float | None, bits: int) -> bool:
    """exact_fma's test on scales of `dtype` (their values all of it: a
    float32 array may hold bfloat16 values) whose largest |scale| is
    `largest` (None: not known, or not finite)."""
    return (
        dtype in ("bfloat16", "float16")
        and largest is not None
        and largest * (2**bits - 1) <= _FLOAT32_MAX
        and fma_matches_mlx()
    )


@functools.cache
def fma_matches_mlx() -> bool:
    """Whether the blocked kernels' fused dequantization computes what this
    MLX computes, bit for bit, on scales and biases stored as bfloat16 (down
    to subnormal scales, up to the largest an 8-bit product allows), decode's
    rows and prefill's panels, every bit width (checked once, as
    kernel_matches_mlx; False where this CPU has no vector FMA)."""
    if not (_native.kernel_fma() and kernel_matches_mlx()):
        return False
    x = mx.random.normal((8, 1, 1, 64), key=mx.random.key(2))
    inds = mx.array([[1]] * 7 + [[0]], mx.uint32)
    # Gate's and up's scales times these: subnormal ones, and ones whose
    # 8-bit products come near float32's largest; the outputs stay finite.
    factors = [(2.0**-140, 2.0**100), (2.0**100, 1e-3)]

    def bf16(a: mx.array) -> mx.array:
        return a.astype(mx.bfloat16).astype(mx.float32)

    def pairs() -> Iterator[tuple[mx.array, mx.array]]:
        for bits in (2, 3, 4, 5, 6, 8):
            weights = []
            for p in range(3):
                key = mx.random.key(100 + 10 * bits + p)
                w, s, b = mx.quantize(mx.random.normal((2, 64, 64), key=key), 32, bits)
                factor = factors[bits % 2][p] if p < 2 else 1.0
                weights += [w, bf16(s * factor), bf16(b)]
            theirs = _reference_mlp(x, inds, weights, bits)
            specs = [(bits, 32, True)] * 3
            rows = blocked_arrays(weights)
            yield _native.expert_mlp(x, inds, rows, specs, 1, blocked=True), theirs

    return agrees_with_mlx("CPU kernel's fused dequantization", pairs())


def _reference_mlp(x: mx.array, inds: mx.array, w: list, bits: int) -> mx.array:
    """mlx-lm's SwitchGLU with SwiGLU, on weights (gate, up, down) x 3."""

    def qmm(x: mx.array, p: int) -> mx.array:
        q, s, b = w[3 * p : 3 * p + 3]
        return mx.gather_qmm(
            x, q, s, b, rhs_indices=inds, transpose=True, group_size=32, bits=bits
        )

    return qmm(swiglu(qmm(x, 0), qmm(x, 1)), 2).squeeze(-2)


def _affine(p: nn.Module) -> bool:
    return p.mode == "affine" and "bias" not in p and "biases" in p


class ExpertKernel:
    """`inner(x, slots)` of a SwitchGLU, on the CPU kernel; calls on other than
    float32 run `inner` itself. `blocked`: the slots hold each projection
    kernel_block() rows at a time (the kernel's layout, which only the kernel
    reads). `fills`: the slots' native cache, whose misses the kernel fills
    as it reads their records in place (ExpertCache.fill_in_kernel; only
    with blocked slots, which no other op reads)."""

    def __init__(
        self,
        inner: SwitchGLU,
        threads: int,
        blocked: bool = False,
        layer: ExpertLayer | None = None,
    ) -> None:
        self.inner = inner
        names = ("gate_proj", "up_proj", "down_proj")
        self.projections = [inner[n] for n in names]
        # (bits, group size, fma): fma where `layer`'s records make every
        # product exact (exact_fma); the blocked kernels then fuse.
        self.specs = [
            (p.bits, p.group_size, exact_fma(_scales(layer, n), p.bits))
            for n, p in zip(names, self.projections, strict=True)
        ]
        self.threads = threads
        self.blocked = blocked
        self.fills: object | None = None

    def fill_through(self, cache: object) -> None:
        """Let this kernel fill `cache`'s slots (blocked slots only)."""
        if not self.blocked:
            raise NativeEngineError(
                "Only blocked slots fill in the kernel: other ops read row slots."
            )
        cache.fill_in_kernel = True  # type: ignore[attr-defined]
        self.fills = cache

    def __call__(self, x: mx.array, slots: mx.array) -> mx.array:
        weights = [a for p in self.projections for a in (p.weight, p.scales, p.biases)]
        # Blocked slots may keep their records' bfloat16 or float16 scales.
        floats = (mx.float32, mx.bfloat16, mx.float16)[: 3 if self.blocked else 1]
        if x.dtype != mx.float32 or any(
            a.dtype not in floats for a in [*weights[1::3], *weights[2::3]]
        ):
            if self.blocked:  # MLX's gather_qmm would read them as rows
                raise NativeEngineError(
                    f"The CPU kernel's blocked slots take float32 calls, not "
                    f"{x.dtype}; MLX's kernels cannot read them."
                )
            return self.inner(x, slots)
        return _native.expert_mlp(
            x,
            slots,
            weights,
            self.specs,
            self.threads,
            blocked=self.blocked,
            fills=self.fills,
        )


def covers(inner: SwitchGLU) -> bool:
    """Whether the CPU kernel computes `inner`: SwiGLU, affine-quantized
    projections without biases."""
    projections = [inner.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    return isinstance(inner.activation, SwiGLU) and all(
        isinstance(p, QuantizedSwitchLinear) and _affine(p) for p in projections
    )


def _scales(layer: ExpertLayer | None, projection: str) -> Segment | None:
    """The `scales` segment of `projection` in `layer`'s records, if any."""
    if layer is None:
        return None
    return next((s for s in layer.segments if s.name == f"{projection}.scales"), None)


def expert_kernel(
    inner: SwitchGLU, plan: ExecutionPlan, layer: ExpertLayer | None = None
) -> ExpertKernel | None:
    """The CPU kernel for `inner` where the plan runs it and it covers `inner`;
    on slots filled from `layer`'s records (which tell where it may fuse)."""
    if not (plan.cpu_kernel and covers(inner)):
        return None
    return ExpertKernel(inner, plan.tuning.kernel_threads, layer=layer)


# How a record stores scales and biases: the extension's ScaleFormat.
SCALE_FORMATS = {"float32": 0, "bfloat16": 1, "float16": 2}


class MappedKernel:
    """`inner(x, experts)` of a SwitchGLU on the records of a mapped cache,
    read in place: the CPU kernel's arithmetic, as on slots. `in_place`: the
    cache is a CPU slot cache that fills in the kernel, whose records the
    call reads in place the same way, its slots left as they are."""

    def __init__(
        self, layer: ExpertLayer, cache: object, threads: int, in_place: bool = False
    ) -> None:
        self.cache = cache
        self.threads = threads
        self.in_place = in_place
        seg = {s.name: s for s in layer.segments}
        self.projections = []
        for name in ("gate_proj", "up_proj", "down_proj"):
            w, sc, b = (seg[f"{name}.{t}"] for t in ("weight", "scales", "biases"))
            if sc.dtype != b.dtype or sc.dtype not in SCALE_FORMATS:
                raise NativeEngineError(
                    f"Layer {layer.layer}: mapped reads float scales and biases of "
                    f"one dtype, not {sc.dtype} and {b.dtype}; leave mapped off."
                )
            rows, words = w.shape
            offsets = (w.offset, sc.offset, b.offset)
            shape = (rows, words * 4, sc.shape[1])
            spec = (SCALE_FORMATS[sc.dtype], w.bits, w.group_size)
            fma = exact_fma(sc, w.bits)
            self.projections.append((*offsets, *shape, *spec, w.blocked, fma))

    def __call__(self, x: mx.array, experts: mx.array, call: int = -1) -> mx.array:
        """`call`: an in-place call's id, under which a recording cache keeps
        its counts (RuntimeStats.events)."""
        return _native.expert_mlp_mapped(
            x,
            experts,
            self.cache,
            self.projections,
            self.threads,
            in_place=self.in_place,
            call=call,
        )


def mapped_kernel(
    inner: SwitchGLU, layer: ExpertLayer, cache: object, plan: ExecutionPlan
) -> MappedKernel:
    """The kernel of a mapped layer: one line where the CPU kernel does not
    cover `inner` (another activation, biases, another quantization)."""
    if expert_kernel(inner, plan) is None:
        raise NativeEngineError(
            f"Layer {layer.layer}: mapped needs SwiGLU experts with affine "
            "quantization and no biases (the CPU kernel's); leave mapped off."
        )
    return MappedKernel(layer, cache, plan.tuning.kernel_threads)


class KernelLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose float32 matmul runs on the CPU kernel.

    Once `block()` has turned it, its weight, scales and biases are stored
    kernel_block() rows at a time, as blocked slots hold an expert (the same
    values; the blocked kernels read a vector's rows in one load), scales and
    biases as bfloat16 where every one of them is a bfloat16 (widened back
    exactly), and dequantized with one fused multiply-add where exact_fma's
    proof holds (bfloat16 scales, no product past float32's range). MLX's own
    op, for other inputs, then reads them turned back."""

    _blocked = False
    _fma = False

    def block(self) -> bool:
        """Store this layer blocked (see the class); False, and nothing
        changed, where it has float scales other than float32 or rows that
        are not whole blocks."""
        w, scales, biases = self["weight"], self["scales"], self.get("biases")
        if (
            self._blocked
            or biases is None
            or scales.dtype != mx.float32
            or biases.dtype != mx.float32
            or w.shape[0] % kernel_block()
        ):
            return False
        s = np.array(scales)
        if _bfloat16_exact(s):
            self._fma = fma_exact("bfloat16", max_abs(s, "float32"), self.bits)
            if _bfloat16_exact(np.array(biases)):  # exactly as bfloat16
                scales, biases = scales.astype(mx.bfloat16), biases.astype(mx.bfloat16)
        self["weight"], self["scales"], self["biases"] = blocked_arrays(
            [w, scales, biases]
        )
        self._blocked = True
        return True

    def _mlx(self, x: mx.array) -> mx.array:
        """MLX's own op, on the weights in MLX's layout (turned back, scales
        and biases float32, where blocked)."""
        if not self._blocked:
            return super().__call__(x)

        def turn(a: mx.array) -> mx.array:
            if a.dtype == mx.bfloat16:  # widened exactly
                a = a.astype(mx.float32)
            return mx.array(unblocked(np.array(a), kernel_block()))

        w, scales, biases = (turn(self[k]) for k in ("weight", "scales", "biases"))
        y = mx.quantized_matmul(
            x,
            w,
            scales=scales,
            biases=biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )
        return y + self["bias"] if "bias" in self else y

    def __call__(self, x: mx.array) -> mx.array:
        w, scales, biases = self["weight"], self["scales"], self["biases"]
        if x.dtype != mx.float32 or not (self._blocked or scales.dtype == mx.float32):
            return self._mlx(x)
        y = _native.quant_matmul(
            x,
            w,
            scales,
            biases,
            self.bits,
            self.group_size,
            self._kernel_threads,
            fma=self._fma,
            blocked=self._blocked,
        )
        if "bias" in self:
            y = y + self["bias"]
        return y


def _bfloat16_exact(a: np.ndarray) -> bool:
    """Whether every float32 of `a` is a bfloat16 (its low 16 bits zero)."""
    return not (np.ascontiguousarray(a).view(np.uint32) & 0xFFFF).any()


class KernelRMSNorm(nn.RMSNorm):
    """nn.RMSNorm whose float32 norm runs as the kernel's one op (MLX's runs
    seven on a CPU), bit for bit."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self["weight"]
        if x.dtype != mx.float32 or w.dtype != mx.float32:
            return super().__call__(x)
        return _native.exact_rms_norm(x, w, self.eps)


@functools.cache
def norm_matches_mlx() -> bool:
    """Whether the kernel's RMS norm equals this MLX's, bit for bit (checked
    once; MLX's random state left alone)."""
    x = mx.random.normal((3, 100), key=mx.random.key(4)) * 3
    w = mx.random.normal((100,), key=mx.random.key(5))
    pair = (_native.exact_rms_norm(x, w, 1e-6), mx.fast.rms_norm(x, w, 1e-6))
    return agrees_with_mlx("kernel's RMS norm", [pair])


class KernelRoPE(nn.RoPE):
    """nn.RoPE whose float32 rotation runs as the kernel's one op (MLX's CPU
    fallback runs about thirty), bit for bit."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype != mx.float32 or not 3 <= x.ndim <= 4:
            return super().__call__(x, offset)
        if isinstance(offset, mx.array):
            offset = offset.astype(mx.int32).reshape(-1)
        else:
            offset = mx.array([offset], mx.int32)
        return _native.exact_rope(
            x, self.dims, self.traditional, self.base, self.scale, offset
        )


@functools.cache
def rope_matches_mlx() -> bool:
    """Whether the kernel's rope equals this MLX's, bit for bit, both layouts
    (checked once; MLX's random state left alone)."""
    x = mx.random.normal((2, 3, 5, 64), key=mx.random.key(6)) * 3
    pairs = (
        (
            _native.exact_rope(
                x, 48, traditional, 10000.0, 1.0, mx.array([offset], mx.int32)
            ),
            mx.fast.rope(
                x, 48, traditional=traditional, base=10000.0, scale=1.0, offset=offset
            ),
        )
        for traditional, offset in ((False, 7), (True, 70000))
    )
    return agrees_with_mlx("kernel's rope", pairs)


def start_kernel_pool(plan: ExecutionPlan) -> None:
    """Set the CPU kernel's thread pool (one per process, shared by every
    kernel) as the plan tunes it, where the plan runs the kernel."""
    if plan.cpu_kernel:
        _native.set_pool_spin(plan.tuning.kernel_spin_us)


def use_dense_kernel(model: nn.Module, plan: ExecutionPlan) -> int:
    """Turn the model's affine nn.QuantizedLinear layers into KernelLinear
    (stored blocked where they can be: KernelLinear.block), its nn.RMSNorm
    into KernelRMSNorm and its nn.RoPE into KernelRoPE, where the plan runs
    the CPU kernel; the number turned."""
    if not plan.cpu_kernel:
        return 0
    n = 0
    norms = norm_matches_mlx()
    ropes = rope_matches_mlx()
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and module.mode == "affine":
            module.__class__ = KernelLinear
            module._kernel_threads = plan.tuning.kernel_threads
            module.block()
            n += 1
        elif type(module) is nn.RMSNorm and norms:
            module.__class__ = KernelRMSNorm
            n += 1
        elif type(module) is nn.RoPE and ropes:
            module.__class__ = KernelRoPE
            n += 1
    return n
