"""Decode tok/s of the streaming runtime at several cache sizes vs mlx-lm resident.

    python scripts/decode_ratio.py OUT 32,16,8,4 --tokens 60

A spot check (medians of interleaved repeats, greedy decode of a fixed prompt);
the benchmark harness with budgets, cold reads and Belady comes separately.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generate_step

import moestream
from moestream.reference import resident_from_converted


def decode_tps(model: nn.Module, prompt: mx.array, tokens: int) -> float:
    start, n = 0.0, 0
    for n, _ in enumerate(generate_step(prompt, model, max_tokens=tokens)):
        if n == 0:
            start = time.perf_counter()  # decode only: after the prompt
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("caches", help="comma-separated slots per layer")
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    prompt = mx.array([(13 * i + 7) % 2000 for i in range(16)])
    models = {"resident": resident_from_converted(a.out)}
    for c in a.caches.split(","):
        models[f"cache {c}"] = moestream.load(a.out, cache_experts=int(c))[0]
    runs: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(a.repeats):
        for name, model in models.items():
            runs[name].append(decode_tps(model, prompt, a.tokens))
    base = statistics.median(runs["resident"])
    print("| model | decode tok/s | ratio | hit rate |\n|---|---|---|---|")
    for name, values in runs.items():
        tps = statistics.median(values)
        hit = (
            ""
            if name == "resident"
            else f"{moestream.stats(models[name]).hit_rate:.3f}"
        )
        print(f"| {name} | {tps:.2f} | {tps / base:.3f} | {hit} |")


if __name__ == "__main__":
    main()
