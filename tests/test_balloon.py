"""The beyond-RAM bench: its balloon holds memory, keeps the floor, and stops;
its rows without llama.cpp; the uniform routing trace it can force."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moestream.bench.balloon import CHUNK, Balloon, available
from moestream.bench.beyond import BeyondConfig, plan, summarize
from moestream.bench.routes import load_trace, uniform_trace, write_trace


def test_balloon_refuses_to_take_the_machine_under_its_floor():
    with pytest.raises(ValueError, match="floor"):
        Balloon(leave=1 << 30, floor=4 << 30)


@pytest.mark.slow
def test_balloon_holds_memory_until_the_block_ends():
    before = available()
    if before < (6 << 30):
        pytest.skip("less than 6 GB available")
    with Balloon(leave=before - 3 * CHUNK, floor=4 << 30) as b:
        assert b.held >= 2 * CHUNK
        assert available() < before - CHUNK
        proc = b._proc
    assert proc.poll() is not None  # stopped, its memory returned


def test_beyond_ram_without_a_gguf_plans_moestream_rows_only(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_experts": 16, "num_experts_per_tok": 2})
    )
    cfg = BeyondConfig(
        out=tmp_path,
        gguf=None,
        exe=None,
        budgets=(25,),
        runtime_fields=(("readers=2", {"readers": 2}),),
        trace=tmp_path / "t.npz",
    )
    rows = [(name, mode) for name, mode, _ in plan(cfg)]
    assert rows == [
        ("moestream 25 %", "cold"),
        ("moestream 25 %", "warm"),
        ("moestream 25 % readers=2", "cold"),
        ("moestream 25 % readers=2", "warm"),
    ]


def test_each_repeat_is_held_to_its_own_compute_term():
    def run(tps: float, disk: float = 0.0) -> dict:
        keys = ("read", "missed", "rss", "hit", "cpu", "system")
        return {"tps": tps, "disk": disk, **dict.fromkeys(keys, disk)}

    # the machine ran at half speed in the second repeat, in RAM and under the
    # balloon alike; the disk (1 GB/s) bounds the cold row's first repeat
    results = {
        ("moestream 100 %", "warm", "in RAM"): [run(10.0), run(5.0)],
        ("moestream 25 %", "cold", "balloon"): [run(4.0, 0.2e9), run(4.0)],
    }
    out = summarize(results, {"limit": 1.0}, held=1 << 30)
    ram, cold = out["rows"]
    assert ram["x_roofline_spread"] == [1.0, 1.0]
    assert cold["x_roofline_spread"] == pytest.approx([0.8, 0.8])
    assert cold["x_roofline"] == pytest.approx(0.8)  # not 4 / 7.5 (medians' ratio)
    assert out["compute_s"]["moestream"] == pytest.approx(0.15)
    assert cold["cpu_ms_per_token"] == pytest.approx(1e3 * 0.1e9)  # the median


def test_a_uniform_trace_routes_to_distinct_experts(tmp_path):
    ids = uniform_trace(layers=3, tokens=200, k=4, num_experts=16, seed=1)
    write_trace(tmp_path / "u.npz", ids, meta={"geometry": {"num_experts": 16}})
    trace = load_trace(tmp_path / "u.npz")  # checks distinct ids per token
    assert (trace.layers, trace.tokens, trace.top_k) == (3, 200, 4)
    counts = np.bincount(trace.ids.ravel(), minlength=16)
    assert counts.min() > 0.7 * counts.mean()  # every expert, about as often


def test_a_model_larger_than_ram_runs_without_a_balloon(tmp_path, monkeypatch):
    """--no-balloon --compute-experts: no balloon process, the rows labelled
    so, the compute term from the N-expert row (no llama.cpp row in RAM: its
    GGUF does not fit), and llama.cpp's rows held to the disk alone."""
    from moestream.bench import beyond

    (tmp_path / "config.json").write_text(
        json.dumps({"num_experts": 16, "num_experts_per_tok": 2})
    )

    def fake(tps: float, disk: float) -> dict:
        keys = ("read", "missed", "rss", "hit", "cpu", "system")
        return {"tps": tps, "disk": disk, **dict.fromkeys(keys, 0)}

    def no_balloon(*args, **kwargs):
        raise AssertionError("a balloon was started")

    monkeypatch.setattr(beyond, "Balloon", no_balloon)
    monkeypatch.setattr(beyond, "_moe", lambda job: fake(10.0 / job.capacity, 0.1e9))
    monkeypatch.setattr(beyond, "_llama", lambda job: fake(4.0, 0.2e9))
    cfg = BeyondConfig(
        out=tmp_path,
        gguf=tmp_path / "m.gguf",
        exe=tmp_path / "llama-bench",
        budgets=(25,),
        compute_experts=4,
        balloon=False,
    )
    results, held = beyond._repeats(cfg, beyond.compute_job(cfg, tmp_path), print)
    assert held == 0
    assert sorted(results) == [
        ("llama.cpp mmap", "cold", "no balloon"),
        ("llama.cpp mmap", "warm", "no balloon"),
        ("moestream 25 %", "cold", "no balloon"),
        ("moestream 25 %", "warm", "no balloon"),
        ("moestream 4 experts", "warm", "in RAM"),
    ]
    rows = {
        (r["row"], r["mode"]): r for r in summarize(results, {"limit": 1.0}, 0)["rows"]
    }
    # moestream: max(compute 0.4 s, disk 0.1 s) at 2.5 tok/s; 25 % slots of 16
    # experts are 4 in the fake's arithmetic, so it runs at the compute term
    assert rows[("moestream 25 %", "cold")]["x_roofline"] == pytest.approx(1.0)
    # llama.cpp: the disk's 0.2 s alone at 4 tok/s
    assert rows[("llama.cpp mmap", "cold")]["x_roofline"] == pytest.approx(0.8)
