// Device helpers of the resolving kernel for the host tier: HostTier's
// request, victim and claim on the device's copy of its table.
#pragma once

#include <cuda/atomic>

#include "cuda_device.cuh"

namespace moestream {

// The host's word on a slot read ahead: 1 while reading, 0 read, 2 failed.
__device__ inline int ahead_state(const DevTier& tt, int s) {
  return cuda::atomic_ref<int, cuda::thread_scope_system>(tt.state[s]).load(
      cuda::memory_order_acquire);
}

// Every thread: the reads ahead that have finished since the last call.
__device__ inline void refresh_ahead(const DevTier& tt) {
  int done = 0;
  for (int s = threadIdx.x; s < tt.capacity; s += blockDim.x) {
    if (tt.ahead[s] == 1) {
      int v = ahead_state(tt, s);
      if (v != 1) {
        tt.ahead[s] = v == 2 ? 2 : 0;
        done += 1;
      }
    }
  }
  if (done) {
    atomicSub(tt.loading, done);
  }
  __syncthreads();
}

// Thread 0: wait for the read ahead into slot `s`; 0 it was read, 1 it was
// still reading (HostTier's `late`), 2 it failed (read it again).
__device__ inline int settle_ahead(const DevTier& tt, int s) {
  if (tt.ahead[s] == 2) {
    tt.ahead[s] = 0;
    return 2;
  }
  int v = ahead_state(tt, s);
  int late = v == 1;
  while (v == 1) {
    __nanosleep(500);
    v = ahead_state(tt, s);
  }
  tt.ahead[s] = 0;
  *tt.loading -= 1;
  return v == 2 ? 2 : late;
}

// Thread 0: wait until no read ahead is in flight (HostTier::victim waits
// for one when every other slot is held).
__device__ inline void wait_ahead(const DevTier& tt) {
  for (int s = 0; s < tt.capacity; s++) {
    if (tt.ahead[s] == 1) {
      int v = ahead_state(tt, s);
      while (v == 1) {
        __nanosleep(500);
        v = ahead_state(tt, s);
      }
      tt.ahead[s] = v == 2 ? 2 : 0;
      *tt.loading -= 1;
    }
  }
}

// A tier slot for a record the tier lacks: a free one, else the oldest not
// held by this call nor being read ahead; with `wait`, once the reads ahead
// are done if every such slot is being read (-1: none).
__device__ inline int tier_victim(const DevTier& tt, Shared& m, int64_t epoch,
                           bool wait) {
  int free_n = *tt.free_n;
  if (free_n > 0) {
    return tt.free_stack[free_n - 1];
  }
  auto* scores = reinterpret_cast<int64_t*>(m.best_score);
  int s = oldest_tier_slot(tt, epoch, scores, m.best_slot);
  if (s < 0 && wait) {
    if (threadIdx.x == 0) {
      wait_ahead(tt);
    }
    __syncthreads();
    s = oldest_tier_slot(tt, epoch, scores, m.best_slot);
  }
  return s;
}

// Thread 0: slot `s` (from tier_victim) now holds `key` (HostTier::claim).
__device__ inline void claim_tier_slot(const DevTier& tt, Shared& m, int s, int key,
                                int free_n) {
  if (free_n > 0) {
    *tt.free_n = free_n - 1;
  } else {
    tt.slot_of[tt.key_in[s]] = -1;
    m.count[10] += 1;
  }
  tt.key_in[s] = key;
  tt.slot_of[key] = s;
  tt.ahead[s] = 0;
}

// Each miss's record in the tier (HostTier::request): a tier hit is used
// again (once its read ahead, if any, is done); a record the tier lacks, or
// whose read ahead failed, gets a slot and goes in the mailbox to be read.
__device__ inline void resolve_tier(const ResolveArgs& a, Shared& m, int64_t epoch) {
  const DevTier& tt = a.tt;
  volatile int* expert = a.box->entries;
  volatile int* slot = expert + tt.capacity;
  int64_t clock = *tt.clock; // thread 0's
  int nm = m.count[4];
  for (int j = 0; j < nm; j++) {
    int key = a.base + m.missed[j];
    int s = tt.slot_of[key];
    int ahead = s >= 0 ? tt.ahead[s] : 0;
    __syncthreads(); // every thread has read before thread 0 writes
    if (ahead) {
      if (threadIdx.x == 0) {
        m.count[15] = settle_ahead(tt, s);
      }
      __syncthreads();
      ahead = m.count[15];
    }
    bool read = s < 0 || ahead == 2;
    if (s < 0) {
      int free_n = *tt.free_n;
      s = tier_victim(tt, m, epoch, true);
      __syncthreads();
      if (threadIdx.x == 0 && s < 0) {
        m.count[5] = 4;
      } else if (threadIdx.x == 0) {
        claim_tier_slot(tt, m, s, key, free_n);
      }
    }
    if (threadIdx.x == 0 && s >= 0) {
      if (read) {
        int r = m.count[6]++;
        expert[r] = m.missed[j];
        slot[r] = s;
        m.count[9] += 1;
      } else {
        m.count[ahead == 1 ? 13 : 8] += 1;
      }
      tt.stamp[s] = ++clock;
      tt.held[s] = epoch;
      a.t.plan->entries[a.max_stage + j] = s;
    }
    __syncthreads();
    if (m.count[5]) {
      break;
    }
  }
  if (threadIdx.x == 0) {
    *tt.clock = clock;
  }
}

// After a call that succeeded: the next layer's predicted experts that are

} // namespace moestream
