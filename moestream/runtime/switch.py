"""StreamingSwitchGLU: the hot path.

It wraps the family's own (quantized) SwitchGLU, whose weight arrays are
replaced by persistent slot arrays `[capacity, ...]`. A call maps expert ids
to slots, reads the missing experts straight into slot memory, and runs
mlx-lm's SwitchGLU on slot-local indices: same kernels, same activation and
biases, so the result is bit-identical to the fully resident model.

Decode calls are speculative (`RuntimeConfig.speculate`): the experts run on
the slots resident *before* the host reads the routing (a device-side
expert -> slot table sends absent experts to a zero slot), so MLX computes
them while the host syncs. Misses are then read into slots no routed expert
occupies, their rows computed and spliced in: a gather kernel on the CPU
computes each row alone, so this equals the whole call bit for bit; where
rows are not independent (GPU, `whole_calls`) the call runs again whole.

Slots are written in place. Every output a streaming layer returns is kept in
a list shared by the model's layers and evaluated right after the next host
sync (where it is already computed, so this costs nothing): no pending
computation ever reads a slot that a later call overwrites.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from ..formats import ExpertLayer
from .config import RuntimeConfig
from .pool import SlotPool
from .stats import RuntimeStats
from .store import ExpertStore, ReadAhead, SlotFiller

FLOAT_DTYPES = ("bfloat16", "float16", "float32")
# SwitchGLU sorts the pairs of a call this large; such calls never speculate.
SORTED_CALL = 64
# A layer speculates while this share of its recent decode calls (decayed
# by CLEAN_DECAY per call) missed nothing: a speculative call with misses
# computes the missed rows twice.
SPECULATE_ABOVE = 0.8
CLEAN_DECAY = 0.9
# A decode call with misses splits its rows (hits first, misses after their
# reads) only when the misses are this large: smaller ones read faster than
# the split's extra calls cost (trained fixture, 27 KB records: 0.60x resident
# split vs 0.72x whole at 25 %; small model, 0.88 MB records: split wins).
SPLIT_MIN_BYTES = 256 << 10


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
        self._pool = SlotPool(cap, layer.num_experts, config.policy)
        # One zero slot past the pool (the pool's table sends absent experts
        # there) for speculative calls and whole-call groups.
        self._speculate, self._whole = config.speculate, config.rows_whole
        self._spare = cap if config.spare_slot else None
        self._clean = 1.0  # decayed share of decode calls that missed nothing
        self._foreseen_miss = False  # the prediction for our next call misses
        # The expert -> slot table on the device once every expert is resident.
        self._all_resident: mx.array | None = None
        self._targets = self._allocate_slots()
        self._filler = SlotFiller(store, layer, [m[n] for m, n in self._targets])
        # Prefetch: the next MoE layer and its router's prediction from our input.
        self._next: StreamingSwitchGLU | None = None
        self._predict: Callable[[mx.array], mx.array] | None = None
        self._prefetched: set[int] = set()
        self._before: tuple = ()  # counters at the start of a call (its event)
        # prefetch_reads="threads": the reader ring, and records staged for us.
        self._ahead: ReadAhead | None = None
        self._staged: dict[int, tuple] = {}

    def chain(
        self, nxt: StreamingSwitchGLU, predict: Callable[[mx.array], mx.array]
    ) -> None:
        """Prefetch for `nxt` with `predict(x)`: its router applied to our input."""
        self._next, self._predict = nxt, predict

    @property
    def capacity(self) -> int:
        return self._pool.capacity

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
        decode = indices.size <= self.capacity and indices.size < SORTED_CALL
        if decode and self._all_resident is not None:
            # Every expert is in a slot for good: nothing to read, no sync.
            self._stats.record(self._layer.layer, indices, None, 0, [], 0)
            self._stats.hits += indices.size
            self._stats.sync_free_calls += 1
            return self._inner(x, self._all_resident[indices])
        s = self._stats
        self._before = (s.hits, s.misses, s.bytes_read, list(self._prefetched))
        predicted = self._predict(x) if self._predict is not None else None
        routing = [indices] if predicted is None else [indices, predicted]
        early = None
        if (
            decode
            and self._speculate
            and self._clean >= SPECULATE_ABOVE
            and not self._foreseen_miss
        ):
            # The routing gets its own evaluation, so the sync below waits for
            # the router only, not for the experts queued behind it.
            mx.async_eval(routing)
            early = self._inner(x, mx.array(self._pool.table)[indices])
            mx.async_eval(early)
            self._stats.early_calls += 1
        else:
            mx.eval(routing)
        experts = np.array(indices)  # the one host sync of this layer
        unique = np.unique(experts)
        missing = self._pool.absent(unique)
        split = (
            decode
            and missing.size * self._layer.record_nbytes >= SPLIT_MIN_BYTES
            and not self._whole
        )
        # Start what is resident computing before any bookkeeping or read.
        if early is None and not missing.size:
            early = self._inner(x, mx.array(self._pool.table[experts]))
            mx.async_eval(early)
        flat = experts.reshape(-1)
        miss = np.isin(flat, missing)
        parts = []  # (pairs, rows) of a split call
        if split and early is not None:
            parts.append((np.arange(flat.size), early.reshape(flat.size, -1)))
        elif split and not miss.all():
            hits = np.flatnonzero(~miss)
            parts.append((hits, self._rows(x, experts, hits, self._pool.table)))
            mx.async_eval(parts[0][1])
        self._after_sync(experts, missing, predicted)
        if early is not None:  # after the settle: it stays in flight
            self._outstanding.arrays.append(early)
        tokens = experts.size // experts.shape[-1]
        if unique.size > self.capacity:
            return self._issue(self._grouped(x, experts, unique), experts)
        if decode:
            clean = not missing.size
            self._clean = CLEAN_DECAY * self._clean + (1 - CLEAN_DECAY) * clean
        lut = self._load(unique, tokens)  # reads the misses
        if not missing.size:
            return self._issue(early, experts)
        self._stats.late_calls += 1
        if not split:  # whole calls: run it (again) on the full slot map
            return self._issue(self._inner(x, mx.array(lut[experts])), experts)
        # Rows are computed alone here: only the misses' rows run now.
        late = np.flatnonzero(miss)
        parts.append((late, self._rows(x, experts, late, lut)))
        return self._issue(_assemble(parts, experts.shape), experts)

    def _rows(
        self, x: mx.array, experts: np.ndarray, pairs: np.ndarray, lut: np.ndarray
    ) -> mx.array:
        """The expert outputs of (token, k) `pairs` alone, `(len(pairs), D)`."""
        k = experts.shape[-1]
        rows = x.reshape(-1, x.shape[-1])[mx.array(pairs // k)]
        slots = mx.array(lut[experts.reshape(-1)[pairs]])[:, None]
        return self._inner(rows, slots)[:, 0]

    def _after_sync(
        self, experts: np.ndarray, missing: np.ndarray, predicted: mx.array | None
    ) -> None:
        """Bookkeeping once the routing is known: no pending computation may
        read a slot from here on; hint the misses and the next layer's
        predicted experts to the kernel."""
        self._outstanding.settle()
        if missing.size:  # the kernel reads them in parallel while we copy
            self._store.willneed(self._layer.layer, missing.tolist())
        if predicted is not None:
            self._next.prefetch(np.unique(np.array(predicted)))  # type: ignore[union-attr]

    def _issue(self, y: mx.array, experts: np.ndarray) -> mx.array:
        """Hand `y` to MLX and keep it until the next sync evaluates it."""
        s = self._stats
        hits, misses, nbytes, prefetched = self._before
        s.record(
            self._layer.layer,
            experts,
            s.hits - hits,
            s.misses - misses,
            prefetched,
            s.bytes_read - nbytes,
        )
        self._prefetched.clear()
        self._staged = {}
        self._outstanding.arrays.append(y)
        mx.async_eval(y)  # compute while Python builds the next layer's graph
        return y

    def fill_if_all_fit(self) -> None:
        """With a slot for every expert, read them all now (in file order, at
        disk speed): the layer then never misses, and decodes with no sync."""
        if self.capacity >= self._layer.num_experts:
            self._load(np.arange(self._layer.num_experts), tokens=0)

    def prefetch(self, experts: np.ndarray) -> None:
        """Start reading the records of `experts` that are not resident."""
        missing = self._pool.absent(experts).tolist()
        self._foreseen_miss = bool(missing)
        if missing:
            if self._ahead is not None:
                self._staged = self._ahead.submit(self._layer, missing)
                missing = list(self._staged)
            else:
                self._store.willneed(self._layer.layer, missing)
            self._prefetched.update(missing)
            self._stats.prefetched += len(missing)
            self._stats.prefetch_bytes += len(missing) * self._layer.record_nbytes

    def _load(self, experts: np.ndarray, tokens: int = 1) -> np.ndarray:
        """Make `experts` resident; return the expert -> slot lookup table."""
        free = len(self._pool.free)
        slots, misses = self._pool.assign(experts, tokens)
        stats = self._stats
        stats.hits += len(experts) - len(misses)
        stats.misses += len(misses)
        stats.evictions += max(0, len(misses) - free)
        used = self._prefetched.intersection(slots)
        stats.prefetched_used += len(used)
        stats.misses_prefetched += sum(e in used for e, _ in misses)
        self._prefetched.difference_update(used)
        for n, (expert, slot) in enumerate(misses):
            try:
                if expert in self._staged:
                    done, record = self._staged.pop(expert)
                    done.result()  # a read or checksum error surfaces here
                    self._filler.fill_from(record, slot)
                else:
                    self._filler.fill(expert, slot)
            except BaseException:
                for e, _ in misses[n:]:  # their slots hold partial data now
                    self._pool.forget(e)
                raise
            stats.bytes_read += self._layer.record_nbytes
        if misses:
            layer = self._layer.layer
            stats.per_layer_misses[layer] = stats.per_layer_misses.get(layer, 0) + len(
                misses
            )
            if len(self._pool.slot_of) == self._layer.num_experts:
                self._all_resident = mx.array(self._pool.table)  # never evicts now
        return self._pool.table

    def _grouped(
        self, x: mx.array, experts: np.ndarray, unique: np.ndarray
    ) -> mx.array:
        """More routed experts than slots (prefill): run them in slot-sized groups."""
        self._stats.grouped_calls += 1
        if self._whole:
            return self._grouped_whole(x, experts, unique)
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        parts = []
        for start in range(0, unique.size, self.capacity):
            group = unique[start : start + self.capacity]
            tokens = flat.size // experts.shape[-1] if start == 0 else 0
            lut = self._load(group, tokens)
            pairs = order[np.isin(flat[order], group)]
            out = self._rows(x, experts, pairs, lut)
            mx.eval(out)  # the next group overwrites these slots
            parts.append((pairs, out))
        return _assemble(parts, experts.shape)

    def _grouped_whole(
        self, x: mx.array, experts: np.ndarray, unique: np.ndarray
    ) -> mx.array:
        """Groups as whole calls: GPU kernels pick their algorithm by the rows
        of a call, so each group runs the resident model's exact call, with the
        pairs of other groups sent to a spare zero slot and masked out."""
        y = None
        for start in range(0, unique.size, self.capacity):
            group = unique[start : start + self.capacity]
            tokens = experts.size // experts.shape[-1] if start == 0 else 0
            lut = self._load(group, tokens)
            member = np.isin(experts, group)
            slots = np.where(member, lut[experts], self._spare)
            out = self._inner(x, mx.array(slots))
            y = out if y is None else mx.where(mx.array(member)[..., None], out, y)
            mx.eval(y)  # the next group overwrites these slots
        return y
