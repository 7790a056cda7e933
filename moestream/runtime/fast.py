"""The fast arithmetic (`RuntimeConfig.arithmetic = "fast"`), opt-in.

A prefill-sized expert call (at least `Tuning.fast_rows` pairs per expert of
the layer) dequantizes its experts' weights to the compute dtype and runs
MLX's gather_mm on the rows sorted by expert: on a GPU one CUTLASS grouped
GEMM on tensor cores, one problem per expert (mlx backend/cuda/gemms/
grouped_gemm_unaligned.cu), each row computed from its own expert's weights
alone; on a CPU one product per row. So a call split into groups of experts
gives every row the bits the whole call gives, and the streaming model equals
a resident model with the same arithmetic (`use_fast_arithmetic`) at every
budget. It is not mlx-lm's kernel, so its bits are not promised to be
mlx-lm's (on the H200 they were, at the medium bench model's geometry, 4-bit,
in bfloat16 and float16; float32 runs on TF32 tensor cores):
`moestream eval --arithmetic fast` reports its perplexity and KL divergence
against the exact path. Smaller calls (decode) keep mlx-lm's kernels.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    _gather_sort,
    _scatter_unsort,
)

from ..families import replace_module, switch_modules
from .config import FAST_ROWS_PER_EXPERT


def fast_pairs(num_experts: int, rows: int = FAST_ROWS_PER_EXPERT) -> int:
    """The fewest (token, expert) pairs of a call that runs fast."""
    return rows * num_experts


def _weight(p: nn.Module, dtype: mx.Dtype, after: mx.array) -> mx.array:
    """A projection's expert weights `[E, out, in]` in `dtype`, made only once
    `after` (the call's input) is: so a lazily built forward dequantizes one
    layer's weights at a time, not every layer's before the first runs."""
    names = [n for n in ("weight", "scales", "biases") if n in p]
    held = dict(zip(names, mx.depends([p[n] for n in names], [after]), strict=True))
    if not isinstance(p, QuantizedSwitchLinear):
        return held["weight"].astype(dtype)
    return mx.dequantize(
        held["weight"],
        held["scales"],
        held.get("biases"),
        group_size=p.group_size,
        bits=p.bits,
        mode=p.mode,
        global_scale=getattr(p, "global_scale", None),
        dtype=dtype,
    )


def _project(
    p: nn.Module, x: mx.array, idx: mx.array, after: mx.array | None = None
) -> mx.array:
    """One projection of rows `x` sorted by expert `idx`, on dequantized weights
    made once `after` (default: `x`) is."""
    w = _weight(p, x.dtype, x if after is None else after).swapaxes(-1, -2)
    y = mx.gather_mm(x, w, rhs_indices=idx, sorted_indices=True)
    if "bias" in p:
        y = y + mx.expand_dims(p["bias"][idx], -2)
    return y


def fast_glu(inner: SwitchGLU, x: mx.array, indices: mx.array) -> mx.array:
    """`inner(x, indices)` (mlx-lm's SwitchGLU) on dequantized weights, the
    rows always sorted by expert, whatever their number."""
    x = mx.expand_dims(x, (-2, -3))
    x, idx, inv_order = _gather_sort(x, mx.stop_gradient(indices))
    # One projection's weights dequantized at a time (on a CPU, gather_mm
    # copies them once more, transposed): the gate's after the up's product.
    up = _project(inner.up_proj, x, idx)
    gate = _project(inner.gate_proj, x, idx, after=up)
    x = _project(inner.down_proj, inner.activation(up, gate), idx)
    return _scatter_unsort(x, inv_order, indices.shape).squeeze(-2)


class FastSwitchGLU(nn.Module):
    """A resident SwitchGLU with the fast arithmetic on prefill-sized calls:
    the oracle of the streaming model's fast mode."""

    def __init__(self, inner: SwitchGLU, rows: int = FAST_ROWS_PER_EXPERT):
        super().__init__()
        self.inner = inner
        self._pairs = fast_pairs(inner.gate_proj.num_experts, rows)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if indices.size >= self._pairs:
            return fast_glu(self.inner, x, indices)
        return self.inner(x, indices)


def use_fast_arithmetic(
    model: nn.Module, rows: int = FAST_ROWS_PER_EXPERT
) -> nn.Module:
    """`model` (mlx-lm's, every expert resident) with each SwitchGLU computing
    as the fast mode does (from `rows` pairs per expert: Tuning.fast_rows);
    returns it."""
    for path, module in switch_modules(model).items():
        replace_module(model, path, FastSwitchGLU(module, rows))
    return model
