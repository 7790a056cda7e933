"""`moestream plan`'s decode forecast against real runs, side by side.

For each slot count: run-moe decodes (fresh process, warm page cache,
sampled at temperature 1 from the packaged bench prompt), then `moestream
plan` forecasts at the hit rate that run measured (and at uniform routing's);
interleaved over rounds, medians reported, with the spread of the measured
runs and the machine's load average while they ran (a shared machine's
speed moves with it).

    python scripts/forecast_check.py OUT --slots 64,16,8 [--rounds 2] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from importlib import resources
from pathlib import Path

BIN = Path(sys.executable).parent


def run_json(args: list[str]) -> dict:
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(out: str, slots: int, tokens: int, prompt: str) -> dict:
    return run_json(
        [
            str(BIN / "run-moe"),
            out,
            "-p",
            prompt,
            "--ignore-chat-template",
            "-m",
            str(tokens),
            "--temp",
            "1",
            "--seed",
            "0",
            "--cache-experts",
            str(slots),
            "--json",
        ]
    )["stats"]


def forecast(out: str, slots: int, hit: float) -> dict:
    proc = subprocess.run(
        [
            str(BIN / "moestream"),
            "plan",
            out,
            "--cache-experts",
            str(slots),
            "--hit-rate",
            f"{min(hit, 1.0):.4f}",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--slots", default="64,16,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=24)
    a = p.parse_args()
    text = resources.files("moestream.bench").joinpath("prompt.txt").read_text()
    prompt = text[:64]
    slots = [int(s) for s in a.slots.split(",")]
    rows: dict[int, list[dict]] = {s: [] for s in slots}
    loads = [os.getloadavg()[0]]
    for r in range(a.rounds):
        for s in slots:
            m = measure(a.out, s, a.tokens, prompt)
            f = forecast(a.out, s, m["hit_rate"])
            rows[s].append({"measured": m, "forecast": f})
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1} slots {s}: ok", file=sys.stderr, flush=True)
    print(
        "| slots | hit rate (run) | measured tok/s (spread) | forecast at that hit "
        "rate | forecast / measured | forecast, uniform routing "
        "| probe compute tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for s, runs in rows.items():

        def med(fn, runs=runs):
            return statistics.median(fn(x) for x in runs)

        hit = med(lambda x: x["measured"]["hit_rate"])
        tps = med(lambda x: x["measured"]["generation_tps"])
        at_hit = med(lambda x: x["forecast"]["forecast"][-1]["warm_tps"])
        uniform = med(lambda x: x["forecast"]["forecast"][0]["warm_tps"])
        compute = med(lambda x: 1 / x["forecast"]["probe"]["token_s"])
        spread = [x["measured"]["generation_tps"] for x in runs]
        print(
            f"| {s} | {hit:.3f} | {tps:.2f} ({min(spread):.2f}-{max(spread):.2f}) "
            f"| {at_hit:.2f} | {at_hit / tps:.2f} | {uniform:.2f} | {compute:.2f} |"
        )
    print(f"\nload average (1 min) during the runs: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
