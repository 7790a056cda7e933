"""One MoE layer's expert call at the medium bench model's geometry (D 2048 ->
F 768, 128 experts, top-8, 4-bit, groups of 64), on the default device:
mlx-lm's SwitchGLU (the exact arithmetic) against the fast arithmetic
(runtime/fast.py: every expert dequantized, gather_mm on sorted rows), by
token count: where the fast one starts to win, and how far its output is from
the exact one.

    python scripts/gpu_fast.py [--tokens 1,8,32,64,128,512,4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from gpu_groups import K, layer, routed, timed  # the same geometry and clock

from moestream.runtime.fast import fast_glu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1,8,32,64,128,512,4096")
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    glu = layer(dtype)
    rng = np.random.default_rng(0)
    print("| tokens | pairs | exact ms | fast ms | fast / exact | max abs diff |")
    print("|---|---|---|---|---|---|")
    for tokens in [int(t) for t in a.tokens.split(",")]:
        x, experts = routed(tokens, dtype, rng)
        idx = mx.array(experts.astype(np.uint32))
        exact = timed(lambda x=x, idx=idx: glu(x, idx))
        fast = timed(lambda x=x, idx=idx: fast_glu(glu, x, idx))
        diff = mx.abs(glu(x, idx) - fast_glu(glu, x, idx)).max().item()
        print(
            f"| {tokens} | {tokens * K} | {exact:.3f} | {fast:.3f} | "
            f"{fast / exact:.2f} | {diff:.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
