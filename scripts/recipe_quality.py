"""Validation loss and expert bytes of quantization recipes, side by side.

    python scripts/recipe_quality.py HF_DIR VAL.txt --recipes "4,4,4" "4,4,6"

Each recipe is gate,up,down bits. Prints one table: loss, delta to the
unquantized model, expert bits per weight and expert bytes per token routed.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import load as mlx_load

import moestream
from moestream.converter import convert
from moestream.families import cast_floating


def loss(model: nn.Module, tokens: list[int], window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = mx.array(tokens[start : start + window + 1])[None]
        logits = model(chunk[:, :-1]).astype(mx.float32)
        ce = nn.losses.cross_entropy(logits, chunk[:, 1:], reduction="sum")
        total += ce.item()
        count += chunk.shape[1] - 1
    return total / count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("hf_dir")
    p.add_argument("val")
    p.add_argument("--recipes", nargs="+", default=["4,4,4", "4,4,6", "3,3,4", "8,8,8"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args()

    base, tokenizer = mlx_load(args.hf_dir)
    cast_floating(base, mx.float32)
    tokens = tokenizer.encode(Path(args.val).read_text())[: args.tokens + 1]
    ref = loss(base, tokens, args.window)
    del base
    print(f"unquantized float32: loss {ref:.4f} (ppl {math.exp(ref):.2f})")
    print("| recipe gate,up,down | loss | delta | expert bits/weight | MB/token |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for r in args.recipes:
            g, u, d = r.split(",")
            out = Path(tmp) / r.replace(",", "-")
            s = convert(
                args.hf_dir,
                out,
                bits=f"gate_proj={g},up_proj={u},down_proj={d}",
                progress=False,
            )
            model, _ = moestream.load(out)
            value = loss(model, tokens, args.window)
            m = moestream.runtime_of(model).manifest
            top_k = model.args.num_experts_per_tok
            per_token = sum(layer.record_nbytes for layer in m.layers) * top_k
            print(
                f"| {r} | {value:.4f} | {value - ref:+.4f} | "
                f"{s.expert_bits_per_weight:.2f} | {per_token / 1e6:.3f} |"
            )


if __name__ == "__main__":
    main()
