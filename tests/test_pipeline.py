"""run-moe --pipeline across processes: `mlx.launch --backend ring` on 127.0.0.1.

Tokens (greedy and seeded sampling) must equal mlx-lm's single-process
resident model; a failure on any rank must end every rank with one line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from builders.synthetic import tiny_model
from helpers import (
    BITS,
    BITS4,
    SEEDS,
    both,
    corrupt_layer,
    generate_args,
    generated,
    mlx_lm_generate,
)
from mlx_lm.utils import load_tokenizer

from moestream.converter import convert
from moestream.formats import Recipe, load_manifest
from moestream.pipeline import PipelineError, plan_stages, split_layers, stages
from moestream.reference import resident_from_converted, resident_model
from moestream.runtime import RuntimeConfig
from moestream.runtime.loader import RESERVE_FRACTION, plan_for

BIN = Path(sys.executable).parent
WORKER = Path(__file__).parent / "pipeline_worker.py"
PROMPT = [(7 * i + 3) % 300 for i in range(20)]
# A launch that takes longer has hung: a ring rank alone waits forever.
TIMEOUT = 120


def free_ports(n: int) -> int:
    """A first port of `n` consecutive free ones (the ring listens on each)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError("no free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_args(n: int, *command: str, backend: str = "ring") -> list[str]:
    """`mlx.launch -n N --backend B` on free local ports, then `command`."""
    args = [str(BIN / "mlx.launch"), "-n", str(n), "--backend", backend]
    port = "--nccl-port" if backend == "nccl" else "--starting-port"
    return [*args, port, str(free_ports(n)), "--", *command]


def launch(
    n: int, *command: str, stdin: str = "", backend: str = "ring"
) -> subprocess.CompletedProcess:
    """`mlx.launch -n N --backend B -- command`, killed whole on a timeout."""
    args = launch_args(n, *command, backend=backend)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(stdin, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"mlx.launch {' '.join(command)} hung")
    return subprocess.CompletedProcess(args, p.returncode, out, err)


ERROR = re.compile(r"error: .*?(?=error: |$)")


def errors(r: subprocess.CompletedProcess) -> list[str]:
    """Every "error: ..." message of the ranks' stderr. mlx.launch relays each
    rank's output in the chunks it reads, so two ranks' lines may be spliced
    into one: a message runs to the next one or to the end of its line."""
    return [m for line in r.stderr.splitlines() for m in ERROR.findall(line)]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, Path]:
    """A family without mlx-lm's PipelineMixin: the generic cut; its resident
    model, and an mlx-lm directory of the same weights (for mlx-lm's commands)."""
    root = tmp_path_factory.mktemp("qwen2_moe")
    out, mlx_dir = both(root, "qwen2_moe", seed=3)
    ref = resident_model(root / "hf-qwen2_moe", Recipe.parse(BITS4), "float32")
    return out, ref, mlx_dir


def test_split_balances_bytes_in_mlx_lm_order() -> None:
    assert split_layers([1, 1, 1, 1], 2) == (2, 2)
    # rank 0 runs the last layers: the heavy first layer goes alone to rank 1
    assert split_layers([10, 1, 1, 1], 2) == (3, 1)
    assert split_layers([1, 1, 1, 10], 2) == (1, 3)
    assert split_layers([1, 1, 1], 3) == (1, 1, 1)
    with pytest.raises(PipelineError, match="between 1 and 3"):
        split_layers([1, 1, 1], 4)


def test_plan_ranks_cover_every_layer_once(converted: Path) -> None:
    cfg = RuntimeConfig(cache_experts=2)
    whole = plan_for(converted, cfg)
    plans = plan_stages(converted, 2, cfg)
    layers = sorted(i for s, _ in plans for i in s.layers)
    assert layers == list(range(3))
    # each rank's slots are its own layers' experts: together, the whole's
    assert sum(p.slot_bytes for _, p in plans) == whole.slot_bytes
    for _, plan in plans:
        assert plan.dense < whole.dense and plan.kv_cache < whole.kv_cache
    # what a rank needs beyond its process is below what one process needs
    assert max(p.total - p.process for _, p in plans) < whole.total - whole.process


def test_two_ranks_generic_family_exact(qwen2) -> None:
    """run-moe --pipeline on 2 ranks: seeded sampling prints mlx_lm.generate's
    text for the same seed (each rank's load ends in one process's state)."""
    out, _, mlx_dir = qwen2
    seed = SEEDS[0]
    want = mlx_lm_generate({0: (mlx_dir, seed)})[0]
    r = launch(
        2,
        str(BIN / "run-moe"),
        str(out),
        "--pipeline",
        *generate_args(seed),
        *("--cache-experts", "1", "--json"),
    )
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout + r.stderr  # rank 0 alone prints
    result = json.loads(lines[0])
    assert result["text"] == want
    ranks = result["stats"]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert sorted(r["layers"][0] for r in ranks) == [0, ranks[1]["layers"][1] + 1]
    assert all(r["bytes_read"] > 0 and r["peak_memory"] > 0 for r in ranks)


SHARE = """
lines = ["h\u00e9llo " + str(r), "" if r == 0 else "x", None if r == 0 else "y"]
print(json.dumps(["share", r, [share_line(g, line) for line in lines]]), flush=True)
"""

IN_FLIGHT = """
x = mx.arange(256, dtype=mx.float32)
with mx.stream(generation_stream):  # a step's hand-over, as mlx-lm runs one ahead
    if r == 1:  # sent late: its layer still computes when the turn reads a line
        a = mx.ones((512, 512))
        for _ in range(8):  # its send starts after share_line's all-sum
            a = a @ a / 512
        y = mx.distributed.send(x + 0 * a[0, 0], 0)
    else:
        y = mx.distributed.recv_like(x, 1)
mx.async_eval(y)
line = share_line(g, "next turn" if r == 0 else None)
print(json.dumps(["in flight", r, line, (y == x).all().item()]), flush=True)
"""

# One launch runs both scripts in turn (each launch starts three processes
# that import mlx-lm): the ring's lines of each, by script.
RING = """
import json, mlx.core as mx
from mlx_lm.generate import generation_stream
from moestream.pipeline import share_line
g = mx.distributed.init()
r = g.rank()
"""


@pytest.fixture(scope="module")
def ring_lines() -> tuple[dict[str, list], str]:
    r = launch(2, sys.executable, "-c", RING + SHARE + IN_FLIGHT)
    got: dict[str, list] = {}
    for line in r.stdout.splitlines():
        if line.startswith("["):
            script, *rest = json.loads(line)
            got.setdefault(script, []).append(rest)
    return got, r.stderr


def test_every_rank_gets_rank_0s_line(ring_lines) -> None:
    """chat --pipeline's input: rank 0's line (text, empty, or the end of
    input) on every rank, whatever the other ranks read."""
    got, stderr = ring_lines
    assert sorted(got.get("share", [])) == [
        [0, ["h\u00e9llo 0", "", None]],
        [1, ["h\u00e9llo 0", "", None]],
    ], stderr


def test_a_line_waits_for_the_step_in_flight(ring_lines) -> None:
    """chat --pipeline reads a turn's line while mlx-lm's step ahead still
    sends on its stream: the line's all-sum waits for it (else both run on the
    ring's sockets at once: the hidden state received shifted by 4 bytes)."""
    got, stderr = ring_lines
    want = [[0, "next turn", True], [1, "next turn", True]]
    assert sorted(got.get("in flight", [])) == want, stderr


@pytest.mark.slow
def test_budget_too_small_on_one_rank_stops_every_rank(converted: Path) -> None:
    """Rank shares of 2 and 1 layers: at a long context the KV cache of one more
    layer (~100 MB) makes the same --memory-budget fit one rank and not the
    other; every rank then stops with the same line."""
    tokens = 200_000
    cfg = RuntimeConfig(cache_experts=2, dtype="float32", context=tokens)
    needs = sorted(p.total - p.process for _, p in plan_stages(converted, 2, cfg))
    assert needs[1] - needs[0] > 80 << 20
    # a launched rank holds about 112 MB before loading (Python, MLX, the ring)
    budget = (needs[0] + needs[1]) // 2 + (112 << 20)
    r = launch(
        2,
        str(BIN / "run-moe"),
        str(converted),
        "--pipeline",
        "-p",
        "x",
        "--ignore-chat-template",
        "-m",
        str(tokens - 8),
        "--memory-budget",
        str(budget),
        "--dtype",
        "float32",
    )
    lines = errors(r)
    assert len(lines) == 2, r.stderr  # one line on every rank, the same
    assert len(set(lines)) == 1 and "too small" in lines[0], lines
    assert lines[0].startswith("error: rank "), lines


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_families_exact(tmp_path: Path, family: str, ranks: int) -> None:
    src = tiny_model(tmp_path / "hf", family, seed=3)
    bits = None if family == "gpt_oss" else BITS
    out = tmp_path / "out"
    convert(str(src), out, bits=bits, progress=False)
    ref = resident_model(src, Recipe.parse(bits) if bits else None)
    r = launch(ranks, sys.executable, str(WORKER), str(out), "1")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["greedy"] == generated(ref, PROMPT, 0.0, 0, n=12)
    assert result["sampled"] == generated(
        lambda: resident_from_converted(out, "float32"), PROMPT, 1.0, 5, n=12
    )
    assert len(result["ranks"]) == ranks


@pytest.mark.slow
def test_native_engine_exact(qwen2) -> None:
    out, ref, _ = qwen2
    r = launch(2, sys.executable, str(WORKER), str(out), "1", "native")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["greedy"] == generated(ref, PROMPT, 0.0, 0, n=12)
    assert result["sampled"] == generated(
        lambda: resident_from_converted(out, "float32"), PROMPT, 1.0, 5, n=12
    )


def _per_rank(tmp_path: Path, converted: Path) -> tuple[Path, Path]:
    """OUT copies named so that rank r opens `copies/out{r}`."""
    import shutil

    for r in (0, 1):
        shutil.copytree(converted, tmp_path / f"out{r}")
    return tmp_path / "out0", tmp_path / "out1"


def _run_per_rank(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    script = f'exec "$0" "{tmp_path}/out$MLX_RANK" "$@"'
    return launch(2, "bash", "-c", script, str(BIN / "run-moe"), "--pipeline", *flags)


@pytest.mark.slow
def test_a_rank_with_another_out_is_refused_everywhere(tmp_path, converted) -> None:
    _, other = _per_rank(tmp_path, converted)
    manifest = other / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"created_by"', '"created_by" '))
    r = _run_per_rank(tmp_path, "-p", "x", "-m", "4", "--cache-experts", "2")
    lines = errors(r)
    assert len(lines) == 2 and len(set(lines)) == 1, r.stderr
    assert "rank 1's converted folder differs from rank 0's" in lines[0]


@pytest.mark.slow
def test_a_rank_that_dies_ends_the_others(tmp_path, converted) -> None:
    """A corrupted expert on rank 1's copy (same manifest): rank 1 stops on its
    checksum, rank 0 learns that the pipeline broke; nothing hangs."""
    _, other = _per_rank(tmp_path, converted)
    stage = stages(converted, 2)[1]
    for layer in load_manifest(other).layers:
        if layer.layer in stage.layers:
            corrupt_layer(other, layer, flip=0xFF, at=0)
    r = _run_per_rank(tmp_path, "-p", "x", "-m", "8", "--cache-experts", "2")
    lines = errors(r)
    assert len(lines) == 2, r.stderr  # one line on each rank
    assert any("fails its checksum" in line for line in lines), lines
    assert any(
        line.startswith("error: rank 0: ")
        and ("pipeline broke" in line or "stopped by mlx.launch" in line)
        for line in lines
    ), lines


def test_pipeline_refuses_what_it_does_not_run(converted: Path) -> None:
    from click.testing import CliRunner

    from moestream.cli.run import main

    r = CliRunner().invoke(
        main, [str(converted), "--pipeline", "-p", "x", "--draft-model", "d"]
    )
    assert r.exit_code == 2 and "--pipeline does not take --draft-model" in r.output


@pytest.mark.slow
def test_per_rank_budget_below_one_process(tmp_path: Path) -> None:
    """A model whose expert slots outweigh a rank's own overhead (the ring's
    buffers): 2 ranks run at a budget one process is refused at, same slots,
    tokens equal to the resident model's."""
    from moestream.bench.models import Scale, write_synthetic

    out = tmp_path / "m"
    write_synthetic(out, Scale(4, 16, 2, 1024, 1024, heads=4, kv_heads=2, vocab=512))
    slots = 12
    cfg = RuntimeConfig(cache_experts=slots, dtype="float32")
    whole = plan_for(out, cfg)
    rank = max(p.total - p.process for _, p in plan_stages(out, 2, cfg))
    # a launched rank holds ~112 MB before loading (Python, MLX, the ring's
    # buffers), one process alone ~80 MB: the budget still refuses one process
    budget = int((rank + (130 << 20)) / (1 - RESERVE_FRACTION))  # + its reserve
    alone = whole.total - whole.process + (80 << 20) + RESERVE_FRACTION * budget
    assert budget < alone, (budget, alone)
    r = launch(
        2, sys.executable, str(WORKER), str(out), str(slots), "python", str(budget)
    )
    assert r.stdout.strip(), r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    ref = resident_from_converted(out, "float32")
    assert result["greedy"] == generated(ref, PROMPT, 0.0, 0, n=12)
    assert result["sampled"] == generated(
        lambda: resident_from_converted(out, "float32"), PROMPT, 1.0, 5, n=12
    )
    assert all(r["peak_memory"] <= budget for r in result["ranks"]), result["ranks"]


@pytest.mark.slow
def test_chat_pipeline_answers_as_one_process(qwen2) -> None:
    """The same sampled replies, turn after turn, as chat in one process (which
    answers as mlx_lm.chat: test_seeding.py)."""
    out, _, _ = qwen2
    args = [str(out), "--cache-experts", "2", "-m", "10", "--dtype", "float32"]
    args += ["--temp", "1.0", "--seed", "5"]
    talk = "hello\nhow are you\nq\n"
    r = launch(2, str(BIN / "moestream"), "chat", *args, "--pipeline", stdin=talk)
    alone = subprocess.run(
        [str(BIN / "moestream"), "chat", *args],
        input=talk,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.stdout.count(">> ") == 3, r.stderr
    assert r.stdout == alone.stdout


@pytest.mark.slow
def test_serve_pipeline_answers_as_the_resident_model(qwen2) -> None:
    """serve --pipeline on 2 ranks: rank 0 listens, greedy text as mlx-lm's."""
    import threading
    import urllib.request

    from mlx_lm.generate import generate as mlx_generate

    out, ref, _ = qwen2
    port = free_ports(1)
    args = launch_args(2, str(BIN / "moestream"), "serve", str(out), "--pipeline")
    args += ["--port", str(port)]
    args += ["--cache-experts", "2", "--dtype", "float32"]
    p = subprocess.Popen(
        args,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready, lines = threading.Event(), []

    def read() -> None:
        for line in p.stderr:
            lines.append(line)
            if "serving" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(TIMEOUT), "".join(lines)
        body = {"prompt": "def add", "max_tokens": 12, "temperature": 0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/stats", timeout=60) as response:
            snap = json.loads(response.read())  # the page's: rank 0's view
        with urllib.request.urlopen(base + "/metrics", timeout=60) as response:
            hits = response.read().decode().splitlines()
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    tok = load_tokenizer(out)
    prompt = tok.encode("def add")
    assert text == mlx_generate(ref, tok, prompt, max_tokens=12)
    assert (snap["rank"], snap["ranks"]) == (0, 2)
    mine = [layer["layer"] for layer in snap["layers"]]
    assert mine and mine == sorted(mine) and len(mine) < len(load_manifest(out).layers)
    assert f"moestream_expert_hits_total {snap['experts']['hits']}" in hits
