// The eviction policy, written once for the host (SlotTable, HostTier) and
// the device (cuda_resolve.cu): LRFU's decayed use counts or LRU's clock, and
// which of two slots goes first. Each step rounds once, on both sides.
#pragma once

#include <cstdint>

#ifndef MOESTREAM_HD // as cast.h defines it
#if defined(__CUDACC__)
#define MOESTREAM_HD __host__ __device__
#else
#define MOESTREAM_HD
#endif
#endif

namespace moestream {

// RuntimeConfig.policy ("lru" or "lrfu") and RuntimeConfig.lrfu_decay.
struct PolicyConfig {
  bool lru{false};
  double decay{0.0};
};

namespace policy {

// a * b rounded once (never fused with a later add on the device).
MOESTREAM_HD inline double mul(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

MOESTREAM_HD inline double add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// LRFU: what every score is multiplied by after a call of `tokens` tokens.
MOESTREAM_HD inline double decay_factor(double decay, int tokens) {
  double f = 1.0;
  for (int t = 0; t < tokens; t++) {
    f = mul(f, decay);
  }
  return f;
}

// LRFU: the score of an expert routed in a call, after the decay.
MOESTREAM_HD inline double lrfu_used(double decayed) {
  return add(decayed, 1.0);
}

// The load keys of a call's misses: in expert order, from `loads` + 1 on, as
// runtime/pool.py loads them (`missed` holds `n` distinct experts).
MOESTREAM_HD inline int64_t load_key(const int* missed, int n, int j,
                                     int64_t loads) {
  int64_t rank = 0;
  for (int i = 0; i < n; i++) {
    rank += missed[i] < missed[j];
  }
  return loads + 1 + rank;
}

// LRU: the score of an expert routed in call number `clock`.
MOESTREAM_HD inline double lru_used(int64_t clock) {
  return double(clock);
}

// Whether `a` (score `sa`) is evicted before `b`: the lower score goes
// first, the lower key among equal scores. A slot's key is when its expert
// was loaded (runtime/pool.py's order: the earliest loaded of equal scores);
// the tier's LRU passes its stamps as scores and its slots as keys.
template <typename Score>
MOESTREAM_HD inline bool evicts_before(Score sa, int64_t a, Score sb,
                                       int64_t b) {
  return sa < sb || (sa == sb && a < b);
}

} // namespace policy
} // namespace moestream
