"""MLX's peak memory in a prefill with the fast arithmetic, beside the memory
plan's figure for what MLX holds (the plan's total less the process and the
reserve, which MLX's counters do not see).

Each row runs in a fresh process: load a synthetic model (float32, on this
machine's default device), reset MLX's peak, prefill `--tokens` tokens, read
the peak. Rows: the exact arithmetic and the fast one at each slot share.

    python scripts/fast_memory.py [--tokens 256] [--slots 100,50,25] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# 4 layers of 32 experts, top-4, D 512 -> F 256: a layer's 32 experts are
# 50 MB dequantized to float32, 7 MB at 4 bits.
SCALE = dict(
    layers=4, experts=32, top_k=4, hidden=512, moe_intermediate=256,
    heads=8, kv_heads=2, head_dim=64, vocab=2048,
)  # fmt: skip
CONTEXT = 512


def one(out: str, arithmetic: str, slots: int, tokens: int) -> dict:
    """One row in this process."""
    import mlx.core as mx

    import moestream

    model, _ = moestream.load(
        out,
        cache_experts=slots,
        arithmetic=arithmetic,
        dtype="float32",
        context=CONTEXT,
        prefetch=False,
    )
    plan = moestream.runtime_of(model).plan
    prompt = mx.array([[(7 * i + 3) % SCALE["vocab"] for i in range(tokens)]])
    mx.eval(model(prompt[:, :8]))  # first-use checks, kernels
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(model(prompt))
    mx.synchronize()
    stats = moestream.stats(model)
    return {
        "arithmetic": arithmetic,
        "slots": slots,
        "peak": mx.get_peak_memory(),
        "before": before,
        "planned": plan.total - plan.process - plan.reserve,
        "fast_scratch": getattr(plan, "fast_scratch", 0),
        "fast_calls": stats.fast_calls,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--slots", default="100,50,25", help="% of each layer's experts")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        arithmetic, slots = args.row.split(":")
        print(json.dumps(one(args.model, arithmetic, int(slots), args.tokens)))
        return 0
    from moestream.bench.models import Scale, write_synthetic

    rows = [("exact", 100)] + [("fast", int(s)) for s in args.slots.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "model"
        write_synthetic(out, Scale(**SCALE))
        got: dict[tuple[str, int], list[dict]] = {r: [] for r in rows}
        for _ in range(args.repeats):  # rows interleaved in each repeat
            for arithmetic, pct in rows:
                slots = max(SCALE["top_k"], SCALE["experts"] * pct // 100)
                cmd = [sys.executable, __file__, "--model", str(out)]
                cmd += ["--row", f"{arithmetic}:{slots}", "--tokens", str(args.tokens)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                got[(arithmetic, pct)].append(json.loads(done.stdout.splitlines()[-1]))
    mb = 1e6
    print("| arithmetic | slots | fast calls | MLX peak MB | planned MB (of it fast) "
          "| peak / planned |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for (arithmetic, pct), runs in got.items():
        peaks = [r["peak"] for r in runs]
        r = runs[0]
        peak = statistics.median(peaks)
        print(
            f"| {arithmetic} | {r['slots']} ({pct} %) | {r['fast_calls']} | "
            f"{peak / mb:.1f} ({min(peaks) / mb:.1f}-{max(peaks) / mb:.1f}) | "
            f"{r['planned'] / mb:.1f} ({r['fast_scratch'] / mb:.1f}) | "
            f"{peak / r['planned']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
