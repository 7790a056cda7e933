// The resolving kernel: ExpertCache::resolve_call through the host tier on
// the device, one block, from the device's copies of the tables.
#include <cuda/atomic>

#include "cuda_device.cuh"
#include "cuda_tier_device.cuh"
#include "slot_policy.h"

namespace moestream {

// The routed experts' slots, each miss given the victim the host would
// choose (SlotTable::assign) and queued in the plan for apply_plan.
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
  if (threadIdx.x == 0) { // SlotTable::loaded: the misses' load keys
    int nm = m.count[4];
    for (int j = 0; j < nm; j++) {
      t.loaded[m.missed[j]] = policy::load_key(m.missed, nm, j, *t.loads);
    }
    *t.loads += nm;
  }
  __syncthreads();
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

// SlotTable::used on the device: slot_policy.h's arithmetic, each step
// rounded once as on the host.
__device__ void use_scores(const ResolveArgs& a, Shared& m) {
  const DevTable& t = a.t;
  int nu = m.count[0];
  if (a.lru) {
    int64_t clock = *t.clock + 1;
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
      t.score[m.unique[u]] = policy::lru_used(clock);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *t.clock = clock;
    }
    return;
  }
  double f = policy::decay_factor(a.decay, a.tokens);
  for (int e = threadIdx.x; e < a.num_experts; e += blockDim.x) {
    t.score[e] = policy::mul(t.score[e], f);
  }
  __syncthreads();
  for (int u = threadIdx.x; u < nu; u += blockDim.x) {
    t.score[m.unique[u]] = policy::lrfu_used(t.score[m.unique[u]]);
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
  for (int i = threadIdx.x; i < a.n; i += blockDim.x) {
    uint32_t e = a.ids[i];
    a.out[i] = !failed && a.t.slot_of[e] >= 0 ? uint32_t(a.t.slot_of[e])
                                              : 0; // an error raises next call
  }
  if (threadIdx.x == 0) {
    report_call(a, m, failed);
  }
}

CUfunction resolve_kernel() {
  static CUfunction f =
      function_of(reinterpret_cast<const void*>(&resolve_on_device));
  return f;
}

} // namespace moestream
