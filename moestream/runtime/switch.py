"""StreamingSwitchGLU: the hot path.

It wraps the family's own (quantized) SwitchGLU, whose weight arrays are
replaced by persistent slot arrays `[capacity, ...]`. A call maps the routed
experts to slots, reading the missing ones straight into slot memory, and
runs mlx-lm's SwitchGLU on the slot indices: same kernels, same activation
and biases, so the result is bit-identical to the fully resident model (on a
CPU, the extension's kernel computes the same bits where the plan runs it).
With the fast arithmetic (fast.py), prefill-sized calls run on dequantized
weights instead, and the oracle is a resident model with that arithmetic.
The engine behind it (engines.py) maps experts to slots and reads misses.
On the cpu-mapped backend there are no slots: the native engine resolves a
call to the routed experts' ids and the CPU kernel reads their records in
place, from the blob mapped into memory (the page cache is the expert cache).

Where the CPU kernel computes every call of a layer, its slots hold each
projection blocked, the kernel's layout (`blocked`, BLOCK_ROWS rows at a
time, as records stored blocked hold them): only the kernel reads them.

Slots are written in place. Every output a streaming layer returns is kept in
a list shared by the model's layers and evaluated right after the next host
sync (where it is already computed, so this costs nothing): no pending
computation ever reads a slot that a later call overwrites.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ..formats import ExpertLayer, Segment
from . import native
from .backend import ExecutionPlan
from .engines import Engine, NativeEngine, Outstanding, Routing, make_engine
from .fast import fast_glu, fast_pairs
from .memory import blocks_rows, kept_as_stored
from .stats import RuntimeStats
from .store import ExpertStore

__all__ = ["Outstanding", "Routing", "StreamingSwitchGLU", "exact_arithmetic"]

Experts = Callable[[mx.array, mx.array], mx.array]

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


def _assemble(parts: list[tuple[np.ndarray, mx.array]], shape: tuple) -> mx.array:
    """`(pairs, rows)` parts -> the `shape + (D,)` output; later parts win."""
    order = np.empty(int(np.prod(shape)), np.int64)
    offset = 0
    for pairs, _ in parts:
        order[pairs] = offset + np.arange(pairs.size)
        offset += pairs.size
    y = mx.concatenate([rows for _, rows in parts])[mx.array(order)]
    return y.reshape(*shape, y.shape[-1])


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
        plan: ExecutionPlan,
        tier: object | None = None,
    ):
        super().__init__()
        # Underscored: not parameters, so load_weights and casts leave them alone.
        self._inner = inner
        self._layer = layer
        self._stats = stats
        self._float_dtype = float_dtype
        self._capacity = min(capacity, layer.num_experts)
        # A group's call runs at least this many rows (the plan's; see _rows).
        self._group_rows = plan.group_rows
        # The routed experts of a call on their slots: the extension's exact
        # CPU kernel where it covers this layer, else mlx-lm's SwitchGLU.
        kernel = native.expert_kernel(inner, plan, layer)
        self._blocked = kernel is not None and self._blocks(plan)
        self._targets = self._allocate_slots()
        if kernel is not None:
            kernel.blocked = self._blocked
        self._experts = kernel or inner
        slots = [m[n] for m, n in self._targets]
        args = (plan, layer, store, slots, self._capacity, stats, outstanding, tier)
        self._engine: Engine = make_engine(*args, blocked=self._blocked)
        self._in_place = self._in_place_kernel(kernel, plan)
        # The fast arithmetic (plan.fast) on calls of at least this many pairs.
        self._fast = functools.partial(fast_glu, inner)
        rows = plan.tuning.fast_rows
        self._fast_pairs = fast_pairs(layer.num_experts, rows) if plan.fast else None
        # cpu-mapped: no slots; the kernel reads each routed record in place
        # (the engine's calls resolve to expert ids).
        self._mapped = (
            native.mapped_kernel(inner, layer, self._engine.cache, plan)
            if plan.mapped
            else None
        )

    def chain(
        self, nxt: StreamingSwitchGLU, predict: Callable[[mx.array], mx.array]
    ) -> None:
        """Prefetch for `nxt` with `predict(x)`: its router applied to our input
        (the native engine hints what it predicts)."""
        self._engine.chain(nxt._engine, predict)

    def last_in_model(self) -> None:
        """Ours is the model's last streaming layer: a prompt's output is
        computed only where something asks for it (the logits, the layers
        after), not for its own sake (NativeEngine._waited)."""
        self._engine.final = True

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def layer(self) -> ExpertLayer:
        return self._layer

    def slot_table(self) -> np.ndarray:
        """Expert -> slot (`capacity` where absent) as the host knows it; any
        thread may read it (the page's view of the slots)."""
        return self._engine.slot_table()

    @property
    def blocked(self) -> bool:
        """Whether the slots hold each projection in the CPU kernel's blocked
        layout (ExpertKernel): then only that kernel reads them."""
        return self._blocked

    def _slot_dtype(self, seg: Segment) -> mx.Dtype:
        """A segment's slots' dtype: its own, or the compute dtype for floats;
        blocked slots keep their records' bfloat16 or float16 scales and
        biases (the kernel widens them as it reads, exactly, as it reads
        mapped records: fewer bytes a token, and a fill that copies them)."""
        if seg.dtype not in FLOAT_DTYPES:
            return getattr(mx, seg.dtype)
        if self._blocked and kept_as_stored(self._layer, seg):
            return getattr(mx, seg.dtype)
        return self._float_dtype

    def _blocks(self, plan: ExecutionPlan) -> bool:
        """Whether this layer's slots are blocked, given that the CPU kernel
        computes its calls: where it computes every one of them (float32
        slots, no fast arithmetic, which reads them with MLX's ops; mapped has
        no slots) and every projection's rows fill whole blocks."""
        if plan.fast or plan.mapped or self._float_dtype != mx.float32:
            return False
        return blocks_rows(self._layer)

    def _in_place_kernel(
        self, kernel: native.ExpertKernel | None, plan: ExecutionPlan
    ) -> native.MappedKernel | None:
        """Where the kernel fills this layer's misses (_fills_in_kernel), let it,
        and give the kernel of a call with more pairs than slots (a prefill):
        every pair from its record in place, no slot written."""
        if kernel is None or not self._fills_in_kernel(plan):
            return None
        cache = self._engine.cache  # type: ignore[attr-defined]
        kernel.fill_through(cache)
        if self.capacity >= self._layer.num_experts:
            return None
        return native.MappedKernel(self._layer, cache, kernel.threads, in_place=True)

    def _fills_in_kernel(self, plan: ExecutionPlan) -> bool:
        """Whether the kernel fills this layer's misses as it reads their
        records in place (ExpertCache.fill_in_kernel): blocked slots, which
        only it reads, from blocked records, which it copies as it reads
        them (from row records, a fill from the mapping measured no faster
        than a read: 1.00x, 2026-12-06), on a CPU's native engine."""
        return (
            self._blocked
            and plan.blocked_records
            and not plan.gpu
            and isinstance(self._engine, NativeEngine)
        )

    def _allocate_slots(self) -> list[tuple[nn.Module, str]]:
        """Replace each expert tensor of the inner module by `[capacity, ...]` slots."""
        targets = []
        for seg in self._layer.segments:
            projection, _, name = seg.name.rpartition(".")
            module = self._inner.get(projection)  # reliability: unknown names refused
            if (
                not isinstance(module, nn.Module)
                or not isinstance(module.get(name), mx.array)
                or tuple(module[name].shape[1:]) != seg.shape
            ):
                raise ValueError(
                    f"Layer {self._layer.layer}: segment {seg.name} {seg.shape} does "
                    "not match the model's expert module; convert again."
                )
            module[name] = mx.zeros((self.capacity, *seg.shape), self._slot_dtype(seg))
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
        if self._mapped is not None:  # any number of pairs: nothing to group
            return self._engine.finish(self._mapped(x, self.slots(x, indices)))
        experts = self._arithmetic(indices)
        table = self._engine.table
        if table is not None:  # prefill too: the resident model's one call
            return self._resident(x, indices, table, experts)
        if indices.size > self.capacity:
            return self._grouped(x, indices, experts)
        return self._decode(x, indices)

    def _arithmetic(self, indices: mx.array) -> Experts:
        """The fast arithmetic for a prefill-sized call where the plan asks for
        it (the whole call decides, so its groups compute as it would); else
        the exact kernels."""
        if self._fast_pairs is None or indices.size < self._fast_pairs:
            return self._experts
        self._stats.fast_calls += 1
        return self._fast

    def _resident(
        self, x: mx.array, indices: mx.array, table: mx.array, experts: Experts
    ) -> mx.array:
        """Every expert holds a slot for good: nothing to read, no host sync."""
        self._stats.hits += indices.size
        self._stats.sync_free_calls += 1
        self._stats.record(self._layer.layer, indices, None, 0, [], 0)
        return experts(x, table[indices])

    def _decode(self, x: mx.array, indices: mx.array) -> mx.array:
        """At most `capacity` pairs (decode): one call on the routed experts' slots."""
        return self._engine.finish(self._experts(x, self.slots(x, indices)))

    def slots(self, x: mx.array, indices: mx.array) -> mx.array:
        """Slot ids for `indices`, every routed expert read into a slot: the
        step an engine implements. "python" reads the routing on the host (one
        sync); "native" resolves it inside MLX's stream."""
        return self._engine.slots(x, indices)

    def _grouped(self, x: mx.array, indices: mx.array, experts: Experts) -> mx.array:
        """More pairs than slots (prefill): from the records in place where the
        kernel reads them so, else one call if the routed experts fit, else
        slot-sized groups, each run once its experts are read."""
        engine = self._engine
        in_place = self._in_place is not None and experts is self._experts
        if in_place and self._experts.fills is not None:  # type: ignore[union-attr]
            self._stats.in_place_calls += 1
            return engine.in_place(x, indices, self._in_place)  # type: ignore[attr-defined]
        r = engine.route(indices)
        if r.unique.size <= self.capacity:
            lut = engine.load(r.unique, r.tokens, r.call)
            engine.record(r)
            return engine.issue(experts(x, mx.array(lut[r.experts])))
        self._stats.grouped_calls += 1
        engine.willneed(r.unique)
        # The experts already in slots first: no group evicts one a later
        # group would read again.
        held = engine.slot_table()[r.unique] < self.capacity
        first = np.concatenate([r.unique[held], r.unique[~held]])
        groups = range(0, first.size, self.capacity)
        groups = [first[g : g + self.capacity] for g in groups]
        y = self._groups(x, r, groups, experts)
        engine.record(r)
        return engine.issue(y)

    def preload_tier(self) -> None:
        """Queue reads of this layer's records into the native host tier."""
        self._engine.preload_tier()

    def fill_if_all_fit(self) -> None:
        """With a slot for every expert, read them all now (in file order, at
        disk speed): the layer then never misses, and decodes with no sync."""
        if self.capacity >= self._layer.num_experts:
            self._engine.load(np.arange(self._layer.num_experts), tokens=0)

    def _groups(
        self, x: mx.array, r: Routing, groups: list[np.ndarray], experts: Experts
    ) -> mx.array:
        """Each group's rows computed alone and put back in order: the kernels
        compute each row by itself, so this equals the whole call (see _rows)."""
        flat = r.experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        parts = []
        for i, group in enumerate(groups):
            lut = self._engine.load(group, r.tokens if i == 0 else 0, r.call)
            pairs = order[np.isin(flat[order], group)]
            out = self._rows(x, r.experts, pairs, lut, experts)
            mx.eval(out)  # the next group overwrites these slots
            parts.append((pairs, out))
        return _assemble(parts, r.experts.shape)

    def _rows(
        self,
        x: mx.array,
        experts: np.ndarray,
        pairs: np.ndarray,
        lut: np.ndarray,
        compute: Experts | None = None,
    ) -> mx.array:
        """The expert outputs of (token, k) `pairs` alone, `(len(pairs), D)`,
        by `compute` (the exact kernels by default). A kernel that picks its
        algorithm by a call's rows (MLX's CUDA gather_qmm: a vector kernel
        under 8) must see as many as the whole call would: short groups run
        padded with copies of their first pair."""
        k, n = experts.shape[-1], pairs.size
        short = min(self._group_rows, experts.size) - n
        run = (
            np.concatenate([pairs, np.repeat(pairs[:1], short)]) if short > 0 else pairs
        )
        rows = x.reshape(-1, x.shape[-1])[mx.array(run // k)]
        slots = mx.array(lut[experts.reshape(-1)[run]])[:, None]
        return (compute or self._experts)(rows, slots)[:n, 0]


@contextlib.contextmanager
def exact_arithmetic(model: nn.Module) -> Iterator[nn.Module]:
    """Within, `model`'s streaming layers compute every call with the exact
    kernels, whatever its plan's arithmetic (the same slots: no second model)."""
    layers = [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]
    saved = [m._fast_pairs for m in layers]
    for m in layers:
        m._fast_pairs = None
    try:
        yield model
    finally:
        for m, pairs in zip(layers, saved, strict=True):
            m._fast_pairs = pairs
