"""Helpers shared by the test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

# Mixed bits on purpose: every projection width must survive the round trip.
BITS = "gate_proj=4,up_proj=3,down_proj=6,down_proj@2-2=8"
PROMPT = mx.array([[(7 * i + 3) % 300 for i in range(48)]])


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
    model, prompt: list[int], temp: float, seed: int, n: int = 24
) -> list[int]:
    mx.random.seed(seed)
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=n,
        sampler=make_sampler(temp, top_p=0.9 if temp else 1.0),
    )
    return [t for t, _ in steps]
