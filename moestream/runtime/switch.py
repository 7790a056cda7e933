"""StreamingSwitchGLU: the hot path.

It wraps the family's own (quantized) SwitchGLU, whose weight arrays are
replaced by persistent slot arrays `[capacity, ...]`. A call maps expert ids
to slots, reads the missing experts straight into slot memory, and runs
mlx-lm's SwitchGLU on slot-local indices: same kernels, same activation and
biases, so the result is bit-identical to the fully resident model.

Slots are written in place. Every output a streaming layer returns is kept in
a list shared by the model's layers and evaluated right after the next host
sync (where it is already computed, so this costs nothing): no pending
computation ever reads a slot that a later call overwrites.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ..formats import ExpertLayer
from .pool import RuntimeStats, SlotPool
from .store import ExpertStore, SlotFiller

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


class Outstanding:
    """Outputs of streaming layers that may not be evaluated yet."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] = []

    def settle(self) -> None:
        """Evaluate them all: after this, no computation reads any slot."""
        if self.arrays:
            mx.eval(self.arrays)
            self.arrays.clear()


class StreamingSwitchGLU(nn.Module):
    def __init__(
        self,
        inner: SwitchGLU,
        layer: ExpertLayer,
        store: ExpertStore,
        capacity: int,
        float_dtype: mx.Dtype,
        stats: RuntimeStats,
        outstanding: Outstanding,
    ):
        super().__init__()
        # Underscored: not parameters, so load_weights and casts leave them alone.
        self._inner = inner
        self._layer = layer
        self._stats = stats
        self._outstanding = outstanding
        self._float_dtype = float_dtype
        self._pool = SlotPool(min(capacity, layer.num_experts))
        self._targets = self._allocate_slots()
        self._filler = SlotFiller(store, layer, [m[n] for m, n in self._targets])

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    def _allocate_slots(self) -> list[tuple[nn.Module, str]]:
        """Replace each expert tensor of the inner module by `[capacity, ...]` slots."""
        targets = []
        for seg in self._layer.segments:
            projection, _, name = seg.name.rpartition(".")
            module = self._inner[projection]
            if name not in module or tuple(module[name].shape[1:]) != seg.shape:
                raise ValueError(
                    f"Layer {self._layer.layer}: segment {seg.name} {seg.shape} does "
                    "not match the model's expert module; convert again."
                )
            dtype = (
                self._float_dtype
                if seg.dtype in FLOAT_DTYPES
                else getattr(mx, seg.dtype)
            )
            module[name] = mx.zeros((self.capacity, *seg.shape), dtype)
            targets.append((module, name))
        params = {
            f"{p}.{n}"
            for p, m in self._inner.children().items()
            if isinstance(m, nn.Module)
            for n in m
            if isinstance(m[n], mx.array)
        }
        if params != {s.name for s in self._layer.segments}:
            raise ValueError(
                f"Layer {self._layer.layer}: the blob holds {sorted(params)} tensors "
                "the model does not expect; convert again."
            )
        mx.eval([m[n] for m, n in targets])
        return targets

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        experts = np.array(indices)  # the one host sync of this layer
        self._outstanding.settle()
        unique = np.unique(experts)
        if unique.size <= self.capacity:
            lut = self._load(unique)
            y = self._inner(x, mx.array(lut[experts]))
        else:
            y = self._grouped(x, experts, unique)
        self._outstanding.arrays.append(y)
        return y

    def _load(self, experts: np.ndarray) -> np.ndarray:
        """Make `experts` resident; return the expert -> slot lookup table."""
        free = len(self._pool.free)
        slots, misses = self._pool.assign(experts)
        self._stats.hits += len(experts) - len(misses)
        self._stats.misses += len(misses)
        self._stats.evictions += max(0, len(misses) - free)
        for n, (expert, slot) in enumerate(misses):
            try:
                self._filler.fill(expert, slot)
            except BaseException:
                for e, _ in misses[n:]:  # their slots hold partial data now
                    self._pool.forget(e)
                raise
            self._stats.bytes_read += self._layer.record_nbytes
        if misses:
            layer = self._layer.layer
            self._stats.per_layer_misses[layer] = self._stats.per_layer_misses.get(
                layer, 0
            ) + len(misses)
        lut = np.zeros(self._layer.num_experts, np.uint32)
        for expert, slot in slots.items():
            lut[expert] = slot
        return lut

    def _grouped(
        self, x: mx.array, experts: np.ndarray, unique: np.ndarray
    ) -> mx.array:
        """More routed experts than slots (prefill): run them in slot-sized groups."""
        self._stats.grouped_calls += 1
        *lead, k = experts.shape
        xs = x.reshape(-1, x.shape[-1])
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        picked, outs = [], []
        for start in range(0, unique.size, self.capacity):
            group = unique[start : start + self.capacity]
            lut = self._load(group)
            pairs = order[np.isin(flat[order], group)]
            local = mx.array(lut[flat[pairs]])[:, None]
            out = self._inner(xs[mx.array(pairs // k)], local)  # (n, 1, D)
            mx.eval(out)  # the next group overwrites these slots
            picked.append(pairs)
            outs.append(out[:, 0])
        inverse = np.empty(flat.size, np.int64)
        inverse[np.concatenate(picked)] = np.arange(flat.size)
        y = mx.concatenate(outs)[mx.array(inverse)]
        return y.reshape(*lead, k, y.shape[-1])
