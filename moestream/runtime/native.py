"""The native engine: slot lookup and expert reads inside MLX's stream.

`RuntimeConfig.engine="native"` (the default wherever the extension is built
and can run) hands each streaming layer an `ExpertCache` (csrc/, built by
`pip install`) whose `fetch` primitive turns routed expert ids into slot ids
while MLX evaluates the graph: misses are read on the stream (CPU); on a GPU
a host function in the CUDA stream resolves them, or, where the host tier
holds a layer's records for good, a kernel does from the device's copy of
the slot table (RuntimeConfig.device_resolve). A decode step never returns
to Python between MoE layers. A `HostTier` (RuntimeConfig.host_budget)
holds records in host memory between the blob and the slots: its reader
threads read a call's misses in parallel and the next layer's predicted
experts ahead; on a GPU it is pinned memory that a copy kernel reads from.
The Python engine (switch.py) is the reference path.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

from ..formats import ExpertLayer
from .store import ExpertReadError

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


def require() -> None:
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
    if mx.default_device() != mx.cpu and not _native.built_with_cuda():
        raise NativeEngineError(
            "moestream's native engine has no implementation for "
            f"{mx.default_device()} here (it was built without CUDA); "
            "use engine='python'."
        )


def fallback_reason() -> str | None:
    """Why the default engine falls back to python here, where a user would
    expect native (None when native runs, and on macOS, which builds none)."""
    if _native is None and sys.platform == "darwin":
        return None
    try:
        require()
    except NativeEngineError as e:
        return str(e)
    return None


def _cast(stored: str, slot: mx.Dtype) -> int:
    if stored == str(slot).removeprefix("mlx.core."):
        return 0
    if (stored, slot) not in CASTS:
        raise NativeEngineError(
            f"The native engine cannot turn {stored} records into {slot} slots; "
            "use engine='python' or the stored dtype."
        )
    return CASTS[(stored, slot)]


def expert_cache(
    path: Path,
    layer: ExpertLayer,
    slots: list[mx.array],
    capacity: int,
    *,
    verify: bool,
    policy: str,
    decay: float,
    max_pairs: int,
    tier: object | None = None,
    record_calls: bool = False,
    device_resolve: bool = True,
) -> object:
    """The native cache of one MoE layer over its evaluated slot arrays;
    `record_calls` keeps each call's counts (RuntimeStats.events);
    `device_resolve`: RuntimeConfig's."""
    require()
    segments = [
        (seg.offset, seg.nbytes, _cast(seg.dtype, a.dtype))
        for seg, a in zip(layer.segments, slots, strict=True)
    ]
    cache = _native.ExpertCache(
        path=str(path),
        layer=layer.layer,
        data_offset=layer.data_offset,
        stride=layer.stride,
        record_nbytes=layer.record_nbytes,
        num_experts=layer.num_experts,
        capacity=capacity,
        segments=segments,
        checksums=[int(c, 16) for c in layer.checksums] if verify else [],
        verify=verify,
        policy=policy,
        decay=decay,
        max_pairs=max_pairs,
        record_calls=record_calls,
    )
    cache.device_resolve = device_resolve
    cache.bind(slots, mx.default_device() != mx.cpu)
    if tier is not None:
        cache.attach(tier)
    return cache


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


def take_uses(cache: object) -> list[int]:
    """Per expert of the cache's layer, the calls that routed to it since the
    last take (resolved on the host: a device kernel's are not counted)."""
    return _native.take_uses(cache)


def tier_filled(tier: object) -> int:
    """Records the host tier holds or is reading."""
    return _native.tier_filled(tier)
