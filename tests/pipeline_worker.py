"""One rank of a pipeline test: `mlx.launch -n N -- python pipeline_worker.py OUT
SLOTS [ENGINE [BUDGET]]`. Rank 0 prints one JSON line: greedy and seeded tokens, the
stage split and every rank's report."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from helpers import generated

from moestream import pipeline
from moestream.runtime import config_from

PROMPT = [(7 * i + 3) % 300 for i in range(20)]
SEED = 5


def main() -> None:
    out, slots = sys.argv[1], int(sys.argv[2])
    engine = sys.argv[3] if len(sys.argv) > 3 else "python"
    budget = int(sys.argv[4]) if len(sys.argv) > 4 else None
    group = pipeline.init()
    config = config_from(
        memory_budget=budget, cache_experts=slots, dtype="float32", engine=engine
    )
    mx.random.seed(SEED)  # before loading, as mlx-lm's commands seed
    model, _, stage = pipeline.load_stage(out, config, group)
    greedy = generated(model, PROMPT, 0.0, None, n=12)  # draws nothing
    sampled = generated(model, PROMPT, 1.0, None, n=12)
    ranks = pipeline.rank_report(group, model, stage)
    if group.rank() == 0:
        print(json.dumps({"greedy": greedy, "sampled": sampled, "ranks": ranks}))


if __name__ == "__main__":
    main()
