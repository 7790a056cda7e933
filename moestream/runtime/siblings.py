"""Sibling projections as one kernel call: a block's quantized linears that
read the same input (attention's q, k and v; a dense MLP's gate and up) keep
their weights as row ranges of one concatenated matrix, and the first of them
called with an input runs the CPU kernel once over all their rows; the others
take their rows of that output.

Exact by construction: the kernel computes each output row from its own
weight row alone (csrc/cpu_experts.h), so a row's bits do not depend on which
other rows share its call. A sibling called with any other input runs on its
own rows (a view of the same matrix). One call instead of three halves the
attention's kernel dispatches in a decode step and gives the threads one
larger matrix in prefill.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .native import KernelLinear, _native

# Children of one module that models call with the same input.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedRows:
    """The concatenated weights of a group of siblings, and the last input's
    output until every sibling has taken its rows."""

    def __init__(self, members: list[KernelLinear]) -> None:
        first = members[0]
        self.bits, self.group_size = first.bits, first.group_size
        self.threads = first._kernel_threads
        self.names = len(members)
        parts = ("weight", "scales", "biases")
        self.weight, self.scales, self.biases = (
            mx.concatenate([m[p] for m in members]) for p in parts
        )
        mx.eval(self.weight, self.scales, self.biases)
        self.ranges: list[tuple[int, int]] = []
        start = 0
        for m in members:
            rows = m["weight"].shape[0]
            self.ranges.append((start, start + rows))
            start += rows
        self._x: mx.array | None = None
        self._y: mx.array | None = None
        self._taken: set[int] = set()
        for i, m in enumerate(members):  # each sibling's weights: a view
            lo, hi = self.ranges[i]
            for p in parts:
                m[p] = getattr(self, p)[lo:hi]
            mx.eval(m["weight"], m["scales"], m["biases"])
            m._fused = (self, i)

    def rows(self, x: mx.array, i: int) -> mx.array:
        """Sibling i's output for x: its rows of the group's call on x (made
        now if the group's last call was on another input)."""
        if self._x is not x:
            self._x = x
            self._y = _native.quant_matmul(
                x,
                self.weight,
                self.scales,
                self.biases,
                self.bits,
                self.group_size,
                self.threads,
            )
            self._taken = set()
        y = self._y
        self._taken.add(i)
        if len(self._taken) == self.names:  # all served: hold nothing
            self._x = self._y = None
        lo, hi = self.ranges[i]
        return y[..., lo:hi]


def fuse_siblings(model: nn.Module) -> int:
    """Group each module's KernelLinear siblings (GROUPS) that share bits,
    group size, input width and the float32 scales the kernel computes in;
    the number of groups made."""
    made = 0
    for _, module in model.named_modules():
        for names in GROUPS:
            members = [module.get(n) for n in names]
            if len(members) > 1 and _fusable(members):
                FusedRows(members)
                made += 1
    return made


def _fusable(members: list[object]) -> bool:
    if not all(type(m) is KernelLinear for m in members):
        return False
    first = members[0]
    return all(
        m.bits == first.bits
        and m.group_size == first.group_size
        and m["weight"].shape[1] == first["weight"].shape[1]
        and m["scales"].dtype == mx.float32
        and not hasattr(m, "_fused")
        for m in members
    )
