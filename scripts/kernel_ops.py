"""One MoE layer's expert call and one quantized matmul at the bench's small
shapes, on the CPU kernel, for several token counts: medians in ms, and
builds of the extension compared side by side.

    .venv/bin/python scripts/kernel_ops.py [--tokens 1,128,1024] [--rounds 3]
        [--variants A.so,B.so] [--mlx] [--from-memory] [--blocked]

64 experts of 512 x 1024 (gate, up) and 1024 x 512 (down), 4-bit, group 64,
scales and biases widened from bfloat16, top-8 of random routing; and a
2048 x 1024 QuantizedLinear. With `--blocked`, the expert call also with
the fused dequantization (`experts fused`). Each round runs
every build in a fresh process, in turn (so a change in the machine's load
hits all alike); the table gives each build's median over the rounds of its
per-call medians. `--variants` names built modules (.so) to load instead
of the installed one; `--mlx` adds MLX's own ops (slow at many tokens);
`--threads 1` times CPU seconds, not wall (a loaded machine's fairer clock).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time


def median_ms(f, n: int) -> float:
    """The median ms of n calls: wall time, or with one thread the process's
    CPU time (what the call computed, whatever else the cores ran)."""
    clock = time.process_time if one_thread else time.perf_counter
    times = []
    mx.eval(f())
    for _ in range(n):
        start = clock()
        mx.eval(f())
        times.append(clock() - start)
    return statistics.median(times) * 1e3


def child(
    so: str | None,
    tokens: list[int],
    mlx: bool,
    threads: int,
    memory: bool,
    blocked: bool,
) -> dict:
    if so:  # before moestream.runtime imports the installed one
        spec = importlib.util.spec_from_file_location("moestream._native", so)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules["moestream._native"] = module
    global mx, one_thread
    import mlx.core as mx

    one_thread = threads == 1
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchGLU

    from moestream.runtime import native

    mx.random.seed(0)
    experts, hidden, d = 64, 512, 1024
    glu = SwitchGLU(d, hidden, experts)
    glu.set_dtype(mx.float32)
    nn.quantize(glu, group_size=64, bits=4)
    linear = nn.QuantizedLinear(d, 2048, bias=False, group_size=64, bits=4)
    projections = (glu.gate_proj, glu.up_proj, glu.down_proj)
    # Scales and biases widened from bfloat16, as slots filled from records
    # stored so hold them: the fused dequantization is exact on them.
    for p in projections:
        for name in ("scales", "biases"):
            p[name] = p[name].astype(mx.bfloat16).astype(mx.float32)
    weights = [a for p in projections for a in (p.weight, p.scales, p.biases)]
    if blocked:  # the experts as blocked slots hold them
        weights = native.blocked_arrays(weights)
    mx.eval(weights, glu.parameters(), linear.parameters())
    ext, out = native._native, {}

    def calls(x: mx.array, inds: mx.array) -> dict:
        w, s, b = linear.weight, linear.scales, linear.biases
        # --from-memory: 8 routings in turn (the ids shifted by 8 each time)
        # spread the calls over the 64 experts' 56 MB, past the L3: a call's
        # weights come from memory, as in decode
        turns = [(inds + 8 * i) % experts for i in range(8)] if memory else [inds]
        mx.eval(turns)
        count = iter(range(1 << 30))
        ops = {
            "experts": lambda: ext.expert_mlp(
                x,
                turns[next(count) % len(turns)],
                weights,
                [(4, 64, False)] * 3,
                threads,
                blocked,
            ),
            "matmul": lambda: ext.quant_matmul(x, w, s, b, 4, 64, threads),
        }
        if blocked:  # the same with the fused dequantization (QuantSpec.fma)
            ops["experts fused"] = lambda: ext.expert_mlp(
                x,
                turns[next(count) % len(turns)],
                weights,
                [(4, 64, True)] * 3,
                threads,
                blocked,
            )
        if mlx and not blocked:
            ops["MLX experts"] = lambda: glu(x, inds)
            ops["MLX matmul"] = lambda: linear(x)
        return ops

    for t in tokens:
        x = mx.random.normal((1, t, d))
        inds = mx.argsort(mx.random.uniform(shape=(1, t, experts)), axis=-1)[..., :8]
        mx.eval(x, inds := inds.astype(mx.uint32))
        for name, f in calls(x, inds).items():
            n = 3 if name.startswith("MLX") else max(3, min(15, 2000 // t))
            out[f"{name} {t}"] = median_ms(f, n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,128,1024")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", default="")
    ap.add_argument("--mlx", action="store_true")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--from-memory",
        action="store_true",
        help="each expert call routes to other experts than the last (the 64 "
        "experts' 56 MB pass through the cache): decode's case",
    )
    ap.add_argument(
        "--blocked",
        action="store_true",
        help="the experts' slots blocked (convert-moe --layout blocked's "
        "layout, the CPU kernel's): the rows and panels that read them",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    if args.child is not None:
        out = child(
            args.child, tokens, args.mlx, args.threads, args.from_memory, args.blocked
        )
        print(json.dumps(out))
        return
    builds = [b for b in args.variants.split(",") if b] or [""]
    runs: dict[str, list[dict]] = {b: [] for b in builds}
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for _ in range(args.rounds):
        for b in builds:
            cmd = [sys.executable, __file__, "--child", b, "--tokens", args.tokens]
            cmd += ["--threads", str(args.threads)] + (["--mlx"] if args.mlx else [])
            cmd += ["--from-memory"] if args.from_memory else []
            cmd += ["--blocked"] if args.blocked else []
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[b].append(json.loads(proc.stdout.splitlines()[-1]))
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    keys = list(runs[builds[0]][0])
    print(
        "| call (ms, median) | " + " | ".join(b or "installed" for b in builds) + " |"
    )
    print("|---" * (len(builds) + 1) + "|")
    for key in keys:
        cells = [statistics.median(r[key] for r in runs[b]) for b in builds]
        print(f"| {key} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
