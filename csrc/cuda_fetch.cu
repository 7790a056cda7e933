// The CUDA side of ExpertFetch: three stream-ordered steps per MoE call, all
// inside MLX's CUDA graph, so Python never waits on the router.
//   1. a kernel copies the routed ids into pinned host memory (zero copy);
//   2. a host function resolves slots and has the misses read into the pinned
//      host tier (host_tier.h), by its reader threads in parallel, unless the
//      tier holds them already (read ahead, or used before);
//   3. a kernel copies those records into their device slots (reading the
//      pinned tier over the bus) and writes the slot ids.
// When the tier holds every record of the layer for good (read at load) and
// nothing is read ahead, step 2 needs no host at all: one kernel resolves the
// call from the device's copy of the slot table, the same choices the host
// makes (victim, scores, counts), and step 3 follows it. The host's copy is
// brought back (gpu_sync_host) before a host-side load uses it.
#include <cuda.h>
#include <cuda_runtime.h>

#include <deque>
#include <mutex>
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
// -1 there means the call has not run yet.
struct DevRecord {
  int64_t hits, misses;
};

// The layer's slot table on the device (one allocation), as ExpertCache
// keeps it on the host: expert -> slot, slot -> expert, policy scores, the
// stack of free slots, the LRU clock; and the tier slot of every record.
struct DevTable {
  int* slot_of; // num_experts
  int* expert_in; // capacity
  double* score; // num_experts
  int* free_stack; // capacity
  int* free_n; // 1
  int64_t* clock; // 1
  int* tier_slot; // num_experts
  int64_t* counts; // hits, misses, evictions so far (device)
  Plan* plan; // the copies of the call in flight (device)
};

// What the host learns from the device: counts so far and an error flag.
struct DevReport {
  int64_t counts[3];
  int error; // 1: a routed id out of range; 2: more experts than slots
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
  int64_t taken[3]{}; // report counts already folded into the counters
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

// ExpertCache::resolve on the device, one block: the routed experts' slots,
// each miss given the victim the host would choose and queued in the plan
// for apply_plan (from its fixed tier slot), then the policy's scores.
__global__ void resolve_on_device(
    const uint32_t* ids, int n, int tokens, DevTable t, int num_experts,
    int capacity, int lru, double decay, int max_stage, uint32_t* out,
    DevReport* report, DevRecord* record) {
  extern __shared__ unsigned char smem[];
  double* best_score = reinterpret_cast<double*>(smem);
  int* best_slot = reinterpret_cast<int*>(best_score + blockDim.x);
  int* unique = best_slot + blockDim.x; // n
  int* count = unique + n; // unique, hits, misses, evictions, planned, error
  unsigned char* keep = reinterpret_cast<unsigned char*>(count + 6);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    keep[e] = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int nu = 0, error = 0;
    for (int i = 0; i < n; i++) {
      uint32_t e = ids[i];
      if (e >= uint32_t(num_experts)) {
        error = 1;
        break;
      }
      if (!keep[e]) {
        keep[e] = 1;
        unique[nu++] = int(e);
      }
    }
    if (nu > capacity) {
      error = 2;
    }
    count[0] = error ? 0 : nu;
    for (int k = 1; k < 5; k++) {
      count[k] = 0;
    }
    count[5] = error;
  }
  __syncthreads();
  int nu = count[0];
  for (int u = 0; u < nu; u++) {
    int e = unique[u];
    if (t.slot_of[e] >= 0) { // every thread reads the same: no divergence
      if (threadIdx.x == 0) {
        count[1] += 1;
      }
      continue;
    }
    int v;
    if (*t.free_n > 0) {
      v = t.free_stack[*t.free_n - 1];
    } else {
      v = lowest_slot(t, capacity, keep, best_score, best_slot);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      if (*t.free_n > 0) {
        *t.free_n -= 1;
      } else {
        t.slot_of[t.expert_in[v]] = -1;
        count[3] += 1;
      }
      t.expert_in[v] = e;
      t.slot_of[e] = v;
      count[2] += 1;
      int j = count[4]++;
      t.plan->entries[j] = v;
      t.plan->entries[max_stage + j] = t.tier_slot[e];
    }
    __syncthreads();
  }
  // ExpertCache::used, in the same double arithmetic (no fused multiply-add)
  if (lru) {
    int64_t clock = *t.clock + 1;
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
      t.score[unique[u]] = double(clock);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      *t.clock = clock;
    }
  } else {
    double f = 1.0;
    for (int k = 0; k < tokens; k++) {
      f = __dmul_rn(f, decay);
    }
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
      t.score[e] = __dmul_rn(t.score[e], f);
    }
    __syncthreads();
    for (int u = threadIdx.x; u < nu; u += blockDim.x) {
      t.score[unique[u]] = __dadd_rn(t.score[unique[u]], 1.0);
    }
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    uint32_t e = ids[i];
    out[i] = e < uint32_t(num_experts) && t.slot_of[e] >= 0
        ? uint32_t(t.slot_of[e])
        : 0; // in range; an error is raised before the next call
  }
  if (threadIdx.x == 0) {
    t.plan->n = count[4];
    for (int k = 0; k < 3; k++) {
      t.counts[k] += count[1 + k];
      report->counts[k] = t.counts[k];
    }
    if (count[5]) {
      report->error = count[5];
    }
    if (record) {
      record->misses = count[2];
      __threadfence_system();
      record->hits = count[1];
    }
    __threadfence_system();
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

// Copies of ExpertCache's table between the host and the device.
struct GpuAccess {
  // Whether this layer's calls resolve on the device, decided at its first
  // call for good: the tier holds each of its records for good, the layer
  // reads nothing ahead for the next one, and the cache allows it.
  static bool device_mode(ExpertCache& c, GpuState& g) {
    if (g.device_mode < 0) {
      std::vector<int> tier_slot;
      bool on = c.device_resolve && !c.next() &&
          c.tier()->fixed_slots(c.tier_base_, c.num_experts, tier_slot);
      if (on) {
        allocate(c, g, tier_slot);
      }
      g.device_mode = on;
    }
    return g.device_mode == 1; // a prediction has nothing left to read
  }

  static void allocate(ExpertCache& c, GpuState& g,
                       const std::vector<int>& tier_slot) {
    int E = c.num_experts, C = c.capacity;
    size_t bytes = sizeof(double) * E + sizeof(int64_t) * 4 +
        sizeof(int) * (3 * E + 2 * C + 1) + sizeof(int) * (2 * g.max_stage + 1) +
        64;
    uint8_t* base = nullptr;
    check(cudaMalloc(&base, bytes), "cudaMalloc");
    g.table_memory = base;
    auto& t = g.table;
    auto* p = base;
    auto take = [&](size_t n) {
      auto* q = p;
      p += (n + 7) / 8 * 8;
      return q;
    };
    t.score = reinterpret_cast<double*>(take(sizeof(double) * E));
    t.clock = reinterpret_cast<int64_t*>(take(sizeof(int64_t)));
    t.counts = reinterpret_cast<int64_t*>(take(sizeof(int64_t) * 3));
    t.slot_of = reinterpret_cast<int*>(take(sizeof(int) * E));
    t.tier_slot = reinterpret_cast<int*>(take(sizeof(int) * E));
    t.expert_in = reinterpret_cast<int*>(take(sizeof(int) * C));
    t.free_stack = reinterpret_cast<int*>(take(sizeof(int) * C));
    t.free_n = reinterpret_cast<int*>(take(sizeof(int)));
    t.plan = reinterpret_cast<Plan*>(take(sizeof(int) * (2 * g.max_stage + 1)));
    check(cudaMemset(t.counts, 0, sizeof(int64_t) * 3), "cudaMemset");
    check(cudaMemcpy(t.tier_slot, tier_slot.data(), sizeof(int) * E,
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
    g.report = pinned<DevReport>(1);
    *g.report = DevReport{};
  }

  // The host's table to the device (the device's copy is not in use).
  static void push(ExpertCache& c, GpuState& g) {
    auto& t = g.table;
    int E = c.num_experts, C = c.capacity;
    int free_n = int(c.free_.size());
    std::vector<int> free_stack(c.free_.begin(), c.free_.end());
    free_stack.resize(C, -1);
    auto up = [](void* dst, const void* src, size_t n) {
      check(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy");
    };
    up(t.slot_of, c.slot_of_.data(), sizeof(int) * E);
    up(t.expert_in, c.expert_in_.data(), sizeof(int) * C);
    up(t.score, c.score_.data(), sizeof(double) * E);
    up(t.free_stack, free_stack.data(), sizeof(int) * C);
    up(t.free_n, &free_n, sizeof(int));
    up(t.clock, &c.clock_, sizeof(int64_t));
    c.device_owned = true;
  }

  // The device's table to the host, once every call on it has run.
  static void pull(ExpertCache& c, GpuState& g) {
    auto& t = g.table;
    int E = c.num_experts, C = c.capacity;
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    auto down = [](void* dst, const void* src, size_t n) {
      check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    };
    int free_n = 0;
    std::vector<int> free_stack(C);
    down(c.slot_of_.data(), t.slot_of, sizeof(int) * E);
    down(c.expert_in_.data(), t.expert_in, sizeof(int) * C);
    down(c.score_.data(), t.score, sizeof(double) * E);
    down(free_stack.data(), t.free_stack, sizeof(int) * C);
    down(&free_n, t.free_n, sizeof(int));
    down(&c.clock_, t.clock, sizeof(int64_t));
    c.free_.assign(free_stack.begin(), free_stack.begin() + free_n);
    c.device_owned = false;
  }

  // Counts and records of the calls that have run, and the error flag.
  static void collect(ExpertCache& c, GpuState& g) {
    int64_t now[3];
    for (int k = 0; k < 3; k++) {
      now[k] = reinterpret_cast<volatile int64_t*>(g.report->counts)[k];
    }
    int64_t hits = now[0] - g.taken[0], misses = now[1] - g.taken[1];
    c.counters.hits += hits;
    c.counters.misses += misses;
    c.counters.evictions += now[2] - g.taken[2];
    c.tier()->counters.hits += misses; // each fill a record of the tier
    std::copy(now, now + 3, g.taken);
    int error = reinterpret_cast<volatile int*>(&g.report->error)[0];
    if (error) {
      g.report->error = 0;
      c.set_error(error == 1 ? "routed expert id out of range"
                             : "more routed experts than slots in one call");
    }
    std::lock_guard<std::mutex> lock(g.records_mutex);
    while (!g.pending.empty()) {
      auto [call, r] = g.pending.front();
      if (reinterpret_cast<volatile int64_t*>(&r->hits)[0] < 0) {
        break; // not run yet, nor any after it
      }
      CallRecord record{call};
      record.hits = r->hits;
      record.misses = r->misses;
      c.add_record(std::move(record));
      g.spare.push_back(r);
      g.pending.pop_front();
    }
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
    r->hits = -1;
    g.pending.push_back({call, r});
    return r;
  }

  static void encode(ExpertCache& c, GpuState& g, cu::CommandEncoder& enc,
                     const mx::array& inds, mx::array& out, int64_t call) {
    if (!c.device_owned) {
      push(c, g); // the host changed it (a load) since the device last did
    }
    int64_t n = inds.size();
    int tokens = int(n / std::max<int64_t>(1, inds.shape(-1)));
    c.counters.calls += 1;
    c.counters.device_calls += 1;
    DevRecord* rec = c.recording_ && call >= 0 ? record(g, call) : nullptr;
    enc.set_input_array(inds);
    enc.set_output_array(out);
    int threads = 256;
    uint32_t smem = threads * (sizeof(double) + sizeof(int)) +
        sizeof(int) * (n + 6) + c.num_experts;
    enc.add_kernel_node_ex(
        kernels().resolve_on_device, dim3(1), dim3(threads), dim3(), smem,
        mlx::core::gpu_ptr<uint32_t>(inds), int(n), tokens, g.table,
        c.num_experts, c.capacity, int(c.lru_), c.decay_, g.max_stage,
        mlx::core::gpu_ptr<uint32_t>(out), g.report, rec);
  }
};

void gpu_sync_host(ExpertCache& c) {
  if (c.gpu && c.device_owned) {
    GpuAccess::pull(c, *c.gpu);
    GpuAccess::collect(c, *c.gpu);
  }
}

void gpu_collect(ExpertCache& c) {
  if (c.gpu && c.gpu->device_mode == 1) {
    GpuAccess::collect(c, *c.gpu);
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
    GpuAccess::encode(c, g, enc, inds, out, call);
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
