"""Prefill speed against mlx-lm's resident model, this checkout and an older one
side by side: every run a fresh process (`moestream.bench.worker`, kernels
warmed up on a prompt as long as the timed one), rows interleaved in each
repeat, medians reported, each run's sampled tokens checked against the
resident model's.

    python scripts/gpu_prefill.py OUT --prompts 512,4096 --budgets 100,25 \\
        --repeats 3 [--arithmetic exact,fast] [--before DIR] [--json FILE]

`--arithmetic exact,fast`: each budget runs with each arithmetic
(RuntimeConfig.arithmetic); a fast row's tokens are checked against the first
fast row's (the fast arithmetic is not mlx-lm's). `--before DIR`: each
streaming row also runs the moestream package in DIR (an older checkout with
its extension built), e.g. `git worktree add DIR COMMIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

from moestream.bench.harness import capacity_for
from moestream.bench.worker import Job
from moestream.formats import load_manifest
from moestream.runtime.config import RuntimeConfig

ROOT = Path(__file__).resolve().parent.parent


def run(job: Job, root: Path) -> dict:
    """One fresh process of the worker, importing moestream from `root`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{root}:{env.get('PYTHONPATH', '')}"
    proc = subprocess.run(
        [sys.executable, "-m", "moestream.bench.worker", json.dumps(asdict(job))],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{root}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(
    out: Path,
    budgets: list[float],
    before: Path | None,
    tier: str | None,
    arithmetics: list[str],
    verify: bool = True,
) -> list[tuple]:
    """(name, capacity, root, runtime) per row; the resident row first. Rows
    under 100 % also run with a host tier of `tier` bytes, if given."""
    config = json.loads((out / "config.json").read_text())
    experts = max(layer.num_experts for layer in load_manifest(out).layers)
    top_k = int(config.get("num_experts_per_tok", 1))
    found = [("mlx-lm resident", None, ROOT, RuntimeConfig())]
    for arithmetic in arithmetics:
        default = RuntimeConfig(arithmetic=arithmetic, verify=verify)
        word = "" if arithmetic == "exact" else f" {arithmetic}"
        for pct in budgets:
            cap = capacity_for(pct, experts, top_k)
            tiers = [("", default)]
            if tier and pct < 100:
                tiers.append((f", tier {tier}", replace(default, host_budget=tier)))
            for label, runtime in tiers:
                name = f"{pct:g} %{word}{label}"
                if before is not None and arithmetic == "exact":
                    found.append((f"{name} before", cap, before, runtime))
                found.append((name, cap, ROOT, runtime))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--prompts", default="512")
    p.add_argument("--budgets", default="100,25")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--before", type=Path)
    p.add_argument("--tier", help="also rows with a host tier of this size")
    p.add_argument("--arithmetic", default="exact", help="exact, fast or both")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="no checksums at load (a shorter load; prefill's time is the same)",
    )
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    budgets = [float(b) for b in a.budgets.split(",")]
    arithmetics = a.arithmetic.split(",")
    table = rows(a.out, budgets, a.before, a.tier, arithmetics, not a.no_verify)
    results: dict = {}
    for prompt in [int(n) for n in a.prompts.split(",")]:
        base = Job(str(a.out), None, prompt_tokens=prompt, decode_tokens=a.tokens)
        for r in range(a.repeats):
            for name, cap, root, runtime in table:
                got = run(replace(base, capacity=cap, runtime=runtime), root)
                results.setdefault((prompt, name), []).append(got)
                if a.json:  # every run kept, should the call be cut short
                    flat = {f"{k[0]} {k[1]}": v for k, v in results.items()}
                    a.json.write_text(json.dumps(flat, indent=1, default=str))
                print(
                    f"{prompt} tokens, repeat {r + 1}, {name}: "
                    f"{got['prefill_tps']:.0f} tok/s",
                    flush=True,
                )
        report(prompt, table, results)


def report(prompt: int, table: list[tuple], results: dict) -> None:
    ref = results[prompt, table[0][0]]
    ref_tps = statistics.median(x["prefill_tps"] for x in ref)
    print(f"\nprefill of {prompt} tokens, medians of {len(ref)} fresh processes")
    print("| row | prefill tok/s (runs) | x resident | decode tok/s | tokens |")
    print("|---|---|---|---|---|")
    fast = [results[prompt, n] for n, _, _, r in table if r.arithmetic == "fast"]
    for name, _, _, runtime in table:
        runs = results[prompt, name]
        tps = [x["prefill_tps"] for x in runs]
        want = fast[0][0] if runtime.arithmetic == "fast" else ref[0]
        same = all(x["tokens"] == want["tokens"] for x in runs)
        mark = "identical" if same else "DIFFER"
        if runtime.arithmetic == "fast":
            mark += " (to the first fast row)"
        decode = statistics.median(x["decode_tps"] for x in runs)
        spread = ", ".join(f"{t:.0f}" for t in tps)
        print(
            f"| {name} | {statistics.median(tps):.0f} ({spread}) | "
            f"{statistics.median(tps) / ref_tps:.2f} | {decode:.1f} | "
            f"{mark} |"
        )
    print(flush=True)


if __name__ == "__main__":
    main()
