"""Replay a recorded routing trace against cache policies and Belady's optimum.

A trace is, per MoE layer, one row of routed expert ids per decode step.
Policies replay through the runtime's own `SlotPool`; Belady evicts the
resident expert used furthest in the future (the limit for any policy).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..runtime.config import Tuning
from ..runtime.pool import SlotPool


def policy_hits(
    trace: np.ndarray,
    capacity: int,
    policy: str,
    experts: int,
    lrfu_decay: float = Tuning.lrfu_decay,
) -> int:
    return int(policy_step_hits(trace, capacity, policy, experts, lrfu_decay).sum())


def policy_step_hits(
    trace: np.ndarray,
    capacity: int,
    policy: str,
    experts: int,
    lrfu_decay: float = Tuning.lrfu_decay,
) -> np.ndarray:
    """Hits of each row of `trace` (distinct experts found resident)."""
    pool = SlotPool(min(capacity, experts), experts, policy, lrfu_decay)
    hits = np.zeros(len(trace), np.int64)
    for t, row in enumerate(trace):
        unique = np.unique(row)
        _, misses = pool.assign(unique)
        hits[t] = len(unique) - len(misses)
    return hits


def belady_hits(trace: np.ndarray, capacity: int) -> int:
    return int(belady_step_hits(trace, capacity).sum())


def belady_step_hits(trace: np.ndarray, capacity: int) -> np.ndarray:
    """Belady's hits of each row of `trace`."""
    steps = [set(np.unique(row).tolist()) for row in trace]
    next_use: list[dict[int, int]] = [{} for _ in steps]
    last: dict[int, int] = {}
    for t in range(len(steps) - 1, -1, -1):
        for e in steps[t]:
            next_use[t][e] = last.get(e, len(steps))
            last[e] = t
    resident: dict[int, int] = {}
    hits = np.zeros(len(steps), np.int64)
    for t, wanted in enumerate(steps):
        hits[t] = len(wanted & resident.keys())
        resident.update(next_use[t])
        while len(resident) > capacity:
            victim = max(
                (e for e in resident if e not in wanted), key=resident.__getitem__
            )
            del resident[victim]
    return hits


def replay_all(
    traces: dict[int, np.ndarray],
    capacity: int,
    policy: str = "lrfu",
    lrfu_decay: float = Tuning.lrfu_decay,
) -> dict[str, float]:
    """Hit rates of LRU, `policy` and Belady on `traces`, from empty caches."""
    total = sum(sum(len(np.unique(r)) for r in t) for t in traces.values())
    out = {}
    for name in dict.fromkeys(["lru", policy]):
        hits = 0
        for t in traces.values():
            experts = int(t.max()) + 1 if t.size else 1
            hits += policy_hits(t, capacity, name, max(experts, capacity), lrfu_decay)
        out[name] = hits / total if total else 0.0
    hits = sum(belady_hits(t, capacity) for t in traces.values())
    out["belady"] = hits / total if total else 0.0
    return out


def ranked(scores: np.ndarray, width: int) -> np.ndarray:
    """The `width` highest-scoring experts of each row of `scores` [..., experts],
    best first (equal scores: the lower id first)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :width]


def prediction_quality(routed: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """How well `predicted` [tokens, n] (distinct ids a row) foretold `routed`
    [tokens, k]: recall (of the routed, the share predicted), precision (of the
    predicted, the share routed) and wasted (predicted, not routed, per token)."""
    if len(routed) != len(predicted):
        raise ValueError(
            f"{len(predicted)} rows of predictions for {len(routed)} routed tokens."
        )
    used = int((predicted[:, :, None] == routed[:, None, :]).any(-1).sum())
    return {
        "recall": used / routed.size if routed.size else 0.0,
        "precision": used / predicted.size if predicted.size else 0.0,
        "wasted": (predicted.size - used) / len(routed) if len(routed) else 0.0,
    }


def cooccurrence(src: np.ndarray, dst: np.ndarray, experts: int) -> np.ndarray:
    """P(expert f routed in `dst` | expert e routed in `src` at the same token),
    as [e, f], from rows [tokens, k] of two layers (a row of zeros for an expert
    `src` never routes to): a learned table that predicts `dst` from `src`."""
    counts = np.zeros((experts, experts))
    np.add.at(counts, (src[:, :, None], dst[:, None, :]), 1.0)
    seen = counts.sum(1, keepdims=True) / dst.shape[1]
    return np.divide(counts, seen, out=np.zeros_like(counts), where=seen > 0)


def table_scores(table: np.ndarray, src: np.ndarray) -> np.ndarray:
    """Each token's score per expert [tokens, experts]: the summed rows of
    `table` (`cooccurrence`) for the experts it routes to in the source layer."""
    return table[src].sum(1)


def prefetch_replay(
    routed: np.ndarray,
    hints: list[np.ndarray],
    capacity: int,
    experts: int,
    policy: str = "lrfu",
    lrfu_decay: float = Tuning.lrfu_decay,
) -> dict[str, int]:
    """One layer's calls, a token each, through the runtime's SlotPool, each
    preceded by its predictions (`hints`: one array [tokens, n] per source,
    the earliest first): as the native engine's prefetch, a predicted expert
    not in a slot is read ahead; it is used if this call routes to it.

    Counts: misses; hinted (read ahead, distinct); used (of those, routed:
    misses found ahead); and per source `early_i`, the misses source i read
    ahead before any later source did (how early reads could start)."""
    pool = SlotPool(min(capacity, experts), experts, policy, lrfu_decay)
    out = {"misses": 0, "hinted": 0, "used": 0}
    out |= {f"early_{i}": 0 for i in range(len(hints))}
    for t, row in enumerate(routed):
        wanted = np.unique(row)
        absent = set(pool.absent(wanted).tolist())
        taken: set[int] = set()
        for i, h in enumerate(hints):
            new = set(pool.absent(np.unique(h[t])).tolist()) - taken
            out[f"early_{i}"] += len(new & absent)
            taken |= new
        out["misses"] += len(absent)
        out["hinted"] += len(taken)
        out["used"] += len(taken & absent)
        pool.assign(wanted)
    return out


@dataclass
class _Disk:
    """One disk reading one record at a time, `read` seconds each: routed reads
    first, reads ahead in the order they were asked for. A key is (layer,
    expert, token): a read ahead serves only the call it was asked for, and
    one not begun by that call is dropped."""

    read: float
    free: float = 0.0  # when the record being read is done
    reads: int = 0
    queue: deque = field(default_factory=deque)  # (key, asked at), not begun
    asked: set = field(default_factory=set)  # keys queued or read
    done: dict = field(default_factory=dict)  # key -> when its read ends

    def run_until(self, limit: float) -> None:
        while self.queue and max(self.free, self.queue[0][1]) < limit:
            key, asked = self.queue.popleft()
            self.free = max(self.free, asked) + self.read
            self.reads += 1
            self.done[key] = self.free

    def ahead(self, key: tuple[int, int, int], now: float) -> None:
        if key not in self.asked:
            self.asked.add(key)
            self.queue.append((key, now))

    def called(self, layer: int, token: int) -> None:
        """Layer `layer`'s call of token `token` has its records: what was read
        ahead for it and not begun is dropped."""
        self.queue = deque(q for q in self.queue if q[0][::2] != (layer, token))
        self.asked = {k for k in self.asked if k[::2] != (layer, token)}
        self.done = {k: v for k, v in self.done.items() if k[::2] != (layer, token)}

    def routed(self, key: tuple[int, int, int], now: float) -> float:
        """When `key`, routed at `now`, is in memory."""
        if key in self.done:
            return self.done[key]
        self.free = max(self.free, now) + self.read
        self.reads += 1
        return self.free


def decode_timeline(
    routed: np.ndarray,
    hints: dict[int, dict[int, np.ndarray]],
    capacity: int,
    experts: int,
    read: float,
    compute: float = 1.0,
    policy: str = "lrfu",
) -> dict[str, float]:
    """Decode `routed` [layers, tokens, k] token by token through one SlotPool
    a layer and one disk (`_Disk`): layer m's call waits for its misses, then
    computes for `compute`. `hints[d][m]` [tokens, n]: layer m's experts as
    predicted at layer m-d, asked for at that layer's call when not in a slot
    (read ahead behind the routed reads; read even when nothing routes to
    them, if begun before the call).

    Returns the time a token, the reads a token, and the disk's busy share."""
    layers, tokens, _ = routed.shape
    pools = [SlotPool(min(capacity, experts), experts, policy) for _ in range(layers)]
    disk, now = _Disk(read), 0.0
    for t in range(tokens):
        for m in range(layers):
            disk.run_until(now)
            for d, by_layer in hints.items():
                if m + d in by_layer:
                    row = np.unique(by_layer[m + d][t])
                    for e in pools[m + d].absent(row).tolist():
                        disk.ahead((m + d, e, t), now)
            wanted = np.unique(routed[m, t])
            ready = [disk.routed((m, e, t), now) for e in pools[m].absent(wanted)]
            pools[m].assign(wanted)
            disk.called(m, t)
            now = max([now, *ready]) + compute
    disk.run_until(float("inf"))
    return {
        "time_per_token": now / tokens,
        "reads_per_token": disk.reads / tokens,
        "disk_busy": min(1.0, disk.reads * read / now) if now else 0.0,
    }


class _ProtectingPool(SlotPool):
    """A SlotPool whose victim is never one of `protect` (the experts predicted
    for this layer) while another resident expert can go."""

    protect: frozenset[int] = frozenset()

    def _evict(self, keep: object) -> int:
        spare = self.protect | set(keep)  # type: ignore[arg-type]
        if any(e not in spare for e in self.slot_of):
            return super()._evict(spare)
        return super()._evict(keep)


def protected_step_hits(
    trace: np.ndarray,
    protect: np.ndarray,
    capacity: int,
    policy: str,
    experts: int,
    lrfu_decay: float = Tuning.lrfu_decay,
) -> np.ndarray:
    """policy_step_hits with a victim choice that spares `protect[t]` (experts
    predicted for this layer, [tokens, n]) at row t while it can."""
    if len(protect) != len(trace):
        raise ValueError(f"{len(protect)} rows to protect for {len(trace)} tokens.")
    pool = _ProtectingPool(min(capacity, experts), experts, policy, lrfu_decay)
    hits = np.zeros(len(trace), np.int64)
    for t, row in enumerate(trace):
        unique = np.unique(row)
        pool.protect = frozenset(protect[t].tolist())
        _, misses = pool.assign(unique)
        hits[t] = len(unique) - len(misses)
    return hits
