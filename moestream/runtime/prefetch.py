"""Next-layer prefetch: the next MoE layer's router, applied to this layer's
input, predicts that layer's experts; the kernel is asked to read the records
of those that hold no slot (`posix_fadvise(WILLNEED)`, into the page cache).
Nothing predicted is put in a slot: a wrong guess costs disk bandwidth, never
a resident expert."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..families import get_family, layer_index, module_at
from ..formats import ExpertLayer
from .pool import SlotPool
from .stats import RuntimeStats
from .store import ExpertStore

if TYPE_CHECKING:
    from .switch import StreamingSwitchGLU


class Prefetch:
    """The experts one MoE layer's predecessor predicted for its next call."""

    def __init__(
        self,
        store: ExpertStore,
        layer: ExpertLayer,
        pool: SlotPool,
        stats: RuntimeStats,
    ):
        self.store, self.layer, self.pool, self.stats = store, layer, pool, stats
        self.expected: set[int] = set()  # hinted, not yet seen by a call

    def start(self, predicted: np.ndarray) -> None:
        """Hint the records of the predicted experts that hold no slot."""
        missing = self.pool.absent(np.unique(predicted)).tolist()
        if missing:
            self.store.willneed(self.layer.layer, missing)
            self.expected.update(missing)
            self.stats.prefetched += len(missing)
            self.stats.prefetch_bytes += len(missing) * self.layer.record_nbytes

    def take(self) -> set[int]:
        """What was prefetched for the call starting now (cleared for the next)."""
        expected, self.expected = self.expected, set()
        return expected

    def score(self, expected: set[int], routed: np.ndarray, missed: list[int]) -> None:
        """Count the predictions the call used, and the misses they covered."""
        self.stats.prefetched_used += len(expected.intersection(routed.tolist()))
        self.stats.misses_prefetched += len(expected.intersection(missed))


def chain_prefetch(
    model: nn.Module,
    streaming: dict[str, StreamingSwitchGLU],
    config: dict,
    extra: int,
) -> None:
    """Give each MoE layer the next one's router, to predict its experts early."""
    ordered = sorted(streaming.items(), key=lambda kv: layer_index(kv[0]))
    k = get_family(config).top_k(config) + extra
    for (_, layer), (path, nxt) in itertools.pairwise(ordered):
        predict = router_predictor(module_at(model, path.rpartition(".")[0]), k)
        if predict is not None:
            layer.chain(nxt, predict)


def router_predictor(block: nn.Module, k: int) -> Callable | None:
    """x -> the `k` experts `block`'s router picks for x (None: no router found)."""
    gate = next(
        (getattr(block, n) for n in ("gate", "router") if hasattr(block, n)), None
    )
    if not callable(gate):
        return None
    bias = block.get("e_score_correction_bias")  # minimax ranks biased sigmoids

    def predict(x: mx.array) -> mx.array:
        out = gate(x)
        if isinstance(out, tuple):  # gates that route themselves: (inds, scores)
            return out[0]
        if bias is not None:
            out = mx.sigmoid(out.astype(mx.float32)) + bias
        n = min(k, out.shape[-1])
        return mx.argpartition(-out, kth=n - 1, axis=-1)[..., :n]

    return predict
