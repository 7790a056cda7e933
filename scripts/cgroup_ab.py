"""RuntimeConfig variants paired, each row a fresh process, optionally inside a
memory cgroup (v1) so that the model is larger than the RAM left to it
without ballooning a shared machine.

    python scripts/cgroup_ab.py OUT RESULTS.jsonl --compare default \\
        --compare prefetch=false --compare host_budget=1G [--rounds 3] \\
        [--budget 25] [--tokens 32] [--cgroup /sys/fs/cgroup/memory/ms-bench \\
        --limit 4G]

Each round runs every variant's cold row, then its warm row right after (what
that cold row left in the page cache), in beyond_ab.py's order: every round
starts at the next variant and every other round runs backwards (A B / B A),
so a burst of other processes' load hits all variants alike. With
`--cgroup`, every row's worker is started inside that memory cgroup (its
anonymous memory and the page cache it reads are charged to it, so a blob
larger than `--limit` does not fit); without it, the row runs in RAM. Cold =
the blobs dropped from the page cache (POSIX_FADV_DONTNEED, the bench's
`drop_cache`) at load and before the timed decode. Jobs are the bench's own
(moestream.bench.worker: sampled decode, temperature 1, seed 0, a 16-token
prompt). Every row is appended to RESULTS.jsonl as it ends; `--summary`
prints the tables of a results file (pairs given as `--pair B:A`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from moestream.bench.beyond import BeyondConfig, moestream_job
from moestream.bench.cli import parse_compare
from moestream.units import parse_size


def _order(variants: list, round_: int) -> list:
    # Rotated every second round and reversed every other one: A B, B A, B A,
    # A B for two variants (beyond_ab.py's `round % n` start left two in
    # A B order every round: the runs of 2026-12-04 04:35 used that).
    start = (round_ // 2) % len(variants)
    order = variants[start:] + variants[:start]
    return order[::-1] if round_ % 2 else order


def _variant(text: str) -> tuple[str, dict]:
    return ("default", {}) if text == "default" else parse_compare(text)


def _cg_write(cgroup: Path, name: str, value: str) -> None:
    (cgroup / name).write_text(value)


def _cg_read(cgroup: Path, name: str) -> int:
    return int((cgroup / name).read_text().split()[0])


def run_row(job, cgroup: Path | None) -> dict:
    argv = [sys.executable, "-m", "moestream.bench.worker", json.dumps(asdict(job))]
    if cgroup is not None:
        _cg_write(cgroup, "memory.max_usage_in_bytes", "0")
        argv = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "sh"]
        argv += [sys.executable, "-m", "moestream.bench.worker"]
        argv += [json.dumps(asdict(job))]
    load = os.getloadavg()[0]
    start = time.time()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.time() - start
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:] or ["(no output)"]
        return {"error": f"rc {proc.returncode}: {' | '.join(tail)}", "load1": load}
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    row = {
        "tps": r["decode_tps"],
        "tokens": r["tokens"],
        "cpu_s_per_token": r["cpu_s_per_token"],
        "disk_mb_per_token": r["disk_bytes_per_token"] / 1e6,
        "read_mb_per_token": r.get("bytes_per_token", 0) / 1e6,
        "hit_rate": r.get("hit_rate"),
        "host_hit_rate": r.get("host_hit_rate"),
        "peak_rss_mb": r["peak_rss"] / 2**20,
        "capacity": r.get("capacity"),
        "host_tier": r.get("host_tier"),
        "wall_s": wall,
        "load1": load,
    }
    if cgroup is not None:
        row["cg_max_usage_mb"] = _cg_read(cgroup, "memory.max_usage_in_bytes") / 2**20
        row["cg_failcnt"] = _cg_read(cgroup, "memory.failcnt")
    return row


def measure(a: argparse.Namespace) -> None:
    variants = [_variant(t) for t in a.compare]
    cfg = BeyondConfig(out=Path(a.out), gguf=None, exe=None, decode_tokens=a.tokens)
    cgroup = Path(a.cgroup) if a.cgroup else None
    if cgroup is not None:
        cgroup.mkdir(exist_ok=True)
        _cg_write(cgroup, "memory.limit_in_bytes", str(parse_size(a.limit)))
    with open(a.results, "a") as f:
        for r in range(a.start_round, a.start_round + a.rounds):
            for name, fields in _order(variants, r):
                for cold in (True, False):
                    job = moestream_job(cfg, a.budget, cold, fields)
                    row = run_row(job, cgroup)
                    row.update(
                        case=a.case,
                        variant=name,
                        mode="cold" if cold else "warm",
                        round=r,
                        time=time.strftime("%H:%M:%S"),
                    )
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    msg = row.get("error") or f"{row['tps']:.2f} tok/s"
                    print(
                        f"{row['time']} {a.case} round {r} {name} {row['mode']}: "
                        f"{msg} (load {row['load1']:.2f})",
                        flush=True,
                    )


def _cells(values: list[float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values)


def _med(runs: dict, rounds: list, key: str, scale: float = 1.0) -> float:
    return scale * statistics.median(runs[i][key] for i in rounds)


def summary(a: argparse.Namespace) -> None:
    rows = [json.loads(line) for line in Path(a.results).read_text().splitlines()]
    rows = [r for r in rows if "error" not in r]
    by: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by.setdefault((r["case"], r["variant"], r["mode"]), {})[r["round"]] = r
    print(
        "| case | mode | B | A | B tok/s median | A tok/s median "
        "| B/A per round | B/A median | rounds | tokens identical "
        "| CPU ms/tok B / A | disk MB/tok B / A |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    cases = sorted({r["case"] for r in rows})
    for case in cases:
        ref = next(r["tokens"] for r in rows if r["case"] == case)
        for pair in a.pair:
            b_name, _, a_name = pair.partition(":")
            for mode in ("cold", "warm"):
                rb = by.get((case, b_name, mode), {})
                ra = by.get((case, a_name, mode), {})
                both = sorted(set(rb) & set(ra))
                if not both:
                    continue
                ratios = [rb[i]["tps"] / ra[i]["tps"] for i in both]
                same = all(x[i]["tokens"] == ref for x in (rb, ra) for i in both)
                print(
                    f"| {case} | {mode} | {b_name} | {a_name} "
                    f"| {statistics.median(rb[i]['tps'] for i in both):.3f} "
                    f"| {statistics.median(ra[i]['tps'] for i in both):.3f} "
                    f"| {_cells(ratios)} | {statistics.median(ratios):.3f} "
                    f"| {len(both)} | {same} "
                    f"| {_med(rb, both, 'cpu_s_per_token', 1e3):.0f} / "
                    f"{_med(ra, both, 'cpu_s_per_token', 1e3):.0f} "
                    f"| {_med(rb, both, 'disk_mb_per_token'):.0f} / "
                    f"{_med(ra, both, 'disk_mb_per_token'):.0f} |"
                )
    loads = [r["load1"] for r in rows]
    print(
        f"\nload average (1 min) at row starts: median {statistics.median(loads):.2f}, "
        f"min {min(loads):.2f}, max {max(loads):.2f}; {len(rows)} rows"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("results")
    p.add_argument("--case", default="")
    p.add_argument("--compare", action="append", default=[])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--start-round", type=int, default=0)  # continue a run
    p.add_argument("--budget", type=float, default=25)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--cgroup")
    p.add_argument("--limit", default="4G")
    p.add_argument("--summary", action="store_true")
    p.add_argument("--pair", action="append", default=[])
    a = p.parse_args()
    summary(a) if a.summary else measure(a)


if __name__ == "__main__":
    main()
