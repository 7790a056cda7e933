// The GPU read-ahead ring, device side: after a call, the next layer's
// predicted records posted for the service thread to read into the tier.
#pragma once

#include <cuda/atomic>

#include "cuda_tier_device.cuh"

namespace moestream {

// in neither its slots nor the tier are read into the tier ahead of its call
// (ExpertCache::hint through HostTier::read_ahead: at most half the tier
// reading, never a slot held by this call or still being read). Posted to
// the ring for the service thread; nothing here waits for them.
__device__ inline void read_ahead_next(const ResolveArgs& a, Shared& m,
                                int64_t epoch) {
  const DevTier& tt = a.tt;
  int64_t clock = *tt.clock; // thread 0's
  for (int i = 0; i < a.npred; i++) {
    uint32_t e = a.pred[i];
    if (e >= uint32_t(a.next_experts) || a.next_slot_of[e] >= 0 ||
        a.next_prefetched[e]) {
      continue; // every thread reads the same: no divergence
    }
    int key = a.next_base + int(e);
    if (tt.slot_of[key] >= 0 || 2 * *tt.loading >= tt.capacity) {
      continue;
    }
    int free_n = *tt.free_n;
    int s = tier_victim(tt, m, epoch, false);
    __syncthreads();
    if (threadIdx.x == 0 && s >= 0) {
      claim_tier_slot(tt, m, s, key, free_n);
      tt.stamp[s] = ++clock;
      tt.ahead[s] = 1;
      *tt.loading += 1;
      cuda::atomic_ref<int, cuda::thread_scope_system>(tt.state[s]).store(
          1, cuda::memory_order_relaxed);
      AheadRing* ring = a.ring;
      int64_t h = reinterpret_cast<volatile int64_t*>(&ring->head)[0];
      AheadEntry* entry = &ring->entries[h % tt.capacity];
      entry->cache = a.next_cache;
      entry->expert = int(e);
      entry->slot = s;
      __threadfence_system();
      cuda::atomic_ref<int64_t, cuda::thread_scope_system>(ring->head).store(
          h + 1, cuda::memory_order_release);
      a.next_prefetched[e] = 1;
      m.count[14] += 1;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *tt.clock = clock;
    a.next_counts[Prefetched] += m.count[14];
    a.next_report->counts[Prefetched] = a.next_counts[Prefetched];
  }
}

} // namespace moestream
