"""This machine's disk read throughput against the reader threads
(`Tuning.readers`), through the native engine's own record reads.

A slot miss reads its record in `readers` pieces at once on the reader threads
(csrc/record_reader.cpp): the disk sees that many reads in flight. Each run, a
fresh process: load a synthetic model with half of each layer's experts in
slots (nothing read at load), evict its blobs from the page cache
(POSIX_FADV_DONTNEED), then load every expert of every layer into the slots,
the first half then the second (each a miss: one record read); the bytes the
process read from storage (/proc/self/io) over the time. Runs of every reader
count interleaved in each repeat; medians.

    python scripts/reader_depth.py [--readers 1,2,4,8,16] [--repeats 3] [--verify]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Qwen3-30B-A3B's expert geometry (D 2048 -> F 768, 4-bit: 2.65 MB records),
# 4 layers of 32 experts: 340 MB of records.
SCALE = dict(
    layers=4, experts=32, top_k=8, hidden=2048, moe_intermediate=768,
    heads=8, kv_heads=2, head_dim=64, vocab=1024,
)  # fmt: skip


def one(out: str, readers: int, verify: bool) -> dict:
    import numpy as np

    import moestream
    from moestream.bench.sysio import drop_cache, read_bytes
    from moestream.runtime.switch import StreamingSwitchGLU

    half = SCALE["experts"] // 2
    model, _ = moestream.load(
        out,
        cache_experts=half,
        readers=readers,
        verify=verify,
        prefetch=False,
        engine="native",
    )
    layers = [m for _, m in model.named_modules() if isinstance(m, StreamingSwitchGLU)]
    for blob in sorted(Path(out, "experts").glob("*.blob")):
        drop_cache(blob)
    before, t0 = read_bytes(), time.perf_counter()
    for layer in layers:
        layer._engine.load(np.arange(half))
        layer._engine.load(np.arange(half, 2 * half))
    seconds = time.perf_counter() - t0
    stats = moestream.stats(model)
    return {
        "readers": readers,
        "seconds": seconds,
        "storage_bytes": read_bytes() - before,
        "bytes_read": stats.bytes_read,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--verify", action="store_true", help="check each record's CRC")
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.one, args.verify)))
        return 0
    from moestream.bench.models import Scale, write_synthetic

    counts = [int(r) for r in args.readers.split(",")]
    runs: dict[int, list[dict]] = {r: [] for r in counts}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        write_synthetic(out, Scale(**SCALE))
        for _ in range(args.repeats):
            for r in counts:
                cmd = [sys.executable, __file__, "--model", str(out), "--one", str(r)]
                cmd += ["--verify"] if args.verify else []
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                runs[r].append(json.loads(done.stdout.splitlines()[-1]))
    print("| readers | GB/s (runs) | from storage / read |")
    print("|---|---|---|")
    for r, got in runs.items():
        rates = [x["bytes_read"] / x["seconds"] / 1e9 for x in got]
        cold = statistics.median(x["storage_bytes"] / x["bytes_read"] for x in got)
        runs_text = ", ".join(f"{x:.2f}" for x in rates)
        print(f"| {r} | {statistics.median(rates):.2f} ({runs_text}) | {cold:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
