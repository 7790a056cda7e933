"""The two engines behind a streaming layer: map routed experts to slots, read
the misses, count. One class each; StreamingSwitchGLU holds one and never asks
which.

- PythonEngine (the reference path): one host sync per call reads the routing,
  the pool picks victims, misses are read into their slots on the host.
- NativeEngine: the extension's ExpertCache resolves slots inside MLX's stream
  (native.py); only prefill's grouped calls read the routing on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from ..formats import BLOCK_ROWS, ExpertLayer
from . import native
from .backend import ExecutionPlan
from .pool import SlotPool
from .stats import RuntimeStats
from .store import ExpertStore, SlotFiller


@dataclass
class Routing:
    """One call's routing, read on the host."""

    experts: np.ndarray  # (..., k) routed expert ids
    unique: np.ndarray
    counters: tuple[int, int, int]  # hits, misses, bytes_read before the call
    call: int  # its event's step, the native cache's id for its loads

    @property
    def tokens(self) -> int:
        return self.experts.size // self.experts.shape[-1]


class Outstanding:
    """Outputs of streaming layers that may not be evaluated yet."""

    def __init__(self) -> None:
        self.arrays: list[mx.array] = []

    def settle(self) -> None:
        """Evaluate them all: after this, no computation reads any slot."""
        if self.arrays:
            mx.eval(self.arrays)
            self.arrays.clear()


class Engine(Protocol):
    """What a streaming layer asks of its engine."""

    table: mx.array | None  # expert -> slot once every expert is resident
    predict: Callable[[mx.array], mx.array] | None  # the next layer's experts
    final: bool  # the model's last streaming layer (see _Base)

    def slots(self, x: mx.array, indices: mx.array) -> mx.array:
        """Slot ids of a decode call's `indices`, every routed expert read."""

    def route(self, indices: mx.array) -> Routing:
        """Read a call's routing on the host (prefill's grouped calls)."""

    def load(self, experts: np.ndarray, tokens: int = 1, call: int = -1) -> np.ndarray:
        """Make `experts` resident as (part of) call `call`; the slot table."""

    def record(self, r: Routing) -> None:
        """The call's event, when recording (RuntimeStats.events)."""

    def issue(self, y: mx.array) -> mx.array:
        """Hand a host-routed call's output to MLX, kept until the next sync."""

    def finish(self, y: mx.array) -> mx.array:
        """What becomes of a decode call's output."""

    def willneed(self, experts: np.ndarray) -> None:
        """Hint that a grouped call reads these experts soon."""

    def chain(self, nxt: Engine, predict: Callable[[mx.array], mx.array]) -> None:
        """Prefetch for the next layer with `predict` (its router on our input)."""

    def preload_tier(self) -> None:
        """Queue reads of this layer's records into the host tier, if any."""

    def slot_table(self) -> np.ndarray:
        """Expert -> slot (`capacity` where absent) as the host knows it; any
        thread may read it."""


class _Base:
    """What both engines share: reading a call's routing on the host."""

    def __init__(
        self, layer: ExpertLayer, stats: RuntimeStats, outstanding: Outstanding
    ) -> None:
        self.layer = layer
        self.stats = stats
        self.outstanding = outstanding
        self.table: mx.array | None = None
        # Our latest output; a native fetch waits for it, since a call need
        # not depend on the one before (prefill chunks, other sequences).
        self.last: mx.array | None = None
        # The next layer's router applied to our input (native prefetch).
        self.predict: Callable[[mx.array], mx.array] | None = None
        # The model's last streaming layer: what generation evaluates of a
        # prompt's chunk (the caches) does not need its output.
        self.final = False

    def _before_route(self, indices: mx.array) -> None:
        pass

    def route(self, indices: mx.array) -> Routing:
        self._before_route(indices)
        experts = np.array(indices)
        # Earlier outputs are upstream of `indices`, so computed by now: settle
        # them, and nothing pending reads a slot we write.
        self.outstanding.settle()
        s = self.stats
        counters = (s.hits, s.misses, s.bytes_read)
        return Routing(
            experts, np.unique(experts), counters, s.next_step(self.layer.layer)
        )

    def issue(self, y: mx.array) -> mx.array:
        self.outstanding.arrays.append(y)
        return self._after(y)

    def _after(self, y: mx.array) -> mx.array:
        """`y`, our next call ordered after it. `last` is a one-element array
        that waits for y, not y itself, which (a prefill's `[tokens, k,
        hidden]`) would stay alive in every layer until that layer's next
        call."""
        self.last = mx.depends([mx.zeros((1,), y.dtype)], [y])[0]
        if not self.final:  # compute y while Python builds the next layer
            mx.async_eval(self.last)
        return y

    def willneed(self, experts: np.ndarray) -> None:
        pass

    def chain(self, nxt: Engine, predict: Callable[[mx.array], mx.array]) -> None:
        self.predict = predict

    def preload_tier(self) -> None:
        pass


class PythonEngine(_Base):
    """The reference path: routing read on the host, misses read there."""

    def __init__(
        self,
        layer: ExpertLayer,
        store: ExpertStore,
        slots: list[mx.array],
        capacity: int,
        stats: RuntimeStats,
        outstanding: Outstanding,
        plan: ExecutionPlan,
        blocked: bool = False,
    ) -> None:
        super().__init__(layer, stats, outstanding)
        self.store = store
        t = plan.tuning
        self.pool = SlotPool(capacity, layer.num_experts, t.policy, t.lrfu_decay)
        # host views of the slots (on a GPU they become managed memory)
        lanes = BLOCK_ROWS if blocked else 0
        self.filler = SlotFiller(store, layer, slots, lanes)

    def slots(self, x: mx.array, indices: mx.array) -> mx.array:
        r = self.route(indices)
        lut = self.load(r.unique, r.tokens, r.call)
        self.record(r)
        return mx.array(lut[r.experts])

    def finish(self, y: mx.array) -> mx.array:
        return self.issue(y)

    def willneed(self, experts: np.ndarray) -> None:
        # the disk reads all of them in parallel
        self.store.willneed(self.layer.layer, self.pool.absent(experts).tolist())

    def record(self, r: Routing) -> None:
        s = self.stats
        hits, misses, nbytes = r.counters
        s.record(
            self.layer.layer,
            r.experts,
            s.hits - hits,
            s.misses - misses,
            [],  # the python engine does not prefetch
            s.bytes_read - nbytes,
        )

    def load(self, experts: np.ndarray, tokens: int = 1, call: int = -1) -> np.ndarray:
        free = len(self.pool.free)
        _, misses = self.pool.assign(experts, tokens)
        s = self.stats
        s.hits += len(experts) - len(misses)
        s.misses += len(misses)
        s.evictions += max(0, len(misses) - free)
        s.used(self.layer.layer, experts, self.layer.num_experts)
        if misses:  # the kernel reads them all in parallel while we copy each
            self.store.willneed(self.layer.layer, [e for e, _ in misses])
            self._read(misses)
        return self.pool.table

    def slot_table(self) -> np.ndarray:
        return self.pool.table.copy()

    def _read(self, misses: list[tuple[int, int]]) -> None:
        """Read each (expert, slot) record into its slot, verified on first read."""
        s, nbytes = self.stats, self.layer.record_nbytes
        for n, (expert, slot) in enumerate(misses):
            try:
                self.filler.fill(expert, slot)
            except BaseException:
                for e, _ in misses[n:]:  # their slots hold partial data now
                    self.pool.forget(e)
                raise
            s.bytes_read += nbytes
            s.fill_bytes += nbytes
        layer = self.layer.layer
        s.per_layer_misses[layer] = s.per_layer_misses.get(layer, 0) + len(misses)
        if len(self.pool.slot_of) == self.layer.num_experts:
            self.table = mx.array(self.pool.table)  # never evicts now


class NativeEngine(_Base):
    """The extension's cache: slots resolved and misses read in MLX's stream."""

    def __init__(
        self,
        layer: ExpertLayer,
        store: ExpertStore,
        slots: list[mx.array],
        capacity: int,
        stats: RuntimeStats,
        outstanding: Outstanding,
        plan: ExecutionPlan,
        tier: object | None,
        blocked: bool = False,
    ) -> None:
        super().__init__(layer, stats, outstanding)
        self.capacity = capacity
        path = store.readers[layer.layer].path
        self.cache = native.expert_cache(
            path,
            layer,
            slots,
            capacity,
            plan,
            verify=store.verify,
            tier=tier,
            blocked_slots=blocked,
        )
        stats.native.append(self.cache)
        stats.native_layers[layer.layer] = self.cache

    def chain(self, nxt: Engine, predict: Callable[[mx.array], mx.array]) -> None:
        self.predict = predict
        self.cache.chain(nxt.cache)  # type: ignore[attr-defined]

    def preload_tier(self) -> None:
        self.cache.preload_tier()

    def _begin(self, indices: mx.array) -> tuple[mx.array, int]:
        """A call of `indices`: counted, its number, and the ids ordered after
        the layer's last output (no slot is overwritten under it)."""
        native.check(self.cache)
        call = self.stats.next_step(self.layer.layer)
        self.stats.record(self.layer.layer, indices, None, None, [], None)
        if self._waited() is not None:
            indices = mx.depends(indices, self.last)
        return indices, call

    def _waited(self) -> mx.array | None:
        """`last`, or None where it waits for an output that nothing has
        asked for and nothing else holds (the final layer's for a prompt's
        chunk, of which generation evaluates only the caches): that output is
        never computed then, so it reads no slot a later call writes, and no
        call need wait for it (or compute it)."""
        if self.last is not None and native.waits_for_unneeded(self.last):
            self.last = None
        return self.last

    def slots(self, x: mx.array, indices: mx.array) -> mx.array:
        indices, call = self._begin(indices)
        predicted = self.predict(x) if self.predict is not None else None
        return native.fetch(self.cache, indices, predicted, call)

    def finish(self, y: mx.array) -> mx.array:
        """A decode step's output (one token a sequence) is what the layer's
        next call waits for, as it is; a prompt's (`[batch, tokens, k,
        hidden]`) would stay alive in every layer until then, so it is waited
        for through a one-element array (_after)."""
        if y.ndim >= 3 and y.shape[-3] > 1:
            return self._after(y)
        self.last = y
        return y

    def in_place(
        self, x: mx.array, indices: mx.array, kernel: Callable[..., mx.array]
    ) -> mx.array:
        """A call computed by `kernel` from the records in place (no slot
        written), after the layer's calls before it."""
        indices, call = self._begin(indices)
        return self._after(kernel(x, indices, call))

    def _before_route(self, indices: mx.array) -> None:
        native.check(self.cache)
        # Our earlier outputs may not be evaluated yet (a later chunk's
        # routing need not depend on them): evaluate them before the host
        # writes our slots, and wait for what is in flight.
        mx.eval([indices] if self._waited() is None else [indices, self.last])
        mx.synchronize()

    def record(self, r: Routing) -> None:
        # the native cache counts in the stream
        self.stats.record(self.layer.layer, r.experts, None, None, [], None)

    def slot_table(self) -> np.ndarray:
        return np.array(self.cache.table(), np.uint32)

    def load(self, experts: np.ndarray, tokens: int = 1, call: int = -1) -> np.ndarray:
        self.cache.load(experts.tolist(), tokens, call)
        table = np.array(self.cache.table(), np.uint32)
        if (table < self.capacity).all():
            self.table = mx.array(table)  # never evicts now
        return table


def make_engine(
    plan: ExecutionPlan,
    layer: ExpertLayer,
    store: ExpertStore,
    slots: list[mx.array],
    capacity: int,
    stats: RuntimeStats,
    outstanding: Outstanding,
    tier: object | None,
    blocked: bool = False,
) -> Engine:
    """The plan's engine for one layer: the backend chose it, once. `blocked`:
    it writes the slots as the CPU kernel's blocked slots hold them."""
    args = (layer, store, slots, capacity, stats, outstanding, plan)
    if plan.native:
        return NativeEngine(*args, tier, blocked=blocked)
    return PythonEngine(*args, blocked=blocked)
