"""Exactness of the streaming runtime on whatever device MLX runs on (e.g. a GPU).

    python scripts/gpu_exactness.py

Builds the tiny test checkpoint, converts it, and compares logits (prefill and
step-by-step decode) with mlx-lm's resident model at several cache sizes and
compute dtypes, on mx.default_device(). Prints one line per case.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import mlx.core as mx
from builders.synthetic import tiny_qwen3_moe
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.converter import convert
from moestream.formats import Recipe
from moestream.reference import resident_model

BITS = "gate_proj=4,up_proj=3,down_proj=6"


def stepwise(model, prompt: mx.array, steps: int) -> list[mx.array]:
    cache = make_prompt_cache(model)
    out = [model(prompt, cache=cache)]
    for _ in range(steps):
        token = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
        out.append(model(token, cache=cache))
    mx.eval(out)
    return out


def main() -> None:
    print("device", mx.default_device())
    prompt = mx.array([[(7 * i + 3) % 300 for i in range(80)]])
    with tempfile.TemporaryDirectory() as tmp:
        src = tiny_qwen3_moe(Path(tmp) / "hf")
        convert(str(src), Path(tmp) / "out", bits=BITS, progress=False)
        for dtype in ("bfloat16", "float32"):
            ref = stepwise(
                resident_model(src, Recipe.parse(BITS), compute_dtype=dtype), prompt, 8
            )
            for cap in (2, 5, 8):
                t = time.perf_counter()
                model, _ = moestream.load(
                    Path(tmp) / "out", cache_experts=cap, dtype=dtype
                )
                ours = stepwise(model, prompt, 8)
                same = [
                    mx.array_equal(a, b).item() for a, b in zip(ours, ref, strict=True)
                ]
                diff = max(
                    mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                    for a, b in zip(ours, ref, strict=True)
                )
                s = moestream.stats(model)
                print(
                    f"{dtype:9s} cache {cap}: prefill exact {same[0]}, decode exact "
                    f"{all(same[1:])}, max |diff| {diff:.3g}, grouped calls "
                    f"{s.grouped_calls}, misses {s.misses} "
                    f"({time.perf_counter() - t:.1f}s)"
                )


if __name__ == "__main__":
    main()
