"""RuntimeStats.events: one record per MoE layer call, when recording a trace."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.families import layer_index, replace_module, switch_modules
from moestream.reference import resident_from_converted

PROMPT = mx.array([[(5 * i + 1) % 300 for i in range(20)]])
STEPS = 6


class Recorder(nn.Module):
    """A resident SwitchGLU that keeps the experts it is routed to."""

    def __init__(self, inner: nn.Module, calls: list):
        super().__init__()
        self._inner, self._calls = inner, calls

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self._calls.append(np.array(indices).reshape(-1).tolist())
        return self._inner(x, indices)


def decode(model) -> None:
    cache = make_prompt_cache(model)
    logits = model(PROMPT, cache=cache)
    for _ in range(STEPS):
        token = mx.argmax(logits[:, -1], axis=-1, keepdims=True)
        logits = model(token, cache=cache)
    mx.eval(logits)


def resident_routing(converted) -> dict[int, list[list[int]]]:
    model = resident_from_converted(converted)
    calls: dict[int, list] = {}
    for path, module in switch_modules(model).items():
        replace_module(
            model, path, Recorder(module, calls.setdefault(layer_index(path), []))
        )
    decode(model)
    return calls


def test_events_record_every_call(converted) -> None:
    model, _ = moestream.load(converted, cache_experts=3, record_trace=True)
    decode(model)
    s = moestream.stats(model)
    events = s.events
    layers = moestream.runtime_of(model).manifest.layers
    assert len(events) == len(layers) * (1 + STEPS)
    want = resident_routing(converted)
    for layer in layers:
        mine = [e for e in events if e["layer"] == layer.layer]
        assert [e["step"] for e in mine] == list(range(1 + STEPS))
        assert [e["tokens"] for e in mine] == [PROMPT.size] + [1] * STEPS
        assert [e["experts"] for e in mine] == want[layer.layer]  # the router's
        for e in mine:
            assert e["hits"] + e["misses"] == len(set(e["experts"]))
            assert e["bytes_read"] == e["misses"] * layer.record_nbytes
    assert sum(e["hits"] for e in events) == s.hits
    assert sum(e["misses"] for e in events) == s.misses > 0
    assert sum(e["bytes_read"] for e in events) == s.bytes_read
    assert all(e["prefetched"] == [] for e in events)  # python: no prefetch
    first = min(layer.layer for layer in layers)
    routing = s.routing()
    assert routing[first].shape == (PROMPT.size + STEPS, 2)
    s.reset()
    assert s.events == [] and s.routing() == {}
    decode(model)
    assert next(e["step"] for e in s.events if e["layer"] == first) == 0


def test_sync_free_calls_record_without_reading_the_routing(converted) -> None:
    model, _ = moestream.load(converted, cache_experts=8, record_trace=True)
    decode(model)
    s = moestream.stats(model)
    decode_events = s._events[2:]  # after the two prefill calls
    assert s.sync_free_calls == 2 * STEPS
    # Kept as device arrays: recording did not read them on the host.
    assert all(isinstance(e["experts"], mx.array) for e in decode_events)
    for e in s.events[2:]:
        assert e["misses"] == e["bytes_read"] == 0 and e["prefetched"] == []
        assert e["hits"] == len(set(e["experts"])) and len(e["experts"]) == 2


def test_no_events_unless_recording(converted) -> None:
    model, _ = moestream.load(converted, cache_experts=3)
    decode(model)
    s = moestream.stats(model)
    assert s.misses > 0 and s.events == [] and s.routing() == {}
