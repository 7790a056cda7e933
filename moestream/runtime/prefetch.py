"""Next-layer prediction: the next MoE layer's router, applied to this layer's
input, predicts that layer's experts. The native engine hints their records to
the kernel (`posix_fadvise(WILLNEED)`); nothing predicted is put in a slot, so
a wrong guess costs disk bandwidth, never a resident expert. (The python
engine did the same and measured 2-6 % slower with it: README, Prefetch.)"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from ..families import get_family, layer_index, module_at

if TYPE_CHECKING:
    from .switch import StreamingSwitchGLU


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
