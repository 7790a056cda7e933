"""RuntimeConfig variants beyond RAM, paired: each round runs every variant's
cold job, then its warm one, under one balloon, in a rotated order.

    python scripts/beyond_ab.py OUT --compare mapped=true \\
        --compare mapped=true,prefetch_extra=0 [--rounds 4] [--budget 25] \\
        [--tokens 128] [--floor 5.5G] [--trace FILE.npz]

`moestream bench beyond-ram` runs its rows in one order every repeat, so a
machine that slows down over a repeat (other processes' load) counts against
its later rows. A `--compare` may name another conversion of the same
weights (`model=DIR`, e.g. `convert-moe --layout blocked`) beside its
fields (`backend=mapped,model=build/medium-blocked`). Here the first
`--compare` is the base; every round starts at
the next variant and every other pass through them runs backwards, and each variant's
tok/s is divided by the base's of the same round. Prints each variant's
median tok/s cold and warm, the per-round ratios to the base and their
median, and the CPU time a cold decode token took. Jobs are the bench's own
(fresh processes, cold = the blobs dropped from the page cache first).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from dataclasses import replace
from pathlib import Path

from moestream.bench.balloon import Balloon
from moestream.bench.beyond import BeyondConfig, _moe, moestream_job
from moestream.bench.cli import parse_compare
from moestream.units import parse_size


def _order(variants: list, round_: int) -> list:
    """Rotated by one a round, and backwards every other pass through the
    rotations (with two variants: ab, ba, ba, ab)."""
    start = round_ % len(variants)
    order = variants[start:] + variants[:start]
    return order[::-1] if round_ // len(variants) % 2 else order


def _variant(text: str) -> tuple[str, dict, Path | None]:
    """`--compare` text -> (label, runtime fields, another model or None)."""
    parts = text.split(",")
    models = [p.partition("=")[2] for p in parts if p.startswith("model=")]
    rest = ",".join(p for p in parts if not p.startswith("model="))
    fields = parse_compare(rest)[1] if rest else {}
    return text, fields, Path(models[-1]) if models else None


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
    p.add_argument(
        "--no-balloon",
        action="store_true",
        help="no balloon: a model larger than the machine's whole RAM",
    )
    args = p.parse_args()
    variants = [_variant(text) for text in args.compare]
    cfg = BeyondConfig(
        out=args.out, gguf=None, exe=None, decode_tokens=args.tokens, trace=args.trace
    )
    floor = max(parse_size(args.floor), 4 << 30)  # as the bench: never under 4G
    runs: dict[str, dict[str, list[float]]] = {
        name: {"cold": [], "warm": [], "cpu": [], "tokens": []}
        for name, _, _ in variants
    }
    balloon = (
        contextlib.nullcontext()
        if args.no_balloon
        else Balloon(leave=floor + (512 << 20), floor=floor)
    )
    with balloon as held:
        if held is not None:
            print(f"balloon holds {held.held >> 20} MB", flush=True)
        for r in range(args.rounds):
            for name, fields, model in _order(variants, r):
                at = replace(cfg, out=model) if model else cfg
                cold = _moe(moestream_job(at, args.budget, True, fields))
                warm = _moe(moestream_job(at, args.budget, False, fields))
                runs[name]["cold"].append(cold["tps"])
                runs[name]["warm"].append(warm["tps"])
                runs[name]["cpu"].append(cold["cpu"])
                runs[name]["tokens"] += [cold["tokens"], warm["tokens"]]
                print(
                    f"{time.strftime('%H:%M:%S')} round {r} {name}: cold "
                    f"{cold['tps']:.2f} warm {warm['tps']:.2f} tok/s",
                    flush=True,
                )
    base = runs[variants[0][0]]
    print(
        "\n| variant | cold tok/s (rounds) | warm tok/s (rounds) "
        "| cold / base (median) | warm / base (median) | CPU ms/tok cold "
        "| tokens = base |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in variants:
        v = runs[name]
        cold = [a / b for a, b in zip(v["cold"], base["cold"], strict=True)]
        warm = [a / b for a, b in zip(v["warm"], base["warm"], strict=True)]
        print(
            f"| {name} | {statistics.median(v['cold']):.2f} ({_cells(v['cold'])}) "
            f"| {statistics.median(v['warm']):.2f} ({_cells(v['warm'])}) "
            f"| {_cells(cold)} ({statistics.median(cold):.2f}) "
            f"| {_cells(warm)} ({statistics.median(warm):.2f}) "
            f"| {1e3 * statistics.median(v['cpu']):.0f} "
            f"| {all(t == base['tokens'][0] for t in v['tokens'])} |"
        )


if __name__ == "__main__":
    main()
