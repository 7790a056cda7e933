"""What this CPU's vector units do in MLX's arithmetic: the ceiling of the
exact kernels, measured, and the tok/s it allows a model's experts.

    .venv/bin/python scripts/cpu_peak.py [build/bench-small] [--repeats 5]

The exact kernels spend, per weight, a separate multiply and add (the
prefill panels: `sum = sum + x * w` per token, one rounding each, as MLX's
`_qmm_t` has it) or seven vector operations per lane-width of weights (the
decode rows: shift, mask, convert, scale, bias, x, sum). A small C loop
(compiled here with `cc -O2 -march=native -ffp-contract=off`) keeps sixteen
independent vector sums in registers and runs exactly that multiply and
add, with nothing to load: the most multiply-adds a second a core can do in
this arithmetic. It runs on one core, then on every core at once (each
copy its own process). With a converted model, the table adds what that
ceiling allows its routed experts alone: prefill (a multiply and an add per
weight and token) and decode (the rows' seven operations per lane-width).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
typedef __m512 V;
#define LANES 16
#define SET1 _mm512_set1_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#else
typedef __m256 V;
#define LANES 8
#define SET1 _mm256_set1_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#endif
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
/* Cycles a second: a chain of dependent one-cycle adds. */
static double clock_hz(void) {
  long n = 300000000, x = 0;
  double a = now();
  for (long i = 0; i < n; i++) __asm__ volatile("add $1, %0" : "+r"(x));
  return n / (now() - a);
}
int main(void) {
  V acc[16], w[4];
  for (int i = 0; i < 16; i++) acc[i] = SET1((float)i);
  for (int i = 0; i < 4; i++) w[i] = SET1(1.0f + 1e-4f * i);
  float xs[4] = {1e-7f, 2e-7f, 3e-7f, 4e-7f};
  long n = 30000000;
  double hz = clock_hz(), a = now();
  for (long i = 0; i < n; i++) {
    for (int t = 0; t < 4; t++) {
      V x = SET1(xs[t]);
      for (int v = 0; v < 4; v++) acc[4 * t + v] = ADD(acc[4 * t + v], MUL(x, w[v]));
    }
    __asm__ volatile("" ::: "memory");
  }
  double macs = n * 16.0 * LANES / (now() - a);
  hz = (hz + clock_hz()) / 2;
  float keep = 0;
  for (int i = 0; i < 16; i++) keep += ((float *)&acc[i])[0];
  printf("%d %.6f %.6f %g\n", LANES, macs / 1e9, hz / 1e9, keep);
  return 0;
}
"""


def build(workdir: Path) -> Path:
    src, exe = workdir / "peak.c", workdir / "peak"
    src.write_text(SOURCE)
    cmd = ["cc", "-O2", "-march=native", "-ffp-contract=off", "-o", str(exe), str(src)]
    subprocess.run(cmd, check=True)
    return exe


def run(exe: Path, copies: int) -> tuple[int, float, float]:
    """(lanes, G multiply-adds a second summed over `copies` processes, and
    their mean G cycles a second)."""
    procs = [
        subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True)
        for _ in range(copies)
    ]
    outs = [p.communicate()[0].split() for p in procs]
    macs = sum(float(o[1]) for o in outs)
    return int(outs[0][0]), macs, statistics.mean(float(o[2]) for o in outs)


def experts_per_token(model: Path) -> int:
    """Routed expert weights one token multiplies (gate, up, down)."""
    cfg = json.loads((model / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    k = cfg.get("num_experts_per_tok") or cfg["moe_topk"]
    inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    return layers * k * 3 * cfg["hidden_size"] * inter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="a converted model")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        one, every = [], []
        for _ in range(args.repeats):  # interleaved: the load hits both alike
            one.append(run(exe, 1))
            every.append(run(exe, cores))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    print(f"load: {uptime.strip()}")
    lanes = one[0][0]
    med = statistics.median
    rows = {
        "G multiply-adds a second": [med(r[1] for r in runs) for runs in (one, every)],
        "GHz (a chain of one-cycle adds)": [
            med(r[2] for r in runs) for runs in (one, every)
        ],
        "multiply-adds a cycle a core": [
            med(r[1] / r[2] / n for r in runs) for runs, n in ((one, 1), (every, cores))
        ],
    }
    print(
        f"| {lanes}-lane multiply, then add: medians of {args.repeats} | one core "
        f"| {cores} cores |"
    )
    print("|---|---|---|")
    for name, (a, b) in rows.items():
        print(f"| {name} | {a:.1f} | {b:.1f} |")
    if args.model:
        w = experts_per_token(args.model)
        macs = rows["G multiply-adds a second"][1] * 1e9
        # decode rows: 7 vector operations per `lanes` weights, against this
        # loop's 2 per `lanes` multiply-adds
        print(
            f"| {args.model.name}: routed expert weights a token | {w / 1e6:.0f} M | |"
        )
        print(f"| its experts alone, prefill ceiling, tok/s | | {macs / w:.0f} |")
        print(
            f"| its experts alone, decode ceiling, tok/s | | {macs * 2 / 7 / w:.0f} |"
        )


if __name__ == "__main__":
    main()
