"""Streaming vs resident logits on a converted model, on whatever device MLX uses.

python scripts/gpu_diagnose.py OUT
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.reference import resident_from_converted


def logits(model, prompt, steps=4):
    cache = make_prompt_cache(model)
    out = [model(prompt, cache=cache)]
    tok = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
    for _ in range(steps):
        out.append(model(tok, cache=cache))
        tok = mx.argmax(out[-1][:, -1], axis=-1, keepdims=True)
    mx.eval(out)
    return out


def main() -> None:
    out = sys.argv[1]
    prompt = mx.array([[(13 * i + 7) % 4000 for i in range(12)]])
    ref = logits(resident_from_converted(out), prompt)
    ref2 = logits(resident_from_converted(out), prompt)
    print(
        "resident vs resident:",
        [mx.array_equal(a, b).item() for a, b in zip(ref, ref2, strict=True)],
    )
    small = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    for cap, prefetch in [(10**6, False), (small, False), (small, True)]:
        model, _ = moestream.load(out, cache_experts=cap, prefetch=prefetch)
        ours = logits(model, prompt)
        same = [mx.array_equal(a, b).item() for a, b in zip(ours, ref, strict=True)]
        diff = [mx.abs(a - b).max().item() for a, b in zip(ours, ref, strict=True)]
        print(f"cap {cap} prefetch {prefetch}: {same} max diff {diff}")


if __name__ == "__main__":
    main()
