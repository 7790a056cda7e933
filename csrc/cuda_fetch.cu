// The CUDA side of ExpertFetch: stream-ordered steps per MoE call, all inside
// MLX's CUDA graph, so Python never waits on the router.
// The reference path (RuntimeConfig.device_resolve=False):
//   1. a kernel copies the routed ids into pinned host memory (zero copy);
//   2. a host function resolves slots and has the misses read into the pinned
//      host tier (host_tier.h), by its reader threads in parallel, unless the
//      tier holds them already (read ahead, or used before);
//   3. a kernel copies those records into their device slots (reading the
//      pinned tier over the bus) and writes the slot ids.
// The device path (the default): one kernel resolves the call from the
// device's copies of the layer's slot table and of the host tier's table,
// making the host's choices (victims, scores, the tier's LRU, counts). Slot
// hits and tier hits need no host at all; for records the tier lacks, the
// kernel posts (record, tier slot) to a pinned mailbox and spins until the
// tier's service thread has had them read (GPU-initiated reads; nothing it
// waits for is queued on the stream). Step 3 follows. A chained layer's
// kernel then reads the next layer's predicted records ahead into the tier
// (posted to a pinned ring; the device waits on a slot's read only when a
// call uses it). The host's copies are brought back (gpu_sync_host) before a
// host-side load uses them.
#include <cuda.h>
#include <cuda/atomic>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <stdexcept>
#include <utility>
#include <vector>

#include "expert_cache.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

namespace moestream {

namespace cu = mlx::core::cu;

namespace {

void check(cudaError_t e, const char* what) {
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

} // namespace

// A call's counts, written by the resolving kernel (pinned); `hits` last, so
// -1 there means the call has not run yet, -2 that it failed (no record).
struct DevRecord {
  int64_t hits, misses, bytes_read;
};

// The layer's slot table on the device (one allocation), as ExpertCache
// keeps it on the host: expert -> slot, slot -> expert, policy scores, the
// stack of free slots, the LRU clock.
struct DevTable {
  int* slot_of; // num_experts
  int* expert_in; // capacity
  double* score; // num_experts
  int* free_stack; // capacity
  int* free_n; // 1
  int64_t* clock; // 1
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

// Reads ahead posted by kernels for the service thread (pinned, mapped): a
// ring of `capacity` entries; `head` counts the entries written so far.
struct AheadEntry {
  ExpertCache* cache; // the layer the record is for (kept alive by its chain)
  int expert, slot;
};
struct AheadRing {
  int64_t head;
  AheadEntry entries[1];
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

// The tier's side on the GPU: its device table, mailbox and counts.
struct TierGpu {
  HostTier* tier;
  int mode{-1}; // -1 not decided yet, 0 the host function, 1 the device
  uint8_t* table_memory{nullptr};
  DevTier table{};
  Mailbox* box{nullptr}; // pinned
  AheadRing* ring{nullptr}; // pinned
  int64_t* report{nullptr}; // pinned: hits, misses, evictions, late so far
  int64_t taken[4]{};
  int64_t served{0}; // the service thread's: the last request it served
  std::atomic<int64_t> ring_taken{0}; // ring entries the service submitted
  std::atomic<int64_t> ahead_pending{0}; // reads ahead not finished
  bool device_owned{false}; // the device's table is the current one
  ~TierGpu();
};

struct GpuState {
  int max_stage, max_pred;
  uint32_t* ids{nullptr}; // pinned: routed ids of the call in flight
  uint32_t* pred{nullptr}; // pinned: predicted ids for the next layer
  uint32_t* out{nullptr}; // pinned: slot per routed pair
  Plan* plan{nullptr}; // pinned
  SegDesc* segs{nullptr}; // device
  int nseg;
  // Device resolution: -1 not decided yet, 0 off, 1 on.
  int device_mode{-1};
  uint8_t* table_memory{nullptr}; // device: every array of `table`
  DevTable table{};
  DevReport* report{nullptr}; // pinned
  int64_t taken[NCOUNTS]{}; // report counts already folded into the counters
  std::mutex records_mutex;
  std::deque<std::pair<int64_t, DevRecord*>> pending; // recording, in order
  std::vector<DevRecord*> spare;
  std::vector<DevRecord*> chunks; // pinned, of `spare` and `pending`

  // The cache goes only once the stream has run its calls (the completed
  // handler of each holds it), so nothing in flight uses these. Errors are
  // ignored: at exit the CUDA runtime may be gone already.
  ~GpuState() {
    for (void* p : {static_cast<void*>(ids), static_cast<void*>(pred),
                    static_cast<void*>(out), static_cast<void*>(plan),
                    static_cast<void*>(report)}) {
      if (p) {
        cudaFreeHost(p);
      }
    }
    for (auto* chunk : chunks) {
      cudaFreeHost(chunk);
    }
    cudaFree(segs);
    cudaFree(table_memory);
  }
};

// Our kernels as driver-API handles: MLX adds graph nodes with its own CUDA
// runtime, which does not know kernels registered by ours.
struct Kernels {
  CUfunction export_ids, apply_plan, resolve_on_device;
};

struct CallArgs {
  ExpertCache* cache;
  int64_t n;
  int tokens;
  int npred;
  int64_t call;
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
  // Read ahead (the layer is chained): the next layer's predicted experts,
  // its table, counts and report, its first tier key, its cache; null
  // `next_slot_of` when none.
  const uint32_t* pred;
  int npred;
  const int* next_slot_of;
  unsigned char* next_prefetched;
  int64_t* next_counts;
  DevReport* next_report;
  int next_experts, next_base;
  ExpertCache* next_cache;
  AheadRing* ring;
};

__global__ void export_ids(
    const uint32_t* ids, uint32_t* host_ids, int n, const uint32_t* pred,
    uint32_t* host_pred, int npred) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    host_ids[i] = ids[i];
  }
  for (int i = threadIdx.x; i < npred; i += blockDim.x) {
    host_pred[i] = pred[i];
  }
  __threadfence_system();
}

__global__ void apply_plan(
    const Plan* plan, int max_stage, const uint8_t* tier, int64_t tier_stride,
    const SegDesc* segs, SlotPtrs dsts, int nseg, const uint32_t* host_out,
    uint32_t* out, int n) {
  int j = blockIdx.y;
  if (host_out && j == 0 && blockIdx.x == 0) { // else resolved on the device
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      out[i] = host_out[i];
    }
  }
  if (j >= plan->n) {
    return;
  }
  const uint8_t* record = tier + plan->entries[max_stage + j] * tier_stride;
  int slot = plan->entries[j];
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t threads = int64_t(gridDim.x) * blockDim.x;
  for (int s = 0; s < nseg; s++) {
    const SegDesc& d = segs[s];
    const uint8_t* src = record + d.offset;
    uint8_t* dst = dsts.p[s] + slot * d.slot_bytes;
    if (d.cast != Cast::None) { // as the host converts (cast.h)
      int64_t n = d.nbytes / cast_src_size(d.cast);
      for (int64_t i = tid; i < n; i += threads) {
        cast_element(d.cast, src, dst, i);
      }
      continue;
    }
    bool aligned = ((reinterpret_cast<uintptr_t>(src) |
                     reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    int64_t vec = aligned ? d.nbytes / 16 : 0;
    auto* s16 = reinterpret_cast<const uint4*>(src);
    auto* d16 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = tid; i < vec; i += threads) {
      d16[i] = s16[i];
    }
    for (int64_t i = vec * 16 + tid; i < d.nbytes; i += threads) {
      dst[i] = src[i];
    }
  }
}

// The smallest (score, slot) over slots whose expert is not kept: the slot
// ExpertCache::victim picks (the first of the lowest score).
__device__ int lowest_slot(const DevTable& t, int capacity,
                           const unsigned char* keep, double* best_score,
                           int* best_slot) {
  double score = 0.0;
  int slot = -1;
  for (int s = threadIdx.x; s < capacity; s += blockDim.x) {
    int e = t.expert_in[s];
    if (!keep[e] && (slot < 0 || t.score[e] < score)) {
      score = t.score[e];
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
          (a < 0 || best_score[o] < best_score[threadIdx.x] ||
           (best_score[o] == best_score[threadIdx.x] && b < a))) {
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

// The tier slot HostTier::victim evicts: the oldest stamp among slots that
// hold a record not used by this call nor being read ahead (-1 if none).
__device__ int oldest_tier_slot(const DevTier& tt, int64_t epoch,
                                int64_t* best_stamp, int* best_slot) {
  int64_t stamp = 0;
  int slot = -1;
  for (int s = threadIdx.x; s < tt.capacity; s += blockDim.x) {
    if (tt.key_in[s] >= 0 && tt.held[s] != epoch && tt.ahead[s] != 1 &&
        (slot < 0 || tt.stamp[s] < stamp)) {
      stamp = tt.stamp[s];
      slot = s;
    }
  }
  best_stamp[threadIdx.x] = stamp;
  best_slot[threadIdx.x] = slot;
  __syncthreads();
  for (int half = blockDim.x / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      int o = threadIdx.x + half;
      int a = best_slot[threadIdx.x], b = best_slot[o];
      if (b >= 0 && (a < 0 || best_stamp[o] < best_stamp[threadIdx.x] ||
                     (best_stamp[o] == best_stamp[threadIdx.x] && b < a))) {
        best_stamp[threadIdx.x] = best_stamp[o];
        best_slot[threadIdx.x] = b;
      }
    }
    __syncthreads();
  }
  int v = best_slot[0];
  __syncthreads();
  return v;
}

// Shared memory of one resolving call.
constexpr int NSHARED = 16;
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

// The routed experts' slots, each miss given the victim the host would
// choose (ExpertCache::resolve) and queued in the plan for apply_plan.
__device__ void resolve_slots(const ResolveArgs& a, Shared& m) {
  const DevTable& t = a.t;
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) {
    m.keep[e] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int nu = 0, error = 0;
    for (int i = 0; i < a.n; i++) {
      uint32_t e = a.ids[i];
      if (e >= uint32_t(a.num_experts)) {
        error = 1;
        break;
      }
      if (!m.keep[e]) {
        m.keep[e] = 1;
        m.unique[nu++] = int(e);
      }
    }
    if (nu > a.capacity) {
      error = 2;
    }
    m.count[0] = error ? 0 : nu;
    for (int k = 1; k < NSHARED; k++) {
      m.count[k] = 0;
    }
    m.count[5] = error;
  }
  __syncthreads();
  int nu = m.count[0];
  for (int u = 0; u < nu; u++) {
    int e = m.unique[u];
    if (t.slot_of[e] >= 0) { // every thread reads the same: no divergence
      if (threadIdx.x == 0) {
        m.count[1] += 1;
        m.count[11] += t.prefetched[e];
        t.prefetched[e] = 0;
      }
      continue;
    }
    int v;
    if (*t.free_n > 0) {
      v = t.free_stack[*t.free_n - 1];
    } else {
      v = lowest_slot(t, a.capacity, m.keep, m.best_score, m.best_slot);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (*t.free_n > 0) {
        *t.free_n -= 1;
      } else {
        t.slot_of[t.expert_in[v]] = -1;
        m.count[3] += 1;
      }
      t.expert_in[v] = e;
      t.slot_of[e] = v;
      m.count[2] += 1;
      m.count[11] += t.prefetched[e]; // ExpertCache::resolve's counts
      m.count[12] += t.prefetched[e];
      t.prefetched[e] = 0;
      int j = m.count[4]++;
      m.missed[j] = e;
      t.plan->entries[j] = v;
    }
    __syncthreads();
  }
}

// The host's word on a slot read ahead: 1 while reading, 0 read, 2 failed.
__device__ int ahead_state(const DevTier& tt, int s) {
  return cuda::atomic_ref<int, cuda::thread_scope_system>(tt.state[s]).load(
      cuda::memory_order_acquire);
}

// Every thread: the reads ahead that have finished since the last call.
__device__ void refresh_ahead(const DevTier& tt) {
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
__device__ int settle_ahead(const DevTier& tt, int s) {
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
__device__ void wait_ahead(const DevTier& tt) {
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
__device__ int tier_victim(const DevTier& tt, Shared& m, int64_t epoch,
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
__device__ void claim_tier_slot(const DevTier& tt, Shared& m, int s, int key,
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
__device__ void resolve_tier(const ResolveArgs& a, Shared& m, int64_t epoch) {
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
// in neither its slots nor the tier are read into the tier ahead of its call
// (ExpertCache::hint through HostTier::read_ahead: at most half the tier
// reading, never a slot held by this call or still being read). Posted to
// the ring for the service thread; nothing here waits for them.
__device__ void read_ahead_next(const ResolveArgs& a, Shared& m,
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

// Thread 0: post the call's requests and wait until the host has read them
// (into pinned memory, by threads that wait on nothing of this stream).
__device__ void read_requests(const ResolveArgs& a, Shared& m) {
  int r = m.count[6];
  if (threadIdx.x != 0 || r == 0) {
    return;
  }
  volatile Mailbox* b = a.box;
  b->cache = a.cache;
  b->n = r;
  cuda::atomic_ref<int64_t, cuda::thread_scope_system> posted(a.box->posted);
  cuda::atomic_ref<int64_t, cuda::thread_scope_system> done(a.box->done);
  int64_t seq = posted.load(cuda::memory_order_relaxed) + 1;
  posted.store(seq, cuda::memory_order_release);
  while (done.load(cuda::memory_order_acquire) != seq) {
    __nanosleep(200);
  }
  m.count[7] = b->failed;
}

// A failed call as the host's: the tier's failed records leave it
// (HostTier::wait), every miss leaves its slot (resolve_through_tier).
__device__ void undo_misses(const ResolveArgs& a, Shared& m) {
  const DevTier& tt = a.tt;
  volatile int* slot = a.box->entries + tt.capacity;
  volatile int* status = slot + tt.capacity;
  for (int r = 0; r < m.count[6]; r++) {
    int s = slot[r];
    if (status[r]) {
      tt.slot_of[tt.key_in[s]] = -1;
      tt.key_in[s] = -1;
      tt.free_stack[(*tt.free_n)++] = s;
    }
  }
  const DevTable& t = a.t;
  for (int j = 0; j < m.count[4]; j++) {
    int e = m.missed[j];
    int v = t.slot_of[e];
    if (v >= 0) {
      t.slot_of[e] = -1;
      t.expert_in[v] = -1;
      t.free_stack[(*t.free_n)++] = v;
    }
  }
}

// ExpertCache::used, in the same double arithmetic (no fused multiply-add).
__device__ void use_scores(const ResolveArgs& a, Shared& m) {
  const DevTable& t = a.t;
  int nu = m.count[0];
  if (a.lru) {
    int64_t clock = *t.clock + 1;
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
      t.score[m.unique[u]] = double(clock);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *t.clock = clock;
    }
    return;
  }
  double f = 1.0;
  for (int k = 0; k < a.tokens; k++) {
    f = __dmul_rn(f, a.decay);
  }
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) {
    t.score[e] = __dmul_rn(t.score[e], f);
  }
  __syncthreads();
  for (int u = threadIdx.x; u < nu; u += blockDim.x) {
    t.score[m.unique[u]] = __dadd_rn(t.score[m.unique[u]], 1.0);
  }
}

// Thread 0: the plan's length, counts so far, the error, the call's record.
__device__ void report_call(const ResolveArgs& a, Shared& m, bool failed) {
  a.t.plan->n = failed ? 0 : m.count[4];
  a.t.counts[Hits] += m.count[1];
  a.t.counts[Misses] += m.count[2];
  a.t.counts[Evictions] += m.count[3];
  a.t.counts[PrefetchedUsed] += m.count[11];
  a.t.counts[MissesPrefetched] += m.count[12];
  for (int k = 0; k < NCOUNTS; k++) {
    a.report->counts[k] = a.t.counts[k];
  }
  for (int k = 0; k < 4; k++) { // hits, misses, evictions, late
    a.tt.counts[k] += m.count[k < 3 ? 8 + k : 13];
    a.tier_report[k] = a.tt.counts[k];
  }
  int error = m.count[5] ? m.count[5] : (m.count[7] ? 3 : 0);
  if (error) {
    a.report->error = error;
  }
  if (a.record) {
    a.record->misses = m.count[2];
    a.record->bytes_read = m.count[6] * a.record_bytes;
    __threadfence_system();
    a.record->hits = failed ? -2 : m.count[1];
  }
  __threadfence_system();
}

// ExpertCache::resolve_call through the tier on the device, one block.
__global__ void resolve_on_device(ResolveArgs a) {
  extern __shared__ unsigned char smem[];
  __shared__ int64_t epoch;
  Shared m;
  m.best_score = reinterpret_cast<double*>(smem);
  m.best_slot = reinterpret_cast<int*>(m.best_score + blockDim.x);
  m.unique = m.best_slot + blockDim.x;
  m.missed = m.unique + a.n;
  m.count = m.missed + a.n;
  m.keep = reinterpret_cast<unsigned char*>(m.count + NSHARED);
  if (threadIdx.x == 0) {
    epoch = ++*a.tt.epoch; // HostTier::begin_call: earlier holds end
  }
  refresh_ahead(a.tt);
  resolve_slots(a, m);
  resolve_tier(a, m, epoch);
  read_requests(a, m);
  __syncthreads();
  int error = m.count[5];
  bool failed = error != 0 || m.count[7] != 0;
  if (threadIdx.x == 0 && failed && error != 1 && error != 2) {
    undo_misses(a, m);
  }
  if (error != 1 && error != 2) { // those raise before any use
    use_scores(a, m);
  }
  __syncthreads();
  if (!failed && a.next_slot_of) {
    read_ahead_next(a, m, epoch);
  }
  for (int i = threadIdx.x; i < a.n; i += blockDim.x) {
    uint32_t e = a.ids[i];
    a.out[i] = !failed && a.t.slot_of[e] >= 0 ? uint32_t(a.t.slot_of[e])
                                              : 0; // an error raises next call
  }
  if (threadIdx.x == 0) {
    report_call(a, m, failed);
  }
}

void CUDART_CB resolve_on_host(void* p) {
  auto* a = static_cast<CallArgs*>(p);
  auto& c = *a->cache;
  auto& g = *c.gpu;
  g.plan->n = 0;
  c.counters.calls += 1;
  try {
    c.resolve_call(
        g.ids, a->n, a->tokens, g.out, a->call,
        [&](const uint8_t*, int64_t host, int s) {
          int i = g.plan->n;
          g.plan->entries[i] = s;
          g.plan->entries[g.max_stage + i] = int(host);
          g.plan->n = i + 1;
        });
    if (a->npred && c.next()) {
      c.next()->hint(g.pred, a->npred);
    }
  } catch (const std::exception& e) {
    c.set_error(e.what());
    g.plan->n = 0;
    for (int64_t i = 0; i < a->n; i++) {
      g.out[i] = 0; // in range; the error is raised before the next call
    }
  }
  delete a;
}

namespace {

const Kernels& kernels() {
  static Kernels k = [] {
    Kernels k;
    cudaFunction_t f;
    check(cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(&export_ids)),
          "cudaGetFuncBySymbol");
    k.export_ids = reinterpret_cast<CUfunction>(f);
    check(cudaGetFuncBySymbol(&f, reinterpret_cast<const void*>(&apply_plan)),
          "cudaGetFuncBySymbol");
    k.apply_plan = reinterpret_cast<CUfunction>(f);
    check(cudaGetFuncBySymbol(
              &f, reinterpret_cast<const void*>(&resolve_on_device)),
          "cudaGetFuncBySymbol");
    k.resolve_on_device = reinterpret_cast<CUfunction>(f);
    return k;
  }();
  return k;
}

GpuState& gpu_state(ExpertCache& c) {
  if (c.gpu) {
    return *c.gpu;
  }
  cu::device(mlx::core::Device(mlx::core::Device::gpu)).make_current();
  if (!c.tier() || !c.tier()->pinned ||
      c.tier()->record_bytes < c.record_nbytes) {
    throw std::runtime_error("the native engine on a GPU needs a pinned host tier");
  }
  auto g = std::make_shared<GpuState>();
  g->max_stage = std::min(c.capacity, c.max_pairs);
  g->max_pred = 4 * c.num_experts;
  g->ids = pinned<uint32_t>(c.max_pairs);
  g->pred = pinned<uint32_t>(g->max_pred);
  g->out = pinned<uint32_t>(c.max_pairs);
  g->plan = reinterpret_cast<Plan*>(pinned<int>(2 * g->max_stage + 1));
  g->plan->n = 0;
  std::vector<SegDesc> segs;
  for (size_t i = 0; i < c.segments.size(); i++) {
    auto& a = c.slots[i];
    segs.push_back(
        {c.segments[i].offset, c.segments[i].nbytes,
         int64_t(a.nbytes() / a.shape(0)), c.segments[i].cast});
  }
  if (segs.size() > MAX_SEGMENTS) {
    throw std::runtime_error("too many expert segments for the native engine");
  }
  g->nseg = int(segs.size());
  check(cudaMalloc(&g->segs, segs.size() * sizeof(SegDesc)), "cudaMalloc");
  check(
      cudaMemcpy(g->segs, segs.data(), segs.size() * sizeof(SegDesc),
                 cudaMemcpyHostToDevice),
      "cudaMemcpy");
  c.gpu = g;
  return *g;
}

} // namespace

namespace {

// The thread that serves every tier's mailbox: it has the records a kernel
// posted read on the tier's reader threads, then raises `done`. Process-wide
// and never destroyed (as the readers are); it holds no tier or cache (a
// posted call keeps its own alive). It spins for a second after a call is
// encoded or served, else looks every millisecond: a kernel that waits finds
// it within that, however late the stream runs.
struct Service {
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<TierGpu*> tiers;
  std::atomic<int64_t> busy_until{0}; // steady clock, ns
  bool started{false};
};

Service& service() {
  static auto* s = new Service();
  return *s;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void service_busy() {
  service().busy_until = now_ns() + 1000000000;
  service().wake.notify_one();
}

void service_loop();

void service_register(TierGpu* tg) {
  auto& sv = service();
  std::lock_guard<std::mutex> lock(sv.mutex);
  sv.tiers.push_back(tg);
  if (!sv.started) {
    sv.started = true;
    std::thread(service_loop).detach();
  }
  sv.wake.notify_one();
}

void service_unregister(TierGpu* tg) {
  auto& sv = service();
  std::lock_guard<std::mutex> lock(sv.mutex);
  std::erase(sv.tiers, tg);
}

} // namespace

TierGpu::~TierGpu() {
  if (box) { // registered with the service
    service_unregister(this);
    cudaFreeHost(box);
    cudaFreeHost(ring);
    cudaFreeHost(table.state);
    cudaFreeHost(report);
  }
  cudaFree(table_memory);
}

// Copies of ExpertCache's and HostTier's tables between the host and the
// device, and the reads the device asks for.
struct GpuAccess {
  // Whether this layer's calls resolve on the device, decided at its first
  // call for good, as the cache asks (the tier's first such decision holds
  // for all its layers).
  static bool device_mode(ExpertCache& c, GpuState& g) {
    if (g.device_mode < 0) {
      HostTier& t = *c.tier();
      if (!t.gpu) {
        t.gpu = std::make_shared<TierGpu>();
        t.gpu->tier = &t;
      }
      TierGpu& tg = *t.gpu;
      bool on = c.device_resolve;
      if (tg.mode < 0) {
        if (on) {
          allocate_tier(tg);
        }
        tg.mode = on;
      } else if (tg.mode == 1 && !on) {
        throw std::runtime_error(
            "the layers of one host tier must all resolve on the device or "
            "none; give them one device_resolve");
      }
      on = on && tg.mode == 1;
      if (on) {
        allocate(c, g);
      }
      g.device_mode = on;
    }
    return g.device_mode == 1;
  }

  template <typename T>
  static T* take(uint8_t*& p, size_t n) {
    auto* q = p;
    p += (n * sizeof(T) + 7) / 8 * 8;
    return reinterpret_cast<T*>(q);
  }

  static void allocate(ExpertCache& c, GpuState& g) {
    int E = c.num_experts, C = c.capacity;
    size_t bytes = sizeof(double) * E + sizeof(int64_t) * (1 + NCOUNTS) +
        sizeof(int) * (2 * E + 2 * C + 1) + sizeof(int) * (2 * g.max_stage + 1) +
        E + 64;
    uint8_t* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    g.table_memory = p;
    auto& t = g.table;
    t.score = take<double>(p, E);
    t.clock = take<int64_t>(p, 1);
    t.counts = take<int64_t>(p, NCOUNTS);
    t.slot_of = take<int>(p, E);
    t.expert_in = take<int>(p, C);
    t.free_stack = take<int>(p, C);
    t.free_n = take<int>(p, 1);
    t.plan = reinterpret_cast<Plan*>(take<int>(p, 2 * g.max_stage + 1));
    t.prefetched = take<unsigned char>(p, E);
    check(cudaMemset(t.counts, 0, sizeof(int64_t) * NCOUNTS), "cudaMemset");
    g.report = pinned<DevReport>(1);
    *g.report = DevReport{};
  }

  static void allocate_tier(TierGpu& tg) {
    HostTier& h = *tg.tier;
    int64_t K = h.slot_of_.size(), C = h.capacity;
    size_t bytes = sizeof(int) * (K + 2 * C + 2) + sizeof(int64_t) * (2 * C + 6) +
        C + 64;
    uint8_t* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc");
    check(cudaMemset(p, 0, bytes), "cudaMemset");
    tg.table_memory = p;
    auto& t = tg.table;
    t.stamp = take<int64_t>(p, C);
    t.held = take<int64_t>(p, C);
    t.clock = take<int64_t>(p, 1);
    t.epoch = take<int64_t>(p, 1);
    t.counts = take<int64_t>(p, 4);
    t.slot_of = take<int>(p, K);
    t.key_in = take<int>(p, C);
    t.free_stack = take<int>(p, C);
    t.free_n = take<int>(p, 1);
    t.loading = take<int>(p, 1);
    t.ahead = take<unsigned char>(p, C);
    t.capacity = int(C);
    t.state = pinned<int>(C);
    std::fill(t.state, t.state + C, 0);
    tg.box = reinterpret_cast<Mailbox*>(
        pinned<uint8_t>(sizeof(Mailbox) + sizeof(int) * 3 * C));
    *tg.box = Mailbox{};
    tg.ring = reinterpret_cast<AheadRing*>(
        pinned<uint8_t>(sizeof(AheadRing) + sizeof(AheadEntry) * C));
    tg.ring->head = 0;
    tg.report = pinned<int64_t>(4);
    std::fill(tg.report, tg.report + 4, 0);
    service_register(&tg);
  }

  // The host's table to the device (the device's copy is not in use).
  static void push(ExpertCache& c, GpuState& g) {
    auto& t = g.table;
    int E = c.num_experts, C = c.capacity;
    int free_n = int(c.free_.size());
    std::vector<int> free_stack(c.free_.begin(), c.free_.end());
    free_stack.resize(C, -1);
    up(t.slot_of, c.slot_of_.data(), sizeof(int) * E);
    up(t.expert_in, c.expert_in_.data(), sizeof(int) * C);
    up(t.score, c.score_.data(), sizeof(double) * E);
    up(t.free_stack, free_stack.data(), sizeof(int) * C);
    up(t.free_n, &free_n, sizeof(int));
    up(t.clock, &c.clock_, sizeof(int64_t));
    up(t.prefetched, c.prefetched_.data(), E);
    c.device_owned = true;
  }

  static void up(void* dst, const void* src, size_t n) {
    check(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy");
  }

  static void down(void* dst, const void* src, size_t n) {
    check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
  }

  // The device's table to the host, once every call on it has run.
  static void pull(ExpertCache& c, GpuState& g) {
    auto& t = g.table;
    int E = c.num_experts, C = c.capacity;
    int free_n = 0;
    std::vector<int> free_stack(C);
    down(c.slot_of_.data(), t.slot_of, sizeof(int) * E);
    down(c.expert_in_.data(), t.expert_in, sizeof(int) * C);
    down(c.score_.data(), t.score, sizeof(double) * E);
    down(free_stack.data(), t.free_stack, sizeof(int) * C);
    down(&free_n, t.free_n, sizeof(int));
    down(&c.clock_, t.clock, sizeof(int64_t));
    down(c.prefetched_.data(), t.prefetched, E);
    c.free_.assign(free_stack.begin(), free_stack.begin() + free_n);
    c.device_owned = false;
  }

  // The tier's table to the device, once no read is in flight. A record
  // whose read failed leaves the tier (as its next request would have it).
  static void push_tier(TierGpu& tg) {
    HostTier& h = *tg.tier;
    h.drain();
    wait_ahead_reads(tg);
    std::lock_guard<std::mutex> lock(h.mutex_);
    int64_t K = h.slot_of_.size(), C = h.capacity;
    std::vector<int> slot_of(K, -1), key_in(C, -1);
    std::vector<int> free_stack(h.free_.begin(), h.free_.end());
    for (int64_t s = 0; s < C; s++) {
      if (h.state_[s] == HostTier::Ready) {
        key_in[s] = int(h.key_in_[s]);
        slot_of[h.key_in_[s]] = int(s);
      } else if (h.state_[s] == HostTier::Failed) {
        free_stack.push_back(int(s));
      }
    }
    int free_n = int(free_stack.size());
    free_stack.resize(C, -1);
    std::vector<int64_t> held(C, 0);
    auto& t = tg.table;
    up(t.slot_of, slot_of.data(), sizeof(int) * K);
    up(t.key_in, key_in.data(), sizeof(int) * C);
    up(t.stamp, h.stamp_.data(), sizeof(int64_t) * C);
    up(t.held, held.data(), sizeof(int64_t) * C);
    up(t.free_stack, free_stack.data(), sizeof(int) * C);
    up(t.free_n, &free_n, sizeof(int));
    up(t.clock, &h.clock_, sizeof(int64_t));
    std::vector<unsigned char> ahead(C, 0);
    int loading = 0;
    up(t.ahead, ahead.data(), C);
    up(t.loading, &loading, sizeof(int));
    std::fill(t.state, t.state + C, 0);
    tg.device_owned = true;
  }

  // Until the service has submitted every read ahead the kernels posted and
  // each has finished (the stream has run: no kernel posts more).
  static void wait_ahead_reads(TierGpu& tg) {
    if (!tg.ring) {
      return;
    }
    while (std::atomic_ref<int64_t>(tg.ring->head).load(
               std::memory_order_acquire) != tg.ring_taken.load() ||
           tg.ahead_pending.load() > 0) {
      service_busy();
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  // The device's tier table to the host, once every call on it has run.
  static void pull_tier(TierGpu& tg) {
    HostTier& h = *tg.tier;
    auto& t = tg.table;
    int64_t K = h.slot_of_.size(), C = h.capacity;
    std::vector<int> slot_of(K), key_in(C), free_stack(C);
    std::vector<unsigned char> ahead(C);
    int free_n = 0;
    wait_ahead_reads(tg);
    std::lock_guard<std::mutex> lock(h.mutex_);
    down(ahead.data(), t.ahead, C);
    down(slot_of.data(), t.slot_of, sizeof(int) * K);
    down(key_in.data(), t.key_in, sizeof(int) * C);
    down(h.stamp_.data(), t.stamp, sizeof(int64_t) * C);
    down(free_stack.data(), t.free_stack, sizeof(int) * C);
    down(&free_n, t.free_n, sizeof(int));
    down(&h.clock_, t.clock, sizeof(int64_t));
    h.slot_of_.assign(slot_of.begin(), slot_of.end());
    for (int64_t s = 0; s < C; s++) {
      h.key_in_[s] = key_in[s];
      // A read ahead that failed: its next request reads it again.
      bool failed = ahead[s] == 2 || (ahead[s] == 1 && t.state[s] == 2);
      h.state_[s] = key_in[s] < 0 ? HostTier::Empty
          : failed               ? HostTier::Failed
                                 : HostTier::Ready;
      h.error_[s].clear();
      h.held_[s] = 0;
    }
    h.held_list_.clear();
    h.free_.assign(free_stack.begin(), free_stack.begin() + free_n);
    tg.device_owned = false;
  }

  // The records a kernel posted, read on the tier's reader threads (this
  // thread reads too), then `done` raised: the kernel goes on.
  static void serve(TierGpu& tg, int64_t seq) {
    Mailbox* b = tg.box;
    HostTier* h = tg.tier;
    ExpertCache* cache = b->cache;
    int capacity = tg.table.capacity, n = b->n;
    int* expert = b->entries;
    int* slot = expert + capacity;
    int* status = slot + capacity;
    struct Left {
      std::mutex mutex;
      std::condition_variable done;
      int n;
    };
    auto left = std::make_shared<Left>();
    left->n = n;
    for (int i = 0; i < n; i++) {
      submit_read([=] {
        int failed = 0;
        try {
          cache->read_record(expert[i], h->data + slot[i] * h->record_bytes);
        } catch (const std::exception& e) {
          failed = 1;
          cache->set_error(e.what());
        }
        status[i] = failed;
        std::lock_guard<std::mutex> lock(left->mutex);
        if (--left->n == 0) {
          left->done.notify_all();
        }
      }, true, h->readers_);
    }
    while (run_routed_read()) {
    }
    {
      std::unique_lock<std::mutex> lock(left->mutex);
      left->done.wait(lock, [&] { return left->n == 0; });
    }
    int failed = 0;
    for (int i = 0; i < n; i++) {
      failed += status[i];
    }
    b->failed = failed;
    std::atomic_ref<int64_t>(b->done).store(seq, std::memory_order_seq_cst);
    tg.served = seq;
  }

  // The reads ahead kernels posted since the last look, queued behind the
  // routed reads on the tier's readers; each tells the device when it is
  // done through the slot's pinned state word (0 read, 2 failed).
  static void submit_ahead(TierGpu& tg) {
    int64_t head = std::atomic_ref<int64_t>(tg.ring->head).load(
        std::memory_order_acquire);
    int64_t taken = tg.ring_taken.load();
    if (head == taken) {
      return;
    }
    auto tier = tg.tier->weak_from_this().lock(); // null while it goes
    for (; taken < head; taken++) {
      AheadEntry e = tg.ring->entries[taken % tg.table.capacity];
      int* state = tg.table.state + e.slot;
      auto cache = e.cache->weak_from_this().lock();
      if (!tier || !cache) {
        std::atomic_ref<int>(*state).store(2);
        continue;
      }
      tg.ahead_pending += 1;
      submit_read([tier, cache, e, state, gpu = tier->gpu] {
        int result = 0;
        try {
          cache->read_record(e.expert, tier->data + e.slot * tier->record_bytes);
        } catch (const std::exception&) {
          result = 2; // routed later, it is read again and raises then
        }
        std::atomic_ref<int>(*state).store(result);
        gpu->ahead_pending -= 1;
      }, false, tier->readers_);
    }
    tg.ring_taken.store(taken);
  }

  // Counts and records of the calls that have run, and the error flag.
  static void collect(ExpertCache& c, GpuState& g) {
    int64_t now[NCOUNTS], d[NCOUNTS];
    for (int k = 0; k < NCOUNTS; k++) {
      now[k] = reinterpret_cast<volatile int64_t*>(g.report->counts)[k];
      d[k] = now[k] - g.taken[k];
    }
    c.counters.hits += d[Hits];
    c.counters.misses += d[Misses];
    c.counters.evictions += d[Evictions];
    c.counters.prefetched += d[Prefetched];
    c.counters.prefetch_bytes += d[Prefetched] * c.record_nbytes;
    c.counters.prefetched_used += d[PrefetchedUsed];
    c.counters.misses_prefetched += d[MissesPrefetched];
    std::copy(now, now + NCOUNTS, g.taken);
    int error = reinterpret_cast<volatile int*>(&g.report->error)[0];
    if (error) {
      g.report->error = 0;
      if (error != 3) { // a read's error: its words are set already
        c.set_error(error == 1   ? "routed expert id out of range"
                        : error == 2 ? "more routed experts than slots in one call"
                                     : "the host tier holds fewer records than "
                                       "one call needs; give a larger host budget");
      }
    }
    std::lock_guard<std::mutex> lock(g.records_mutex);
    while (!g.pending.empty()) {
      auto [call, r] = g.pending.front();
      int64_t hits = reinterpret_cast<volatile int64_t*>(&r->hits)[0];
      if (hits == -1) {
        break; // not run yet, nor any after it
      }
      if (hits >= 0) { // -2: the call failed, and keeps no record
        CallRecord record{call};
        record.hits = hits;
        record.misses = r->misses;
        record.bytes_read = r->bytes_read;
        c.add_record(std::move(record));
      }
      g.spare.push_back(r);
      g.pending.pop_front();
    }
  }

  // The tier's counts of the calls that have run.
  static void collect_tier(TierGpu& tg) {
    auto& k = tg.tier->counters;
    int64_t now[4];
    for (int i = 0; i < 4; i++) {
      now[i] = reinterpret_cast<volatile int64_t*>(tg.report)[i];
    }
    k.hits += now[0] - tg.taken[0];
    k.misses += now[1] - tg.taken[1];
    k.evictions += now[2] - tg.taken[2];
    k.late += now[3] - tg.taken[3];
    std::copy(now, now + 4, tg.taken);
  }

  // A pinned record for the call being encoded, marked not run.
  static DevRecord* record(GpuState& g, int64_t call) {
    std::lock_guard<std::mutex> lock(g.records_mutex);
    if (g.spare.empty()) {
      constexpr int CHUNK = 1024; // reused once collected
      auto* chunk = pinned<DevRecord>(CHUNK);
      g.chunks.push_back(chunk);
      for (int i = 0; i < CHUNK; i++) {
        g.spare.push_back(chunk + i);
      }
    }
    auto* r = g.spare.back();
    g.spare.pop_back();
    r->misses = 0;
    r->bytes_read = 0;
    r->hits = -1;
    g.pending.push_back({call, r});
    return r;
  }

  static void encode(ExpertCache& c, GpuState& g, cu::CommandEncoder& enc,
                     const mx::array& inds, mx::array& out, int64_t call,
                     const uint32_t* pred, int npred) {
    TierGpu& tg = *c.tier()->gpu;
    if (!tg.device_owned) {
      push_tier(tg); // a host-side load changed it, or the first call
    }
    if (!c.device_owned) {
      push(c, g); // the host changed it (a load) since the device last did
    }
    int64_t n = inds.size();
    c.counters.calls += 1;
    c.counters.device_calls += 1;
    ResolveArgs a{};
    a.ids = mlx::core::gpu_ptr<uint32_t>(inds);
    a.n = int(n);
    a.tokens = int(n / std::max<int64_t>(1, inds.shape(-1)));
    a.t = g.table;
    a.tt = tg.table;
    a.base = int(c.tier_base());
    a.cache = &c;
    a.box = tg.box;
    a.num_experts = c.num_experts;
    a.capacity = c.capacity;
    a.lru = int(c.lru_);
    a.max_stage = g.max_stage;
    a.decay = c.decay_;
    a.record_bytes = c.record_nbytes;
    a.out = mlx::core::gpu_ptr<uint32_t>(out);
    a.report = g.report;
    a.tier_report = tg.report;
    a.record = c.recording_ && call >= 0 ? record(g, call) : nullptr;
    if (ExpertCache* next = c.next().get(); next && pred) {
      GpuState& gn = gpu_state(*next); // its table, read ahead for here
      if (!device_mode(*next, gn)) {
        throw std::runtime_error("a chained layer does not resolve on the device");
      }
      if (!next->device_owned) {
        push(*next, gn);
      }
      a.pred = pred;
      a.npred = npred;
      a.next_slot_of = gn.table.slot_of;
      a.next_prefetched = gn.table.prefetched;
      a.next_counts = gn.table.counts;
      a.next_report = gn.report;
      a.next_experts = next->num_experts;
      a.next_base = int(next->tier_base());
      a.next_cache = next;
      a.ring = tg.ring;
    }
    enc.set_input_array(inds);
    enc.set_output_array(out);
    int threads = 256;
    uint32_t smem = threads * (sizeof(double) + sizeof(int)) +
        sizeof(int) * (2 * n + NSHARED) + c.num_experts;
    service_busy();
    enc.add_kernel_node_ex(kernels().resolve_on_device, dim3(1), dim3(threads),
                           dim3(), smem, a);
  }
};

namespace {

void service_loop_body(Service& sv) {
  TierGpu* found = nullptr;
  int64_t seq = 0;
  {
    std::unique_lock<std::mutex> lock(sv.mutex);
    if (sv.tiers.empty()) {
      sv.wake.wait(lock);
      return;
    }
    for (auto* tg : sv.tiers) {
      GpuAccess::submit_ahead(*tg);
    }
    for (auto* tg : sv.tiers) {
      seq = std::atomic_ref<int64_t>(tg->box->posted).load(
          std::memory_order_acquire);
      if (seq != tg->served) {
        found = tg;
        break;
      }
    }
    if (!found && now_ns() > sv.busy_until) {
      sv.wake.wait_for(lock, std::chrono::milliseconds(1));
      return;
    }
  }
  if (found) { // its call is in flight: the tier and cache are alive
    GpuAccess::serve(*found, seq);
    sv.busy_until = now_ns() + 1000000000;
  } else {
    std::this_thread::yield();
  }
}

void service_loop() {
  auto& sv = service();
  while (true) {
    service_loop_body(sv);
  }
}
} // namespace

void gpu_sync_host(ExpertCache& c) {
  bool layer = c.gpu && c.device_owned;
  TierGpu* tg = c.tier() ? c.tier()->gpu.get() : nullptr;
  bool tier = tg && tg->device_owned;
  if (!layer && !tier) {
    return;
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (layer) {
    GpuAccess::pull(c, *c.gpu);
    GpuAccess::collect(c, *c.gpu);
  }
  if (tier) {
    GpuAccess::pull_tier(*tg);
    GpuAccess::collect_tier(*tg);
  }
}

void gpu_collect(ExpertCache& c) {
  if (c.gpu && c.gpu->device_mode == 1) {
    GpuAccess::collect(c, *c.gpu);
  }
}

void gpu_tier_collect(HostTier& t) {
  if (t.gpu && t.gpu->mode == 1) {
    GpuAccess::collect_tier(*t.gpu);
  }
}

void gpu_tier_sync_host(HostTier& t) {
  if (t.gpu && t.gpu->device_owned) {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    GpuAccess::pull_tier(*t.gpu);
    GpuAccess::collect_tier(*t.gpu);
  }
}

void gpu_fetch(ExpertCache& c, const std::vector<mx::array>& inputs,
               mx::array& out, bool predicted, int64_t call, mx::Stream s) {
  auto& enc = cu::get_command_encoder(s);
  enc.device().make_current();
  auto& g = gpu_state(c);
  auto& inds = inputs[0];
  int64_t n = inds.size();
  if (n > c.max_pairs) {
    throw std::runtime_error("more routed pairs than the native call holds");
  }
  int npred = predicted ? int(std::min<size_t>(inputs[1].size(), g.max_pred))
                        : 0;
  // cu::malloc_async is not exported by libmlx; MLX puts arrays this small
  // in unified memory anyway.
  out.set_data(mlx::core::allocator::malloc(out.nbytes()));
  const uint32_t* pred = predicted ? mlx::core::gpu_ptr<uint32_t>(inputs[1])
                                   : nullptr;
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  bool on_device = GpuAccess::device_mode(c, g);
  if (!on_device) {
    enc.add_kernel_node(
      kernels().export_ids, dim3(1), dim3(256),
      mlx::core::gpu_ptr<uint32_t>(inds), g.ids, int(n), pred, g.pred, npred);
    int tokens = int(n / std::max<int64_t>(1, inds.shape(-1)));
    enc.set_input_array(out);
    enc.set_output_array(out);
    auto capture = enc.capture_context();
    check(
        cudaLaunchHostFunc(enc.stream(), resolve_on_host,
                           new CallArgs{&c, n, tokens, npred, call}),
        "cudaLaunchHostFunc");
  } else {
    GpuAccess::encode(c, g, enc, inds, out, call, pred, npred);
  }
  enc.set_input_array(out);
  enc.set_output_array(out);
  SlotPtrs dsts{};
  for (int i = 0; i < g.nseg; i++) {
    dsts.p[i] = static_cast<uint8_t*>(mlx::core::gpu_ptr<void>(c.slots[i]));
  }
  uint8_t* tier = c.tier()->data;
  int64_t tier_stride = c.tier()->record_bytes; // a copy: parameters are not const
  // Until the stream has run this call: the slots its copies write, and the
  // cache (with its host tier) that its host function and copies use.
  for (auto& a : c.slots) {
    enc.add_temporary(a);
  }
  enc.add_completed_handler([keep = c.shared_from_this()] {});
  enc.add_kernel_node(
      kernels().apply_plan, dim3(32, g.max_stage), dim3(256),
      on_device ? g.table.plan : g.plan, g.max_stage, tier, tier_stride,
      g.segs, dsts, g.nseg, on_device ? nullptr : g.out,
      mlx::core::gpu_ptr<uint32_t>(out), int(n));
}

void gpu_load_copy(ExpertCache& c, const uint8_t* record, int slot) {
  cu::device(mlx::core::Device(mlx::core::Device::gpu)).make_current();
  std::vector<uint8_t> cast;
  for (size_t i = 0; i < c.segments.size(); i++) {
    auto& seg = c.segments[i];
    auto& a = c.slots[i];
    size_t slot_bytes = a.nbytes() / a.shape(0);
    auto* dst = static_cast<uint8_t*>(mlx::core::gpu_ptr<void>(a)) +
        slot * slot_bytes;
    const void* src = record + seg.offset;
    size_t nbytes = seg.nbytes;
    if (seg.cast != Cast::None) {
      cast.resize(seg.nbytes / cast_src_size(seg.cast) * cast_dst_size(seg.cast));
      c.cast_host(record + seg.offset, seg, cast.data());
      src = cast.data();
      nbytes = cast.size();
    }
    check(cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
}

uint8_t* pinned_alloc(size_t bytes) {
  return pinned<uint8_t>(bytes);
}

void pinned_free(uint8_t* p) {
  cudaFreeHost(p);
}

bool built_with_cuda() {
  return true;
}

} // namespace moestream
