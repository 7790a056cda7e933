"""info, plan, eval, plot, run-moe's mlx_lm.generate flags, traces, options."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import shutil
import sys
from dataclasses import fields
from pathlib import Path

import click
import mlx.core as mx
import pytest
from click.testing import CliRunner
from mlx_lm.generate import generate_step
from mlx_lm.perplexity import eval_ppl
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import compute_bits_per_weight, load_tokenizer

import moestream
import moestream.plan
from moestream.cli import main as cli
from moestream.cli.run import main as run_main
from moestream.evaluate import evaluate, sequences
from moestream.generate import encode_prompt
from moestream.options import engine_options, field_help
from moestream.reference import resident_from_converted
from moestream.runtime import RuntimeConfig, Tuning, loader, memory, native
from moestream.trace import read_trace

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 12


def invoke(command, args: list[str]):
    return CliRunner().invoke(command, [str(a) for a in args], catch_exceptions=False)


def last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def run_json(converted: Path, *args) -> dict:
    r = invoke(
        run_main,
        [
            converted,
            "-p",
            "def add",
            "-m",
            10,
            "--ignore-chat-template",
            "--json",
            *args,
        ],
    )
    assert r.exit_code == 0, r.output
    return last_json(r.output)


def resident_tokens(reference, prompt: list[int], n: int, **kw) -> list[int]:
    out = [t for t, _ in generate_step(mx.array(prompt), reference, max_tokens=n, **kw)]
    return out[: out.index(0)] if 0 in out else out  # eos ends generation


# ------------------------------------------------------------------ options


def test_every_engine_field_is_one_flag_with_help() -> None:
    @click.command()
    @engine_options()
    def cmd(engine: dict) -> None:
        click.echo(json.dumps(engine))

    user = [f.name for f in fields(RuntimeConfig) if f.name != "tuning"]
    names = {p.name for p in cmd.params}
    assert names == {*user, "tuning_settings"}
    for name in user:
        assert len(field_help(name)) > 10
    sets = ["prefetch=off", "policy=lru", "prefetch-extra=4", "readers=3"]
    r = invoke(cmd, ["--backend", "slots", *(a for s in sets for a in ("--set", s))])
    got = json.loads(r.output)
    assert got["backend"] == "slots"
    want = {"prefetch": False, "policy": "lru", "prefetch_extra": 4}
    assert got["tuning"] == {**want, "readers": 3}
    assert RuntimeConfig(**got).tuning == Tuning(**want, readers=3)
    bad = CliRunner().invoke(cmd, ["--backend", "fifo"])
    assert bad.exit_code == 2 and "fifo" in bad.output
    fifo = json.loads(invoke(cmd, ["--set", "policy=fifo"]).output)
    with pytest.raises(ValueError, match="Unknown cache policy 'fifo'"):
        RuntimeConfig(**fifo)  # where the command builds its config


@pytest.mark.parametrize(
    "args",
    [
        ["run"],
        ["convert"],
        ["bench"],
        ["verify"],
        ["info"],
        ["plan"],
        ["eval"],
        ["plot"],
        ["serve"],
        ["chat"],
        [],
    ],
)
def test_version_on_every_command(args: list[str]) -> None:
    r = invoke(cli, [*args, "--version"])
    assert r.exit_code == 0 and moestream.__version__ in r.output


@pytest.mark.parametrize("flags", [["-v"], ["-vv"], []])
def test_log_level_and_v_reach_logging(converted: Path, flags) -> None:
    r = invoke(run_main, [converted, "-p", "x", "-m", 2, "--cache-experts", 3, *flags])
    assert r.exit_code == 0, r.output
    logged = "INFO moestream.runtime.loader: memory plan:" in r.output
    assert logged == bool(flags)


# ------------------------------------------------------------------ run-moe


def test_sampling_flags_match_mlx_lm(converted: Path, hf_dir: Path, recipe) -> None:
    from moestream.reference import resident_model

    out = run_json(
        converted,
        *("--temp", 0.8, "--top-p", 0.9, "--seed", 7),
        *("--cache-experts", 3),
    )
    tok = load_tokenizer(converted)
    mx.random.seed(7)  # before the model is built, as run-moe and mlx-lm seed
    reference = resident_model(hf_dir, recipe)
    sampler = make_sampler(0.8, 0.9)
    want = resident_tokens(reference, tok.encode("def add"), 10, sampler=sampler)
    assert out["tokens"] == want


@pytest.mark.parametrize(
    "flags, kv",
    [
        (["--max-kv-size", 6], {"max_kv_size": 6}),
        (["--kv-bits", 4], {"kv_bits": 4}),
    ],
)
def test_kv_flags_match_mlx_lm(converted: Path, reference, flags, kv) -> None:
    out = run_json(converted, *flags, "--cache-experts", 3)
    tok = load_tokenizer(converted)
    assert out["tokens"] == resident_tokens(reference, tok.encode("def add"), 10, **kv)
    both = CliRunner().invoke(
        run_main, [str(converted), "-p", "x", "--kv-bits", "4", "--max-kv-size", "8"]
    )
    assert both.exit_code == 2 and "cannot be used together" in both.output


def test_system_prompt_encodes_as_mlx_lm(converted: Path) -> None:
    tok = load_tokenizer(converted)
    messages = [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "hello"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = encode_prompt(tok, "hello", False, system_prompt="be short")
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids != encode_prompt(tok, "hello", False)


def test_saved_prompt_cache_continues_exactly(
    converted: Path, reference, tmp_path: Path
) -> None:
    cache = tmp_path / "prefix.safetensors"
    r = invoke(
        run_main,
        [
            converted,
            "-p",
            "def add",
            "--ignore-chat-template",
            "--save-prompt-cache",
            cache,
        ],
    )
    assert r.exit_code == 0, r.output
    assert cache.is_file() and "saved the KV cache of 3 prompt tokens" in r.output
    out = run_json(converted, "--prompt-cache-file", cache, "--cache-experts", 3)
    tok = load_tokenizer(converted)
    # run_json's prompt "def add" continues the cached "def add"
    ids = tok.encode("def add") + tok.encode("def add", add_special_tokens=False)
    assert out["tokens"] == resident_tokens(reference, ids, 10)
    moved = shutil.copytree(converted, tmp_path / "moved")
    r = CliRunner().invoke(
        run_main, [str(moved), "-p", "x", "--prompt-cache-file", str(cache)]
    )
    assert r.exit_code == 2 and "was saved for" in r.output
    bad = CliRunner().invoke(
        run_main, [str(converted), "-p", "x", "--save-prompt-cache", "c.bin"]
    )
    assert bad.exit_code == 2 and ".safetensors" in bad.output


def test_draft_model_keeps_greedy_output(converted: Path, reference) -> None:
    plain = run_json(converted, "--cache-experts", 3)
    drafted = run_json(
        converted,
        "--cache-experts",
        3,
        "--draft-model",
        converted,
    )
    assert drafted["tokens"] == plain["tokens"]
    tok = load_tokenizer(converted)
    assert plain["tokens"] == resident_tokens(reference, tok.encode("def add"), 10)
    r = CliRunner().invoke(
        run_main, [str(converted), "-p", "x", "--draft-model", "./no/such/draft"]
    )
    assert r.exit_code == 2 and "is not a directory" in r.output


def test_stats_prints_as_mlx_lm_verbose(converted: Path) -> None:
    r = invoke(run_main, [converted, "-p", "def", "-m", 4, "--stats"])
    assert r.exit_code == 0, r.output
    assert re.search(r"^backend (cpu-slots|cpu-mapped|python), ", r.output, re.M)
    assert "==========\n" in r.output
    assert re.search(r"Prompt: \d+ tokens, [\d.]+ tokens-per-sec", r.output)
    assert re.search(r"Generation: \d+ tokens, [\d.]+ tokens-per-sec", r.output)
    assert "Peak memory:" in r.output


# ------------------------------------------------------------------ traces, plots


@pytest.fixture(
    scope="module", params=["python"] + (["native"] if native.available() else [])
)
def traced(converted: Path, tmp_path_factory: pytest.TempPathFactory, request):
    path = tmp_path_factory.mktemp("trace") / "run.jsonl"
    engine = ["--set", f"engine={request.param}"]
    out = run_json(converted, "--cache-experts", 3, *engine, "--trace", path)
    return path, out


def test_trace_holds_every_layer_call(traced) -> None:
    path, out = traced
    trace = read_trace(path)
    assert trace.meta["capacity"] == 3 and trace.meta["num_experts"] == 8
    assert trace.layers() == [0, 2]  # layer 1 is dense (conftest)
    s, events = out["stats"], trace.events
    assert sum(e["hits"] for e in events) == s["hits"]
    assert sum(e["misses"] for e in events) == s["misses"]
    assert sum(e["bytes_read"] for e in events) == s["bytes_read"] > 0
    calls = [[e["step"] for e in events if e["layer"] == x] for x in trace.layers()]
    assert calls[0] == list(range(len(calls[0]))) and calls[0] == calls[1]
    for e in events:
        assert len(e["experts"]) == e["tokens"] * trace.meta["top_k"]
        assert min(e["experts"]) >= 0 and max(e["experts"]) < 8
        assert e["hits"] + e["misses"] == len(set(e["experts"]))
    assert sum(len(e["prefetched"]) for e in events) == s["prefetched"]


def test_plot_draws_a_trace(traced, tmp_path: Path) -> None:
    from moestream.bench.plot import per_token
    from moestream.bench.replay import belady_hits, policy_hits

    path, _ = traced
    trace = read_trace(path)
    curves = per_token(trace)
    decode = [e for e in trace.events if e["tokens"] == 1]
    steps = sorted({e["step"] for e in decode})
    assert curves["step"].tolist() == steps
    for i, step in enumerate(steps):
        mine = [e for e in decode if e["step"] == step]
        hits = sum(e["hits"] for e in mine)
        assert curves["hit_rate"][i] == hits / sum(len(set(e["experts"])) for e in mine)
        assert curves["mb"][i] == pytest.approx(
            sum(e["bytes_read"] for e in mine) / 1e6
        )
    assert (curves["belady"] >= 0).all() and (curves["belady"] <= 1).all()
    for layer in trace.layers():
        routing = trace.routing(layer)
        assert belady_hits(routing, 3) >= policy_hits(routing, 3, "lru", 8)
    out = tmp_path / "fig.png"
    r = invoke(cli, ["plot", path, "-o", out])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20000


def test_plot_refuses_a_non_trace_and_missing_matplotlib(
    tmp_path: Path, traced, monkeypatch
) -> None:
    bad = tmp_path / "x.jsonl"
    bad.write_text('{"a": 1}\n')
    r = CliRunner().invoke(cli, ["plot", str(bad), "-o", str(tmp_path / "f.png")])
    assert r.exit_code == 2 and "not a moestream trace" in r.output
    bad.write_bytes(b"\x89PNG\r\n")
    r = CliRunner().invoke(cli, ["plot", str(bad), "-o", str(tmp_path / "f.png")])
    assert r.exit_code == 2 and "not a moestream trace" in r.output
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = CliRunner().invoke(cli, ["plot", str(traced[0]), "-o", str(tmp_path / "f.png")])
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: Plotting needs matplotlib: pip install 'moestream[plot]'."
    )
    assert not (tmp_path / "f.png").exists()


# ------------------------------------------------------------------ info


def test_info_reports_bits_as_mlx_lm(converted: Path) -> None:
    r = invoke(cli, ["info", converted, "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    resident = resident_from_converted(converted, dtype="bfloat16")  # as stored
    assert math.isclose(info["bits_per_weight"], compute_bits_per_weight(resident))
    assert info["family"] == "qwen3_moe" and info["top_k"] == 2
    assert info["experts"] == [8] and info["version"] == 1
    assert info["created_by"].startswith("moestream")
    # conftest's recipe: gate 4, up 3, down 6 except layer 2 at 8 (bf16 scales
    # and biases: 0.5 bit per weight on top); layer 1 is dense
    runs = [
        (r["layers"], {p: q["bits"] for p, q in r["projections"].items()})
        for r in info["expert_quantization"]
    ]
    assert runs == [
        ([0, 0], {"down_proj": 6, "gate_proj": 4, "up_proj": 3}),
        ([2, 2], {"down_proj": 8, "gate_proj": 4, "up_proj": 3}),
    ]
    assert info["expert_bits_per_weight"] == pytest.approx((14.5 + 16.5) / 6)
    text = invoke(cli, ["info", converted]).output
    assert "layer 0: down_proj 6-bit g64" in text and "layer 2: down_proj 8-bit" in text


def test_info_missing_dir_one_line(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["info", str(tmp_path / "none")])
    assert r.exit_code == 2 and r.output.count("\n") == 1


# ------------------------------------------------------------------ plan


PLAN_FIELDS = (
    "dense",
    "kv_cache",
    "activations",
    "staging",
    "slot_bytes",
    "capacity",
    "concurrency",
)


@pytest.mark.parametrize(
    "flags, options",
    [
        (["--cache-experts", "3"], {"cache_experts": 3}),
        (["--memory-budget", "600M"], {"memory_budget": "600M"}),
        (
            ["--cache-experts", "5", "--set", "prefetch=off", "--context", "300"],
            {"cache_experts": 5, "prefetch": False, "context": 300},
        ),
        (
            ["--concurrency", "3", "--cache-experts", "6"],
            {"concurrency": 3, "cache_experts": 6},
        ),
        pytest.param(
            ["--cache-experts", "3", "--set", "engine=native"],
            {"cache_experts": 3, "engine": "native"},
            marks=pytest.mark.skipif(
                not native.available(), reason="the native engine is not built"
            ),
            id="native",
        ),
    ],
)
def test_plan_is_the_plan_load_makes(converted: Path, flags, options) -> None:
    r = invoke(cli, ["plan", converted, "--no-forecast", "--json", *flags])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)["plan"]
    # plan sizes run-moe's context (test_plan_sizes_the_context_as_run_moe)
    model, _ = moestream.load(converted, **{"context": plan["context"], **options})
    loaded = moestream.runtime_of(model).plan
    for name in PLAN_FIELDS:
        assert plan[name] == getattr(loaded, name), name
    assert plan["total"] == plan["process"] + sum(
        plan[k]
        for k in ("dense", "kv_cache", "activations", "staging", "reserve", "pools")
    )
    assert plan["residency"] == plan["capacity"] / plan["num_experts"]
    assert plan["host_tier"] == loaded.host_tier
    assert loaded.host_tier == 0  # a GPU's
    execution = moestream.runtime_of(model).execution
    assert plan["execution"] == execution.as_dict()
    text = invoke(cli, ["plan", converted, "--no-forecast", *flags]).output
    assert "host tier" not in text
    assert text.splitlines()[1].strip() == execution.describe()


def test_default_budget_is_what_the_model_needs(converted: Path, monkeypatch) -> None:
    plan = moestream.runtime_of(moestream.load(converted)[0]).plan
    assert plan.capacity == plan.num_experts == 8
    assert plan.total <= plan.budget < plan.total + (1 << 20)
    assert plan.reserve == loader.RESERVE_BYTES + int(0.03 * plan.budget)
    need = 100 << 20
    monkeypatch.setattr(memory, "available_memory", lambda: 10 << 30)
    assert memory.default_budget(need, 50 << 20) == memory._budget_holding(need)
    monkeypatch.setattr(memory, "available_memory", lambda: 40 << 20)
    assert memory.default_budget(need, 50 << 20) == int(0.8 * (90 << 20))


def test_plan_forecast_from_probes(converted: Path, monkeypatch) -> None:
    r = invoke(cli, ["plan", converted, "--cache-experts", 4, "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    probe, rows = result["probe"], result["forecast"]
    assert probe["token_s"] > 0 and probe["miss_s"] >= 0
    assert probe["disk_parallel_gbps"] > 0 and probe["page_cache_gbps"] > 0
    assert [f["hit_rate"] for f in rows] == [0.5, 0.75, 0.9, 0.95]
    for f in rows:  # 2 MoE layers, top-2
        assert f["misses_per_token"] == pytest.approx((1 - f["hit_rate"]) * 2 * 2)
        assert 0 < f["cold_tps"] <= f["warm_tps"] <= 1 / probe["token_s"]
    assert rows[0]["warm_tps"] < rows[-1]["warm_tps"]
    # The next two forecast from the probe just measured (the probes take
    # seconds; what is tested here is the forecast and its table).
    probes = []

    def same_probe(*args, **kwargs):
        probes.append(args)
        return moestream.plan.Probe(**probe)

    monkeypatch.setattr(moestream.plan, "run_probe", same_probe)
    r = invoke(cli, ["plan", converted, "--cache-experts", 4, "--hit-rate", 0.8])
    assert "4 of 8 per layer (50 % resident)" in r.output
    table = r.output[r.output.index("hit rate  misses") :].splitlines()[1:]
    assert [line.split()[0] for line in table] == ["0.500", "0.800"]
    warm = [float(line.split()[3]) for line in table]
    assert warm[0] == pytest.approx(rows[0]["warm_tps"], abs=0.006)  # same probe
    full = invoke(cli, ["plan", converted, "--json"])
    (row,) = json.loads(full.output)["forecast"]
    assert row["hit_rate"] == 1.0 and row["bytes_per_token"] == 0
    assert row["warm_tps"] == pytest.approx(1 / probe["token_s"])
    assert len(probes) == 2


def test_forecast_reads_the_page_cache_no_slower_than_the_disk(converted: Path):
    from mlx_lm.utils import load_config

    from moestream.formats import load_manifest
    from moestream.plan import Probe, forecast_at

    manifest, config = load_manifest(converted), load_config(converted)
    record = sum(x.record_nbytes for x in manifest.layers) / len(manifest.layers)
    normal = forecast_at(0.5, manifest, config, Probe(0.01, 1e-4, 0.2, 0.5, 4.0))
    assert normal.cold_tps < normal.warm_tps
    # 2 misses per token (2 layers, top-2, half resident), each 1e-4 s + reads
    assert 1 / normal.warm_tps == pytest.approx(0.01 + 2 * (1e-4 + record / 4e9))
    # a loaded machine's probes: the page cache measured slower than the disk
    noisy = forecast_at(0.5, manifest, config, Probe(0.01, 1e-4, 0.2, 0.5, 0.3))
    assert (
        noisy.warm_tps
        == noisy.cold_tps
        == pytest.approx(1 / (0.01 + 2 * (1e-4 + record / 0.5e9)))
    )


# ------------------------------------------------------------------ eval


def test_eval_perplexity_as_mlx_lm(converted: Path, tmp_path: Path) -> None:
    data = tmp_path / "val.txt"
    data.write_text(TEXT)
    r = invoke(
        cli,
        [
            "eval",
            converted,
            "--data",
            data,
            "--context",
            32,
            "--cache-experts",
            3,
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    got = last_json(r.output)
    rows = sequences(load_tokenizer(converted), TEXT, 32)
    with contextlib.redirect_stdout(io.StringIO()):
        ppl, se = eval_ppl(resident_from_converted(converted), rows, batch_size=4)
    assert got["perplexity"] == pytest.approx(ppl, rel=1e-6)
    assert got["perplexity_se"] == pytest.approx(se, rel=1e-5)
    assert got["tokens"] == rows.shape[0] * 31 and got["kl"] is None


def test_eval_kl_is_zero_against_the_same_weights(converted: Path) -> None:
    model, tok = moestream.load(converted, cache_experts=3)
    rows = sequences(tok, TEXT, 24, limit=3)
    result = evaluate(model, rows, resident_from_converted(converted))
    assert result.kl == 0.0 and result.sequences == 3


def test_eval_kl_against_the_unquantized_source(
    converted: Path, hf_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "val.txt"
    data.write_text(TEXT)
    r = invoke(
        cli,
        [
            "eval",
            converted,
            "--data",
            data,
            "--context",
            24,
            "--num-samples",
            2,
            "--reference",
            hf_dir,
        ],
    )
    assert r.exit_code == 0, r.output
    m = re.search(r"KL\(reference \|\| model\): ([\d.]+)", r.output)
    assert m and 0 < float(m.group(1)) < 1
    assert "over 46 tokens (2 x 24)" in r.output


def test_eval_refuses_too_little_data(converted: Path, tmp_path: Path) -> None:
    data = tmp_path / "short.txt"
    data.write_text("def")
    r = CliRunner().invoke(
        cli, ["eval", str(converted), "--data", str(data), "--context", "64"]
    )
    assert r.exit_code == 2 and "fewer than one sequence" in r.output


def test_plan_sizes_the_context_as_run_moe(tmp_path: Path, monkeypatch) -> None:
    """plan takes run-moe's --prompt and --max-tokens and plans its slots: at a
    budget where 4096 tokens of KV cache and activations do not fit and run-moe's
    own context does, both answer the same slots. Both run in this one test
    process, whose size grows between the calls (separate commands measure
    their own): it is held still here, so only the context can move the slots."""
    monkeypatch.setattr(memory, "_resident_bytes", lambda: 200 << 20)
    from builders.synthetic import tiny_qwen3_moe

    from moestream.converter import convert
    from moestream.runtime import BudgetError
    from moestream.runtime.loader import _budget_holding, plan_for

    out = tmp_path / "out"
    convert(
        str(tiny_qwen3_moe(tmp_path / "hf", moe_intermediate_size=8192)),
        out,
        progress=False,
    )
    prompt, n = "def add", 2
    context = len(encode_prompt(load_tokenizer(out), prompt, False)) + n
    three = plan_for(out, RuntimeConfig(cache_experts=3, context=context))
    # half a slot more than 3 slots need at run-moe's context
    budget = _budget_holding(three.total - three.reserve + three.slot_bytes // 2)
    with pytest.raises(BudgetError, match="too small"):
        plan_for(out, RuntimeConfig(memory_budget=budget))  # 4096 tokens
    flags = ["-p", prompt, "-m", str(n), "--memory-budget", str(budget)]
    plan = ["plan", str(out), "--no-forecast", "--json"]
    r = CliRunner().invoke(cli, [*plan, *flags])
    assert r.exit_code == 0, r.output
    assert (json.loads(r.stdout)["plan"]["context"], three.capacity) == (context, 3)
    assert json.loads(r.stdout)["plan"]["capacity"] == 3
    r = CliRunner().invoke(run_main, [str(out), *flags, "--stats"])
    assert r.exit_code == 0, r.output
    assert "(3/8 per layer)" in r.stderr
    # --prompt-tokens stands for the prompt; --for chat plans chat's 4096 tokens
    r = CliRunner().invoke(
        cli, [*plan, "--prompt-tokens", str(context - n), *flags[2:]]
    )
    assert json.loads(r.stdout)["plan"]["context"] == context
    r = CliRunner().invoke(cli, [*plan[:3], "--for", "chat", *flags[2:]])
    assert r.exit_code == 2 and "too small" in r.output, r.output
