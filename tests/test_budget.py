"""Budgets a user can trust, on the bundled demo model: the minimum a "too
small" error suggests runs (run-moe, chat, serve, plan), and plan and run-moe
give the same slots at every budget around each slot threshold."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import moestream
from moestream.converter import convert
from moestream.runtime import BudgetError, RuntimeConfig, loader, memory, runtime_of
from moestream.runtime.loader import plan_for
from moestream.units import parse_size

DEMO = Path(__file__).parent.parent / "examples" / "stdlib-moe"
MOESTREAM = [sys.executable, "-m", "moestream"]
TIMEOUT = 120
PROMPT, TOKENS = "def quicksort(xs):", "8"
SUGGESTED = re.compile(r"give --memory-budget (\S+) or more")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo") / "stdlib-moe"
    convert(str(DEMO), out, progress=False)
    return out


def cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [*MOESTREAM, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def suggestion(r: subprocess.CompletedProcess) -> str:
    """The budget a refused command's one error line suggests."""
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("error: Memory budget 1.0K is too small"), r.stderr
    found = SUGGESTED.search(lines[-1])
    assert found, lines[-1]
    return found.group(1)


def slots_of(stderr: str) -> tuple[int, str]:
    """Slots per layer and the process figure of a printed memory plan."""
    found = re.search(r"memory plan: process (\S+) .* \((\d+)/\d+ per layer\)", stderr)
    assert found, stderr
    return int(found.group(2)), found.group(1)


def planned_slot(demo: Path) -> int:
    """One slot's bytes in every MoE layer, as run-moe's plan counts it."""
    return plan_for(demo, RuntimeConfig(cache_experts=4)).slot_bytes


def run_moe(demo: Path, budget: str) -> subprocess.CompletedProcess:
    args = ["run", str(demo), "-p", PROMPT, "-m", TOKENS, "--stats"]
    return cli(*args, "--memory-budget", budget)


def plan(demo: Path, budget: str, *more: str) -> subprocess.CompletedProcess:
    args = ["plan", str(demo), "--no-forecast", "--json", *more]
    return cli(*args, "--memory-budget", budget)


def test_run_and_plan_suggest_the_same_minimum_and_it_runs(demo: Path) -> None:
    least = suggestion(run_moe(demo, "1K"))
    assert suggestion(plan(demo, "1K", "-p", PROMPT, "-m", TOKENS)) == least
    r = run_moe(demo, least)
    assert r.returncode == 0, r.stderr
    capacity, process = slots_of(r.stderr)
    # At least the top-k (the least one token routes to); more only where a
    # slot is smaller than the suggestion's rounding (0.1M), and a budget
    # one rounding step smaller is refused: the suggestion is the least.
    assert capacity >= 4
    assert capacity == 4 or capacity - 4 <= 0.1 * 2**20 // planned_slot(demo)
    smaller = run_moe(demo, f"{parse_size(least) / 2**20 - 0.1:.1f}M")
    assert (
        smaller.returncode == 2 and f"--memory-budget {least} or more" in smaller.stderr
    )
    p = plan(demo, least, "-p", PROMPT, "-m", TOKENS)
    assert p.returncode == 0, p.stderr
    planned = json.loads(p.stdout)["plan"]
    assert planned["capacity"] == capacity
    assert parse_size(process) == planned["process"]  # measured alike, rounded
    assert planned["total"] <= parse_size(least)


def test_chat_runs_at_the_minimum_it_suggests(demo: Path) -> None:
    least = suggestion(cli("chat", str(demo), "--memory-budget", "1K", stdin="q\n"))
    r = cli("chat", str(demo), "--memory-budget", least, stdin="def f(x):\nq\n")
    assert r.returncode == 0, r.stderr
    assert slots_of(r.stderr)[0] >= 4  # (as the run's, above)
    assert "tokens of context]" in r.stderr  # it answered


def test_serve_runs_at_the_minimum_it_suggests(demo: Path) -> None:
    refused = cli("serve", str(demo), "--port", "0", "--memory-budget", "1K")
    least = suggestion(refused)
    p = plan(demo, "1K", "--for", "serve")
    assert suggestion(p) == least
    proc = subprocess.Popen(
        [*MOESTREAM, "serve", str(demo), "--port", "0", "--memory-budget", least],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = []
        for line in proc.stderr:  # bounded by the kill in `finally`
            lines.append(line)
            if "(Ctrl-C stops)" in line or line.startswith("error"):
                break
        assert any("(Ctrl-C stops)" in x for x in lines), "".join(lines)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.wait(timeout=TIMEOUT)
    assert proc.returncode == 0, err
    assert plan(demo, least, "--for", "serve").returncode == 0


def test_the_process_figure_is_rounded_up_to_a_coarse_step(monkeypatch) -> None:
    step, floor = memory.PROCESS_STEP, memory.PROCESS_FLOOR
    for resident, want in (
        (1, floor),
        (floor - 1, floor),
        (floor + 1, floor + step),
        (floor + step, floor + step),
    ):
        monkeypatch.setattr(memory, "_resident_bytes", lambda r=resident: r)
        assert memory._process_bytes() == want


def test_the_suggested_budget_holds_its_own_reserve() -> None:
    for unreserved in (0, 1, 12345, 130 << 20, 7 << 30, (1 << 40) + 7):
        budget = memory._budget_holding(unreserved)
        assert budget - memory.reserve_for(budget) >= unreserved
        assert budget - 1 - memory.reserve_for(budget - 1) < unreserved


def test_plan_and_load_give_the_same_slots_around_every_threshold(
    demo: Path, monkeypatch
) -> None:
    """Each budget from one byte below to one above the least that holds c slots,
    for every c from the top-k to all: plan_for's slots are load's, and c."""
    measured = memory._process_bytes()
    monkeypatch.setattr(loader, "_process_bytes", lambda: measured)
    base = RuntimeConfig(context=64, cache_experts=4)
    p = plan_for(demo, base)
    for c in range(4, p.num_experts + 1):
        least = memory.least_budget(p, c)
        for budget, want in ((least - 1, c - 1), (least, c), (least + 1, c)):
            cfg = RuntimeConfig(context=64, memory_budget=budget)
            if want < 4:
                with pytest.raises(BudgetError):
                    plan_for(demo, cfg)
                continue
            planned = plan_for(demo, cfg)
            model, _ = moestream.load(demo, cfg)
            loaded = runtime_of(model).plan
            runtime_of(model).store.close()
            assert planned.capacity == loaded.capacity == want, (c, budget)
            assert planned.total == loaded.total <= budget


def test_mlx_cache_takes_the_scores_room_only_where_none_are_written(
    demo: Path,
) -> None:
    """The plan counts a prefill chunk's `[heads, L, S]` attention scores in
    its activations; where the CPU kernel's exact attention writes none, MLX's
    buffer cache may hold that room on top of its quarter, else not."""
    cfg = RuntimeConfig(context=300, memory_budget="2G")
    plan = plan_for(demo, cfg)
    heads = json.loads((demo / "config.json").read_text())["num_attention_heads"]
    assert plan.scores == 4 * heads * 300 * 300
    assert plan.scores < plan.activations
    saved = mx.set_cache_limit(0)
    try:
        loader._bound_allocators(plan)
        assert mx.set_cache_limit(0) == plan.activations // 4
        loader._bound_allocators(plan, scores_written=False)
        assert mx.set_cache_limit(0) == plan.activations // 4 + plan.scores
    finally:
        mx.set_cache_limit(saved)


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_prefill_leaves_no_layer_holding_its_output(demo: Path, engine) -> None:
    """A layer orders its next call after its last host-routed one through a
    one-element marker: a prefill's `[tokens, k, hidden]` output is not kept
    in every layer until that layer's next call (outside the memory plan)."""
    from moestream.runtime.switch import StreamingSwitchGLU

    model, _ = moestream.load(demo, cache_experts=4, engine=engine)
    layers = [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]
    assert layers and all(m.capacity < m._layer.num_experts for m in layers)
    mx.eval(model(mx.arange(1, 41)[None]))
    held = [m._engine.last for m in layers]
    assert all(h is not None for h in held)  # each layer ran a host-routed call
    assert all(h.size == 1 for h in held), [h.shape for h in held]
    runtime_of(model).store.close()
