"""Decode (and prefill) tok/s of the streaming model with and without the exact
CPU kernel, beside mlx-lm's resident model on the same weights, in one run.

    .venv/bin/python scripts/kernel_bench.py build/bench-small [--rounds 5]
        [--prompt-tokens 128,1024] [--kernel-only]

Every variant is loaded first; then each round decodes `--tokens` tokens with
each variant in turn (so a change in the machine's load hits all alike), and
the table gives each variant's median tok/s and its ratio to the resident
model's. Sampling is at temperature 1 from one seed, the same for all, so the
routing does not repeat; the greedy tokens of every variant are checked equal
to the resident model's first (the kernel is exact). With --prompt-tokens,
each round also times a prefill of each length (prompt to logits), and the
prefill logits of every variant are checked equal to the resident model's
once; --kernel-only leaves out the variants without the kernel.
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


def prefill(model: nn.Module, tokens: int) -> tuple[float, mx.array]:
    """Seconds to prefill a `tokens` prompt (to its last logits), and those."""
    prompt = mx.array([(7 * i + 3) % 8000 + 1 for i in range(tokens)])[None]
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(prompt, cache=cache)[:, -1]
    mx.eval(logits)
    return time.perf_counter() - start, logits


def variants(
    model_dir: Path, pcts: list[float], kernel_only: bool
) -> dict[str, nn.Module]:
    experts = load_manifest(model_dir).layers[0].num_experts
    models = {"mlx-lm resident": resident_from_converted(model_dir)}
    for pct in pcts:
        slots = max(8, round(experts * pct / 100))
        for kernel in (True,) if kernel_only else (False, True):
            name = f"native {pct:.0f} %" + (" + kernel" if kernel else "")
            models[name], _ = load(model_dir, cache_experts=slots, cpu_kernel=kernel)
    return models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--pcts", default="100,25")
    ap.add_argument("--prompt-tokens", default="")
    ap.add_argument("--kernel-only", action="store_true")
    args = ap.parse_args()
    prompts = [int(p) for p in args.prompt_tokens.split(",") if p]
    pcts = [float(p) for p in args.pcts.split(",")]
    models = variants(args.model, pcts, args.kernel_only)
    same = check(models, prompts)
    times: dict[str, list[float]] = {n: [] for n in models}
    fills = {(n, p): [] for n in models for p in prompts}
    uptime = [subprocess.run(["uptime"], capture_output=True, text=True).stdout]
    for r in range(args.rounds):
        for name, model in models.items():
            times[name].append(decode(model, args.tokens, 1.0, r)[0])
            for p in prompts:
                fills[name, p].append(prefill(model, p)[0])
    uptime.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    print("load before/after:", *(u.strip() for u in uptime), sep="\n  ")
    table(times, fills, prompts, same)


def check(models: dict[str, nn.Module], prompts: list[int]) -> dict[str, bool]:
    """Per variant: greedy tokens and prefill logits equal to the resident's."""
    ref = models["mlx-lm resident"]
    first = decode(ref, 8, 0.0, 0)[1]
    logits = [prefill(ref, p)[1] for p in prompts]
    same = {}
    for name, model in models.items():
        ok = decode(model, 8, 0.0, 0)[1] == first
        for p, theirs in zip(prompts, logits, strict=True):
            ok = ok and mx.array_equal(prefill(model, p)[1], theirs).item()
        same[name] = ok
    return same


def table(times: dict, fills: dict, prompts: list[int], same: dict) -> None:
    base = statistics.median(times["mlx-lm resident"])
    cols = "".join(f" prefill {p} tok/s | x resident |" for p in prompts)
    print(f"| variant | decode tok/s (median) | x resident |{cols} same as resident |")
    print("|---" * (4 + 2 * len(prompts)) + "|")
    for name, ts in times.items():
        med = statistics.median(ts)
        row = f"| {name} | {1 / med:.2f} | {base / med:.2f} |"
        for p in prompts:
            f = statistics.median(fills[name, p])
            f0 = statistics.median(fills["mlx-lm resident", p])
            row += f" {p / f:.1f} | {f0 / f:.2f} |"
        print(f"{row} {same[name]} |")


if __name__ == "__main__":
    main()
