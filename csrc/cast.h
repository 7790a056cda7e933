// Stored float segments into slots of another float dtype, bit for bit as
// MLX's astype (its CPU kernels) converts them: round to nearest even,
// subnormals and infinities kept, every NaN made MLX's (float16: the sign and
// 0x7D00; bfloat16: 0x7FC0; float16 to float32: the payload, made quiet).
// Integer arithmetic only, so host and device (cuda_copy.cu) agree exactly.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MOESTREAM_HD __host__ __device__
#else
#define MOESTREAM_HD
#endif

namespace moestream {

// The values are native.py's CASTS.
enum class Cast : int {
  None = 0,
  Bf16ToF32 = 1,
  F16ToF32 = 2,
  Bf16ToF16 = 3,
  F16ToBf16 = 4,
  F32ToF16 = 5,
  F32ToBf16 = 6,
};

MOESTREAM_HD inline int cast_src_size(Cast c) {
  return c == Cast::F32ToF16 || c == Cast::F32ToBf16 ? 4 : 2;
}

MOESTREAM_HD inline int cast_dst_size(Cast c) {
  return c == Cast::Bf16ToF32 || c == Cast::F16ToF32 ? 4 : 2;
}

MOESTREAM_HD inline uint32_t f16_to_f32(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F,
           man = h & 0x3FF;
  if (exp == 0x1F) {
    return sign | 0x7F800000u | (man ? 0x400000u | (man << 13) : 0);
  }
  if (exp != 0) {
    return sign | ((exp + 112) << 23) | (man << 13);
  }
  if (man == 0) {
    return sign;
  }
  int e = -1; // a subnormal: normalize its significand
  do {
    e++;
    man <<= 1;
  } while (!(man & 0x400));
  return sign | (uint32_t(112 - e) << 23) | ((man & 0x3FF) << 13);
}

// Keep the top bits of `q << shift | rest`, rounded to nearest even.
MOESTREAM_HD inline uint32_t round_even(uint32_t value, int shift) {
  uint32_t q = value >> shift, rest = value & ((1u << shift) - 1),
           half = 1u << (shift - 1);
  return q + (rest > half || (rest == half && (q & 1)));
}

MOESTREAM_HD inline uint16_t f32_to_f16(uint32_t x) {
  uint16_t sign = uint16_t((x >> 16) & 0x8000);
  uint32_t a = x & 0x7FFFFFFF, exp = a >> 23;
  if (a > 0x7F800000u) {
    return sign | 0x7D00;
  }
  if (exp >= 143) { // 2^16 and above (infinity too): past float16's range
    return sign | 0x7C00;
  }
  if (exp >= 113) { // normal; rounding up may carry into the exponent, or to inf
    return sign | uint16_t(round_even(((exp - 112) << 23) | (a & 0x7FFFFF), 13));
  }
  if (exp < 102) { // below half of float16's smallest subnormal, 2^-24
    return sign;
  }
  // Subnormal in float16: units of 2^-24 (rounding may reach the smallest normal).
  return sign | uint16_t(round_even((a & 0x7FFFFF) | 0x800000, 126 - exp));
}

MOESTREAM_HD inline uint16_t f32_to_bf16(uint32_t x) {
  if ((x & 0x7FFFFFFF) > 0x7F800000u) {
    return 0x7FC0;
  }
  return uint16_t((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

// Element `i` of `src` (stored dtype) into element `i` of `dst` (slot dtype).
MOESTREAM_HD inline void cast_element(Cast c, const uint8_t* src, uint8_t* dst,
                                      int64_t i) {
  uint32_t w = 0;
  uint16_t h = 0;
  if (cast_src_size(c) == 4) {
    memcpy(&w, src + 4 * i, 4);
  } else {
    memcpy(&h, src + 2 * i, 2);
  }
  switch (c) {
    case Cast::Bf16ToF32:
      w = uint32_t(h) << 16;
      break;
    case Cast::F16ToF32:
      w = f16_to_f32(h);
      break;
    case Cast::Bf16ToF16:
      h = f32_to_f16(uint32_t(h) << 16);
      break;
    case Cast::F16ToBf16:
      h = f32_to_bf16(f16_to_f32(h));
      break;
    case Cast::F32ToF16:
      h = f32_to_f16(w);
      break;
    case Cast::F32ToBf16:
      h = f32_to_bf16(w);
      break;
    case Cast::None:
      break;
  }
  if (cast_dst_size(c) == 4) {
    memcpy(dst + 4 * i, &w, 4);
  } else {
    memcpy(dst + 2 * i, &h, 2);
  }
}

} // namespace moestream
