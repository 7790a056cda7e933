// Device helpers of the resolving kernel: its shared memory, and the one
// block-wide choice of the slot that goes first (slot_policy.h's order).
#pragma once

#include "cuda_shared.cuh"
#include "slot_policy.h"

namespace moestream {

// Shared memory of one resolving call.
struct Shared {
  double* best_score;
  int* best_slot;
  int* unique; // n
  int* missed; // n: the experts given a slot, in order
  int* count; // unique, hits, misses, evictions, planned, error, requests,
              // failed reads, tier hits, tier misses, tier evictions,
              // prefetched used, misses prefetched, tier late, read ahead,
              // scratch (NSHARED)
  unsigned char* keep; // num_experts
};

// Every thread: the usable slot (`usable(s)`) that policy::evicts_before puts
// first by `score(s)` and `key(s)`, or -1; one block's reduction.
template <typename Score, typename Usable, typename ScoreOf, typename KeyOf>
__device__ int first_to_go(int capacity, Usable usable, ScoreOf score_of,
                           KeyOf key_of, Score* best_score, int* best_slot) {
  Score score = 0;
  int slot = -1;
  for (int s = threadIdx.x; s < capacity; s += blockDim.x) {
    if (usable(s) && (slot < 0 || policy::evicts_before(score_of(s), key_of(s),
                                                        score, key_of(slot)))) {
      score = score_of(s);
      slot = s;
    }
  }
  best_score[threadIdx.x] = score;
  best_slot[threadIdx.x] = slot;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      int o = threadIdx.x + half;
      int a = best_slot[threadIdx.x], b = best_slot[o];
      if (b >= 0 &&
          (a < 0 || policy::evicts_before(best_score[o], key_of(b),
                                          best_score[threadIdx.x], key_of(a)))) {
        best_score[threadIdx.x] = best_score[o];
        best_slot[threadIdx.x] = b;
      }
    }
    __syncthreads();
  }
  int v = best_slot[0];
  __syncthreads();
  return v;
}

// The slot SlotTable::victim evicts: the lowest score of an expert not kept,
// the earliest loaded of equal ones.
__device__ inline int lowest_slot(const DevTable& t, int capacity,
                                  const unsigned char* keep, double* best_score,
                                  int* best_slot) {
  return first_to_go(
      capacity, [&](int s) { return !keep[t.expert_in[s]]; },
      [&](int s) { return t.score[t.expert_in[s]]; },
      [&](int s) { return t.loaded[t.expert_in[s]]; }, best_score, best_slot);
}

// The tier slot HostTier::victim evicts: the oldest stamp among slots that
// hold a record not used by this call nor being read ahead (-1 if none).
__device__ inline int oldest_tier_slot(const DevTier& tt, int64_t epoch,
                                       int64_t* best_stamp, int* best_slot) {
  return first_to_go(
      tt.capacity,
      [&](int s) {
        return tt.key_in[s] >= 0 && tt.held[s] != epoch && tt.ahead[s] != 1;
      },
      [&](int s) { return tt.stamp[s]; }, [](int s) { return int64_t(s); },
      best_stamp, best_slot);
}

} // namespace moestream
