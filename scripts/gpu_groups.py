"""One MoE layer's prefill arithmetic at the medium bench model's geometry
(D 2048 -> F 768, 128 experts, top-8, 4-bit, groups of 64), on the default
device: mlx-lm's whole SwitchGLU call against the same pairs computed in
slot-sized groups of experts (each group's own rows, as the streaming layer
runs them) and as whole calls per group (every pair computed once per group,
the rest sent to a zero expert), checking the groups' bits against the whole
call's.

    python scripts/gpu_groups.py [--tokens 512,4096] [--groups 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import SwitchGLU

from moestream.runtime.backend import GPU_GROUP_ROWS
from moestream.runtime.switch import StreamingSwitchGLU

D, F, E, K = 2048, 768, 128, 8


def timed(f, repeats: int = 10) -> float:
    """Milliseconds per call, each evaluated (after two warm-up calls)."""
    for _ in range(2):
        mx.eval(f())
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(f())
    return (time.perf_counter() - start) / repeats * 1e3


def layer(dtype: mx.Dtype) -> SwitchGLU:
    """One MoE layer's experts at this geometry, 4-bit, groups of 64."""
    mx.random.seed(0)
    glu = SwitchGLU(D, F, E)
    nn.quantize(glu, group_size=64, bits=4)
    glu.set_dtype(dtype)
    return glu


def routed(tokens: int, dtype: mx.Dtype, rng: np.random.Generator) -> tuple:
    """A prompt's hidden states and its top-K experts, drawn uniformly."""
    x = (mx.random.normal((1, tokens, D)) * 0.5).astype(dtype)
    return x, np.argsort(rng.random((1, tokens, E)), axis=-1)[..., :K]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="512,4096")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    glu = layer(dtype)
    me = SimpleNamespace(_group_rows=GPU_GROUP_ROWS, _experts=glu)
    rng = np.random.default_rng(0)
    for tokens in [int(t) for t in a.tokens.split(",")]:
        x, experts = routed(tokens, dtype, rng)
        ms, same = measure(me, x, experts, E // a.groups)
        print(
            f"{tokens} tokens ({tokens * K} pairs), {a.dtype}: whole call "
            f"{ms[0]:.2f} ms, {a.groups} groups' own rows {ms[1]:.2f} ms "
            f"({'bit-identical' if same else 'DIFFERENT'}), {a.groups} whole "
            f"calls {ms[2]:.2f} ms",
            flush=True,
        )


def measure(me: SimpleNamespace, x: mx.array, experts: np.ndarray, size: int):
    """ms of (whole call, groups' own rows, whole calls per group); whether the
    groups' rows equal the whole call's."""
    glu, lut = me._experts, np.arange(E, dtype=np.uint32)
    flat = experts.reshape(-1)
    starts = range(0, E, size)
    parts = [np.flatnonzero((flat >= g) & (flat < g + size)) for g in starts]
    idx = mx.array(experts.astype(np.uint32))
    masked = [
        mx.array(np.where((experts >= g) & (experts < g + size), experts, 0))
        for g in starts
    ]
    ref = glu(x, idx).reshape(-1, x.shape[-1])
    rows = [StreamingSwitchGLU._rows(me, x, experts, q, lut) for q in parts]
    same = all(
        mx.array_equal(r, ref[mx.array(q)]).item()
        for q, r in zip(parts, rows, strict=True)
    )
    ms = (
        timed(lambda: glu(x, idx)),
        timed(
            lambda: [StreamingSwitchGLU._rows(me, x, experts, q, lut) for q in parts]
        ),
        timed(lambda: [glu(x, m.astype(mx.uint32)) for m in masked]),
    )
    return ms, same


if __name__ == "__main__":
    main()
