"""Per-layer resident expert slots and the policies that pick what to evict."""

from __future__ import annotations

import numpy as np

from ..units import count
from .config import POLICIES, Tuning
from .stats import RuntimeStats  # noqa: F401  (its old home)


class Policy:
    """Scores experts; the resident expert with the lowest score goes first."""

    def __init__(self, num_experts: int):
        self.score = np.zeros(num_experts)

    def used(self, experts: np.ndarray, tokens: int) -> None:
        raise NotImplementedError


class LRU(Policy):
    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.clock = 0

    def used(self, experts: np.ndarray, tokens: int) -> None:
        self.clock += 1
        self.score[experts] = self.clock


class LRFU(Policy):
    """Exponentially decayed use count (LRFU, Lee et al. 1999).

    Each use adds 1; every token multiplies all counts by `decay`
    (Tuning.lrfu_decay).
    """

    def __init__(self, num_experts: int, decay: float):
        super().__init__(num_experts)
        self.decay = decay

    def used(self, experts: np.ndarray, tokens: int) -> None:
        self.score *= self.decay**tokens
        self.score[experts] += 1.0


CLASSES: dict[str, type[Policy]] = {"lru": LRU, "lrfu": LRFU}
assert set(CLASSES) == set(POLICIES), "a policy without its class"


def make_policy(
    name: str, num_experts: int, lrfu_decay: float = Tuning.lrfu_decay
) -> Policy:
    if name not in POLICIES:
        raise ValueError(
            f"Unknown cache policy {name!r}; use one of {', '.join(POLICIES)}."
        )
    return LRFU(num_experts, lrfu_decay) if name == "lrfu" else LRU(num_experts)


class SlotPool:
    """Which expert sits in which of `capacity` slots, and who is evicted next."""

    def __init__(
        self,
        capacity: int,
        num_experts: int,
        policy: str = "lru",
        lrfu_decay: float = Tuning.lrfu_decay,
    ):
        if capacity < 1:
            raise ValueError("A slot pool needs at least one slot.")
        self.capacity = capacity
        self.policy = make_policy(policy, num_experts, lrfu_decay)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(capacity - 1, -1, -1))
        # expert -> slot as an array; `capacity` (the row past the pool) if absent.
        self.table = np.full(num_experts, capacity, np.uint32)

    def assign(
        self, experts: np.ndarray, tokens: int = 1
    ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Slots for `experts` (unique, at most `capacity`), and the misses to load.

        No expert of `experts` is evicted to make room for another of them.
        """
        if len(experts) > self.capacity:
            raise ValueError(
                f"{count(len(experts), 'expert')} do not fit "
                f"{count(self.capacity, 'slot')}."
            )
        wanted = [int(e) for e in experts]
        slots, misses = {}, []
        for e in wanted:
            if e in self.slot_of:
                slots[e] = self.slot_of[e]
        for e in sorted(set(wanted) - slots.keys()):
            slot = self.free.pop() if self.free else self._evict(slots.keys())
            self.slot_of[e] = slots[e] = slot
            self.table[e] = slot
            misses.append((e, slot))
        self.policy.used(np.fromiter(slots, np.int64, len(slots)), tokens)
        return slots, misses

    def _evict(self, keep: object) -> int:
        candidates = np.fromiter(
            (e for e in self.slot_of if e not in keep),
            np.int64,  # type: ignore[operator]
        )
        victim = int(candidates[np.argmin(self.policy.score[candidates])])
        self.table[victim] = self.capacity
        return self.slot_of.pop(victim)

    def resident(self, expert: int) -> bool:
        return expert in self.slot_of

    def absent(self, experts: np.ndarray) -> np.ndarray:
        """Those of `experts` that hold no slot."""
        return experts[self.table[experts] == self.capacity]

    def forget(self, expert: int) -> None:
        """Drop `expert` (its slot content is no longer trusted)."""
        slot = self.slot_of.pop(expert, None)
        if slot is not None:
            self.table[expert] = self.capacity
            self.free.append(slot)
