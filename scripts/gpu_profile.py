"""Where decode time goes on a GPU: resident vs streaming at full and partial
capacity, on each engine built here (greedy, after a warm-up run); and the
host memory the GPU runtime itself takes (RSS before and after its start).

    python scripts/gpu_profile.py OUT
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import moestream
from moestream.reference import resident_from_converted
from moestream.runtime import native
from moestream.runtime.loader import _process_bytes


def decode_tps(model, prompt, n=32):
    start = 0.0
    tokens = []
    for i, (t, _) in enumerate(generate_step(prompt, model, max_tokens=n)):
        if i == 0:
            start = time.perf_counter()
        tokens.append(int(t))
    return (n - 1) / (time.perf_counter() - start), tokens


def rss_mb() -> float:
    return _process_bytes() / 1e6


def main() -> None:
    out = sys.argv[1]
    before = rss_mb()
    mx.eval(mx.zeros(1) + 1)
    print(f"RSS {before:.0f} MB before the device starts, {rss_mb():.0f} MB after")
    prompt = mx.array([(13 * i + 7) % 4000 for i in range(40)])
    res = resident_from_converted(out)
    decode_tps(res, prompt, 4)
    base, ref_tokens = decode_tps(res, prompt)
    print(f"resident: {base:.1f} tok/s, RSS {rss_mb():.0f} MB")
    del res
    engines = ["python", "native"] if native.available() else ["python"]
    for cap, engine in [(c, e) for c in (10**6, 32) for e in engines]:
        model, _ = moestream.load(out, cache_experts=cap, engine=engine)
        decode_tps(model, prompt, 4)
        moestream.stats(model).reset()
        tps, tokens = decode_tps(model, prompt)
        s = moestream.stats(model)
        print(
            f"cap {cap} {engine}: {tps:.1f} tok/s ({tps / base:.3f}x), "
            f"same tokens {tokens == ref_tokens}, hit {s.hit_rate:.3f}, "
            f"misses/token {s.misses / 32:.1f}, RSS {rss_mb():.0f} MB"
        )


if __name__ == "__main__":
    main()
