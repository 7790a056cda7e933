"""The extension's CPU kernel (csrc/cpu_experts.h) against MLX's own ops, bit
for bit: SwitchGLU over gather_qmm and mx.quantized_matmul, on every bit width
and group size, one token and several, on slots as MLX holds them and blocked
(the kernel's layout); and the streaming model with it against mlx-lm's
resident model, its slots blocked where the kernel computes every call."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import PROMPT, logits_stepwise
from mlx_lm.models.switch_layers import SwitchGLU

import moestream
from moestream.formats import BLOCK_ROWS, blocked, unblocked
from moestream.formats.manifest import Segment
from moestream.runtime import Tuning, native
from moestream.runtime.switch import StreamingSwitchGLU

pytestmark = pytest.mark.skipif(
    not native.available(), reason="the native extension is not built here"
)

BITS = [2, 3, 4, 5, 6, 8]
GROUPS = [32, 64, 128]


def _switch(d: int, hidden: int, experts: int, specs: list[tuple[int, int]]):
    glu = SwitchGLU(d, hidden, experts)
    glu.set_dtype(mx.float32)
    for name, (bits, gs) in zip(
        ("gate_proj", "up_proj", "down_proj"), specs, strict=True
    ):
        glu[name] = glu[name].to_quantized(group_size=gs, bits=bits)
    mx.eval(glu.parameters())
    return glu


def _kernel(
    glu: SwitchGLU,
    x: mx.array,
    inds: mx.array,
    threads: int = 0,
    rows_blocked: bool = False,
    fma: bool = False,
):
    """The kernel on `glu`'s weights; `rows_blocked`: blocked first, as blocked
    slots hold them; `fma`: every spec allows the fused dequantization."""
    projections = [glu.gate_proj, glu.up_proj, glu.down_proj]
    weights = [a for p in projections for a in (p.weight, p.scales, p.biases)]
    if rows_blocked:
        weights = native.blocked_arrays(weights)
    specs = [(p.bits, p.group_size, fma) for p in projections]
    return native._native.expert_mlp(
        x, inds, weights, specs, threads, blocked=rows_blocked
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_expert_mlp_equals_switch_glu(bits, group_size, tokens):
    mx.random.seed(bits * 1000 + group_size + tokens)
    glu = _switch(256, 384, 6, [(bits, group_size)] * 3)
    x = mx.random.normal((1, tokens, 256))
    inds = mx.random.randint(0, 6, (1, tokens, 4)).astype(mx.uint32)
    ours, theirs = _kernel(glu, x, inds), glu(x, inds)
    assert ours.shape == theirs.shape == (1, tokens, 4, 256)
    assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("spin_us", [0, Tuning.kernel_spin_us])
def test_mixed_bits_partial_tasks_and_threads_agree(spin_us):
    """Per-projection bits (as recipes write them), rows that are not a
    multiple of a task's 64, 1 thread or 2 or 3 (runs of tasks handed out
    to more threads than cores), idle threads that sleep at once or wait
    awake first: still MLX's bits."""
    mx.random.seed(3)
    glu = _switch(128, 224, 5, [(4, 64), (3, 32), (6, 32)])
    x = mx.random.normal((2, 3, 128))
    inds = mx.random.randint(0, 5, (2, 3, 2))
    theirs = glu(x, inds)
    native._native.set_pool_spin(spin_us)
    try:
        for threads in (1, 2, 3):
            assert mx.array_equal(_kernel(glu, x, inds, threads), theirs).item()
    finally:
        native._native.set_pool_spin(Tuning.kernel_spin_us)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_prefill_panels_equal_switch_glu(bits, group_size):
    """Many tokens an expert (prefill): each expert's rows dequantized once
    for all its tokens, still MLX's bits; a few experts with one token beside."""
    mx.random.seed(bits * 100 + group_size)
    glu = _switch(256, 384, 6, [(bits, group_size)] * 3)
    x = mx.random.normal((1, 41, 256))
    inds = mx.random.randint(0, 5, (1, 41, 3)).astype(mx.uint32)
    inds[0, 7, 2] = 5  # expert 5: one pair only
    ours, theirs = _kernel(glu, x, inds), glu(x, inds)
    assert mx.array_equal(ours, theirs).item()


def test_blocked_layout_is_the_kernels():
    """blocked() puts row r's element c at (r / lanes * cols + c) * lanes +
    r % lanes, and unblocked() undoes it."""
    lanes = 4
    a = np.arange(2 * 8 * 3).reshape(2, 8, 3)
    b = blocked(a, lanes)
    assert b.shape == a.shape
    flat = b.reshape(2, -1)
    for r in range(8):
        for c in range(3):
            assert flat[1, (r // lanes * 3 + c) * lanes + r % lanes] == a[1, r, c]
    assert np.array_equal(unblocked(b, lanes), a)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("tokens", [1, 2, 3, 17, 130])
def test_blocked_expert_mlp_equals_switch_glu(bits, group_size, tokens):
    """Blocked slots: decode's rows (1, 2 tokens) and prefill's panels (3 and
    more an expert), 1 thread and 2, MLX's bits. With groups of 32 the
    rows end in a partial panel and task (not a multiple of 64)."""
    mx.random.seed(bits * 1000 + group_size + tokens + 7)
    d, hidden = {32: (224, 352), 64: (192, 320), 128: (256, 384)}[group_size]
    glu = _switch(d, hidden, 6, [(bits, group_size)] * 3)
    x = mx.random.normal((1, tokens, d))
    inds = mx.random.randint(0, 6, (1, tokens, 4)).astype(mx.uint32)
    theirs = glu(x, inds)
    for threads in (1, 2):
        ours = _kernel(glu, x, inds, threads, rows_blocked=True)
        assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("tokens", [1, 2, 3, 17, 130])
def test_blocked_mixed_bits_equal_switch_glu(tokens):
    """Per-projection bits and group sizes on blocked slots."""
    mx.random.seed(tokens + 50)
    glu = _switch(128, 224, 5, [(4, 64), (3, 32), (6, 32)])
    x = mx.random.normal((tokens, 128))
    inds = mx.random.randint(0, 5, (tokens, 3)).astype(mx.uint32)
    theirs = glu(x, inds)
    for threads in (1, 2):
        ours = _kernel(glu, x, inds, threads, rows_blocked=True)
        assert mx.array_equal(ours, theirs).item()
    # the layout matters: rows read as blocks are other values
    wrong = native._native.expert_mlp(
        x,
        inds,
        [a for n in ("gate_proj", "up_proj", "down_proj") for a in _arrays(glu[n])],
        [(4, 64, False), (3, 32, False), (6, 32, False)],
        1,
        blocked=True,
    )
    assert not mx.array_equal(wrong, theirs).item()


def _arrays(p: nn.Module) -> list[mx.array]:
    return [p.weight, p.scales, p.biases]


def test_blocked_rows_must_fill_blocks():
    """A blocked call on rows that are not a multiple of the lanes: one line."""
    w = []
    for rows in (36, 36, 64):
        w += mx.quantize(mx.zeros((2, rows, 64)), 32, 4)
    x, inds = mx.zeros((1, 64)), mx.zeros((1, 1), mx.uint32)
    lanes = native.kernel_block()
    assert 36 % lanes
    with pytest.raises(ValueError, match=f"multiples of {lanes}"):
        native._native.expert_mlp(x, inds, w, [(4, 32, False)] * 3, 1, blocked=True)


def test_blocked_kernel_never_falls_back_to_mlx():
    """MLX's gather_qmm would read blocked slots as rows: a call the kernel
    does not take raises instead."""
    glu = _switch(64, 64, 2, [(4, 32)] * 3)
    kernel = native.ExpertKernel(glu, 1, blocked=True)
    with pytest.raises(native.NativeEngineError, match="blocked"):
        kernel(mx.zeros((1, 64), mx.float16), mx.zeros((1, 1), mx.uint32))


@pytest.mark.parametrize("tokens", [2, 3, 4, 7, 256, 300, 4096])
def test_prefill_token_counts_equal_switch_glu(tokens):
    """Token counts around the panel path's threshold, its tiles of tokens
    and its blocks of 256, up to 4096; per-projection bits, partial panels."""
    mx.random.seed(tokens)
    glu = _switch(64, 96, 3, [(4, 32), (3, 32), (6, 32)])
    x = mx.random.normal((tokens, 64))
    inds = mx.random.randint(0, 3, (tokens, 2)).astype(mx.uint32)
    theirs = glu(x, inds)
    for threads in (1, 2):
        assert mx.array_equal(_kernel(glu, x, inds, threads), theirs).item()


@pytest.mark.parametrize("tokens", [1, 2, 40])
def test_swiglu_far_tails_equal_switch_glu(tokens):
    """Gates far past exp's cut-offs (|gate| > 88: infinity and zero) and
    near them, on the fused rows and on the panels: the kernel's vector
    sigmoid is MLX's, value for value. The down projection is an identity,
    so each hidden value (however small) reaches the output."""
    mx.random.seed(tokens + 17)
    glu = _switch(128, 128, 4, [(4, 32)] * 3)
    eye = mx.broadcast_to(mx.eye(128), (4, 128, 128))
    down = glu.down_proj
    down.weight, down.scales, down.biases = mx.quantize(eye, 32, 4)
    x = mx.random.normal((tokens, 128)) * mx.linspace(1, 400, tokens * 128).reshape(
        tokens, 128
    )
    inds = mx.random.randint(0, 4, (tokens, 2)).astype(mx.uint32)
    gate = glu.gate_proj(x[:, None, None, :], inds)
    assert ((gate < -80) & (gate > -88)).any().item() and (gate > 88).any().item()
    ours, theirs = _kernel(glu, x, inds), glu(x, inds)
    assert mx.array_equal(ours, theirs).item()


@pytest.mark.parametrize("tokens", [2, 3, 5, 255, 257, 4096])
@pytest.mark.parametrize("bits", [3, 4])
def test_quant_matmul_many_tokens(tokens, bits):
    mx.random.seed(tokens + bits)
    layer = nn.QuantizedLinear(128, 72, bias=False, group_size=64, bits=bits)
    x = mx.random.normal((1, tokens, 128))
    ours = native._native.quant_matmul(
        x, layer.weight, layer.scales, layer.biases, bits, 64
    )
    assert mx.array_equal(ours, layer(x)).item()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
def test_quant_matmul_equals_quantized_linear(bits, group_size):
    mx.random.seed(bits + group_size)
    layer = nn.QuantizedLinear(256, 200, bias=False, group_size=group_size, bits=bits)
    for shape in [(1, 1, 256), (2, 7, 256)]:
        x = mx.random.normal(shape)
        ours = native._native.quant_matmul(
            x, layer.weight, layer.scales, layer.biases, bits, group_size
        )
        assert mx.array_equal(ours, layer(x)).item()


def _plan(cpu_kernel: bool) -> SimpleNamespace:
    """What the kernel's helpers read of an ExecutionPlan."""
    return SimpleNamespace(cpu_kernel=cpu_kernel, tuning=Tuning())


def test_kernel_linear_swaps_in_exactly():
    layer = nn.QuantizedLinear(128, 64, bias=True, group_size=32, bits=4)
    x = mx.random.normal((3, 128))
    theirs, theirs16 = layer(x), layer(x.astype(mx.float16))
    assert native.use_dense_kernel(layer, _plan(cpu_kernel=True)) == 1
    assert type(layer) is native.KernelLinear
    assert mx.array_equal(layer(x), theirs).item()
    # not float32: MLX's own op
    assert mx.array_equal(layer(x.astype(mx.float16)), theirs16).item()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group_size", GROUPS)
@pytest.mark.parametrize("scales", ["float32", "bfloat16"])
def test_a_blocked_kernel_linear_equals_quantized_linear(bits, group_size, scales):
    """use_dense_kernel stores a layer blocked: bfloat16 scales and biases as
    bfloat16 with the fused dequantization, others as float32 unfused; its
    decode rows and prefill panels equal MLX's layer bit for bit, and MLX's
    own op (a float16 input) still reads the weights as MLX holds them."""
    mx.random.seed(bits + group_size)
    layer = nn.QuantizedLinear(256, 96, bias=True, group_size=group_size, bits=bits)
    if scales == "bfloat16":  # as a float32 model loads a converted layer
        for name in ("scales", "biases"):
            layer[name] = layer[name].astype(mx.bfloat16).astype(mx.float32)
    xs = [mx.random.normal((1, t, 256)) for t in (1, 2, 7, 300)]
    theirs = [layer(x) for x in xs]
    theirs16 = layer(xs[0].astype(mx.float16))
    assert native.use_dense_kernel(layer, _plan(cpu_kernel=True)) == 1
    assert layer._blocked
    assert layer.scales.dtype == getattr(mx, scales)
    assert layer._fma == (scales == "bfloat16" and native.fma_matches_mlx())
    for x, y in zip(xs, theirs, strict=True):
        assert mx.array_equal(layer(x), y).item()
    assert mx.array_equal(layer(xs[0].astype(mx.float16)), theirs16).item()


def test_a_layer_of_partial_blocks_stays_in_mlxs_layout():
    layer = nn.QuantizedLinear(128, 72, bias=False, group_size=64, bits=4)
    x = mx.random.normal((1, 3, 128))
    theirs = layer(x)
    assert native.use_dense_kernel(layer, _plan(cpu_kernel=True)) == 1
    assert not layer._blocked  # 72 rows: not whole blocks of 16
    assert mx.array_equal(layer(x), theirs).item()


def test_bad_input_raises_one_clear_line():
    glu = _switch(64, 64, 2, [(4, 32)] * 3)
    inds = mx.zeros((1, 1, 1), mx.uint32)
    with pytest.raises(ValueError, match="float32"):
        _kernel(glu, mx.zeros((1, 1, 64), mx.float16), inds)
    with pytest.raises(RuntimeError, match="slot id past the slots"):
        mx.eval(_kernel(glu, mx.zeros((1, 1, 64)), inds + 2))  # 2 experts
    with pytest.raises(ValueError, match="bits must be"):
        native._native.quant_matmul(
            mx.zeros((1, 64)),
            mx.zeros((8, 7), mx.uint32),
            mx.zeros((8, 2)),
            mx.zeros((8, 2)),
            7,
            32,
        )


def test_kernel_covers_only_swiglu_affine_layers():
    glu = _switch(64, 64, 2, [(4, 32)] * 3)
    on = _plan(cpu_kernel=True)
    assert native.expert_kernel(glu, on) is not None
    assert native.expert_kernel(glu, _plan(cpu_kernel=False)) is None
    glu.activation = nn.GELU()  # not mlx-lm's SwiGLU: MLX's ops run it
    assert native.expert_kernel(glu, on) is None


@pytest.mark.parametrize("cache_experts", [2, 5, 8])
@pytest.mark.parametrize("engine", ["python", "native"])
def test_streaming_model_with_kernel_bit_identical(
    converted, reference, cache_experts, engine
):
    model, _ = moestream.load(
        converted, cache_experts=cache_experts, engine=engine, cpu_kernel=True
    )
    layers = [m for _, m in model.named_modules() if hasattr(m, "_experts")]
    assert layers and all(m._experts is not m._inner for m in layers)
    assert any(isinstance(m, native.KernelLinear) for _, m in model.named_modules())
    ours = logits_stepwise(model, PROMPT, steps=8)
    theirs = logits_stepwise(reference, PROMPT, steps=8)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert mx.array_equal(a, b).item(), f"step {step} differs"


def _streaming(model: nn.Module) -> dict[str, StreamingSwitchGLU]:
    return {n: m for n, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)}


@pytest.mark.parametrize("engine", ["python", "native"])
def test_slots_blocked_where_the_kernel_runs(converted, reference, engine):
    """With the kernel, every slot holds its expert blocked (each engine's
    filler): un-blocked, the resident model's weights, scales and biases
    (scales and biases as their records store them, here bfloat16: widened,
    the resident model's float32 values)."""
    model, _ = moestream.load(
        converted, cache_experts=8, engine=engine, cpu_kernel=True
    )
    layers = _streaming(model)
    assert layers and all(m.blocked and m._experts.blocked for m in layers.values())
    logits_stepwise(model, PROMPT, steps=2)  # reads every expert into a slot
    resident = dict(reference.named_modules())
    lanes = BLOCK_ROWS  # on every ISA, as records stored blocked hold them
    checked = 0
    for name, m in layers.items():
        table = m.slot_table()
        for proj in ("gate_proj", "up_proj", "down_proj"):
            for part in ("weight", "scales", "biases"):
                held = m._inner[proj][part]
                if part != "weight":
                    assert held.dtype == getattr(
                        mx, m.layer.segment(f"{proj}.{part}").dtype
                    )
                    held = held.astype(mx.float32)
                slots = np.array(held)
                theirs = np.array(resident[name][proj][part])
                for expert in range(m.layer.num_experts):
                    if table[expert] < m.capacity:
                        ours = unblocked(slots[table[expert]], lanes)
                        assert np.array_equal(ours, theirs[expert]), (name, proj)
                        checked += 1
    assert checked


@pytest.mark.parametrize(
    "options",
    [
        {"cpu_kernel": False},
        {"cpu_kernel": True, "arithmetic": "fast"},
        {"engine": "python"},  # MLX's ops by default on the reference path
    ],
)
def test_slots_row_major_where_mlx_reads_them(converted, options):
    model, _ = moestream.load(converted, cache_experts=3, **options)
    layers = _streaming(model).values()
    assert layers and not any(m.blocked for m in layers)


def _scales(kind: str, s: mx.array) -> mx.array:
    """Scales of unusual kinds: widened from bfloat16 (as converted models
    hold them), float32, bfloat16 subnormals, bfloat16 ones whose products
    pass float32's range (MLX's product is inf), and groups where one row's
    scale is float32 and the others bfloat16."""
    widened = s.astype(mx.bfloat16).astype(mx.float32)
    if kind == "bfloat16":
        return widened
    if kind == "subnormal":
        return (widened * 2.0**-140).astype(mx.bfloat16).astype(mx.float32)
    if kind == "huge":
        return (widened * 2.0**124).astype(mx.bfloat16).astype(mx.float32)
    if kind == "one-row-float32":
        return mx.concatenate([s[..., :1, :], widened[..., 1:, :]], axis=-2)
    return s


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "kind", ["float32", "bfloat16", "subnormal", "huge", "one-row-float32"]
)
def test_every_kind_of_scale_gives_mlxs_bits(bits, kind):
    """Rows and panels, slots as MLX holds them and blocked, and the dense
    matmul: MLX's bits (its NaNs where a product overflows) on every kind.
    (A dequantization fused where the product is exact must keep this.)"""
    mx.random.seed(bits)
    glu = _switch(64, 96, 4, [(bits, 32)] * 3)
    for p in (glu.gate_proj, glu.up_proj, glu.down_proj):
        p.scales = _scales(kind, p.scales)
        p.biases = p.biases.astype(mx.bfloat16).astype(mx.float32)
    mx.eval(glu.parameters())
    largest = max(
        mx.abs(p.scales).max().item()
        for p in (glu.gate_proj, glu.up_proj, glu.down_proj)
    )
    stored = "float32" if "float32" in kind else "bfloat16"
    seg = Segment("gate_proj.scales", stored, (1,), 0, 4, max_abs=largest)
    allowed = native.exact_fma(seg, bits) if math.isfinite(largest) else False
    if kind != "huge":  # (fused at few bits, where no product overflows)
        assert allowed == (
            kind in ("bfloat16", "subnormal") and native.fma_matches_mlx()
        )
    for tokens in (1, 9):
        x = mx.random.normal((1, tokens, 64))
        inds = mx.random.randint(0, 4, (1, tokens, 2)).astype(mx.uint32)
        theirs = glu(x, inds)
        for rows_blocked in (False, True):
            ours = _kernel(glu, x, inds, 2, rows_blocked=rows_blocked)
            assert mx.array_equal(ours, theirs, equal_nan=True).item()
        # Blocked, fused where the rule allows (as records stored with these
        # scales would say); fused against the rule, float32 scales differ.
        fused = _kernel(glu, x, inds, 2, rows_blocked=True, fma=allowed)
        assert mx.array_equal(fused, theirs, equal_nan=True).item()
        if kind == "float32" and native.fma_matches_mlx():
            wrong = _kernel(glu, x, inds, 2, rows_blocked=True, fma=True)
            assert not mx.array_equal(wrong, theirs, equal_nan=True).item()
        q = glu.gate_proj
        dense = (q.weight[0], q.scales[0], q.biases[0])
        ours = native._native.quant_matmul(x, *dense, bits, 32)
        theirs = mx.quantized_matmul(x, *dense, group_size=32, bits=bits)
        assert mx.array_equal(ours, theirs, equal_nan=True).item()
