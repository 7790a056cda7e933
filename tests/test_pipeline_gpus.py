"""The pipeline on two GPUs of one machine: `mlx.launch -n 2 --backend nccl`.

mlx.launch gives rank r the GPU `CUDA_VISIBLE_DEVICES=r` and MLX's NCCL
backend between them. Each rank holds its share of the layers and its own
slots; the tokens must be those of one process: greedy as mlx-lm's resident
model, seeded sampling as `mlx_lm.generate --seed S` prints. Marked `device`;
skipped where MLX sees fewer than two GPUs (this needs the nvidia-h200-x2
kind of machine, or any host with two CUDA GPUs).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from helpers import SEEDS, both, generate_args, mlx_lm_generate
from test_pipeline import BIN, TIMEOUT, launch

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(
        mx.device_count(mx.gpu) < 2,
        reason=f"MLX sees {mx.device_count(mx.gpu)} GPUs here; this needs two",
    ),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_gpus_sample_as_one_process(tmp_path: Path, dtype: str) -> None:
    """Seeded sampling on two GPUs prints one process's text on one GPU, and,
    in float32 (mlx-lm's stored dtype here), mlx_lm.generate's."""
    out, mlx_dir = both(tmp_path, "qwen3_moe")
    seed = SEEDS[0]
    flags = [*generate_args(seed), "--cache-experts", "2", "--dtype", dtype, "--json"]
    alone = subprocess.run(
        [str(BIN / "run-moe"), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert alone.returncode == 0, alone.stderr
    r = launch(2, str(BIN / "run-moe"), str(out), "--pipeline", *flags, backend="nccl")
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout + r.stderr  # rank 0 alone prints
    result = json.loads(lines[0])
    assert result["text"] == json.loads(alone.stdout)["text"]
    if dtype == "float32":
        assert result["text"] == mlx_lm_generate({0: (mlx_dir, seed)})[0]
    ranks = result["stats"]["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1]
    assert all(x["bytes_read"] > 0 for x in ranks)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-m", "device", "-v"]))
