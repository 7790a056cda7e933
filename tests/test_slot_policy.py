"""The native engine's eviction policy (csrc/slot_policy.h, the one the CPU
path and the CUDA kernel run) evicts what runtime/pool.py's SlotPool, the
reference, evicts: the same victims call by call on recorded routing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import PROMPT, logits_stepwise

import moestream
from moestream.runtime import native
from moestream.runtime.pool import SlotPool

pytestmark = pytest.mark.skipif(
    not native.available(), reason="moestream's native engine is not built"
)

TRACES = Path(__file__).resolve().parent.parent / "moestream" / "bench" / "traces"


def calls(rows: np.ndarray, capacity: int) -> list[tuple[np.ndarray, int]]:
    """Decode rows one a call, every fifth call a group of three rows (a
    prefill's: more tokens, so LRFU decays by more) where they fit."""
    out, t = [], 0
    while t < len(rows):
        group = rows[t : t + 3]
        if len(out) % 5 == 4 and len(np.unique(group)) <= capacity:
            out.append((group.ravel(), len(group)))
            t += len(group)
        else:
            out.append((rows[t], 1))
            t += 1
    return out


def victims(
    rows: np.ndarray, experts: int, capacity: int, policy: str, decay: float
) -> tuple[list[list[int]], list[list[int]]]:
    pool = SlotPool(capacity, experts, policy, decay)
    ours = native._native.SlotPolicy(experts, capacity, policy, decay)
    theirs, mine = [], []
    for routed, tokens in calls(rows, capacity):
        before = set(pool.slot_of)
        pool.assign(np.unique(routed), tokens)
        theirs.append(sorted(before - set(pool.slot_of)))
        mine.append(sorted(ours.access(routed.tolist(), tokens)))
    return theirs, mine


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
@pytest.mark.parametrize("capacity", [4, 7, 16, 31])
def test_policy_evicts_as_the_reference_pool(policy: str, capacity: int) -> None:
    trace = np.load(TRACES / "tiny-qwen3-moe-stdlib.npz")["ids"]
    for layer in (0, len(trace) - 1):
        theirs, mine = victims(trace[layer][:1500], 32, capacity, policy, 0.9)
        assert sum(map(len, theirs)) > 0 or capacity == 31
        first = next(
            (i for i, (a, b) in enumerate(zip(theirs, mine, strict=True)) if a != b),
            None,
        )
        assert first is None, (
            f"layer {layer}, call {first}: {theirs[first]} != {mine[first]}"
        )


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_policy_on_a_wide_layer(policy: str) -> None:
    """128 experts, 8 routed per token (the 30B geometry's recorded routing)."""
    trace = np.load(TRACES / "qwen3-30b-a3b-geometry.npz")["ids"]
    for capacity in (16, 40):
        theirs, mine = victims(trace[3][:600], 128, capacity, policy, 0.95)
        assert sum(map(len, theirs)) > 0 and theirs == mine


def test_policy_refuses_what_the_engine_refuses() -> None:
    policy = native._native.SlotPolicy(8, 2, "lru")
    with pytest.raises(ValueError, match="more routed experts than slots"):
        policy.access([0, 1, 2])
    with pytest.raises(ValueError, match="out of range"):
        policy.access([9])
    with pytest.raises(ValueError, match="'lru' or 'lrfu'"):
        native._native.SlotPolicy(8, 2, "fifo")
    assert policy.access([3, 3, 4]) == [] and policy.access([5]) == [3]


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_both_engines_count_alike(converted, policy: str) -> None:
    """One policy, so the python and native engines evict alike: the same
    hits, misses and evictions over a prompt and decode steps."""
    counts = {}
    for engine in ("python", "native"):
        model, _ = moestream.load(
            converted, cache_experts=3, engine=engine, policy=policy, prefetch=False
        )
        logits_stepwise(model, PROMPT, steps=10)
        s = moestream.stats(model)
        counts[engine] = (s.hits, s.misses, s.evictions)
    assert counts["python"] == counts["native"] and counts["native"][2] > 0
