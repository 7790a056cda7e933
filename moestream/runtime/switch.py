"""StreamingSwitchGLU: the hot path.

It wraps the family's own (quantized) SwitchGLU, whose weight arrays are
replaced by persistent slot arrays `[capacity, ...]`. A call maps the routed
experts to slots, reading the missing ones straight into slot memory, and
runs mlx-lm's SwitchGLU on the slot indices: same kernels, same activation
and biases, so the result is bit-identical to the fully resident model.

Slots are written in place. Every output a streaming layer returns is kept in
a list shared by the model's layers and evaluated right after the next host
sync (where it is already computed, so this costs nothing): no pending
computation ever reads a slot that a later call overwrites.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ..formats import ExpertLayer
from . import native
from .config import RuntimeConfig
from .pool import SlotPool
from .stats import RuntimeStats
from .store import ExpertStore, SlotFiller

FLOAT_DTYPES = ("bfloat16", "float16", "float32")


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


def _assemble(parts: list[tuple[np.ndarray, mx.array]], shape: tuple) -> mx.array:
    """`(pairs, rows)` parts -> the `shape + (D,)` output; later parts win."""
    order = np.empty(int(np.prod(shape)), np.int64)
    offset = 0
    for pairs, _ in parts:
        order[pairs] = offset + np.arange(pairs.size)
        offset += pairs.size
    y = mx.concatenate([rows for _, rows in parts])[mx.array(order)]
    return y.reshape(*shape, y.shape[-1])


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
        config: RuntimeConfig,
        tier: object | None = None,
    ):
        super().__init__()
        # Underscored: not parameters, so load_weights and casts leave them alone.
        self._inner = inner
        self._layer = layer
        self._store = store
        self._stats = stats
        self._outstanding = outstanding
        self._float_dtype = float_dtype
        cap = min(capacity, layer.num_experts)
        self._pool = SlotPool(cap, layer.num_experts, config.policy, config.lrfu_decay)
        # Whole-call groups send other groups' pairs to a zero slot past the pool.
        self._whole = config.rows_whole
        self._spare = cap if config.spare_slot else None
        # The expert -> slot table on the device once every expert is resident.
        self._table: mx.array | None = None
        self._targets = self._allocate_slots()
        slots = [m[n] for m, n in self._targets]
        self._native = None
        if config.engine_used == "native":
            self._native = native.expert_cache(
                store.readers[layer.layer].path,
                layer,
                slots,
                cap,
                verify=store.verify,
                policy=config.policy,
                decay=config.lrfu_decay,
                max_pairs=cap,
                tier=tier,
                record_calls=config.record_trace,
                device_resolve=config.device_resolve,
            )
            stats.native.append(self._native)
            stats.native_layers[layer.layer] = self._native
        else:  # host views of the slots (on a GPU they become managed memory)
            self._filler = SlotFiller(store, layer, slots)
        # The next layer's router applied to our input (native prefetch).
        self._predict: Callable[[mx.array], mx.array] | None = None
        # Native: our latest output; the next fetch waits for it, since a call
        # need not depend on the one before (prefill chunks, other sequences).
        self._last: mx.array | None = None

    def chain(
        self, nxt: StreamingSwitchGLU, predict: Callable[[mx.array], mx.array]
    ) -> None:
        """Prefetch for `nxt` with `predict(x)`: its router applied to our input
        (the native engine hints what it predicts)."""
        self._predict = predict
        if self._native is not None:
            self._native.chain(nxt._native)

    @property
    def capacity(self) -> int:
        return self._pool.capacity

    @property
    def layer(self) -> ExpertLayer:
        return self._layer

    def slot_table(self) -> np.ndarray:
        """Expert -> slot (`capacity` where absent) as the host knows it; any
        thread may read it (the page's view of the slots)."""
        if self._native is not None:
            return np.array(self._native.table(), np.uint32)
        return self._pool.table.copy()

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
            dtype = (
                self._float_dtype
                if seg.dtype in FLOAT_DTYPES
                else getattr(mx, seg.dtype)
            )
            rows = self.capacity + (self._spare is not None)
            module[name] = mx.zeros((rows, *seg.shape), dtype)
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
        if indices.size > self.capacity:
            return self._grouped(x, indices)
        if self._table is not None:
            return self._resident(x, indices)
        return self._decode(x, indices)

    def _resident(self, x: mx.array, indices: mx.array) -> mx.array:
        """Every expert holds a slot for good: nothing to read, no host sync."""
        self._stats.hits += indices.size
        self._stats.sync_free_calls += 1
        self._stats.record(self._layer.layer, indices, None, 0, [], 0)
        return self._inner(x, self._table[indices])  # type: ignore[index]

    def _decode(self, x: mx.array, indices: mx.array) -> mx.array:
        """At most `capacity` pairs (decode): one call on the routed experts' slots."""
        y = self._inner(x, self.slots(x, indices))
        if self._native is None:
            return self._issue(y)
        self._last = y
        return y

    def slots(self, x: mx.array, indices: mx.array) -> mx.array:
        """Slot indices for `indices`, every routed expert read into a slot: the
        step an engine implements. "python" reads the routing on the host (one
        sync); "native" resolves it inside MLX's stream."""
        if self._native is not None:
            native.check(self._native)
            call = self._stats.next_step(self._layer.layer)
            self._stats.record(self._layer.layer, indices, None, None, [], None)
            if self._last is not None:  # no slot is overwritten under it
                indices = mx.depends(indices, self._last)
            predicted = self._predict(x) if self._predict is not None else None
            return native.fetch(self._native, indices, predicted, call)
        r = self._route(indices)
        lut = self._load(r.unique, r.tokens, r.call)
        self._record(r)
        return mx.array(lut[r.experts])

    def _grouped(self, x: mx.array, indices: mx.array) -> mx.array:
        """More pairs than slots (prefill): one call if the routed experts fit,
        else slot-sized groups, each run once its experts are read."""
        r = self._route(indices)
        if r.unique.size <= self.capacity:
            lut = self._load(r.unique, r.tokens, r.call)
            self._record(r)
            return self._issue(self._inner(x, mx.array(lut[r.experts])))
        self._stats.grouped_calls += 1
        if self._native is None:  # the disk reads all of them in parallel
            self._store.willneed(
                self._layer.layer, self._pool.absent(r.unique).tolist()
            )
        groups = range(0, r.unique.size, self.capacity)
        groups = [r.unique[g : g + self.capacity] for g in groups]
        run = self._groups_whole if self._whole else self._groups
        y = run(x, r, groups)
        self._record(r)
        return self._issue(y)

    def _route(self, indices: mx.array) -> Routing:
        """Read the routing on the host: the one sync of a python call."""
        if self._native is not None:
            native.check(self._native)
            # Our earlier outputs may not be evaluated yet (a later chunk's
            # routing need not depend on them): evaluate them before the host
            # writes our slots, and wait for what is in flight.
            mx.eval([indices] if self._last is None else [indices, self._last])
            mx.synchronize()
        experts = np.array(indices)
        # Earlier outputs are upstream of `indices`, so computed by now: settle
        # them, and nothing pending reads a slot we write.
        self._outstanding.settle()
        s = self._stats
        counters = (s.hits, s.misses, s.bytes_read)
        return Routing(
            experts, np.unique(experts), counters, s.next_step(self._layer.layer)
        )

    def _issue(self, y: mx.array) -> mx.array:
        """Hand `y` to MLX and keep it until the next host sync."""
        self._last = y if self._native is not None else None
        self._outstanding.arrays.append(y)
        mx.async_eval(y)  # compute while Python builds the next layer's graph
        return y

    def _record(self, r: Routing) -> None:
        """The call's event, when recording (RuntimeStats.events)."""
        s, layer = self._stats, self._layer.layer
        if self._native is not None:  # the native cache counts in the stream
            s.record(layer, r.experts, None, None, [], None)
            return
        hits, misses, nbytes = r.counters
        s.record(
            layer,
            r.experts,
            s.hits - hits,
            s.misses - misses,
            [],  # the python engine does not prefetch
            s.bytes_read - nbytes,
        )

    def preload_tier(self) -> None:
        """Queue reads of this layer's records into the native host tier."""
        if self._native is not None:
            self._native.preload_tier()

    def fill_if_all_fit(self) -> None:
        """With a slot for every expert, read them all now (in file order, at
        disk speed): the layer then never misses, and decodes with no sync."""
        if self.capacity >= self._layer.num_experts:
            self._load(np.arange(self._layer.num_experts), tokens=0)

    def _load(self, experts: np.ndarray, tokens: int = 1, call: int = -1) -> np.ndarray:
        """Make `experts` (unique, at most `capacity`) resident, as (part of)
        call `call` (the native cache records its counts); return the
        expert -> slot table."""
        if self._native is not None:
            self._native.load(experts.tolist(), tokens, call)
            table = np.array(self._native.table(), np.uint32)
            if (table < self.capacity).all():
                self._table = mx.array(table)  # never evicts now
            return table
        free = len(self._pool.free)
        _, misses = self._pool.assign(experts, tokens)
        s = self._stats
        s.hits += len(experts) - len(misses)
        s.misses += len(misses)
        s.evictions += max(0, len(misses) - free)
        s.used(self._layer.layer, experts, self._layer.num_experts)
        if misses:  # the kernel reads them all in parallel while we copy each
            self._store.willneed(self._layer.layer, [e for e, _ in misses])
            self._read(misses)
        return self._pool.table

    def _read(self, misses: list[tuple[int, int]]) -> None:
        """Read each (expert, slot) record into its slot, verified on first read."""
        s = self._stats
        for n, (expert, slot) in enumerate(misses):
            try:
                self._filler.fill(expert, slot)
            except BaseException:
                for e, _ in misses[n:]:  # their slots hold partial data now
                    self._pool.forget(e)
                raise
            s.bytes_read += self._layer.record_nbytes
            s.fill_bytes += self._layer.record_nbytes
        layer = self._layer.layer
        s.per_layer_misses[layer] = s.per_layer_misses.get(layer, 0) + len(misses)
        if len(self._pool.slot_of) == self._layer.num_experts:
            self._table = mx.array(self._pool.table)  # never evicts now

    def _groups(self, x: mx.array, r: Routing, groups: list[np.ndarray]) -> mx.array:
        """Each group's rows computed alone (CPU: a gather kernel computes each
        row by itself, so this equals the whole call) and put back in order."""
        flat = r.experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        parts = []
        for i, group in enumerate(groups):
            lut = self._load(group, r.tokens if i == 0 else 0, r.call)
            pairs = order[np.isin(flat[order], group)]
            out = self._rows(x, r.experts, pairs, lut)
            mx.eval(out)  # the next group overwrites these slots
            parts.append((pairs, out))
        return _assemble(parts, r.experts.shape)

    def _groups_whole(
        self, x: mx.array, r: Routing, groups: list[np.ndarray]
    ) -> mx.array:
        """Groups as whole calls: GPU kernels pick their algorithm by the rows
        of a call, so each group runs the resident model's exact call, with the
        pairs of other groups sent to a spare zero slot and masked out."""
        y = None
        for i, group in enumerate(groups):
            lut = self._load(group, r.tokens if i == 0 else 0, r.call)
            member = np.isin(r.experts, group)
            slots = np.where(member, lut[r.experts], self._spare)
            out = self._inner(x, mx.array(slots))
            y = out if y is None else mx.where(mx.array(member)[..., None], out, y)
            mx.eval(y)  # the next group overwrites these slots
        return y  # type: ignore[return-value]

    def _rows(
        self, x: mx.array, experts: np.ndarray, pairs: np.ndarray, lut: np.ndarray
    ) -> mx.array:
        """The expert outputs of (token, k) `pairs` alone, `(len(pairs), D)`."""
        k = experts.shape[-1]
        rows = x.reshape(-1, x.shape[-1])[mx.array(pairs // k)]
        slots = mx.array(lut[experts.reshape(-1)[pairs]])[:, None]
        return self._inner(rows, slots)[:, 0]
