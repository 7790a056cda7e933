"""mlx-lm's attention with its matmuls and softmax on the CPU kernel, bit for bit.

On a CPU, `mx.fast.scaled_dot_product_attention` runs MLX's fallback: the
queries times the scale, `q @ k.T`, the mask, a precise softmax, `@ v`. Its
matmuls are MLX's CPU matmul, which the Linux wheel computes with the
reference BLAS (one output at a time, k ascending, a multiply and an add
each); csrc/cpu_matmul.h computes the same sums at vector speed, and
csrc/cpu_ops.h MLX's softmax (its own exp, the row's sum in order) with its
exps in vector lanes and rows over threads. Unmasked or causal, the three
run as one op (csrc/cpu_attention.h), a block of query rows at a time, so no
scores array is written, and under a causal mask the scores a query does not
see are not computed (the mask puts float32's lowest there; their exps are
zeros, which add nothing). With an array mask they are three ops, the mask
MLX's. Either way `exact_sdpa` equals MLX's fallback bit for bit (checked
once at first use: `matches_mlx`).
`use_exact_attention` rebinds a model's attention modules to it, each
through a subclass whose `__call__` is mlx-lm's own code with
`scaled_dot_product_attention` resolved to `exact_sdpa`: the model's code
and every other instance of its classes stay as they are.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from .native import _native, agrees_with_mlx

if TYPE_CHECKING:
    from .backend import ExecutionPlan


def _covered(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    mask: Any,
    sinks: Any,
) -> bool:
    """Float32 attention over a plain cache: what exact_sdpa computes."""
    plain = sinks is None and not hasattr(cache, "bits")
    f32 = all(a.dtype == mx.float32 for a in (queries, keys, values))
    causal = isinstance(mask, str) and mask == "causal"
    masks = mask is None or (causal and queries.shape[2] <= keys.shape[2])
    masks = masks or (isinstance(mask, mx.array) and mask.ndim <= 4)
    return plain and f32 and masks and queries.shape[1] % keys.shape[1] == 0


def _masked(
    scores: mx.array, mask: Any, queries: mx.array, keys: mx.array, rep: int
) -> mx.array:
    """The fallback's mask step on `[B, Hkv, rep, L, S]` scores for an array
    mask (none, or a causal one, is exact_attention's)."""
    low = mx.array(mx.finfo(mx.float32).min, mx.float32)
    if mask.dtype != mx.bool_:
        mask = mask.astype(mx.float32)
    b, heads, q_len, _ = queries.shape
    mask = mx.broadcast_to(mask, (b, heads, q_len, keys.shape[2]))
    mask = mask.reshape(b, heads // rep, rep, q_len, keys.shape[2])
    return mx.where(mask, scores, low) if mask.dtype == mx.bool_ else scores + mask


def exact_sdpa(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
    threads: int = 0,
) -> mx.array:
    """mlx_lm.models.base.scaled_dot_product_attention, MLX's CPU fallback's
    arithmetic with its matmuls on the kernel; other cases run mlx-lm's."""
    if not _covered(queries, keys, values, cache, mask, sinks):
        return base.scaled_dot_product_attention(
            queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
        )
    b, heads, q_len, dim = queries.shape
    kv_heads, k_len = keys.shape[1], keys.shape[2]
    rep = heads // kv_heads
    q = mx.multiply(mx.array(scale, mx.float32), queries)
    q = q.reshape(b * kv_heads, rep * q_len, dim)  # a kv head's queries as rows
    k = keys.reshape(b * kv_heads, k_len, dim)
    v = values.reshape(b * kv_heads, k_len, values.shape[-1])
    if mask is None or isinstance(mask, str):  # none or causal: one op
        causal = q_len if isinstance(mask, str) else 0
        out = _native.exact_attention(q, k, v, causal, threads)
        return out.reshape(b, heads, q_len, values.shape[-1])
    scores = _native.exact_matmul(q, k, True, threads)
    scores = _masked(
        scores.reshape(b, kv_heads, rep, q_len, k_len), mask, queries, keys, rep
    )
    scores = _native.exact_softmax(scores, threads)  # mx.softmax(precise=True)
    out = _native.exact_matmul(
        scores.reshape(b * kv_heads, rep * q_len, k_len), v, False, threads
    )
    return out.reshape(b, heads, q_len, values.shape[-1])


@functools.cache
def matches_mlx() -> bool:
    """Whether exact_sdpa equals this MLX's sdpa bit for bit (causal and
    unmasked, grouped heads, a decode step and a prompt; checked once, MLX's
    random state left alone)."""
    keys = [mx.random.key(i) for i in range(3)]

    def pairs() -> Iterator[tuple[mx.array, mx.array]]:
        for q_len, mask in ((1, None), (9, "causal"), (9, None)):
            q = mx.random.normal((1, 4, q_len, 16), key=keys[0])
            k = mx.random.normal((1, 2, 11, 16), key=keys[1])
            v = mx.random.normal((1, 2, 11, 16), key=keys[2])
            yield (
                exact_sdpa(q, k, v, None, 0.25, mask),
                mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask),
            )

    return agrees_with_mlx("kernel's attention", pairs())


@functools.cache
def _exact_class(cls: type, threads: int) -> type:
    """`cls` with its own `__call__` run against exact_sdpa."""
    call = cls.__call__
    scope = dict(call.__globals__)
    scope["scaled_dot_product_attention"] = functools.partial(
        exact_sdpa, threads=threads
    )
    bound = types.FunctionType(
        call.__code__, scope, call.__name__, call.__defaults__, call.__closure__
    )
    bound.__kwdefaults__ = call.__kwdefaults__
    return type(cls.__name__, (cls,), {"__call__": bound, "__module__": cls.__module__})


def _calls_sdpa(module: nn.Module) -> bool:
    call = type(module).__call__
    code = getattr(call, "__code__", None)
    return bool(
        code is not None
        and "scaled_dot_product_attention" in code.co_names
        and call.__globals__.get("scaled_dot_product_attention")
        is base.scaled_dot_product_attention
    )


def use_exact_attention(model: nn.Module, plan: ExecutionPlan) -> int:
    """Rebind the model's attention modules to exact_sdpa where the plan runs
    the CPU kernel and it equals MLX's; the number rebound."""
    if not plan.cpu_kernel:
        return 0
    found = [m for _, m in model.named_modules() if _calls_sdpa(m)]
    if not found or not matches_mlx():
        return 0
    for module in found:
        module.__class__ = _exact_class(type(module), plan.tuning.kernel_threads)
    return len(found)
