"""`--seed` means what it means in mlx-lm's own commands (docs/architecture.md).

mlx_lm.generate and mlx_lm.chat seed before they load, so the random numbers
drawn while the model is built are part of what a seed gives. The oracle is
mlx-lm's command itself, run in a process apart from ours (the six runs of
mlx_lm generate one after another in one: helpers.mlx_lm_generate) on an
mlx-lm directory of the same quantized weights (`mlx_lm.convert -q --q-bits 4
--q-group-size 64 --dtype float32` beside `convert-moe --bits
gate_proj=4,up_proj=4,down_proj=4 --dtype float32` of one checkpoint); run-moe
and chat must print its text.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from helpers import (
    COMMAND_TIMEOUT,
    SAMPLED_PROMPT,
    SAMPLED_TOKENS,
    SEEDS,
    both,
    generate_args,
    mlx_lm_command,
    mlx_lm_generate,
)

from moestream.cli import main as cli
from moestream.cli.run import main as run_moe
from moestream.converter.relayout import relayout
from moestream.runtime import native

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
ENGINES = ["python"] + ["native"] * native.available()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("seeding")
    return {f: both(root, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def mlx_lm_texts(models) -> dict[tuple[str, int], str]:
    runs = {(f, s): (models[f][1], s) for f in FAMILIES for s in SEEDS}
    return mlx_lm_generate(runs)


def run_moe_text(out: Path, seed: int, *flags: str) -> str:
    r = CliRunner().invoke(run_moe, [str(out), *generate_args(seed), "--json", *flags])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout.strip().splitlines()[-1])["text"]


def runs() -> list:
    """(family, slots, engine): in make test each family with both engines and
    both budgets between them; every pairing in make test-all (slow)."""
    out = []
    for family in FAMILIES:
        for slots in ("all", "2"):
            for engine in ENGINES:
                fast = (slots == "2") == (engine == "python")
                marks = () if fast or len(ENGINES) == 1 else pytest.mark.slow
                out.append(pytest.param(family, slots, engine, marks=marks))
    return out


@pytest.mark.parametrize("family, slots, engine", runs())
def test_run_moe_seed_prints_mlx_lm_generate(
    models, mlx_lm_texts, family: str, slots: str, engine: str
) -> None:
    out, _ = models[family]
    budget = [] if slots == "all" else ["--cache-experts", slots]
    texts = [run_moe_text(out, s, "--set", f"engine={engine}", *budget) for s in SEEDS]
    assert texts == [mlx_lm_texts[family, s] for s in SEEDS]
    assert texts[0] != texts[1]  # the seed decides the text


@pytest.mark.skipif(not native.available(), reason="the native engine is not built")
@pytest.mark.parametrize("family", FAMILIES)
def test_mapped_seed_prints_mlx_lm_generate(models, mlx_lm_texts, family: str) -> None:
    """Mapped experts (the default beyond RAM on a CPU) draw what mlx-lm does."""
    out, _ = models[family]
    texts = [run_moe_text(out, s, "--backend", "mapped") for s in SEEDS]
    assert texts == [mlx_lm_texts[family, s] for s in SEEDS]


@pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native engine or its exact CPU kernel is not here",
)
def test_kernel_fills_seed_prints_mlx_lm_generate(
    models, mlx_lm_texts, tmp_path: Path
) -> None:
    """Records stored blocked at two slots: the misses the CPU kernel fills
    as it reads their records in place draw what mlx-lm does."""
    family = "qwen3_moe"
    blocked = tmp_path / "blocked"
    relayout(models[family][0], blocked, "blocked", progress=False)
    results = []
    for s in SEEDS:
        args = [str(blocked), *generate_args(s), "--json", "--cache-experts", "2"]
        r = CliRunner().invoke(run_moe, args)
        assert r.exit_code == 0, r.output
        results.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert [r["text"] for r in results] == [mlx_lm_texts[family, s] for s in SEEDS]
    assert all(r["stats"]["kernel_fills"] > 0 for r in results)


@pytest.mark.device
@pytest.mark.skipif(not mx.is_available(mx.gpu), reason="MLX has no GPU here")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpu_seed_prints_mlx_lm_generate(tmp_path: Path, dtype: str) -> None:
    """On a GPU both compute in the stored dtype, so bfloat16 weights compare
    too (a CPU computes run-moe in float32, mlx-lm in bfloat16)."""
    out, mlx_dir = both(tmp_path, "qwen3_moe", dtype=dtype)
    want = mlx_lm_generate({s: (mlx_dir, s) for s in SEEDS})
    for engine in ENGINES:
        texts = [run_moe_text(out, s, "--set", f"engine={engine}") for s in SEEDS]
        assert texts == [want[s] for s in SEEDS], engine


def test_a_seed_counts_the_draws_of_loading(models, mlx_lm_texts) -> None:
    """Seeding after the load (as the regression did) gives other text: the
    test above can tell the two apart."""
    from mlx_lm.generate import generate

    import moestream

    out, _ = models["qwen3_moe"]
    model, tok = moestream.load(out)
    mx.random.seed(SEEDS[0])  # after the build's draws
    late = generate(
        model, tok, tok.encode(SAMPLED_PROMPT), max_tokens=SAMPLED_TOKENS, sampler=hot()
    )
    assert late != mlx_lm_texts["qwen3_moe", SEEDS[0]]


def hot():
    from mlx_lm.sample_utils import make_sampler

    return make_sampler(1.0)


# mlx_lm.chat writes its prompt, then a newline once the line is read, then the
# streamed reply, a newline and "  N tokens · ..." (colours stripped first).
MLX_CHAT_REPLY = re.compile(r"› \n(.*?)\n  \d+ tokens · ", re.DOTALL)
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\x01\x02]")


def chat_replies(stdout: str, mlx_lm: bool) -> list[str]:
    if mlx_lm:
        return MLX_CHAT_REPLY.findall(ANSI.sub("", stdout))
    return [turn.removesuffix("\n") for turn in stdout.split(">> ")[1:-1]]


def test_chat_seed_answers_as_mlx_lm_chat(models) -> None:
    out, mlx_dir = models["qwen2_moe"]
    talk = "hello there\nhow are you\nq\n"
    flags = ["--temp", "1.0", "--seed", "5", "--max-tokens", "12"]
    theirs = mlx_lm_command("chat", "--model", str(mlx_dir), *flags)
    ours = CliRunner().invoke(cli, ["chat", str(out), *flags], input=talk)
    stdout, err = theirs.communicate(talk, timeout=COMMAND_TIMEOUT)
    assert theirs.returncode == 0 and ours.exit_code == 0, err + ours.output
    want = chat_replies(stdout, mlx_lm=True)
    assert len(want) == 2, stdout
    assert chat_replies(ours.stdout, mlx_lm=False) == want


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(url: str, seed: int) -> str:
    import urllib.request

    body = {"prompt": SAMPLED_PROMPT, "max_tokens": SAMPLED_TOKENS}
    body |= {"temperature": 1.0, "seed": seed}
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=COMMAND_TIMEOUT) as response:
        return json.loads(response.read())["choices"][0]["text"]


def mlx_lm_server_texts(mlx_dir: Path, seeds: tuple[int, ...]) -> list[str]:
    """Requests with a "seed" to `python -m mlx_lm server` on 127.0.0.1."""
    import time
    import urllib.error

    port = free_port()
    p = mlx_lm_command("server", "--model", str(mlx_dir), "--port", str(port))
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + COMMAND_TIMEOUT
    try:
        while True:
            try:
                return [completion(url, s) for s in seeds]
            except urllib.error.URLError:
                assert p.poll() is None and time.monotonic() < deadline
                time.sleep(0.3)
    finally:
        p.kill()
        p.communicate(timeout=COMMAND_TIMEOUT)


def test_serve_seed_answers_as_mlx_lm_server(models) -> None:
    """mlx_lm.server seeds each request that carries a "seed" right before it
    generates (no load in between): serve answers the same text."""
    from moestream.runtime import RuntimeConfig
    from moestream.serve import Server, ServerOptions

    out, mlx_dir = models["mixtral"]
    seeds = (*SEEDS, SEEDS[0])  # a seed asked again gives its text again
    want = mlx_lm_server_texts(mlx_dir, seeds)
    config = RuntimeConfig(cache_experts=2, context=160)
    with Server(out, config, ServerOptions(), port=0) as s:
        got = [completion(s.url, seed) for seed in seeds]
    assert got == want
    assert want[0] == want[2] != want[1]


@pytest.mark.skipif(
    not native.available() or not native.kernel_matches_mlx(),
    reason="the native engine or its exact CPU kernel is not here",
)
def test_a_budget_over_blocked_records_seed_prints_mlx_lm_generate(
    models, mlx_lm_texts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Records stored blocked under a budget of three records a layer: mapped
    by default, each layer's window kept mapped, the prompt past it read in
    place; what it draws is what mlx-lm draws."""
    from moestream.runtime import RuntimeConfig, loader, memory
    from moestream.runtime.loader import plan_for

    family = "qwen3_moe"
    blocked = tmp_path / "blocked"
    relayout(models[family][0], blocked, "blocked", progress=False)
    measured = memory._process_bytes()  # the plan's and load's alike
    monkeypatch.setattr(loader, "_process_bytes", lambda: measured)

    def run(seed: int, *flags: str) -> tuple[dict, str]:
        args = [str(blocked), *generate_args(seed), "--json", "--stats", *flags]
        r = CliRunner().invoke(run_moe, args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr

    # run-moe's context: the prompt's tokens and the tokens it may generate
    prompt = run(SEEDS[0], "--backend", "mapped")[0]["stats"]["prompt_tokens"]
    cfg = RuntimeConfig(backend="mapped", context=prompt + SAMPLED_TOKENS)
    base = plan_for(blocked, cfg)
    budget = str(base.total + 3 * base.slot_bytes + base.slot_bytes // 2)
    texts = []
    for s in SEEDS:
        result, stderr = run(s, "--memory-budget", budget)
        assert "cpu-mapped, experts mapped, 3 a layer kept" in stderr
        texts.append(result["text"])
    assert texts == [mlx_lm_texts[family, s] for s in SEEDS]
