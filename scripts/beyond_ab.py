"""RuntimeConfig variants beyond RAM, paired: each round runs every variant's
cold job, then its warm one, under one balloon, in a rotated order.

    python scripts/beyond_ab.py OUT --compare mapped=true \\
        --compare mapped=true,prefetch_extra=0 [--rounds 4] [--budget 25] \\
        [--tokens 128] [--floor 5.5G] [--trace FILE.npz]

`moestream bench beyond-ram` runs its rows in one order every repeat, so a
machine that slows down over a repeat (other processes' load) counts against
its later rows. Here the first `--compare` is the base; every round starts at
the next variant and every other round runs backwards, and each variant's
tok/s is divided by the base's of the same round. Prints each variant's
median tok/s cold and warm, the per-round ratios to the base and their
median, and the CPU time a cold decode token took. Jobs are the bench's own
(fresh processes, cold = the blobs dropped from the page cache first).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from moestream.bench.balloon import Balloon
from moestream.bench.beyond import BeyondConfig, _moe, moestream_job
from moestream.bench.cli import parse_compare
from moestream.units import parse_size


def _order(variants: list, round_: int) -> list:
    start = round_ % len(variants)
    order = variants[start:] + variants[:start]
    return order[::-1] if round_ % 2 else order


def _cells(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--compare", action="append", required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--budget", type=float, default=25)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--floor", default="5.5G")
    p.add_argument("--trace", type=Path)
    args = p.parse_args()
    variants = [parse_compare(text) for text in args.compare]
    cfg = BeyondConfig(
        out=args.out, gguf=None, exe=None, decode_tokens=args.tokens, trace=args.trace
    )
    floor = max(parse_size(args.floor), 4 << 30)  # as the bench: never under 4G
    runs: dict[str, dict[str, list[float]]] = {
        name: {"cold": [], "warm": [], "cpu": []} for name, _ in variants
    }
    with Balloon(leave=floor + (512 << 20), floor=floor) as balloon:
        print(f"balloon holds {balloon.held >> 20} MB", flush=True)
        for r in range(args.rounds):
            for name, fields in _order(variants, r):
                cold = _moe(moestream_job(cfg, args.budget, True, fields))
                warm = _moe(moestream_job(cfg, args.budget, False, fields))
                runs[name]["cold"].append(cold["tps"])
                runs[name]["warm"].append(warm["tps"])
                runs[name]["cpu"].append(cold["cpu"])
                print(
                    f"{time.strftime('%H:%M:%S')} round {r} {name}: cold "
                    f"{cold['tps']:.2f} warm {warm['tps']:.2f} tok/s",
                    flush=True,
                )
    base = runs[variants[0][0]]
    print(
        "\n| variant | cold tok/s (rounds) | warm tok/s (rounds) "
        "| cold / base (median) | warm / base (median) | CPU ms/tok cold |"
    )
    print("|---|---|---|---|---|---|")
    for name, _ in variants:
        v = runs[name]
        cold = [a / b for a, b in zip(v["cold"], base["cold"], strict=True)]
        warm = [a / b for a, b in zip(v["warm"], base["warm"], strict=True)]
        print(
            f"| {name} | {statistics.median(v['cold']):.2f} ({_cells(v['cold'])}) "
            f"| {statistics.median(v['warm']):.2f} ({_cells(v['warm'])}) "
            f"| {_cells(cold)} ({statistics.median(cold):.2f}) "
            f"| {_cells(warm)} ({statistics.median(warm):.2f}) "
            f"| {1e3 * statistics.median(v['cpu']):.0f} |"
        )


if __name__ == "__main__":
    main()
