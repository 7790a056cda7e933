"""The kernel's small exact ops against MLX's, bit for bit: the float32 matmul
(csrc/cpu_matmul.h) against mx.matmul, attention on it
(moestream/runtime/attention.py) against mx.fast.scaled_dot_product_attention,
the RMS norm and the rope (csrc/cpu_ops.h) against mx.fast.rms_norm and
mx.fast.rope; the streaming model with them against mlx-lm's resident model."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.runtime import Tuning, native
from moestream.runtime import attention as att

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native extension is not built here"
)


def _operand(shape: tuple, key: int) -> mx.array:
    """Normal values with a tenth of them zero (signed zeros in products)."""
    a = mx.random.normal(shape, key=mx.random.key(key))
    zero = mx.random.uniform(shape=shape, key=mx.random.key(key + 1)) < 0.1
    return mx.where(zero, 0.0, a)


@pytest.mark.parametrize(
    "batch, m, k, n",
    [
        (1, 1, 64, 17),
        (4, 4, 64, 40),
        (2, 7, 33, 5),
        (3, 130, 100, 64),
        (1, 3, 1, 3),
        (2, 16, 128, 100),
        (1, 1, 1000, 1),
        (2, 37, 16, 129),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_equals_mlx(batch, m, k, n, threads):
    a = _operand((batch, m, k), 1)
    b = _operand((batch, k, n), 3)
    bt = _operand((batch, n, k), 5)
    ours = native._native.exact_matmul(a, b, False, threads)
    assert mx.array_equal(ours, a @ b).item()
    ours_t = native._native.exact_matmul(a, bt, True, threads)
    assert mx.array_equal(ours_t, a @ mx.swapaxes(bt, -1, -2)).item()


def test_kernels_read_views_through_their_strides():
    """A cache's slice, a transpose, a broadcast: no copy in the graph, the
    same bits as MLX's ops on the same views."""
    cache = _operand((2, 4, 256, 64), 31)  # [B, heads, capacity, dim]
    keys = cache[:, :, :37, :].reshape(8, 37, 64)  # a view: rows 256 apart
    q = _operand((8, 5, 64), 32)
    scores = native._native.exact_matmul(q, keys, True)
    assert mx.array_equal(scores, q @ keys.transpose(0, 2, 1)).item()
    ours = native._native.exact_matmul(scores, keys, False)
    assert mx.array_equal(ours, scores @ keys).item()
    qt = _operand((8, 64, 5), 33).transpose(0, 2, 1)
    assert mx.array_equal(
        native._native.exact_matmul(qt, keys, True), qt @ keys.transpose(0, 2, 1)
    ).item()
    wide = mx.broadcast_to(_operand((1, 64, 9), 34), (8, 64, 9))
    assert mx.array_equal(native._native.exact_matmul(q, wide), q @ wide).item()
    x = _operand((3, 40, 7), 35).transpose(0, 2, 1)
    assert mx.array_equal(native._native.exact_softmax(x, 2), mx.softmax(x, -1)).item()
    w = _operand((40,), 36)
    assert mx.array_equal(
        native._native.exact_rms_norm(x, w, 1e-5), mx.fast.rms_norm(x, w, 1e-5)
    ).item()
    wq, sc, bi = mx.quantize(_operand((48, 64), 38), 64, 4)
    xq = _operand((64, 5), 39).T
    assert mx.array_equal(
        native._native.quant_matmul(xq, wq, sc, bi, 4, 64),
        mx.quantized_matmul(xq, wq, sc, bi, True, 64, 4),
    ).item()
    xs = _operand((2, 9, 3, 64), 37).transpose(0, 2, 1, 3)
    assert mx.array_equal(
        native._native.exact_rope(xs, 64, False, 1e4, 1.0, mx.array([4], mx.int32)),
        mx.fast.rope(xs, 64, traditional=False, base=1e4, scale=1.0, offset=4),
    ).item()


@pytest.mark.parametrize("causal", [0, 5])
def test_attention_op_reads_cache_views(causal):
    """exact_attention on a cache's slices (rows 256 apart), values of a
    width that is not whole vectors: MLX's sdpa fallback steps, bit for bit."""
    cache = _operand((2, 4, 256, 64), 51)
    keys = cache[:, :, :37, :].reshape(8, 37, 64)
    values = _operand((2, 4, 256, 40), 52)[:, :, :37, :].reshape(8, 37, 40)
    q = _operand((8, 3 * 5, 64), 53) * 0.125
    scores = q @ keys.transpose(0, 2, 1)
    if causal:
        q_idx = mx.tile(mx.arange(37 - causal, 37), 3)[:, None]
        low = mx.array(mx.finfo(mx.float32).min, mx.float32)
        scores = mx.where(q_idx >= mx.arange(37)[None], scores, low)
    theirs = mx.softmax(scores, axis=-1, precise=True) @ values
    ours = native._native.exact_attention(q, keys, values, causal, 2)
    assert mx.array_equal(ours, theirs).item()
    with pytest.raises(ValueError, match="causal"):
        native._native.exact_attention(q, keys, values, 4)
    with pytest.raises(ValueError, match="float32"):
        native._native.exact_attention(q.astype(mx.float16), keys, values)


def test_matmul_refuses_what_it_does_not_compute():
    with pytest.raises(ValueError, match="float32"):
        native._native.exact_matmul(
            mx.zeros((1, 2, 2), mx.float16), mx.zeros((1, 2, 2), mx.float16)
        )
    with pytest.raises(ValueError, match=r"\[batch, M, K\]"):
        native._native.exact_matmul(mx.zeros((1, 2, 3)), mx.zeros((1, 2, 3)))


@pytest.mark.parametrize(
    "shape", [(1, 1, 1024), (1, 16, 64), (3, 5, 80), (2, 7), (4, 1)]
)
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.5])
def test_rms_norm_equals_mlx(shape, eps):
    x = _operand(shape, 7) * 3
    w = _operand(shape[-1:], 9)
    ours = native._native.exact_rms_norm(x, w, eps)
    assert mx.array_equal(ours, mx.fast.rms_norm(x, w, eps)).item()


def test_rms_norm_swaps_in_where_it_is_exact():
    import mlx.nn as nn

    norm = nn.RMSNorm(48, eps=1e-5)
    norm.weight = mx.random.normal((48,), key=mx.random.key(1))
    x = mx.random.normal((2, 3, 48), key=mx.random.key(2))
    theirs, theirs16 = norm(x), norm(x.astype(mx.float16))
    native.norm_matches_mlx.cache_clear()
    assert (
        native.use_dense_kernel(norm, SimpleNamespace(cpu_kernel=True, tuning=Tuning()))
        == 1
    )
    assert type(norm) is native.KernelRMSNorm
    assert mx.array_equal(norm(x), theirs).item()
    assert mx.array_equal(norm(x.astype(mx.float16)), theirs16).item()  # MLX's own
    with pytest.raises(ValueError, match="one weight per element"):
        native._native.exact_rms_norm(x, mx.zeros((3,)), 1e-5)


@pytest.mark.parametrize(
    "shape, dims",
    [
        ((1, 16, 1, 64), 64),
        ((2, 4, 37, 128), 128),
        ((3, 2, 9, 80), 48),
        ((2, 9, 96), 96),
    ],
)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize(
    "base, scale, offset", [(1e4, 1.0, 0), (1e6, 1.0, 4095), (5e5, 0.25, 123457)]
)
def test_rope_equals_mlx(shape, dims, traditional, base, scale, offset):
    """Decode rows and prompts, rotated part of the features or all of them,
    positions past sin and cos's 2^23 cut-over to libm."""
    x = _operand(shape, 17) * 4
    ours = native._native.exact_rope(
        x, dims, traditional, base, scale, mx.array([offset], mx.int32)
    )
    theirs = mx.fast.rope(
        x, dims, traditional=traditional, base=base, scale=scale, offset=offset
    )
    assert mx.array_equal(ours, theirs).item()


def test_rope_per_batch_offsets_frequencies_and_strided_input():
    x = _operand((3, 4, 7, 64), 19)
    offsets = mx.array([0, 100, 5000], mx.int32)
    ours = native._native.exact_rope(x, 64, False, 1e4, 1.0, offsets)
    theirs = mx.fast.rope(x, 64, traditional=False, base=1e4, scale=1.0, offset=offsets)
    assert mx.array_equal(ours, theirs).item()
    every_other = mx.array([0, 7, 100, 9, 5000, 1], mx.int32)[::2]  # a view
    ours = native._native.exact_rope(x, 64, False, 1e4, 1.0, every_other)
    theirs = mx.fast.rope(
        x, 64, traditional=False, base=1e4, scale=1.0, offset=every_other
    )
    assert mx.array_equal(ours, theirs).item()
    freqs = mx.random.uniform(1, 1000, (32,), key=mx.random.key(3))
    ours = native._native.exact_rope(x, 64, False, 0.0, 1.0, offsets[1:2], freqs)
    theirs = mx.fast.rope(
        x, 64, traditional=False, base=None, scale=1.0, offset=100, freqs=freqs
    )
    assert mx.array_equal(ours, theirs).item()
    xt = _operand((1, 9, 16, 64), 21).transpose(0, 2, 1, 3)  # as attention's q
    ours = native._native.exact_rope(xt, 64, False, 1e4, 1.0, mx.array([3], mx.int32))
    theirs = mx.fast.rope(xt, 64, traditional=False, base=1e4, scale=1.0, offset=3)
    assert mx.array_equal(ours, theirs).item()
    with pytest.raises(ValueError, match="dims must be even"):
        native._native.exact_rope(x, 63, False, 1e4, 1.0, offsets)
    with pytest.raises(ValueError, match="one value or one per batch"):
        native._native.exact_rope(x, 64, False, 1e4, 1.0, mx.zeros((2,), mx.int32))


def test_rope_swaps_in_where_it_is_exact():
    import mlx.nn as nn

    rope = nn.RoPE(32, base=1e4)
    x = _operand((1, 2, 5, 48), 23)
    theirs = [rope(x, offset=9), rope(x.astype(mx.float16), offset=9)]
    native.rope_matches_mlx.cache_clear()
    plan = SimpleNamespace(cpu_kernel=True, tuning=Tuning())
    assert native.use_dense_kernel(rope, plan) == 1
    assert type(rope) is native.KernelRoPE
    assert mx.array_equal(rope(x, offset=9), theirs[0]).item()
    assert mx.array_equal(rope(x, offset=mx.array(9)), theirs[0]).item()
    assert mx.array_equal(rope(x.astype(mx.float16), offset=9), theirs[1]).item()


@pytest.mark.parametrize(
    "shape", [(1, 17), (3, 1024), (2, 5, 100), (4, 16, 33), (7, 3)]
)
@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_softmax_equals_mlx(shape, scale):
    x = _operand(shape, 13) * scale  # large scales reach exp's -88 cut-off
    ours = native._native.exact_softmax(x, 2)
    assert mx.array_equal(ours, mx.softmax(x, axis=-1, precise=True)).item()


def test_softmax_keeps_mlx_edges():
    """NaN, infinities and signed zeros come out as MLX's do."""
    nan, inf = float("nan"), float("inf")
    x = mx.array(
        [[nan, 1.0, 2.0], [-inf, 0.0, 1.0], [-0.0, 0.0, -100.0], [inf, 1.0, 0.0]]
    )
    ours = native._native.exact_softmax(x, 1)
    theirs = mx.softmax(x, axis=-1, precise=True)
    assert mx.array_equal(ours, theirs, equal_nan=True).item()
    with pytest.raises(ValueError, match="float32"):
        native._native.exact_softmax(x.astype(mx.float16))


def test_softmax_closing_runs_equal_mlx():
    """Rows that end in a run of one value (a causal mask's lowest, a value
    whose exp is not zero, signed zeros, a whole row of it): MLX's bits."""
    low = float(mx.finfo(mx.float32).min)
    x = _operand((6, 70), 17) * 4
    tails = [low, low, 0.5, -0.0, 0.0, low]
    rows = []
    for i, (row, tail) in enumerate(zip(x, tails, strict=True)):
        start = [70, 40, 3, 30, 50, 0][i]
        rows.append(mx.concatenate([row[:start], mx.full((70 - start,), tail)]))
    x = mx.stack(rows)
    ours = native._native.exact_softmax(x, 2)
    assert mx.array_equal(ours, mx.softmax(x, axis=-1, precise=True)).item()


@pytest.mark.parametrize("rep, q_len, k_len", [(1, 1, 1), (4, 7, 7), (3, 5, 29)])
def test_causal_scores_equal_masked_product(rep, q_len, k_len):
    """causal = q_len: q @ k.T with float32's lowest past each query's key,
    as MLX's sdpa masks it; the rest computed as ever."""
    q = _operand((2, rep * q_len, 24), 31)
    k = _operand((2, k_len, 24), 33)
    ours = native._native.exact_matmul(q, k, True, 2, causal=q_len)
    q_idx = mx.tile(mx.arange(k_len - q_len, k_len), rep)[:, None]
    seen = q_idx >= mx.arange(k_len)[None]
    low = mx.array(mx.finfo(mx.float32).min, mx.float32)
    theirs = mx.where(seen, q @ mx.swapaxes(k, 1, 2), low)
    assert mx.array_equal(ours, theirs).item()
    with pytest.raises(ValueError, match="causal"):
        native._native.exact_matmul(q, mx.swapaxes(k, 1, 2), False, 2, causal=q_len)


def test_matmul_trailing_zeros_against_infinity():
    """Rows of a that end in zeros skip them only where b is finite: a zero
    times an infinity is MLX's NaN."""
    a = _operand((1, 9, 40), 41)
    a = mx.where(mx.arange(40)[None, None] < mx.arange(9)[None, :, None] * 4, a, 0.0)
    b = _operand((1, 40, 32), 43)
    for bb in (b, mx.where(mx.arange(40)[None, :, None] == 37, float("inf"), b)):
        ours = native._native.exact_matmul(a, bb, False, 2)
        assert mx.array_equal(ours, a @ bb, equal_nan=True).item()
    assert mx.isnan(ours).any().item()


def _qkv(batch, heads, kv_heads, q_len, k_len, dim, key):
    q = mx.random.normal((batch, heads, q_len, dim), key=mx.random.key(key))
    k = mx.random.normal((batch, kv_heads, k_len, dim), key=mx.random.key(key + 1))
    v = mx.random.normal((batch, kv_heads, k_len, dim), key=mx.random.key(key + 2))
    return q, k, v


@pytest.mark.parametrize(
    "batch, heads, kv_heads, q_len, k_len, dim",
    [
        (1, 16, 4, 1, 40, 64),
        (1, 16, 4, 33, 33, 64),
        (2, 8, 8, 5, 20, 32),
        (1, 4, 2, 6, 9, 80),
        (1, 6, 1, 17, 17, 128),
        (1, 2, 2, 3, 11, 16),
    ],
)
@pytest.mark.parametrize("mask", [None, "causal", "bool", "float"])
def test_attention_equals_mlx_sdpa(batch, heads, kv_heads, q_len, k_len, dim, mask):
    q, k, v = _qkv(batch, heads, kv_heads, q_len, k_len, dim, 11)
    if mask == "bool":  # as a batch's left padding makes them
        mask = (
            mx.random.uniform(shape=(batch, 1, q_len, k_len), key=mx.random.key(2))
            > 0.2
        )
    elif mask == "float":
        mask = mx.random.normal((q_len, k_len), key=mx.random.key(3))
    scale = dim**-0.5
    ours = att.exact_sdpa(q, k, v, None, scale, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    assert mx.array_equal(ours, theirs).item()


def test_other_attention_runs_mlx_lm_own():
    """Sinks, a quantized cache's attention and float16 are mlx-lm's path."""
    q, k, v = _qkv(1, 4, 2, 3, 5, 16, 21)
    sinks = mx.zeros((4,))
    ours = att.exact_sdpa(q, k, v, None, 0.25, "causal", sinks=sinks)
    theirs = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=0.25, mask="causal", sinks=sinks
    )
    assert mx.array_equal(ours, theirs).item()
    h = [a.astype(mx.float16) for a in (q, k, v)]
    ours = att.exact_sdpa(*h, None, 0.25, None)
    assert ours.dtype == mx.float16
    theirs = mx.fast.scaled_dot_product_attention(*h, scale=0.25)
    assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize(
    "check",
    [
        native.kernel_matches_mlx,
        native.norm_matches_mlx,
        native.rope_matches_mlx,
        att.matches_mlx,
    ],
)
def test_first_use_checks_pass_here_and_leave_the_random_state(check):
    """Each kernel's check at first use finds it equal to this MLX, and draws
    nothing from MLX's random state (seeded sampling stays mlx-lm's)."""
    mx.random.seed(7)
    expected = mx.random.normal((4,))
    mx.random.seed(7)
    check.cache_clear()
    assert check()
    assert mx.array_equal(mx.random.normal((4,)), expected).item()


def _attentions(model) -> list:
    return [m for _, m in model.named_modules() if type(m).__name__ == "Attention"]


def test_rebinding_touches_one_model_only(converted, reference):
    """The streaming model's attention runs the kernel; mlx-lm's resident
    model of the same class keeps its own, and their logits agree."""
    model, _ = moestream.load(converted, cache_experts=3, cpu_kernel=True)
    ours, theirs = _attentions(model), _attentions(reference)
    assert ours and len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert type(a) is not type(b) and isinstance(a, type(b))
        bound = type(a).__call__.__globals__["scaled_dot_product_attention"]
        assert bound.func is att.exact_sdpa
        assert type(b).__call__.__globals__["scaled_dot_product_attention"] is (
            att.base.scaled_dot_product_attention
        )
    norms = [
        type(m) for _, m in model.named_modules() if isinstance(m, native.nn.RMSNorm)
    ]
    assert norms and set(norms) == {native.KernelRMSNorm}
    ropes = [type(m) for _, m in model.named_modules() if isinstance(m, native.nn.RoPE)]
    assert ropes and set(ropes) == {native.KernelRoPE}
    off = SimpleNamespace(cpu_kernel=False, tuning=Tuning())
    assert att.use_exact_attention(reference, off) == 0
    a = logits_stepwise(model, PROMPT, steps=6)
    b = logits_stepwise(reference, PROMPT, steps=6)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert mx.array_equal(x, y).item(), f"step {step} differs"
