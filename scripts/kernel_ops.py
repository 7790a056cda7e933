"""One MoE layer's expert call and one quantized matmul at the bench's small
shapes: MLX's ops beside the CPU kernel (1 and 2 threads), medians in ms.

    .venv/bin/python scripts/kernel_ops.py

8 routed experts of 512 x 1024 (gate, up) and 1024 x 512 (down), 4-bit,
group 64, one token; and a 2048 x 1024 QuantizedLinear. Two passes, so a
change in the machine's load shows.
"""

from __future__ import annotations

import statistics
import subprocess
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from moestream.runtime import native


def median_ms(f, n: int = 15) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    mx.random.seed(0)
    experts, hidden, d = 64, 512, 1024
    glu = SwitchGLU(d, hidden, experts)
    glu.set_dtype(mx.float32)
    nn.quantize(glu, group_size=64, bits=4)
    x = mx.random.normal((1, 1, d))
    inds = mx.random.randint(0, experts, (1, 1, 8)).astype(mx.uint32)
    projections = (glu.gate_proj, glu.up_proj, glu.down_proj)
    weights = [a for p in projections for a in (p.weight, p.scales, p.biases)]
    linear = nn.QuantizedLinear(d, 2048, bias=False, group_size=64, bits=4)
    mx.eval(glu.parameters(), linear.parameters(), x, inds)
    ext = native._native
    rows = {
        "MLX SwitchGLU (gather_qmm)": lambda: glu(x, inds),
        "kernel, 1 thread": lambda: ext.expert_mlp(x, inds, weights, [(4, 64)] * 3, 1),
        "kernel, 2 threads": lambda: ext.expert_mlp(x, inds, weights, [(4, 64)] * 3, 2),
        "MLX quantized_matmul 2048x1024": lambda: linear(x),
        "kernel matmul, 1 thread": lambda: ext.quant_matmul(
            x, linear.weight, linear.scales, linear.biases, 4, 64, 1
        ),
        "kernel matmul, 2 threads": lambda: ext.quant_matmul(
            x, linear.weight, linear.scales, linear.biases, 4, 64, 2
        ),
    }
    for _ in range(2):
        for name, f in rows.items():
            print(f"{name:32s} {median_ms(f):8.3f} ms")


if __name__ == "__main__":
    main()
