"""Decode tok/s of the streaming model with and without the exact CPU kernel,
beside mlx-lm's resident model on the same weights, in one run.

    .venv/bin/python scripts/kernel_bench.py build/bench-small [--rounds 5]

Every variant is loaded first; then each round decodes `--tokens` tokens with
each variant in turn (so a change in the machine's load hits all alike), and
the table gives each variant's median tok/s and its ratio to the resident
model's. Sampling is at temperature 1 from one seed, the same for all, so the
routing does not repeat; the greedy tokens of every variant are checked equal
to the resident model's first (the kernel is exact).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from moestream.formats import load_manifest
from moestream.reference import resident_from_converted
from moestream.runtime import load

PROMPT = list(range(1, 17))


def decode(model: nn.Module, tokens: int, temp: float, seed: int) -> tuple[float, list]:
    """Seconds per decoded token after a 16-token prefill, and the tokens."""
    mx.random.seed(seed)
    cache = make_prompt_cache(model)
    logits = model(mx.array(PROMPT)[None], cache=cache)[:, -1]
    out = []

    def pick(logits: mx.array) -> mx.array:
        if temp == 0:
            return mx.argmax(logits, axis=-1)
        return mx.random.categorical(logits / temp)

    token = pick(logits)
    mx.eval(token)
    start = time.perf_counter()
    for _ in range(tokens):
        logits = model(token[None], cache=cache)[:, -1]
        token = pick(logits)
        mx.eval(token)
        out.append(token.item())
    return (time.perf_counter() - start) / tokens, out


def variants(model_dir: Path, pcts: list[float]) -> dict[str, nn.Module]:
    experts = load_manifest(model_dir).layers[0].num_experts
    models = {"mlx-lm resident": resident_from_converted(model_dir)}
    for pct in pcts:
        slots = max(8, round(experts * pct / 100))
        for kernel in (False, True):
            name = f"native {pct:.0f} %" + (" + kernel" if kernel else "")
            models[name], _ = load(model_dir, cache_experts=slots, cpu_kernel=kernel)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pcts", default="100,25")
    args = ap.parse_args()
    models = variants(args.model, [float(p) for p in args.pcts.split(",")])
    greedy = {n: decode(m, 8, 0.0, 0)[1] for n, m in models.items()}
    first = greedy["mlx-lm resident"]
    same = {n: t == first for n, t in greedy.items()}
    times: dict[str, list[float]] = {n: [] for n in models}
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout]
    for r in range(args.rounds):
        for name, model in models.items():
            times[name].append(decode(model, args.tokens, 1.0, r)[0])
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    print("load before/after:", *(u.strip() for u in uptime), sep="\n  ")
    base = statistics.median(times["mlx-lm resident"])
    print(
        "| variant | decode tok/s (median) | x resident | greedy tokens = resident's |"
    )
    print("|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {1 / med:.2f} | {base / med:.2f} | {same[name]} |")


if __name__ == "__main__":
    main()
