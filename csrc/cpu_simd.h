// The CPU kernels' vectors, MLX's CPU exp on them, and scans of rows.
//
// A vector holds sixteen floats where the CPU has AVX-512 (one of its 32
// registers), eight elsewhere (one AVX2 register of 16). Each lane's
// arithmetic is the same either way. The kernels are built with
// -ffp-contract=off (CMakeLists.txt): a multiply and an add stay two
// roundings, as in MLX's scalar loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace moestream {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
// The rows of one block of the blocked layout (slots, and records converted
// with --layout blocked): sixteen on every CPU, so that a record is read
// as stored everywhere; an 8-lane vector holds half a block.
constexpr int kBlock = 16;
static_assert(kBlock % kLanes == 0);
using VF = float __attribute__((vector_size(4 * kLanes)));
using VU = uint32_t __attribute__((vector_size(4 * kLanes)));
using VI = int32_t __attribute__((vector_size(4 * kLanes)));

#if defined(__AVX512F__)
// Sixteen vectors of sixteen words, turned: r[i] (lane j) = r[j] (lane i).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

#endif

inline VF floor_lanes(VF x) {
#if defined(__AVX512F__)
  return VF(_mm512_roundscale_ps(__m512(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
#elif defined(__AVX2__)
  return VF(_mm256_floor_ps(__m256(x)));
#else
  for (int j = 0; j < kLanes; j++) {
    x[j] = std::floor(x[j]);
  }
  return x;
#endif
}

// Whether fma_lanes is one instruction (else a library call a lane).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
constexpr bool kVectorFma = true;
#else
constexpr bool kVectorFma = false;
#endif

// a * b + c with one rounding, as std::fma.
inline VF fma_lanes(VF a, VF b, VF c) {
#if defined(__AVX512F__)
  return VF(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#elif defined(__AVX2__) && defined(__FMA__)
  return VF(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  for (int j = 0; j < kLanes; j++) {
    a[j] = std::fma(a[j], b[j], c[j]);
  }
  return a;
#endif
}

// MLX's CPU exp (mlx/backend/cpu/simd/math.h) in every lane, operation for
// operation: x * log2(e); its integer part floor(x + 0.5), which MLX takes in
// double (exact), here floor(x) plus one where x - floor(x) (exact) is at
// least a half; a polynomial of fused multiply-adds in the fraction; times 2
// to that integer; NaN kept, above 88 infinity, below -88 zero.
inline VF exp_lanes(VF in) {
  VF x = in * 1.442695f;
  VF f = floor_lanes(x);
  VF ipart = x - f >= 0.5f ? f + 1.0f : f;
  VF fpart = x - ipart;
  VF p = VF{} + 1.535336188319500e-4f;
  p = fma_lanes(p, fpart, VF{} + 1.339887440266574e-3f);
  p = fma_lanes(p, fpart, VF{} + 9.618437357674640e-3f);
  p = fma_lanes(p, fpart, VF{} + 5.550332471162809e-2f);
  p = fma_lanes(p, fpart, VF{} + 2.402264791363012e-1f);
  p = fma_lanes(p, fpart, VF{} + 6.931472028550421e-1f);
  p = fma_lanes(p, fpart, VF{} + 1.000000000000000f);
  VI epart = (__builtin_convertvector(ipart, VI) + 127) << 23;
  VF two;
  std::memcpy(&two, &epart, sizeof two);
  VF out = in != in ? in : two * p;
  out = in > 88.0f ? VF{} + std::numeric_limits<float>::infinity() : out;
  return in < -88.0f ? VF{} : out;
}

// How many of a row's first values count: past the last nonzero, a product
// with a finite b is a zero whose sum leaves the total as it is (it starts
// at +0 and never becomes -0). Softmax rows under a causal mask end in
// zeros.
inline int64_t until_zeros(const float* a, int64_t K) {
  int64_t k = K;
#if defined(__AVX512F__)
  while (k >= 16) {
    __mmask16 nz = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + k - 16),
                                      _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (nz) {
      return k - 16 + (32 - __builtin_clz(uint32_t(nz)));
    }
    k -= 16;
  }
#endif
  while (k > 0 && a[k - 1] == 0.0f) {
    k--;
  }
  return k;
}

inline bool all_finite(const float* b, int64_t rs, int64_t cs, int64_t K,
                       int64_t N) {
  VI seen = {}; // the exponent bits of every value, ANDed: all ones only
  for (int64_t k = 0; k < K; k++) { // where some value is infinite or NaN
    int64_t j = 0;
    for (; cs == 1 && j + kLanes <= N; j += kLanes) {
      VI v;
      std::memcpy(&v, b + k * rs + j, sizeof v);
      seen |= (v & 0x7f800000) == 0x7f800000;
    }
    for (; j < N; j++) {
      if (!std::isfinite(b[k * rs + j * cs])) {
        return false;
      }
    }
  }
  for (int l = 0; l < kLanes; l++) {
    if (seen[l]) {
      return false;
    }
  }
  return true;
}

} // namespace moestream
