"""Write a random Qwen3-MoE checkpoint in Hugging Face layout (for converter runs).

    python scripts/synthetic_hf.py OUT --layers 24 --experts 64 --hidden 1024 \\
        --moe-intermediate 512 [--layout per-expert|fused|fp8]

`fused` stores experts as transformers >= 5 does (`experts.gate_up_proj`),
`fp8` as Qwen3-FP8 does (float8_e4m3fn + 128x128 `weight_scale_inv`).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

# The checkpoint builders are dev-only: they live with the tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from builders.synthetic import large_qwen3_moe
from builders.synthetic_sources import rewrite_shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument(
        "--layout", choices=("per-expert", "fused", "fp8"), default="per-expert"
    )
    a = p.parse_args()
    hf = a.out if a.layout == "per-expert" else a.out.with_name(a.out.name + ".hf")
    large_qwen3_moe(
        hf,
        num_hidden_layers=a.layers,
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        hidden_size=a.hidden,
        moe_intermediate_size=a.moe_intermediate,
        intermediate_size=4 * a.hidden,
        num_attention_heads=a.hidden // 64,
        num_key_value_heads=max(a.hidden // 256, 1),
        head_dim=64,
        vocab_size=a.vocab,
    )
    if a.layout != "per-expert":
        rewrite_shards(hf, a.out, a.layout)
        shutil.rmtree(hf)


if __name__ == "__main__":
    main()
