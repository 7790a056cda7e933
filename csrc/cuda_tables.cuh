// GpuAccess: the host's slot and tier tables copied to the device and back.
#pragma once

#include "cuda_state.cuh"

namespace moestream {

// Friend of ExpertCache, SlotTable and HostTier: the tables' device copies,
// and the device's counts and records.
struct GpuAccess {
  // Whether this layer's calls resolve on the device, decided at its first
  // call for good, as the cache asks (the tier's first such decision holds
  // for all its layers).
  static bool device_mode(ExpertCache& c, GpuState& g);
  static void allocate(ExpertCache& c, GpuState& g);
  static void allocate_tier(TierGpu& tg);
  // The host's table to the device (the device's copy is not in use).
  static void push(ExpertCache& c, GpuState& g);
  static void up(void* dst, const void* src, size_t n);
  static void down(void* dst, const void* src, size_t n);
  // The device's table to the host, once every call on it has run.
  static void pull(ExpertCache& c, GpuState& g);
  // The tier's table to the device, once no read is in flight. A record
  // whose read failed leaves the tier (as its next request would have it).
  static void push_tier(TierGpu& tg);
  // The device's tier table to the host, once every call on it has run.
  static void pull_tier(TierGpu& tg);
  // Counts and records of the calls that have run, and the error flag.
  static void collect(ExpertCache& c, GpuState& g);
  // The tier's counts of the calls that have run.
  static void collect_tier(TierGpu& tg);
  // A pinned record for the call being encoded, marked not run.
  static DevRecord* record(GpuState& g, int64_t call);
  template <typename T>
  static T* take(uint8_t*& p, size_t n) {
    auto* q = p;
    p += (n * sizeof(T) + 7) / 8 * 8;
    return reinterpret_cast<T*>(q);
  }
};

} // namespace moestream
