"""Resident vs the native and python engines, decode on one device, one process.

    python scripts/engine_gpu.py OUT [EXPERTS] [TOKENS]

Times mlx-lm's resident model of OUT's bytes, then each engine at 25 % and
10 % of EXPERTS slots per layer (greedy, after 8 warm-up tokens, page cache
warm), then the resident model again: the README's GPU table.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

import moestream
from moestream.reference import resident_from_converted


def decode_tps(model, prompt: mx.array, n: int) -> tuple[float, list[int]]:
    start, tokens = 0.0, []
    for i, (t, _) in enumerate(generate_step(prompt, model, max_tokens=n)):
        if i == 0:
            start = time.perf_counter()
        tokens.append(int(t))
    return (n - 1) / (time.perf_counter() - start), tokens


def resident_tps(out: str, prompt: mx.array, n: int) -> tuple[float, list[int]]:
    model = resident_from_converted(out)
    decode_tps(model, prompt, 8)
    return decode_tps(model, prompt, n)


def main() -> None:
    out = sys.argv[1]
    experts = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    prompt = mx.array([(13 * i + 7) % 4000 for i in range(40)])
    base, ref = resident_tps(out, prompt, n)
    print(f"resident {base:.1f} tok/s")
    rows = [(experts // 4, "native"), (max(8, experts // 10), "native")]
    for cap, engine in [*rows, (experts // 4, "python")]:
        model, _ = moestream.load(out, cache_experts=cap, engine=engine)
        decode_tps(model, prompt, 8)
        moestream.stats(model).reset()
        tps, tokens = decode_tps(model, prompt, n)
        s = moestream.stats(model)
        print(
            f"{engine} {cap} slots: {tps:.1f} tok/s ({tps / base:.3f}x), same "
            f"tokens {tokens == ref}, hit {s.hit_rate:.3f}, "
            f"{s.bytes_read / n / 1e6:.1f} MB/token"
        )
        del model
    print(f"resident again {resident_tps(out, prompt, n)[0]:.1f} tok/s")


if __name__ == "__main__":
    main()
