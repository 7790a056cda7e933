"""What one host sync per MoE layer costs by itself: mlx-lm's resident model,
plain and with a sync added before every SwitchGLU call (the streaming
runtime's floor), decode tok/s, medians of interleaved runs.

    python scripts/sync_cost.py OUT [--repeats 3] [--tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_tokenizer

from moestream.bench.worker import prompt_ids
from moestream.families import replace_module, switch_modules
from moestream.reference import resident_from_converted


class Synced(nn.Module):
    def __init__(self, inner: nn.Module, async_out: bool):
        super().__init__()
        self._inner, self._async = inner, async_out

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        np.array(indices)  # the host sync the streaming runtime needs
        y = self._inner(x, indices)
        if self._async:
            mx.async_eval(y)
        return y


def decode_tps(model: nn.Module, prompt: mx.array, tokens: int) -> float:
    mx.random.seed(0)
    steps = generate_step(
        prompt, model, max_tokens=tokens + 1, sampler=make_sampler(1.0)
    )
    next(steps)
    start = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=24)
    a = p.parse_args()
    prompt = mx.array(prompt_ids(load_tokenizer(a.out), 16))
    models = {"resident": resident_from_converted(a.out)}
    for name, async_out in (("sync per layer", False), ("sync + async_eval", True)):
        m = resident_from_converted(a.out)
        for path, module in switch_modules(m).items():
            replace_module(m, path, Synced(module, async_out))
        models[name] = m
    runs: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(a.repeats):
        for k, m in models.items():
            runs[k].append(decode_tps(m, prompt, a.tokens))
    base = statistics.median(runs["resident"])
    for k, v in runs.items():
        print(
            f"{k}: {statistics.median(v):.2f} tok/s, {statistics.median(v) / base:.3f}x"
        )


if __name__ == "__main__":
    main()
