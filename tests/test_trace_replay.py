"""Routing traces forced into a bench model (bench --trace) and replayed
against cache policies (bench trace)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.bench.beyond import BeyondConfig, compute_job
from moestream.bench.harness import BenchConfig, plan_rows
from moestream.bench.models import Scale, write_synthetic
from moestream.bench.replay import belady_hits, policy_hits, policy_step_hits
from moestream.bench.routes import (
    force_routes,
    load_trace,
    locality,
    policy_curves,
    write_trace,
)
from moestream.bench.worker import Job, run
from moestream.cli import main as moestream_cli
from moestream.runtime import config_from, native

TINY = Scale(3, 8, 2, 128, 64, heads=4, kv_heads=2, head_dim=32, vocab=512)
ENGINES = ["python", "native"] if native.available() else ["python"]


def random_trace(layers: int, tokens: int, k: int, experts: int, seed: int = 0):
    """Ids with some locality: each token keeps one expert of the last."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((layers, tokens, k), np.int64)
    for layer in range(layers):
        row = rng.choice(experts, k, replace=False)
        for t in range(tokens):
            fresh = [e for e in rng.permutation(experts) if e != row[0]]
            row = np.array([row[0], *fresh[: k - 1]])
            ids[layer, t] = rng.permutation(row)
    return ids


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trace") / "tiny"
    write_synthetic(out, TINY)
    return out


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "routing.npz"
    ids = random_trace(2, 24, 2, 8)
    write_trace(path, ids, [0, 12], {"geometry": {"num_experts": 8}})
    return path


def decode_one_token_at_a_time(model, steps: int) -> None:
    cache = make_prompt_cache(model)
    for t in range(steps):
        mx.eval(model(mx.array([[1 + t]]), cache=cache))


@pytest.mark.parametrize("engine", ENGINES)
def test_forced_routes_are_what_the_engine_routes_and_hits_match_slot_pool(
    synthetic, trace_file, engine
):
    """Each layer's recorded routing is its trace layer's (l mod 2, wrapping
    past the trace's end), and the engine's hits per call are the SlotPool
    replay's for the same policy and capacity."""
    trace = load_trace(trace_file)
    cap, steps = 3, 30  # past the 24 trace tokens: wraps around
    for policy in ("lru", "lrfu"):
        model, _ = moestream.load(
            synthetic,
            cache_experts=cap,
            record_trace=True,
            engine=engine,
            policy=policy,
            prefetch=False,
        )
        assert len(force_routes(model, trace)) == TINY.layers
        decode_one_token_at_a_time(model, steps)
        stats = moestream.runtime_of(model).stats
        routing = stats.routing()
        assert len(routing) == TINY.layers
        for i, layer in enumerate(sorted(routing)):
            want = np.take(trace.ids[i % 2], range(steps), axis=0, mode="wrap")
            got = routing[layer]
            assert np.array_equal(np.sort(got, -1), np.sort(want, -1))
            hits = [e["hits"] for e in stats.events if e["layer"] == layer]
            replay = policy_step_hits(want.astype(np.int64), cap, policy, TINY.experts)
            assert hits == replay.tolist(), (policy, layer)


def test_a_rewound_trace_routes_from_its_first_token_again(synthetic, trace_file):
    """What the bench's warm runs do after their warm-up: the timed run routes
    as the trace's first tokens, as a run without the warm-up would."""
    from moestream.bench.routes import rewind_routes

    trace = load_trace(trace_file)

    def routing(warm_up: int) -> dict:
        model, _ = moestream.load(
            synthetic, cache_experts=3, record_trace=True, prefetch=False
        )
        force_routes(model, trace)
        decode_one_token_at_a_time(model, warm_up)
        rewind_routes(model)
        stats = moestream.runtime_of(model).stats
        stats.reset()
        decode_one_token_at_a_time(model, 5)
        return {k: np.sort(v, -1) for k, v in stats.routing().items()}

    fresh, warmed = routing(0), routing(7)
    assert fresh.keys() == warmed.keys()
    for i, layer in enumerate(sorted(fresh)):
        assert np.array_equal(fresh[layer], warmed[layer])
        want = np.sort(trace.ids[i % trace.layers][:5], -1)
        assert np.array_equal(fresh[layer], want)


def test_forcing_refuses_a_model_of_another_geometry(synthetic, tmp_path):
    path = tmp_path / "top3.npz"
    write_trace(path, random_trace(1, 4, 3, 8))
    model, _ = moestream.load(synthetic, cache_experts=4)
    with pytest.raises(ValueError, match="top-3 of 8 experts; the model's layers"):
        force_routes(model, load_trace(path))
    wide = tmp_path / "wide.npz"
    write_trace(wide, random_trace(1, 4, 2, 8), meta={"geometry": {"num_experts": 16}})
    with pytest.raises(ValueError, match="top-2 of 16 experts"):
        plan_rows(BenchConfig(synthetic, trace=wide))


def oracle_trace(path: Path, shift: int) -> None:
    """A 3-layer trace whose `ahead` predicts layer j+1 at layer j: its real
    ids (shift 0), or those of the token `shift` later (misaligned), then two
    experts it does not route to."""
    ids = random_trace(3, 40, 2, 8, seed=3)
    ahead = np.zeros((2, 40, 4), np.int64)
    for j in range(2):
        for t in range(40):
            row = ids[j + 1, (t + shift) % 40]
            ahead[j, t] = [*row, *[e for e in range(8) if e not in row][:2]]
    write_trace(path, ids, meta={"geometry": {"num_experts": 8}}, ahead=ahead)


@pytest.mark.skipif(not native.available(), reason="native engine not built")
def test_forced_predictions_drive_prefetch_token_by_token(synthetic, tmp_path):
    """With a trace's `ahead`, layer j's prefetch at token t hints what the trace
    recorded for layer j+1 at t: every record hinted before a call is one of
    its token's predictions, so with predictions that are the next layer's
    routes each is routed; with those of the next token, some are not."""
    routed = {}
    for shift in (0, 1):
        path = tmp_path / f"ahead{shift}.npz"
        oracle_trace(path, shift)
        trace = load_trace(path)
        model, _ = moestream.load(
            synthetic, cache_experts=3, prefetch=True, record_trace=True
        )
        force_routes(model, trace, prefetch_extra=0)
        decode_one_token_at_a_time(model, 30)
        s = moestream.stats(model)
        layers = sorted({e["layer"] for e in s.events})
        hinted, used = 0, True
        for e in s.events:
            j, t = layers.index(e["layer"]), e["step"] % 40
            got = set(e["prefetched"])
            if j == 0:
                assert not got  # nothing predicts the first layer
                continue
            hinted += len(got)
            assert got <= set(trace.ahead[j - 1][t][:2].tolist())
            used &= got <= set(trace.ids[j][t].tolist())
        assert hinted > 20
        routed[shift] = used
    assert routed == {0: True, 1: False}


def test_trace_predictions_are_checked_against_prefetch_extra(synthetic, tmp_path):
    path = tmp_path / "ahead.npz"
    oracle_trace(path, 0)  # 4 predictions a token: top-2 + at most 2
    on = config_from(prefetch=True, prefetch_extra=2)
    assert plan_rows(BenchConfig(synthetic, budgets=(50,), trace=path, runtime=on))
    with pytest.raises(ValueError, match="use prefetch_extra <= 2"):
        plan_rows(
            BenchConfig(synthetic, trace=path, runtime=config_from(prefetch_extra=3))
        )
    model, _ = moestream.load(synthetic, cache_experts=3, prefetch=True)
    with pytest.raises(ValueError, match="records 4: use prefetch_extra <= 2"):
        force_routes(model, load_trace(path), prefetch_extra=3)


def test_bench_rows_carry_the_trace_and_refuse_prefetch(synthetic, trace_file):
    rows = plan_rows(BenchConfig(synthetic, budgets=(50,), trace=trace_file))
    assert {r.job.trace for r in rows} == {str(trace_file)}
    with pytest.raises(ValueError, match="leave --prefetch unset"):
        BenchConfig(synthetic, trace=trace_file, runtime=config_from(prefetch=True))


def test_a_bench_run_under_a_trace_reports_its_replays(synthetic, trace_file):
    """One streaming run and one resident run in this process: the same tokens
    (forcing changes the routes of both alike), and the run's Belady replay is
    of the trace's routes."""
    job = Job(
        str(synthetic), 3, prompt_tokens=8, decode_tokens=6, trace=str(trace_file)
    )
    streamed = run(job)
    resident = run(
        Job(
            str(synthetic),
            None,
            prompt_tokens=8,
            decode_tokens=6,
            trace=str(trace_file),
        )
    )
    assert streamed["tokens"] == resident["tokens"]
    trace = load_trace(trace_file)
    decoded = [
        np.take(trace.ids[i % 2], range(9, 15), axis=0, mode="wrap") for i in range(3)
    ]
    total = sum(len(d) * 2 for d in decoded)
    belady = sum(belady_hits(d.astype(np.int64), 3) for d in decoded) / total
    assert streamed["replay"]["belady"] == pytest.approx(belady)
    assert 0 < streamed["hit_rate"] <= 1  # slots warm from the prompt, not replayed


def test_policy_curves_and_locality_of_a_small_trace(trace_file):
    trace = load_trace(trace_file)
    curves = policy_curves(trace, [2, 4, 8])
    for cap, rates in curves.items():
        assert rates["belady"] >= max(rates["lru"], rates["lrfu"]) - 1e-9
        seqs = [(layer, s) for layer in range(2) for s in trace.sequences(layer)]
        lru = sum(policy_hits(s, cap, "lru", 8) for _, s in seqs) / (2 * 24 * 2)
        assert rates["lru"] == pytest.approx(lru)
    assert curves[8]["belady"] == pytest.approx(curves[8]["lru"])  # all fit
    loc = locality(trace)
    # each token keeps one of its 2 experts: at least half are reused
    assert loc["p_reuse_next"] >= 0.5 and loc["uniform_p_reuse_next"] == 0.25
    assert 0.25 <= loc["top25_share"] <= 1


def test_trace_command_prints_the_curves(trace_file):
    r = CliRunner().invoke(
        moestream_cli, ["bench", "trace", str(trace_file), "--capacities", "25,50"]
    )
    assert r.exit_code == 0, r.output
    assert "2 layers x 24 tokens (2 sequences), top-2 of 8 experts" in r.output
    assert "| 25 | 2 | 1 |" in r.output and "| 50 | 4 | 2 |" in r.output
    r = CliRunner().invoke(moestream_cli, ["bench", "trace", str(trace_file), "--json"])
    assert json.loads(r.output)["num_experts"] == 8


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        (None, "is not a routing trace (.npz)"),
        ({"other": np.zeros(3)}, "it needs `ids`"),
        ({"ids": np.zeros((4, 2), np.uint8)}, "it needs `ids`"),
        ({"ids": np.array([[[1, 1]]], np.uint8)}, "same expert twice"),
        (
            {
                "ids": np.array([[[0, 9]]]),
                "meta": np.array('{"geometry": {"num_experts": 8}}'),
            },
            "0..7",
        ),
        ({"ids": np.array([[[0, 1]]]), "seq_starts": np.array([1])}, "rise from 0"),
        ({"ids": np.array([[[0, 1]]]), "meta": np.array("[1")}, "not a JSON string"),
        (
            {"ids": np.zeros((2, 3, 1), np.uint8), "ahead": np.zeros((2, 3, 4))},
            "`ahead` must be integer",
        ),
        (
            {"ids": np.zeros((2, 3, 1), np.uint8), "ahead": np.full((1, 3, 2), 9)},
            "`ahead` ids must lie in 0..0",
        ),
    ],
)
def test_bad_trace_files_give_one_line(tmp_path, arrays, message):
    path = tmp_path / "bad.npz"
    if arrays is None:
        path.write_text("not a zip")
    else:
        np.savez(path, **arrays)
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        load_trace(path)
    r = CliRunner().invoke(moestream_cli, ["bench", "trace", str(path)])
    assert r.exit_code == 2 and r.output.startswith("error: ")
    assert r.output.count("\n") == 1


def test_replay_saves_the_routing_it_records_as_a_trace(converted, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    saved = tmp_path / "fixture.npz"
    args = ["--tokens", "48", "--slots", "3", "--save-trace", str(saved)]
    r = CliRunner().invoke(
        moestream_cli, ["bench", "replay", str(converted), str(text), *args]
    )
    assert r.exit_code == 0, r.output
    assert r.output.startswith("48 tokens")
    trace = load_trace(saved)
    config = json.loads((converted / "config.json").read_text())
    assert trace.ids.shape[1:] == (48, config["num_experts_per_tok"])
    assert trace.num_experts == config["num_experts"]


def test_the_compute_row_of_a_model_larger_than_ram_decodes_from_slots(
    synthetic, tmp_path
):
    """beyond-ram --compute-experts N: each layer's first N experts in slots,
    every token routed uniformly among them, so decode reads nothing and its
    time is the compute of the same arithmetic a token of any routing does."""
    cfg = BeyondConfig(
        out=synthetic, gguf=None, exe=None, decode_tokens=6, compute_experts=3
    )
    job = compute_job(cfg, tmp_path)
    trace = load_trace(job.trace)
    assert job.capacity == 3 and not trace.predicts
    assert set(np.unique(trace.ids)) == {0, 1, 2}
    assert trace.tokens > job.prompt_tokens + job.decode_tokens
    r = run(job)
    assert r["hit_rate"] == 1.0 and r["fill_bytes_per_token"] == 0
    with pytest.raises(ValueError, match="--compute-experts 1: give 2"):
        compute_job(BeyondConfig(synthetic, None, None, compute_experts=1), tmp_path)
