"""What a row-blocked weight layout would give the decode rows: the exact
kernel's loop on weights as the slots hold them today (row after row) and on
the same values blocked by sixteen rows, side by side, from memory.

    .venv/bin/python scripts/rows_layout.py [--rounds 5] [--matrices 256]

Today a slot holds a projection as MLX does, `[rows, words]`: the decode
rows (`rows_block` in csrc/cpu_experts.cpp) read sixteen rows' 64-byte
lines at a time and turn them in registers (a 16 x 16 transpose), and the
scales and biases likewise, so that each lane holds one row. Blocked, word w
of sixteen rows would be one line (`[rows / 16, words, 16]`, the scales and
biases `[rows / 16, groups, 16]`): no transpose, one stream a block instead
of sixteen. The values and each lane's operations are the same; the harness
checks that both layouts give the same sums, bit for bit.

A small C++ program (compiled here with `c++ -O3 -march=native
-ffp-contract=off`, the kernel's flags, against csrc/cpu_simd.h, the
kernel's vectors and its 16 x 16 transpose) runs both
loops over `--matrices` projections of `small`'s expert shape (512 x 1024,
4-bit, groups of 64; 288 KB each, 256 of them past the L3), on one thread and
on every core, the layouts alternating within each round. AVX-512 only (the
blocked loop is written for sixteen lanes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"

SOURCE = r"""
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "cpu_simd.h"

using namespace moestream;
constexpr int kRows = 512, kCols = 1024, kBits = 4, kGroup = 64;
constexpr int kWords = kCols * kBits / 32, kGroups = kCols / kGroup;

struct Mat { const uint32_t* w; const float* s; const float* b; };

// sum += x[k] * (scale * q + bias), k ascending, one rounding each.
template <int I>
inline VF step(VF acc, const VU* w, VF s, VF b, float x) {
  constexpr int off = I * kBits, word = off / 32, shift = off % 32;
  VF d = __builtin_convertvector(VI((w[word] >> shift) & 15u), VF) * s + b;
  return acc + x * d;
}

// Rows [r0, r0 + 32) as stored: sixteen rows' lines turned in registers.
void rows_stored(const Mat& m, int r0, const float* x, float* out) {
  VF acc[2] = {};
  alignas(64) VU ring[2][16];
  alignas(64) VF gs[2][16], gb[2][16];
  const int64_t ahead = r0 + 32 < kRows ? 32 * kWords : 0;
  for (int v = 0; v < 2; v++) {
    __m512i rs[16], rb[16];
    for (int j = 0; j < 16; j++) {
      rs[j] = _mm512_loadu_si512(m.s + (r0 + 16 * v + j) * kGroups);
      rb[j] = _mm512_loadu_si512(m.b + (r0 + 16 * v + j) * kGroups);
    }
    transpose16(rs);
    transpose16(rb);
    for (int i = 0; i < 16; i++) {
      gs[v][i] = VF(_mm512_castsi512_ps(rs[i]));
      gb[v][i] = VF(_mm512_castsi512_ps(rb[i]));
    }
  }
  for (int w0 = 0; w0 < kWords; w0 += 16) {
    for (int v = 0; v < 2; v++) {
      __m512i r[16];
      for (int j = 0; j < 16; j++) {
        const uint32_t* row = m.w + int64_t(r0 + 16 * v + j) * kWords + w0;
        r[j] = _mm512_loadu_si512(row);
        if (ahead)
          _mm_prefetch(reinterpret_cast<const char*>(row + ahead), _MM_HINT_T1);
      }
      transpose16(r);
      for (int i = 0; i < 16; i++) ring[v][i] = VU(r[i]);
    }
    for (int c = 0; c < 16 / kBits; c++) {
      int g = (w0 / kBits + c) * 32 / kGroup;
      const float* xc = x + (w0 / kBits + c) * 32;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((acc[0] = step<I>(acc[0], ring[0] + c * kBits, gs[0][g], gb[0][g], xc[I]),
          acc[1] = step<I>(acc[1], ring[1] + c * kBits, gs[1][g], gb[1][g], xc[I])),
         ...);
      }(std::make_integer_sequence<int, 32>{});
    }
  }
  std::memcpy(out + r0, &acc[0], 64);
  std::memcpy(out + r0 + 16, &acc[1], 64);
}

// The same rows blocked: word w of block k's sixteen rows at (k * kWords + w) * 16.
void rows_blocked(const Mat& m, int r0, const float* x, float* out) {
  VF acc[2] = {};
  const uint32_t* blk[2] = {m.w + int64_t(r0) * kWords,
                            m.w + int64_t(r0 + 16) * kWords};
  const float* s[2] = {m.s + r0 * kGroups, m.s + (r0 + 16) * kGroups};
  const float* b[2] = {m.b + r0 * kGroups, m.b + (r0 + 16) * kGroups};
  const int64_t ahead = r0 + 32 < kRows ? 32 * kWords : 0;
  for (int c = 0; c < kCols / 32; c++) {
    int g = c * 32 / kGroup;
    VU w[2][kBits];
    VF sv[2], bv[2];
    for (int v = 0; v < 2; v++) {
      std::memcpy(w[v], blk[v] + c * kBits * 16, sizeof w[v]);
      std::memcpy(&sv[v], s[v] + g * 16, 64);
      std::memcpy(&bv[v], b[v] + g * 16, 64);
      if (ahead) {
        for (int l = 0; l < kBits; l++) {
          const uint32_t* next = blk[v] + ahead + (c * kBits + l) * 16;
          _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T1);
        }
      }
    }
    const float* xc = x + c * 32;
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((acc[0] = step<I>(acc[0], w[0], sv[0], bv[0], xc[I]),
        acc[1] = step<I>(acc[1], w[1], sv[1], bv[1], xc[I])), ...);
    }(std::make_integer_sequence<int, 32>{});
  }
  std::memcpy(out + r0, &acc[0], 64);
  std::memcpy(out + r0 + 16, &acc[1], 64);
}

int main(int argc, char** argv) {
  int mats = atoi(argv[1]), threads = atoi(argv[2]), passes = atoi(argv[3]);
  std::mt19937 rng(7);
  std::vector<uint32_t> W(size_t(mats) * kRows * kWords), Wb(W.size());
  std::vector<float> S(size_t(mats) * kRows * kGroups), B(S.size());
  std::vector<float> Sb(S.size()), Bb(S.size());
  for (auto& v : W) v = rng();
  for (size_t i = 0; i < S.size(); i++) {
    S[i] = 1e-3f * float(rng() % 1000 + 1);
    B[i] = -1e-3f * float(rng() % 1000);
  }
  for (int m = 0; m < mats; m++)  // blocked copies of the same values
    for (int r = 0; r < kRows; r++) {
      size_t blk = size_t(m) * kRows + r / 16 * 16;
      for (int w = 0; w < kWords; w++)
        Wb[blk * kWords + w * 16 + r % 16] = W[(size_t(m) * kRows + r) * kWords + w];
      for (int g = 0; g < kGroups; g++) {
        Sb[blk * kGroups + g * 16 + r % 16] = S[(size_t(m) * kRows + r) * kGroups + g];
        Bb[blk * kGroups + g * 16 + r % 16] = B[(size_t(m) * kRows + r) * kGroups + g];
      }
    }
  std::vector<float> x(kCols), outs(size_t(mats) * kRows), outb(outs.size());
  for (auto& v : x) v = 1e-2f * float(int(rng() % 200) - 100);
  auto pass = [&](bool blocked, float* out) {
    std::atomic<int> next{0};
    int tasks = mats * (kRows / 32);
    auto work = [&] {
      for (int t = next++; t < tasks; t = next++) {
        int m = t / (kRows / 32), r0 = t % (kRows / 32) * 32;
        size_t wo = size_t(m) * kRows * kWords, so = size_t(m) * kRows * kGroups;
        Mat mat = blocked ? Mat{Wb.data() + wo, Sb.data() + so, Bb.data() + so}
                          : Mat{W.data() + wo, S.data() + so, B.data() + so};
        auto rows = blocked ? rows_blocked : rows_stored;
        rows(mat, r0, x.data(), out + size_t(m) * kRows);
      }
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < threads; i++) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  };
  pass(false, outs.data());
  pass(true, outb.data());
  bool same = std::memcmp(outs.data(), outb.data(), outs.size() * 4) == 0;
  double best[2] = {0, 0};
  for (int p = 0; p < passes; p++)
    for (int blocked = 0; blocked < 2; blocked++) {
      auto t0 = std::chrono::steady_clock::now();
      pass(blocked, blocked ? outb.data() : outs.data());
      auto t1 = std::chrono::steady_clock::now();
      double s = std::chrono::duration<double>(t1 - t0).count();
      double gw = double(mats) * kRows * kCols / s / 1e9;
      best[blocked] = best[blocked] > gw ? best[blocked] : gw;
    }
  printf("%.4f %.4f %d\n", best[0], best[1], same ? 1 : 0);
  return 0;
}
"""


def build(workdir: Path) -> Path:
    src, exe = workdir / "rows_layout.cpp", workdir / "rows_layout"
    src.write_text(SOURCE)
    cmd = ["c++", "-O3", "-march=native", "-ffp-contract=off", "-std=c++20"]
    cmd += ["-I", str(CSRC), "-o", str(exe), str(src), "-lpthread"]
    subprocess.run(cmd, check=True)
    return exe


def avx512() -> bool:
    out = subprocess.run(
        ["c++", "-march=native", "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "__AVX512F__" in out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--matrices", type=int, default=256)
    args = ap.parse_args()
    if not avx512():
        raise SystemExit(
            "rows_layout: the blocked loop is written for AVX-512; this CPU has none"
        )
    cores = os.cpu_count() or 1
    runs: dict[int, list[tuple[float, float]]] = {1: [], cores: []}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(Path(tmp))
        for _ in range(args.rounds):  # each round a fresh process per thread count
            for threads in runs:
                out = subprocess.run(
                    [str(exe), str(args.matrices), str(threads), "3"],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split()
                if out[2] != "1":
                    raise SystemExit("rows_layout: the two layouts' sums differ")
                runs[threads].append((float(out[0]), float(out[1])))
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout
    print(f"load: {uptime.strip()}")
    print(
        f"{args.matrices} projections of 512 x 1024 (4-bit, groups of 64), "
        f"{args.rounds} rounds, medians; sums equal bit for bit"
    )
    print(
        "| threads | as stored, G weights/s | blocked, G weights/s | blocked x stored |"
    )
    print("|---|---|---|---|")
    for threads, r in runs.items():
        stored = statistics.median(a for a, _ in r)
        blocked = statistics.median(b for _, b in r)
        ratios = statistics.median(b / a for a, b in r)
        print(f"| {threads} | {stored:.2f} | {blocked:.2f} | {ratios:.2f} |")


if __name__ == "__main__":
    main()
