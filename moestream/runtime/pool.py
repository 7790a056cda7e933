"""Per-layer resident expert slots with LRU replacement."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RuntimeStats:
    """Counters of one loaded model; read with `moestream.stats(model)`."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_read: int = 0
    grouped_calls: int = 0
    per_layer_misses: dict[int, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def reset(self) -> None:
        self.hits = self.misses = self.evictions = self.bytes_read = 0
        self.grouped_calls = 0
        self.per_layer_misses.clear()

    def as_dict(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "hit_rate": self.hit_rate,
        }


class SlotPool:
    """Which expert sits in which of `capacity` slots; LRU goes first."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("A slot pool needs at least one slot.")
        self.capacity = capacity
        self.slot_of: OrderedDict[int, int] = OrderedDict()
        self.free = list(range(capacity - 1, -1, -1))

    def assign(
        self, experts: np.ndarray
    ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for `experts` (unique, at most `capacity`), and the misses to load.

        No expert of `experts` is evicted to make room for another of them.
        """
        if len(experts) > self.capacity:
            raise ValueError(
                f"{len(experts)} experts do not fit {self.capacity} slots."
            )
        wanted = {int(e) for e in experts}
        slots, misses = {}, []
        for e in wanted & self.slot_of.keys():
            self.slot_of.move_to_end(e)
            slots[e] = self.slot_of[e]
        for e in sorted(wanted - slots.keys()):
            slot = self.free.pop() if self.free else self._evict(wanted)
            self.slot_of[e] = slots[e] = slot
            misses.append((e, slot))
        return slots, misses

    def _evict(self, keep: set[int]) -> int:
        for e in self.slot_of:
            if e not in keep:
                return self.slot_of.pop(e)
        raise AssertionError("no evictable slot")  # unreachable: len(keep) <= capacity

    def forget(self, expert: int) -> None:
        """Drop `expert` (its slot content is no longer trusted)."""
        slot = self.slot_of.pop(expert, None)
        if slot is not None:
            self.free.append(slot)
