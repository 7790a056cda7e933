// The CUDA side of ExpertFetch: three stream-ordered steps per MoE call, all
// inside MLX's CUDA graph, so Python never waits on the router.
//   1. a kernel copies the routed ids into pinned host memory (zero copy);
//   2. a host function resolves slots and has the misses read into the pinned
//      host tier (host_tier.h), by its reader threads in parallel, unless the
//      tier holds them already (read ahead, or used before);
//   3. a kernel copies those records into their device slots (reading the
//      pinned tier over the bus) and writes the slot ids.
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <stdexcept>

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

struct GpuState {
  int max_stage, max_pred;
  uint32_t* ids; // pinned: routed ids of the call in flight
  uint32_t* pred; // pinned: predicted ids for the next layer
  uint32_t* out; // pinned: slot per routed pair
  Plan* plan; // pinned
  SegDesc* segs; // device
  int nseg;
};

// Our kernels as driver-API handles: MLX adds graph nodes with its own CUDA
// runtime, which does not know kernels registered by ours.
struct Kernels {
  CUfunction export_ids, apply_plan;
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
  if (j == 0 && blockIdx.x == 0) {
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
  enc.add_kernel_node(
      kernels().export_ids, dim3(1), dim3(256),
      mlx::core::gpu_ptr<uint32_t>(inds), g.ids, int(n), pred, g.pred, npred);
  int tokens = int(n / std::max<int64_t>(1, inds.shape(-1)));
  enc.set_input_array(out);
  enc.set_output_array(out);
  {
    auto capture = enc.capture_context();
    check(
        cudaLaunchHostFunc(enc.stream(), resolve_on_host,
                           new CallArgs{&c, n, tokens, npred, call}),
        "cudaLaunchHostFunc");
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
      kernels().apply_plan, dim3(32, g.max_stage), dim3(256), g.plan,
      g.max_stage, tier, tier_stride, g.segs, dsts, g.nseg, g.out,
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
