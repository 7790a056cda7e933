"""Runtime modes side by side in one process, decode steps interleaved.

    python scripts/mode_ab.py OUT --budget 25 [--compare speculate=false ...]
        [--steps 48] [--warmup 8] [--seed 0] [--cold]

Loads mlx-lm's resident model and one streaming model per variant (the base
RuntimeConfig, then each `--compare FIELD=VALUE[,...]` as `moestream bench`
takes it), all at `--budget` % of each layer's experts. Every round runs one
decode step of each model, in a new random order, so a burst of load from
other processes hits all of them alike; prints each variant's median step
time and, per round, its time over the base's: median and quartiles. Every
model must produce the same tokens (seeded sampling, one key per step).
`--cold` drops the blobs from the page cache before every streaming step, so
each step's misses come from the disk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_config, load_tokenizer

import moestream
from moestream.bench.cli import parse_compare
from moestream.bench.harness import capacity_for
from moestream.bench.worker import prompt_ids
from moestream.formats import load_manifest
from moestream.reference import resident_from_converted


class Decoder:
    """One model's sampled decode, one synchronous step at a time."""

    def __init__(self, model, prompt: mx.array, seed: int, cold: bool = False):
        self.model, self.cache = model, make_prompt_cache(model)
        self.runtime = moestream.runtime_of(model) if cold else None
        self.key = mx.random.key(seed)
        self.logits = model(prompt[None], cache=self.cache)[:, -1]
        self.tokens: list[int] = []

    def step(self) -> float:
        if self.runtime is not None:
            self.runtime.drop_cache()
        start = time.perf_counter()
        self.key, k = mx.random.split(self.key)
        token = mx.random.categorical(self.logits, key=k)
        self.logits = self.model(token[:, None], cache=self.cache)[:, -1]
        mx.eval(self.logits, token)
        self.tokens.append(token.item())
        return time.perf_counter() - start


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--budget", type=float, default=25)
    p.add_argument("--compare", action="append", default=[])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cold", action="store_true")
    a = p.parse_args()
    experts = max(layer.num_experts for layer in load_manifest(a.out).layers)
    top_k = int(load_config(Path(a.out)).get("num_experts_per_tok", 1))
    cap = capacity_for(a.budget, experts, top_k)
    tok = load_tokenizer(a.out)
    prompt = mx.array(prompt_ids(tok, 16))
    variants = [("base", {})] + [parse_compare(c) for c in a.compare]
    models = {"resident": resident_from_converted(a.out)}
    for label, fields in variants:
        models[label] = moestream.load(a.out, cache_experts=cap, **fields)[0]
    decoders = {
        k: Decoder(m, prompt, a.seed, a.cold and k != "resident")
        for k, m in models.items()
    }
    rng = random.Random(a.seed)
    times: dict[str, list[float]] = {k: [] for k in decoders}
    for i in range(a.warmup + a.steps):
        order = list(decoders)
        rng.shuffle(order)
        for k in order:
            t = decoders[k].step()
            if i >= a.warmup:
                times[k].append(t)
    same = {k: d.tokens == decoders["resident"].tokens for k, d in decoders.items()}
    mode = "cold" if a.cold else "warm"
    print(
        f"{a.out}: {cap} of {experts} slots ({a.budget:g} %), {a.steps} steps, {mode}"
    )
    print("| variant | median ms/step | x resident | time / base: q1, median, q3 |")
    print("|---|---|---|---|")
    res = statistics.median(times["resident"])
    for k, ts in times.items():
        ratios = [t / b for t, b in zip(ts, times["base"], strict=True)]
        q1, med, q3 = quartiles(ratios)
        m = statistics.median(ts)
        print(
            f"| {k} | {1e3 * m:.1f} | {res / m:.3f} | {q1:.3f}, {med:.3f}, {q3:.3f} |"
            + ("" if same[k] else " TOKENS DIFFER")
        )


if __name__ == "__main__":
    main()
