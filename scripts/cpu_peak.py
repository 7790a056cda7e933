"""What this CPU's vector units do in MLX's arithmetic: the ceiling of the
exact kernels, measured, and the tok/s it allows a model's experts.

    .venv/bin/python scripts/cpu_peak.py [build/bench-small] [--repeats 5]

The exact kernels spend, per weight, a separate multiply and add (the
prefill panels: `sum = sum + x * w` per token, one rounding each, as MLX's
`_qmm_t` has it) or seven vector operations per lane-width of weights (the
decode rows: shift, mask, convert, scale, bias, x, sum). A small C loop
(compiled here with `cc -O3 -march=native -ffp-contract=off`) runs the
panels' inner loop with its operands in L1 (at each k four vectors of
weights, four tokens' x broadcast, sixteen sums in registers): the most
multiply-adds a second a core does in this arithmetic, with nothing to
dequantize and nothing from memory. It runs on one core, then on every
core at once (each copy its own process), beside a chain of one-cycle adds
that gives the clock. With a converted model, the table adds what that
ceiling allows its routed experts alone: prefill (a multiply and an add per
weight and token) and decode (the rows' seven operations per lane-width, at
the loop's two a lane-width of multiply-adds). The same program also reads
a 512 MiB buffer with vector loads, on one core and on every core: what
memory delivers, and the decode speed at which a token's routed records
(top-k a layer, from the model's manifest) take all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from moestream.formats import load_manifest

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
/* Memory read with vector loads: a 512 MiB buffer, touched first, then read
   whole five times; prints "lanes GB/s". */
static int read_memory(void) {
  size_t n = (size_t)512 << 20, v = n / sizeof(V);
  V *buf = aligned_alloc(64, n);
  memset(buf, 1, n);
  V acc[4] = {SET1(0), SET1(0), SET1(0), SET1(0)};
  double best = 1e9;
  for (int r = 0; r < 5; r++) {
    double a = now();
    for (size_t i = 0; i < v; i += 4)
      for (int j = 0; j < 4; j++) acc[j] = ADD(acc[j], buf[i + j]);
    __asm__ volatile("" ::: "memory");
    double t = now() - a;
    best = t < best ? t : best;
  }
  float keep = ((float *)&acc[0])[0] + ((float *)&acc[3])[0];
  printf("%d %.6f %g\n", LANES, n / best / 1e9, keep);
  return 0;
}
int main(int argc, char **argv) {
  if (argc > 1) return read_memory();
  /* The prefill panel's loop, its operands in L1: at each k, four vectors of
     weights (64 rows) and four tokens' x, sixteen sums of a multiply then an
     add. */
  enum { K = 64, T = 4, NV = 4 };
  static float w[K][NV * LANES] __attribute__((aligned(64)));
  static float xs[T][K];
  for (int k = 0; k < K; k++) {
    for (int j = 0; j < NV * LANES; j++) w[k][j] = 1.0f + 1e-6f * (j + k);
    for (int t = 0; t < T; t++) xs[t][k] = 1e-7f * (t + 1);
  }
  V acc[T][NV];
  for (int t = 0; t < T; t++)
    for (int v = 0; v < NV; v++) acc[t][v] = SET1((float)(t + v));
  long n = 500000;
  double hz = clock_hz(), a = now();
  for (long i = 0; i < n; i++) {
    for (int k = 0; k < K; k++) {
      V wv[NV];
      for (int v = 0; v < NV; v++) wv[v] = *(const V *)&w[k][v * LANES];
      for (int t = 0; t < T; t++) {
        V x = SET1(xs[t][k]);
        for (int v = 0; v < NV; v++) acc[t][v] = ADD(acc[t][v], MUL(x, wv[v]));
      }
    }
    __asm__ volatile("" ::: "memory");
  }
  double macs = n * (double)K * T * NV * LANES / (now() - a);
  hz = (hz + clock_hz()) / 2;
  float keep = 0;
  for (int t = 0; t < T; t++)
    for (int v = 0; v < NV; v++) keep += ((float *)&acc[t][v])[0];
  printf("%d %.6f %.6f %g\n", LANES, macs / 1e9, hz / 1e9, keep);
  return 0;
}
"""


def build(workdir: Path) -> Path:
    src, exe = workdir / "peak.c", workdir / "peak"
    src.write_text(SOURCE)
    cmd = ["cc", "-O3", "-march=native", "-ffp-contract=off", "-o", str(exe), str(src)]
    subprocess.run(cmd, check=True)
    return exe


def run(exe: Path, copies: int, *mode: str) -> tuple[int, float, float]:
    """(lanes, G multiply-adds a second summed over `copies` processes, and
    their mean G cycles a second); with mode "read": (lanes, GB a second read
    from memory summed over the copies, their mean of the last field)."""
    procs = [
        subprocess.Popen([str(exe), *mode], stdout=subprocess.PIPE, text=True)
        for _ in range(copies)
    ]
    outs = [p.communicate()[0].split() for p in procs]
    macs = sum(float(o[1]) for o in outs)
    return int(outs[0][0]), macs, statistics.mean(float(o[2]) for o in outs)


def expert_bytes_per_token(model: Path) -> int:
    """Bytes of the routed experts' records one token reads (top-k a layer)."""
    cfg = json.loads((model / "config.json").read_text())
    k = cfg.get("num_experts_per_tok") or cfg["moe_topk"]
    return sum(layer.record_nbytes * k for layer in load_manifest(model).layers)


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
        one, every, read_one, read_every = [], [], [], []
        for _ in range(args.repeats):  # interleaved: the load hits all alike
            one.append(run(exe, 1))
            every.append(run(exe, cores))
            read_one.append(run(exe, 1, "read"))
            read_every.append(run(exe, cores, "read"))
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
        "GB a second read from memory (512 MiB a core)": [
            med(r[1] for r in runs) for runs in (read_one, read_every)
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
        read = rows["GB a second read from memory (512 MiB a core)"][1] * 1e9
        nbytes = expert_bytes_per_token(args.model)
        print(f"| its experts' records a token, MB | {nbytes / 1e6:.0f} | |")
        print(
            f"| its experts alone, decode from memory, tok/s | | {read / nbytes:.0f} |"
        )


if __name__ == "__main__":
    main()
