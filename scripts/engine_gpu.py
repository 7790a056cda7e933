"""The native engine against mlx-lm's resident model on a GPU, one process.

    python scripts/engine_gpu.py OUT [TOKENS] [REPEATS] [ROWS]

Each row loads OUT with its options, decodes 8 warm-up tokens (every kernel
shape compiled, page cache warm), then alternates REPEATS decode runs of
TOKENS greedy tokens with runs of the resident model held beside it: the
ratio is the median of the per-repeat ratios. A cold row loads afresh (empty
slots and host tier), drops OUT's page cache and times its first TOKENS.
ROWS: the rows to run, by their indices in `rows` (e.g. 0,1,2,3); all unless given.
The last table gives each row against our own 100 % slots (row 0, the same
kernels with nothing to read) when it ran, and the bytes per token that the
slots were filled with from the host tier (over the bus) and read from the
blob (disk or page cache).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import moestream
from moestream.formats import load_manifest
from moestream.reference import resident_from_converted
from moestream.units import peak_rss

PROMPT = mx.array([(13 * i + 7) % 4000 for i in range(40)])


def decode(model, n: int) -> tuple[float, list[int]]:
    start, tokens = 0.0, []
    for i, (t, _) in enumerate(generate_step(PROMPT, model, max_tokens=n + 1)):
        if i == 0:
            start = time.perf_counter()  # after the prompt and first token
        else:
            tokens.append(int(t))
    return n / (time.perf_counter() - start), tokens


def rows(out: str) -> list[tuple[str, dict]]:
    layers = load_manifest(out).layers
    experts = layers[0].num_experts
    q, d = experts // 4, max(8, experts // 10)
    native = {"engine": "native"}
    tier = {**native, "host_budget": "1900M"}  # the 25 % of medium
    host_fn = {"device_resolve": False}
    return [
        ("native 100 %", {**native, "cache_experts": experts}),
        ("native 25 %", {**native, "cache_experts": q}),
        ("native 10 %", {**native, "cache_experts": d}),
        ("native 25 %, tier 1.9 GB", {**tier, "cache_experts": q}),
        ("native 10 %, tier 1.9 GB", {**tier, "cache_experts": d}),
        (
            "native 25 %, tier 1.9 GB, host function",
            {**tier, **host_fn, "cache_experts": q},
        ),
        # per-call trace records, as `moestream bench` loads
        (
            "native 25 %, record_trace",
            {**native, "record_trace": True, "cache_experts": q},
        ),
        ("native 25 %, host function", {**native, **host_fn, "cache_experts": q}),
        ("native 10 %, host function", {**native, **host_fn, "cache_experts": d}),
        ("python 25 %", {"cache_experts": q}),
    ]


def main() -> None:
    out = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    resident = resident_from_converted(out)
    decode(resident, 8)
    base_tps, ref = decode(resident, n)
    print(
        f"resident {base_tps:.1f} tok/s, "
        f"device peak {mx.get_peak_memory() / 1e6:.0f} MB"
    )
    print(
        "| row | mode | decode tok/s | x resident (spread) | hit | host tier hit | "
        "MB read/tok | slot fills/tok | pf precision | device calls | device peak MB "
        "| RSS MB | same |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    keep = [int(i) for i in sys.argv[4].split(",")] if len(sys.argv) > 4 else None
    summary = []
    for i, (name, options) in enumerate(rows(out)):
        if keep is not None and i not in keep:
            continue
        mx.reset_peak_memory()
        model, _ = moestream.load(out, **options)
        decode(model, 8)
        s = moestream.stats(model)
        s.reset()
        ratios, speeds, same = [], [], True
        for _ in range(repeats):
            base, _ = decode(resident, n)
            tps, tokens = decode(model, n)
            ratios.append(tps / base)
            speeds.append(tps)
            same &= tokens == ref
        s.collect()
        runs = repeats * n
        line(name, "warm", statistics.median(speeds), ratios, s, runs, same)
        peak = mx.get_peak_memory() / 1e6
        fill, disk = s.fill_bytes / runs / 1e6, s.bytes_read / runs / 1e6
        summary.append((name, statistics.median(speeds), fill, disk, peak))
        del model, s
        gc.collect()
        if name in ("native 25 %, tier 1.9 GB", "native 10 %, tier 1.9 GB"):
            model, _ = moestream.load(out, **options)
            model.moestream.drop_cache()
            moestream.stats(model).reset()
            base, _ = decode(resident, n)
            tps, tokens = decode(model, n)
            s = moestream.stats(model).collect()
            line(name, "cold", tps, [tps / base], s, n, tokens == ref)
            del model, s
            gc.collect()
    print_summary(summary)


def print_summary(summary: list[tuple]) -> None:
    full = [tps for name, tps, *_ in summary if name == "native 100 %"]
    print(
        "\n| row | decode tok/s | x our 100 % slots | host->device MB/tok "
        "| blob MB/tok | device peak MB |"
    )
    print("|---|---|---|---|---|---|")
    for name, tps, fill, disk, peak in summary:
        x = f"{tps / full[0]:.3f}" if full else ""
        print(f"| {name} | {tps:.1f} | {x} | {fill:.1f} | {disk:.1f} | {peak:.0f} |")


def line(name, mode, tps, ratios, s, runs, same) -> None:
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
    host = s.host_hits + s.host_late + s.host_misses
    host_hit = f"{s.host_hit_rate:.3f}" if host else ""
    print(
        f"| {name} | {mode} | {tps:.1f} | {statistics.median(ratios):.3f} ({spread}) "
        f"| {s.hit_rate:.3f} | {host_hit} | {s.bytes_read / runs / 1e6:.1f} "
        f"| {s.misses / runs:.1f} | {s.prefetch_precision:.2f} "
        f"| {s.device_calls / max(1, s.native_calls):.2f} "
        f"| {mx.get_peak_memory() / 1e6:.0f} | {peak_rss() / 1e6:.0f} | {same} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
