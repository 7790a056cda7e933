#include "crc32.h"

#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moestream {

namespace {

// zlib's CRC-32 (reflected 0xEDB88320), slice-by-8.
struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) {
        c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      }
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
      for (int s = 1; s < 8; s++) {
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
      }
    }
  }
};

const CrcTables& crc_tables() {
  static CrcTables tables;
  return tables;
}

} // namespace

namespace {

// The register form (not inverted) of zlib's CRC-32, slice-by-8.
uint32_t crc32_tables(const uint8_t* p, size_t n, uint32_t crc) {
  const auto& t = crc_tables().t;
  while (n >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;
    crc = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^
        t[4][a >> 24] ^ t[3][b & 0xFF] ^ t[2][(b >> 8) & 0xFF] ^
        t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) {
    crc = t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  }
  return crc;
}

#if defined(__x86_64__)
// The same CRC by carry-less multiplication: four 128-bit lanes folded over
// 64 bytes at a time, then into one, then Barrett-reduced to 32 bits (Intel,
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", 2009; the
// bit-reflected constants of zlib's polynomial as in Chromium's zlib).
#define CLMUL __attribute__((target("pclmul,sse4.1")))

CLMUL inline __m128i load(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// x's two halves multiplied by k's, summed with the next 16 bytes.
CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(hi, lo), next);
}

// `n` >= 64 and a multiple of 16; register form in and out.
CLMUL uint32_t crc32_fold(const uint8_t* p, size_t n, uint32_t crc) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const uint64_t poly[] = {0x01db710641, 0x01f7011641};
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(int(crc)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  p += 64;
  n -= 64;
  while (n >= 64) {
    x1 = fold(x1, k, load(p));
    x2 = fold(x2, k, load(p + 16));
    x3 = fold(x3, k, load(p + 32));
    x4 = fold(x4, k, load(p + 48));
    p += 64;
    n -= 64;
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = fold(x1, k, x2);
  x1 = fold(x1, k, x3);
  x1 = fold(x1, k, x4);
  while (n >= 16) {
    x1 = fold(x1, k, load(p));
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits
  const __m128i mask = _mm_setr_epi32(~0, 0, ~0, 0);
  x2 = _mm_clmulepi64_si128(x1, k, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x00), x2);
  // Barrett reduction -> 32 bits
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x10);
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, mask), k, 0x00);
  return uint32_t(_mm_extract_epi32(_mm_xor_si128(x1, x2), 1));
}

bool has_clmul() {
  static const bool yes =
      __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

} // namespace

uint32_t crc32(const uint8_t* p, size_t n, uint32_t crc) {
  crc = ~crc;
#if defined(__x86_64__)
  if (n >= 64 && has_clmul()) {
    size_t blocks = n & ~size_t(15);
    crc = crc32_fold(p, blocks, crc);
    p += blocks;
    n -= blocks;
  }
#endif
  return ~crc32_tables(p, n, crc);
}

// zlib's crc32_combine: the CRC of A followed by B from crc(A), crc(B) and
// B's length, multiplying by x^(8 len) modulo the polynomial.
namespace {

uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) {
        break;
      }
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
  }
  return p;
}

} // namespace

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, int64_t len2) {
  uint32_t x2n = 1u << 30; // x^1, squared to x^(2^k) as k climbs
  uint32_t p = 1u << 31; // x^0
  // x^(8 len2) = product of x^(2^k) over the set bits of 8 len2
  for (uint64_t n = uint64_t(len2) << 3; n; n >>= 1) {
    if (n & 1) {
      p = multmodp(x2n, p);
    }
    x2n = multmodp(x2n, x2n);
  }
  return multmodp(p, crc1) ^ crc2;
}

} // namespace moestream
