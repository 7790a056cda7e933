"""RuntimeStats.events: one record per MoE layer call, when recording a trace."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import corrupt_layer
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.families import layer_index, replace_module, switch_modules
from moestream.formats import load_manifest
from moestream.reference import resident_from_converted
from moestream.runtime import ExpertReadError, native

PROMPT = mx.array([[(5 * i + 1) % 300 for i in range(20)]])
STEPS = 6
ENGINES = ["python"] + (["native"] if native.available() else [])


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


def load(path: Path, engine: str, **options):
    return moestream.load(path, engine=engine, **options)[0]


class Recorder(nn.Module):
    """A resident SwitchGLU that keeps the experts it is routed to."""

    def __init__(self, inner: nn.Module, calls: list):
        super().__init__()
        self._inner, self._calls = inner, calls

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self._calls.append(np.array(indices).reshape(-1).tolist())
        return self._inner(x, indices)


def decode(model, steps: int = STEPS, cache=None) -> None:
    cache = cache or make_prompt_cache(model)
    logits = model(PROMPT, cache=cache)
    for _ in range(steps):
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


def test_events_record_every_call(converted, engine) -> None:
    ahead = {"prefetch": True} if engine != "python" else {}  # (off by default)
    model = load(converted, engine, cache_experts=3, record_trace=True, **ahead)
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
            # The prompt's call runs in groups of 3 slots: they add up.
            assert e["hits"] + e["misses"] == len(set(e["experts"]))
            assert e["bytes_read"] == e["misses"] * layer.record_nbytes
            assert len(set(e["prefetched"])) == len(e["prefetched"])
            assert all(0 <= x < layer.num_experts for x in e["prefetched"])
    assert sum(e["hits"] for e in events) == s.hits
    assert sum(e["misses"] for e in events) == s.misses > 0
    assert sum(e["bytes_read"] for e in events) == s.bytes_read
    assert sum(len(e["prefetched"]) for e in events) == s.prefetched
    assert (s.prefetched > 0) == (engine != "python")  # python: no prefetch
    first = min(layer.layer for layer in layers)
    assert events[0]["prefetched"] == []  # nothing predicts the first layer
    routing = s.routing()
    assert routing[first].shape == (PROMPT.size + STEPS, 2)
    s.reset()
    assert s.events == [] and s.routing() == {}
    decode(model)
    mine = [e for e in s.events if e["layer"] == first]
    assert mine[0]["step"] == 0
    assert all(e["hits"] + e["misses"] == len(set(e["experts"])) for e in mine)


def test_events_read_mid_run_then_filled_on(converted, engine) -> None:
    """Events read between calls are complete; later ones fill in later."""
    model = load(converted, engine, cache_experts=3, record_trace=True)
    cache = make_prompt_cache(model)
    decode(model, steps=2, cache=cache)
    s = moestream.stats(model)
    assert all(e["hits"] is not None for e in s.events)
    before = len(s.events)
    token = mx.array([[7]])
    for _ in range(3):
        mx.eval(model(token, cache=cache))
    events = s.events
    assert len(events) == before + 3 * len(moestream.runtime_of(model).manifest.layers)
    assert all(e["hits"] + e["misses"] == len(set(e["experts"])) for e in events)
    assert sum(e["misses"] for e in events) == moestream.stats(model).misses


def test_a_failed_call_does_not_shift_later_events(copy, engine) -> None:
    """The native cache's counts are matched to their calls, so a call that
    failed (or never ran) leaves later calls' events right."""
    model = load(copy, engine, cache_experts=2, record_trace=True)
    cache = make_prompt_cache(model)
    decode(model, steps=0, cache=cache)
    layer = load_manifest(copy).layers[0]
    original = corrupt_layer(copy, layer)
    # a decode step that misses in layer 0
    with pytest.raises(ExpertReadError):
        for t in range(1, 40):
            mx.eval(model(mx.array([[t]]), cache=make_prompt_cache(model)))
    (copy / layer.file).write_bytes(original)
    failed = len(moestream.stats(model).events)
    decode(model)
    events = moestream.stats(model).events
    later = events[failed:]
    assert len(later) == 2 * (1 + STEPS)
    assert all(e["hits"] + e["misses"] == len(set(e["experts"])) for e in later)
    counted = [e for e in events[:failed] if e["hits"] is not None]
    assert all(e["hits"] + e["misses"] == len(set(e["experts"])) for e in counted)


def test_sync_free_calls_record_without_reading_the_routing(converted, engine) -> None:
    model = load(converted, engine, cache_experts=8, record_trace=True)
    decode(model)
    s = moestream.stats(model)
    decode_events = s._events[2:]  # after the two prefill calls
    assert s.sync_free_calls == 2 * (1 + STEPS)  # the prefill's calls too
    # Kept as device arrays: recording did not read them on the host.
    assert all(isinstance(e["experts"], mx.array) for e in decode_events)
    for e in s.events[2:]:
        assert e["misses"] == e["bytes_read"] == 0 and e["prefetched"] == []
        assert e["hits"] == len(set(e["experts"])) and len(e["experts"]) == 2


def test_no_events_unless_recording(converted, engine) -> None:
    model = load(converted, engine, cache_experts=3)
    decode(model)
    s = moestream.stats(model)
    assert s.misses > 0 and s.events == [] and s.routing() == {}
    if engine != "python":
        assert all(c.take_records() == [] for c in s.native_layers.values())
