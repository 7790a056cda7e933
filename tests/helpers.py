"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

# Mixed bits on purpose: every projection width must survive the round trip.
BITS = "gate_proj=4,up_proj=3,down_proj=6,down_proj@2-2=8"
PROMPT = mx.array([[(7 * i + 3) % 300 for i in range(48)]])
# Seeded sampling against mlx-lm's own commands (test_seeding.py).
BITS4 = "gate_proj=4,up_proj=4,down_proj=4"
SEEDS = (3, 4)
SAMPLED_PROMPT = "hello world"
SAMPLED_TOKENS = 16
COMMAND_TIMEOUT = 120


def logits_stepwise(model, prompt: mx.array, steps: int) -> list[mx.array]:
    """Prefill `prompt`, then feed greedy tokens one at a time with a KV cache."""
    cache = make_prompt_cache(model)
    out = [model(prompt, cache=cache)]
    token = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
    for _ in range(steps):
        out.append(model(token, cache=cache))
        token = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
    mx.eval(out)
    return out


def same_files(a: Path, b: Path) -> None:
    """The two directories hold the same files, byte for byte."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f


def parse_metrics(body: bytes) -> dict[str, float]:
    """A Prometheus text page (`/metrics`): each sample's value by its name."""
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def corrupt_layer(out: Path, layer, flip: int = 0x10, at: int = 7) -> bytes:
    """Damage one byte of every expert record of manifest layer `layer` in
    place (same inode); returns the blob's original bytes, to restore it."""
    blob = out / layer.file
    original = blob.read_bytes()
    data = bytearray(original)
    for e in range(layer.num_experts):
        data[layer.data_offset + e * layer.stride + at] ^= flip
    blob.write_bytes(bytes(data))
    return original


def edit_manifest(out: Path, fn) -> None:
    path = out / "manifest.json"
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def generated(
    model: nn.Module | Callable[[], nn.Module],
    prompt: list[int],
    temp: float,
    seed: int | None,
    n: int = 24,
) -> list[int]:
    """Tokens of mlx-lm's generate_step, seeded where mlx-lm's commands seed:
    `model` may be a function that loads it, called after the seed (its draws
    then count, as in mlx_lm.generate); seed None keeps the random state."""
    if seed is not None:
        mx.random.seed(seed)
    if not isinstance(model, nn.Module):
        model = model()
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=n,
        sampler=make_sampler(temp, top_p=0.9 if temp else 1.0),
    )
    return [t for t, _ in steps]


def mlx_lm_convert(src: Path, dst: Path, dtype: str = "float32") -> Path:
    """mlx_lm.convert -q --q-bits 4 --q-group-size 64 --dtype DTYPE."""
    from mlx_lm.convert import convert as mlx_convert

    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        mlx_convert(
            str(src),
            str(dst),
            quantize=True,
            q_bits=4,
            q_group_size=64,
            dtype=dtype,
        )
    return dst


def both(
    root: Path, family: str, seed: int = 0, dtype: str = "float32"
) -> tuple[Path, Path]:
    """(convert-moe OUT, mlx-lm directory) of the same weights: one random
    checkpoint in hub layout (root/hf-FAMILY), every projection at 4 bits."""
    from builders.synthetic import tiny_model

    from moestream.converter import convert

    src = tiny_model(root / f"hf-{family}", family, seed=seed)
    out = root / f"out-{family}"
    convert(str(src), out, bits=BITS4, dtype=dtype, progress=False)
    return out, mlx_lm_convert(src, root / f"mlx-{family}", dtype)


def mlx_lm_command(*args: str) -> subprocess.Popen:
    """`python -m mlx_lm ARGS` in its own process (stdin, stdout, stderr piped)."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.Popen(
        [sys.executable, "-m", "mlx_lm", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
        env=env,
    )


def generate_args(seed: int) -> list[str]:
    """mlx_lm.generate's flags of a seeded sampled run; run-moe takes the same."""
    return [
        *("--prompt", SAMPLED_PROMPT, "--ignore-chat-template"),
        *("--temp", "1.0", "--seed", str(seed), "--max-tokens", str(SAMPLED_TOKENS)),
    ]


# `python -m mlx_lm generate ARGS` for each ARGS in turn, in one process: each
# run is that command's own code run afresh (it seeds, loads and generates; the
# process's first import of mlx-lm, ~2 s, is paid once), then a line RUN_END.
RUN_END = "\x1e mlx_lm generate ended \x1e"
GENERATE_RUNS = f"""
import json, runpy, sys
for args in json.loads(sys.argv[1]):
    sys.argv = ["mlx_lm", "generate", *args]
    runpy.run_module("mlx_lm", run_name="__main__", alter_sys=True)
    print({RUN_END!r}, flush=True)
"""


def mlx_lm_generate(runs: dict[object, tuple[Path, int]]) -> dict[object, str]:
    """`python -m mlx_lm generate` of each (mlx-lm directory, seed), one after
    another in one process of their own: the text each printed."""
    args = [
        ["--model", str(m), *generate_args(s), "--verbose", "False"]
        for m, s in runs.values()
    ]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    p = subprocess.run(
        [sys.executable, "-c", GENERATE_RUNS, json.dumps(args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=COMMAND_TIMEOUT * len(args),
    )
    assert p.returncode == 0, p.stderr
    texts = p.stdout.split(RUN_END + "\n")
    assert len(texts) == len(args) + 1 and texts[-1] == "", p.stdout
    # each printed its text, then a newline
    return {key: t.removesuffix("\n") for key, t in zip(runs, texts, strict=False)}


def tiny_converted(root: Path, bits: str, geometry: dict) -> tuple[Path, Path]:
    """A tiny Qwen3-MoE of `geometry` in HF layout (root/hf), converted with
    `bits` (root/out)."""
    from builders.synthetic import tiny_qwen3_moe

    from moestream.converter import convert

    hf = tiny_qwen3_moe(root / "hf", **geometry)
    out = root / "out"
    convert(str(hf), out, bits=bits, progress=False)
    return hf, out


def fail_reads(model: nn.Module, layer: int, expert: int, count: int) -> None:
    """Make the next `count` reads of record (`layer`, `expert`) fail with EIO,
    through the engine's fault-injection hook (a read that fails is tried once
    more: 1 heals, 2 fails the call); a negative count takes back failures not
    spent yet."""
    from moestream.runtime import runtime_of

    rt = runtime_of(model)
    pending = rt.__dict__.setdefault("_failing_reads", {})
    n = max(0, pending.get((layer, expert), 0) + count)
    pending[(layer, expert)] = n
    if rt.execution.native:
        rt.stats.native_layers[layer].inject_read_failures(expert, n)
    else:
        rt.store.inject_read_failures(layer, expert, n)


def copy_of(model: Path, tmp_path: Path) -> Path:
    """A private copy of `model` in tmp_path, free to damage."""
    out = tmp_path / "model"
    shutil.copytree(model, out)
    return out
