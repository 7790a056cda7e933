"""Decode speed of one fresh process, window by window: how a run's first
tokens compare with its later ones (slot fills, first reads, kernel shapes).

    python scripts/decode_windows.py OUT resident
    python scripts/decode_windows.py OUT stream '{"cache_experts": 32}' [--bench]

Loads OUT (mlx-lm's resident model, or moestream with the RuntimeConfig
fields given as JSON), decodes 4 warm-up tokens of another prompt as the
bench does, then TOKENS sampled tokens (seeded, temperature 1), and prints
each window's tok/s, median and worst token time and, when streaming, the
window's slot fills, slot hit rate and host tier counters. `--bench` sizes
the memory budget and context as `moestream bench` does.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer

import moestream
from moestream.formats import load_manifest
from moestream.formats.verify import check_files
from moestream.reference import resident_from_converted
from moestream.runtime import RuntimeConfig
from moestream.runtime.loader import budget_for

PROMPT = mx.array([(13 * i + 7) % 4000 for i in range(16)])
WARMUP = mx.array([(7 * i + 3) % 4000 for i in range(16)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("kind", choices=("resident", "stream"))
    ap.add_argument("options", nargs="?", default="{}")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--bench", action="store_true")
    args = ap.parse_args()
    options = json.loads(args.options)
    start = time.perf_counter()
    stats = None
    if args.kind == "resident":
        model = resident_from_converted(args.out)
    else:
        tokenizer = load_tokenizer(args.out)  # before the budget, as the bench
        if args.bench:
            context = len(PROMPT) + args.tokens + 1
            cfg = RuntimeConfig(**options)
            if cfg.verify:  # as load will: its read buffers stay in RSS
                check_files(args.out, load_manifest(args.out))
            options["context"] = context
            options["memory_budget"] = budget_for(
                args.out, options["cache_experts"], context, cfg
            )
        model, _ = moestream.load(
            args.out, RuntimeConfig(**options), tokenizer=tokenizer
        )
        stats = moestream.stats(model)
    load_s = time.perf_counter() - start
    for _ in generate_step(WARMUP, model, max_tokens=4):
        pass
    if stats is not None:
        stats.reset()
    mx.random.seed(0)
    times: list[float] = []
    last = time.perf_counter()
    steps = generate_step(
        PROMPT, model, max_tokens=args.tokens + 1, sampler=make_sampler(1.0)
    )
    for i, _ in enumerate(steps):
        now = time.perf_counter()
        if i > 0:
            times.append(now - last)
        last = now
        if i == 0 or i % args.window:
            continue
        w = times[-args.window :]
        line = (
            f"tokens {i - args.window + 1}-{i}: {len(w) / sum(w):.1f} tok/s, "
            f"median {1e3 * statistics.median(w):.2f} ms, worst {1e3 * max(w):.1f}"
        )
        if stats is not None:
            s = stats.collect()
            line += (
                f" | slot fills {s.misses}, hit {s.hit_rate:.3f}, host tier "
                f"hit/late/miss {s.host_hits}/{s.host_late}/{s.host_misses}"
            )
            stats.reset()
        print(line, flush=True)
    print(
        f"{args.kind} {options}: load {load_s:.1f} s, "
        f"{len(times) / sum(times):.1f} tok/s over {len(times)} tokens, "
        f"device peak {mx.get_peak_memory() / 1e9:.2f} GB"
    )


if __name__ == "__main__":
    main()
