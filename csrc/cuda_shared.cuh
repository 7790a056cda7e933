// The CUDA side's plain data: what the host and the kernels share through
// device and pinned memory (the slot table's and the tier's device copies,
// the mailbox, the reports), and the kernels' arguments.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cast.h"

namespace moestream {

class ExpertCache;

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(
        std::string(what) + " failed: " + cudaGetErrorString(e));
  }
}

template <typename T>
T* pinned(size_t count) {
  void* p = nullptr;
  check(
      cudaHostAlloc(&p, count * sizeof(T) + 16, cudaHostAllocMapped |
                                                    cudaHostAllocPortable),
      "cudaHostAlloc");
  return static_cast<T*>(p);
}

struct SegDesc {
  int64_t offset, nbytes, slot_bytes;
  Cast cast;
};

// Slot memory per segment, read when each call is encoded: a slot array whose
// buffer MLX moved (to unified memory) is written where it lives now.
constexpr int MAX_SEGMENTS = 16;
struct SlotPtrs {
  uint8_t* p[MAX_SEGMENTS];
};

// The copies of one call: records[0 .. n) of the host tier go to slots.
struct Plan {
  int n;
  int entries[1]; // max_stage slots, then max_stage host tier records
};

// Our kernels as driver-API handles: MLX adds graph nodes with its own CUDA
// runtime, which does not know kernels registered by ours.
inline CUfunction function_of(const void* kernel) {
  cudaFunction_t f;
  check(cudaGetFuncBySymbol(&f, kernel), "cudaGetFuncBySymbol");
  return reinterpret_cast<CUfunction>(f);
}

// A call's counts, written by the resolving kernel (pinned); `hits` last, so
// -1 there means the call has not run yet, -2 that it failed (no record).
struct DevRecord {
  int64_t hits, misses, bytes_read;
};

// The layer's slot table on the device (one allocation), as SlotTable
// keeps it on the host: expert -> slot, slot -> expert, policy scores, the
// stack of free slots, the LRU clock.
struct DevTable {
  int* slot_of; // num_experts
  int* expert_in; // capacity
  double* score; // num_experts
  int* free_stack; // capacity
  int* free_n; // 1
  int64_t* clock; // 1
  int64_t* loaded; // num_experts: each expert's load key (slot_policy.h)
  int64_t* loads; // 1: load keys given so far
  int64_t* counts; // NCOUNTS so far (device): see Count
  Plan* plan; // the copies of the call in flight (device)
  // Read ahead for this layer by the layer before, since its last call
  // (ExpertCache::prefetched_): written by that layer's kernel.
  unsigned char* prefetched; // num_experts
};

// A layer's counts on the device, in Counters' terms.
enum Count { Hits, Misses, Evictions, Prefetched, PrefetchedUsed,
             MissesPrefetched, NCOUNTS };

// The host tier's table on the device, as HostTier keeps it: key -> tier
// slot, slot -> key, last use (LRU stamps), the call that holds a slot, the
// stack of free slots, the clock, calls so far.
struct DevTier {
  int* slot_of; // keys
  int* key_in; // capacity
  int64_t* stamp; // capacity
  int64_t* held; // capacity: the epoch of the call that last used the slot
  int* free_stack; // capacity
  int* free_n;
  int64_t* clock;
  int64_t* epoch;
  int64_t* counts; // hits, misses, evictions, late so far (device)
  // Read ahead on the device: 1 while the slot's read may be in flight, 2
  // once it failed (the host's word is in `state`); `loading` of them at 1.
  unsigned char* ahead; // capacity
  int* loading; // 1
  int* state; // pinned, capacity: 1 reading, 0 read, 2 failed (the host's)
  int capacity;
};

// Records the tier lacks, posted by a kernel for the tier's service thread
// (pinned, mapped): `posted` is raised by the device once the request is
// written, `done` by the host once every record is read. Then `expert`,
// `slot` and `status` (nonzero: its read failed), `capacity` entries each.
struct Mailbox {
  int64_t posted, done;
  ExpertCache* cache; // the layer whose records (alive: its call is in flight)
  int n, failed;
  int entries[1];
};

// What the host learns from the device: counts so far and an error flag.
struct DevReport {
  int64_t counts[NCOUNTS];
  int error; // 1: id out of range; 2: more experts than slots; 3: a read
             // failed (the host set its words); 4: no tier slot to evict
};

// Everything the resolving kernel reads and writes.
struct ResolveArgs {
  const uint32_t* ids;
  int n, tokens;
  DevTable t;
  DevTier tt;
  int base; // the layer's first key in the tier
  ExpertCache* cache; // a host pointer, posted with the records to read
  Mailbox* box;
  int num_experts, capacity, lru, max_stage;
  double decay;
  int64_t record_bytes;
  uint32_t* out;
  DevReport* report;
  int64_t* tier_report;
  DevRecord* record;
};

// Counters in the resolving kernel's shared memory (cuda_device.cuh).
constexpr int NSHARED = 16;

// The kernels, in cuda_copy.cu and cuda_resolve.cu.
CUfunction export_ids_kernel();
CUfunction apply_plan_kernel();
CUfunction resolve_kernel();

} // namespace moestream
