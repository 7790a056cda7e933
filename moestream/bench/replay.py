"""Replay a recorded routing trace against cache policies and Belady's optimum.

A trace is, per MoE layer, one row of routed expert ids per decode step.
Policies replay through the runtime's own `SlotPool`; Belady evicts the
resident expert used furthest in the future (the limit for any policy).
"""

from __future__ import annotations

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
