"""Cache policies vs Belady on a model's routing over a text (teacher-forced).

    python scripts/policy_replay.py OUT TEXT_FILE [--tokens 4096] [--offset CHARS]
        [--slots 8,6,16]

Records which experts each MoE layer routes every token of TEXT_FILE to (the
streaming model with all experts resident records it), then replays that
trace through the runtime's own slot pool for every policy, and Belady's
optimum, at each capacity.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

import moestream
from moestream.bench.replay import belady_hits, policy_hits
from moestream.runtime.pool import POLICIES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("text")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--offset", type=int, default=0, help="characters to skip")
    p.add_argument("--slots", default="8")
    a = p.parse_args()
    model, tok = moestream.load(a.out, cache_experts=10**6, record_trace=True)
    with open(a.text) as f:
        f.seek(a.offset)
        ids = tok.encode(f.read(8 * a.tokens))[: a.tokens]
    cache = make_prompt_cache(model)
    for s in range(0, len(ids), 256):
        mx.eval(model(mx.array([ids[s : s + 256]]), cache=cache))
    traces = moestream.stats(model).routing()
    experts = max(int(t.max()) + 1 for t in traces.values())
    total = sum(len(np.unique(r)) for t in traces.values() for r in t)
    print(f"{len(ids)} tokens, {len(traces)} MoE layers, {experts} experts")
    print("| slots | " + " | ".join(POLICIES) + " | Belady | gap closed by lrfu |")
    print("|---" * (len(POLICIES) + 3) + "|")
    for cap in (int(c) for c in a.slots.split(",")):
        rates = {
            name: sum(policy_hits(t, cap, name, experts) for t in traces.values())
            / total
            for name in POLICIES
        }
        best = sum(belady_hits(t, cap) for t in traces.values()) / total
        gap = (rates["lrfu"] - rates["lru"]) / max(best - rates["lru"], 1e-9)
        cells = " | ".join(f"{rates[n]:.3f}" for n in POLICIES)
        print(f"| {cap} | {cells} | {best:.3f} | {gap:.0%} |")


if __name__ == "__main__":
    main()
