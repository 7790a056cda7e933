"""Small parts: slot pool, sizes, recipes."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest

import moestream
from moestream.formats import Recipe, RecipeError
from moestream.runtime import config_from, parse_size
from moestream.runtime.pool import SlotPool


def test_pool_lru_never_evicts_requested() -> None:
    pool = SlotPool(3, 8, "lru")
    slots, misses = pool.assign(np.array([1, 2, 3]))
    assert len(misses) == 3 and sorted(slots.values()) == [0, 1, 2]
    slots2, misses2 = pool.assign(np.array([1, 4]))  # 2 is least recently used
    assert misses2 == [(4, slots[2])] and slots2[1] == slots[1]
    _, misses3 = pool.assign(np.array([3, 4, 5]))  # 1 is now the oldest not wanted
    assert misses3 == [(5, slots[1])]
    assert set(pool.slot_of) == {3, 4, 5}
    with pytest.raises(ValueError, match="do not fit"):
        pool.assign(np.array([1, 2, 6, 7]))


def test_pool_forget_frees_slot() -> None:
    pool = SlotPool(2, 10)
    slots, _ = pool.assign(np.array([7, 8]))
    pool.forget(7)
    _, misses = pool.assign(np.array([8, 9]))
    assert misses == [(9, slots[7])]


def test_lrfu_keeps_a_hot_expert_that_lru_drops() -> None:
    # Expert 0 is used at 6 of 8 steps; one-off experts pass through between.
    steps = [[0, 1], [0, 2], [0, 3], [0, 4], [0, 5], [0, 6], [7, 8], [9, 10], [0, 11]]
    hits = {}
    for name in ("lru", "lrfu"):
        pool = SlotPool(3, 12, name)
        for step in steps[:-1]:
            pool.assign(np.array(step))
        hits[name] = pool.resident(0)
    assert hits == {"lru": False, "lrfu": True}


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="Unknown cache policy 'mru'"):
        SlotPool(2, 4, "mru")


@pytest.mark.parametrize(
    "text, n",
    [
        ("8G", 8 << 30),
        ("512M", 512 << 20),
        ("1.5G", 3 << 29),
        ("8GB", 8 << 30),
        ("8GiB", 8 << 30),
        ("4096", 4096),
        (1024, 1024),
        ("2k", 2048),
    ],
)
def test_parse_size(text, n) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["3Q", "", "G", "-1G", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_recipe_parse_and_layers() -> None:
    r = Recipe.parse("gate_proj=4,up_proj=4,down_proj=6,down_proj@0-1=8")
    assert r.expert_spec("down_proj", 0).bits == 8
    assert r.expert_spec("down_proj", 2).bits == 6
    assert r.expert_spec("gate_proj", 1).bits == 4
    assert Recipe.from_dict(r.to_dict()) == r


@pytest.mark.parametrize(
    "bits, message",
    [
        ("down_proj=7", "Impossible bit width 7"),
        ("down_proj", "Cannot parse"),
        ("down_proj@3-1=4", "Bad layer range"),
    ],
)
def test_recipe_rejects(bits: str, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        Recipe.parse(bits)
    with pytest.raises(RecipeError, match="group size"):
        Recipe.parse(None, group_size=48)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("engine", "cuda", "Unknown engine 'cuda'"),
        ("policy", "mru", "Unknown cache policy 'mru'"),
        ("policy", "lfuda", "Unknown cache policy 'lfuda'"),
        ("context", 0, "context must be at least 1"),
        ("backend", "gpu", "Unknown backend 'gpu'"),
        ("lrfu_decay", 1.01, "lrfu_decay must be in"),
        ("prefetch_extra", -1, "prefetch_extra must be in"),
    ],
)
def test_runtime_config_refuses_bad_values(field: str, value, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from(**{field: value})
    with pytest.raises(TypeError, match="Unknown runtime option mapped"):
        config_from(mapped=True)


def test_lrfu_decay_reaches_the_policy() -> None:
    # decay 0.5: one use now outweighs any number of older uses (LRU's order).
    steps = [[0, 1], [0, 2], [3], [4, 5]]
    pool = SlotPool(3, 6, "lrfu", lrfu_decay=0.5)
    for step in steps:
        pool.assign(np.array(step))
    assert not pool.resident(0)  # the oldest, however often used, went first
    pool = SlotPool(3, 6, "lrfu", lrfu_decay=0.98)
    for step in steps:
        pool.assign(np.array(step))
    assert pool.resident(0)


def test_engine_defaults_to_native_wherever_it_runs(monkeypatch, converted) -> None:
    """engine=None: native where the extension is built and can run on the
    current device (a CPU; a GPU only if built with CUDA), else python;
    prefetch is off unless asked for, and only the native engine on a CPU
    has it. The plan decides it, once."""
    from moestream.runtime import backend, native
    from moestream.runtime.loader import execution_for

    gpu = backend.on_gpu()
    want = "native" if native.runs_here(gpu) else "python"
    plan = execution_for(converted, config_from(cache_experts=4))
    assert (plan.backend != backend.PYTHON) == (want == "native")
    assert not plan.prefetch
    on = execution_for(converted, config_from(cache_experts=4, prefetch=True))
    assert on.prefetch == (want == "native" and not gpu)
    python = execution_for(converted, config_from(cache_experts=4, engine="python"))
    assert python.backend == backend.PYTHON and not python.prefetch
    off = config_from(cache_experts=4, engine=want, prefetch=False)
    assert not execution_for(converted, off).prefetch
    with pytest.raises(ValueError, match="python engine has no prefetch"):
        execution_for(converted, config_from(engine="python", prefetch=True))
    monkeypatch.setattr(native, "_native", None)  # not built (macOS)
    plan = execution_for(converted, config_from(cache_experts=4))
    assert plan.backend == backend.PYTHON


def test_a_gpu_never_reads_ahead() -> None:
    """Reading ahead into a GPU's host tier measured 0.89x / 0.97x (H200):
    deleted. The plan never prefetches on a GPU and refuses prefetch=True in
    one line (checked here on the plan's own function: no GPU is needed)."""
    from moestream.runtime import backend
    from moestream.runtime.config import Tuning

    for asked in (None, False):
        t = Tuning(prefetch=asked)
        assert not backend._prefetches(t, "native", True)
    with pytest.raises(ValueError, match="a GPU does not read ahead") as e:
        backend._prefetches(Tuning(prefetch=True), "native", True)
    assert "\n" not in str(e.value) and "leave prefetch unset" in str(e.value)


def test_default_engine_falls_back_with_a_warning(
    monkeypatch, converted, caplog
) -> None:
    """An extension built against another MLX (an upgrade since the install)
    cannot run: the default engine is python then, and load says why."""
    from moestream.runtime import native

    if not native.available() or mx.default_device() != mx.cpu:
        pytest.skip("needs the native engine built for this CPU")
    assert native.fallback_reason(False) is None
    monkeypatch.setattr(native._native, "mlx_version", "0.0.1")
    assert not native.runs_here(False)
    assert "built against MLX 0.0.1" in native.fallback_reason(False)
    with caplog.at_level(logging.WARNING, logger="moestream.runtime.backend"):
        moestream.load(converted, cache_experts=4)
    (record,) = [r for r in caplog.records if "instead of the native" in r.message]
    assert "reinstall moestream" in record.message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moestream.runtime.backend"):
        moestream.load(converted, cache_experts=4, engine="python")  # as asked
    assert not [r for r in caplog.records if "instead of the native" in r.message]
