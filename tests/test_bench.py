"""The benchmark's parts: synthetic scale models, trace replays, the harness."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm import load as mlx_load

import moestream
from moestream.bench.harness import BenchConfig, capacity_for, plan_rows
from moestream.bench.models import Scale, export_mlx, write_synthetic
from moestream.bench.replay import belady_hits, policy_hits, replay_all
from moestream.cli import main as moestream_cli
from moestream.families import cast_floating
from moestream.reference import resident_from_converted
from moestream.runtime.loader import budget_for

TINY = Scale(3, 8, 2, 128, 64, heads=4, kv_heads=2, head_dim=32, vocab=512)
PROMPT = mx.array([[5, 9, 200, 31, 7, 77, 400, 3, 12, 8]])


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "tiny"
    write_synthetic(out, TINY)
    return out


def test_synthetic_model_streams_exactly_and_exports_to_mlx_lm(synthetic, tmp_path):
    resident = resident_from_converted(synthetic)
    expected = resident(PROMPT)
    assert not mx.isnan(expected).any().item() and expected.abs().max().item() > 0
    model, _ = moestream.load(synthetic, cache_experts=3)
    assert mx.array_equal(model(PROMPT), expected).item()
    exported, _ = mlx_load(str(export_mlx(synthetic, tmp_path / "mlx")))
    cast_floating(exported, mx.float32)
    assert mx.array_equal(exported(PROMPT), expected).item()


def test_budget_for_gives_the_asked_capacity(synthetic):
    budget = budget_for(synthetic, 5, context=64)
    model, _ = moestream.load(
        synthetic, memory_budget=budget, cache_experts=5, context=64
    )
    plan = moestream.runtime_of(model).plan
    assert plan.capacity == 5 and plan.total <= plan.budget == budget
    tight = plan.total - (4 << 20)  # the process's RSS drifts between loads
    with pytest.raises(ValueError, match="more than --memory-budget"):
        moestream.load(synthetic, memory_budget=tight, cache_experts=5, context=64)


def brute_force_optimum(trace: np.ndarray, capacity: int) -> int:
    """Most hits any eviction choice achieves (tiny traces only)."""
    steps = [frozenset(r.tolist()) for r in trace]
    best = {frozenset(): 0}
    for wanted in steps:
        nxt: dict[frozenset, int] = {}
        for cache, hits in best.items():
            h = hits + len(wanted & cache)
            union = cache | wanted
            others = sorted(union - wanted)
            keep = capacity - len(wanted)
            for kept in itertools.combinations(others, min(keep, len(others))):
                state = frozenset(kept) | wanted
                nxt[state] = max(nxt.get(state, -1), h)
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_optimal_and_bounds_every_policy(seed):
    rng = np.random.default_rng(seed)
    trace = rng.integers(0, 6, (12, 2))
    trace[:, 1] = (trace[:, 0] + 1 + rng.integers(0, 5, 12)) % 6  # distinct pairs
    optimum = brute_force_optimum(trace, 3)
    assert belady_hits(trace, 3) == optimum
    for policy in ("lru", "lrfu"):
        assert policy_hits(trace, 3, policy, 6) <= optimum


def test_replay_of_a_repeating_trace():
    # A cycle of 3 experts through 2 slots: LRU never hits, Belady hits half.
    trace = np.array([[0], [1], [2]] * 6)
    rates = replay_all({0: trace}, 2, "lru")
    assert rates["lru"] == 0.0
    assert rates["belady"] == pytest.approx(8 / 18)


def test_capacity_for_budget_rows():
    assert capacity_for(25, 64, 8) == 16
    assert capacity_for(10, 64, 8) == 8  # never below top-k
    assert capacity_for(100, 64, 8) == 64


COMPARE = "policy=lru,prefetch_extra=4"


def test_bench_rows_cover_budgets_modes_and_variants(synthetic):
    """The table's rows, without running them: resident, each budget in each
    mode for the base options and each --compare variant, the no-verify row."""
    cfg = BenchConfig(
        synthetic,
        budgets=(50, 12.5),
        compare=(("policy=lru", {"policy": "lru"}),),
    )
    rows = plan_rows(cfg)
    assert [(r.name, r.mode, r.variant) for r in rows] == [
        ("resident", "-", ""),
        ("50 %", "warm", ""),
        ("50 % policy=lru", "warm", "policy=lru"),
        ("50 %", "cold", ""),
        ("50 % policy=lru", "cold", "policy=lru"),
        ("12.5 %", "warm", ""),
        ("12.5 % policy=lru", "warm", "policy=lru"),
        ("12.5 %", "cold", ""),
        ("12.5 % policy=lru", "cold", "policy=lru"),
        ("25 % no-verify", "cold", ""),
    ]
    assert rows[0].job.capacity is None  # mlx-lm's resident model
    assert [r.job.capacity for r in rows[1:5]] == [4] * 4  # 50 % of 8
    assert [r.job.capacity for r in rows[5:9]] == [2] * 4  # never below top-k
    assert [r.job.cold for r in rows[1:]] == [False, False, True, True] * 2 + [True]
    assert {r.job.runtime.tuning.policy for r in rows if r.variant} == {"lru"}
    assert {r.job.runtime.tuning.policy for r in rows if not r.variant} == {"lrfu"}
    assert rows[-1].job.runtime.verify is False
    warm_only = plan_rows(replace(cfg, modes=("warm",)))
    assert [r.mode for r in warm_only] == ["-"] + ["warm"] * 4  # no no-verify row
    assert plan_rows(replace(cfg, verify_cost=False)) == rows[:-1]


def test_bench_cli_prints_ratio_table(synthetic, tmp_path):
    """End to end, every run a fresh process; cold runs only, without the
    no-verify row (a warm run is a cold one with a warm-up instead of the
    page-cache drops, the no-verify row a run with verify=False; the rows are
    checked above). The resident row warms up, the streaming ones do not: their
    tokens still match."""
    figure = tmp_path / "bench.png"
    r = CliRunner().invoke(
        moestream_cli,
        [
            "bench",
            str(synthetic),
            "--budgets",
            "50",
            "--modes",
            "cold",
            "--no-verify-cost",
            "--tokens",
            "3",
            "--prompt-tokens",
            "0",
            "--repeats",
            "1",
            "--compare",
            COMPARE,
            "--json",
            "--plot",
            str(figure),
        ],
    )
    assert r.exit_code == 0, r.output
    assert figure.read_bytes()[:4] == b"\x89PNG"
    result = json.loads(r.stdout[r.stdout.index("{") :])
    rows = {(x["row"], x["mode"]): x for x in result["rows"]}
    assert set(rows) == {
        ("resident", "-"),
        ("50 %", "cold"),
        (f"50 % {COMPARE}", "cold"),
    }
    for row in rows.values():
        assert row["tokens_match"]  # exact output in every run
        assert row["decode_tps"] > 0
        assert len(row["decode_ratios"]) == 1
    cold = rows[("50 %", "cold")]
    assert cold["variant"] == ""
    variant = rows[(f"50 % {COMPARE}", "cold")]
    assert variant["variant"] == COMPARE
    assert variant["policy"] == variant["lru"]  # its replay is of its own policy
    assert cold["capacity"] == 4 and cold["peak_over_budget"] > 0
    assert cold["belady"] >= cold["policy"] - 1e-9 and cold["belady"] >= cold["lru"]
    assert result["disk_gbps"]["qd1"] > 0


def test_bench_refuses_bad_compare(synthetic):
    bench = ["bench", str(synthetic), "--compare"]
    r = CliRunner().invoke(moestream_cli, [*bench, "policy"])
    assert r.exit_code == 2 and "FIELD=VALUE" in r.output
    r = CliRunner().invoke(moestream_cli, [*bench, "policy=mru"])
    assert r.exit_code == 2 and "Unknown cache policy 'mru'" in r.output
    r = CliRunner().invoke(moestream_cli, [*bench, "cache_experts=3"])
    assert r.exit_code == 2 and "sets cache_experts per run" in r.output


def test_bench_refuses_bad_budgets(synthetic):
    r = CliRunner().invoke(moestream_cli, ["bench", str(synthetic), "--budgets", "x"])
    assert r.exit_code != 0 and "100,25,12.5" in r.output
    r = CliRunner().invoke(moestream_cli, ["bench", str(synthetic), "--budgets", "0"])
    assert r.exit_code == 2 and "percentages" in r.output


def test_bench_prompt_is_the_packaged_text(converted):
    """The decode prompt is a fixed file, not the source of the hot path."""
    from importlib import resources

    from mlx_lm.utils import load_tokenizer

    from moestream.bench.worker import prompt_ids

    tok = load_tokenizer(converted)
    text = resources.files("moestream.bench").joinpath("prompt.txt").read_text()
    ids = prompt_ids(tok, 16)
    assert len(ids) == 16 and ids == tok.encode(text[:200])[:16]
    long = prompt_ids(tok, 5000)  # longer than the text: repeated
    assert len(long) == 5000 and long[:16] == ids


def test_bench_group_runs_replay_and_keeps_bench_out(converted: Path, tmp_path: Path):
    """`moestream bench replay` prints each policy's hit rate and Belady's,
    which no policy beats; `bench OUT` still means `bench run OUT`."""
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    r = CliRunner().invoke(
        moestream_cli,
        [
            "bench",
            "replay",
            str(converted),
            str(text),
            "--tokens",
            "64",
            "--slots",
            "3,5",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("| 3 |")]
    (row,) = rows
    rates = [float(x) for x in row.strip("| ").split(" | ")[1:]]
    assert all(0 < x <= rates[-1] for x in rates[:-1])  # Belady is the bound
    r = CliRunner().invoke(moestream_cli, ["bench", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "bench run" in r.output


def test_x_full_divides_by_the_same_variants_full_row():
    """A GPU row's yardstick: our own 100 % slots of the same variant and mode."""
    from moestream.bench.harness import Row, x_full
    from moestream.bench.worker import Job

    def row(pct, variant, mode, *tps):
        r = Row(f"{pct} % {variant}", pct, mode, Job("m", 1), variant=variant)
        r.decode = [{"decode_tps": t} for t in tps]
        return r

    rows = [
        row(None, "", "-", 50.0),
        row(100, "", "warm", 100.0, 140.0, 120.0),
        row(100, "tier", "warm", 80.0),
        row(25, "", "warm", 60.0),
        row(25, "tier", "warm", 40.0),
        row(25, "", "cold", 30.0),
    ]
    assert x_full(rows, rows[3]) == 60.0 / 120.0  # the median of the 100 % row
    assert x_full(rows, rows[4]) == 40.0 / 80.0
    assert x_full(rows, rows[5]) is None  # no cold 100 % row in this run


def test_a_worker_killed_by_a_signal_is_named_with_its_python_frame():
    """A worker that dies of a signal (a crash, the OOM killer) says so in
    one line, with the frame faulthandler wrote; an error exit gives its last
    line."""
    from moestream.bench.harness import worker_failure

    stack = (
        "Fatal Python error: Segmentation fault\n\n"
        "Current thread 0x01 (most recent call first):\n"
        '  File "/w/gen.py", line 3 in step\n  File "/w/run.py", line 9 in main\n'
    )
    line = worker_failure(-11, stack)
    assert "SIGSEGV" in line and 'File "/w/gen.py", line 3 in step' in line
    assert "run the bench again" in line and "\n" not in line
    assert "SIGKILL" in worker_failure(-9, "")
    assert worker_failure(1, "Traceback\nValueError: bad\n").endswith("ValueError: bad")
    assert worker_failure(1, "").endswith("(no output)")
