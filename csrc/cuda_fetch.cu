// The CUDA side of ExpertFetch: stream-ordered steps per MoE call, all inside
// MLX's CUDA graph, so Python never waits on the router.
// The reference path (RuntimeConfig.device_resolve=False):
//   1. a kernel copies the routed ids into pinned host memory (zero copy);
//   2. a host function resolves slots and has the misses read into the pinned
//      host tier (host_tier.h), by its reader threads in parallel, unless the
//      tier holds them already (used before);
//   3. a kernel copies those records into their device slots (reading the
//      pinned tier over the bus) and writes the slot ids.
// The device path (the default): one kernel resolves the call from the
// device's copies of the layer's slot table and of the host tier's table,
// making the host's choices (victims, scores, the tier's LRU, counts). Slot
// hits and tier hits need no host at all; for records the tier lacks, the
// kernel posts (record, tier slot) to a pinned mailbox and spins until the
// tier's service thread has had them read (GPU-initiated reads; nothing it
// waits for is queued on the stream). Step 3 follows. The host's copies are
// brought back (gpu_sync_host) before a host-side load uses them.
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <vector>

#include "cuda_tables.cuh"
#include "expert_fetch.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"

namespace moestream {

namespace cu = mlx::core::cu;

namespace {

struct CallArgs {
  ExpertCache* cache;
  int64_t n;
  int tokens;
  int npred;
  int64_t call;
};

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
    c.log.set_error(e.what());
    g.plan->n = 0;
    for (int64_t i = 0; i < a->n; i++) {
      g.out[i] = 0; // in range; the error is raised before the next call
    }
  }
  delete a;
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
  for (size_t i = 0; i < c.memory.segments.size(); i++) {
    auto& a = c.memory.slots[i];
    segs.push_back(
        {c.memory.segments[i].offset, c.memory.segments[i].nbytes,
         int64_t(a.nbytes() / a.shape(0)), c.memory.segments[i].cast});
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

// One call resolved by the kernel: its arguments, then its node.
void encode_on_device(ExpertCache& c, GpuState& g, cu::CommandEncoder& enc,
                      const mx::array& inds, mx::array& out, int64_t call) {
  TierGpu& tg = *c.tier()->gpu;
  if (!tg.device_owned) {
    GpuAccess::push_tier(tg); // a host-side load changed it, or the first call
  }
  if (!c.device_owned) {
    GpuAccess::push(c, g); // the host changed it (a load) since the device last did
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
  a.lru = int(c.policy().lru);
  a.max_stage = g.max_stage;
  a.decay = c.policy().decay;
  a.record_bytes = c.record_nbytes;
  a.out = mlx::core::gpu_ptr<uint32_t>(out);
  a.report = g.report;
  a.tier_report = tg.report;
  a.record = c.log.recording() && call >= 0 ? GpuAccess::record(g, call) : nullptr;
  enc.set_input_array(inds);
  enc.set_output_array(out);
  int threads = 256;
  uint32_t smem = threads * (sizeof(double) + sizeof(int)) +
      sizeof(int) * (2 * n + NSHARED) + c.num_experts;
  service_busy();
  enc.add_kernel_node_ex(resolve_kernel(), dim3(1), dim3(threads),
                         dim3(), smem, a);
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
      export_ids_kernel(), dim3(1), dim3(256),
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
    encode_on_device(c, g, enc, inds, out, call);
  }
  enc.set_input_array(out);
  enc.set_output_array(out);
  SlotPtrs dsts{};
  for (int i = 0; i < g.nseg; i++) {
    dsts.p[i] = static_cast<uint8_t*>(mlx::core::gpu_ptr<void>(c.memory.slots[i]));
  }
  uint8_t* tier = c.tier()->data;
  int64_t tier_stride = c.tier()->record_bytes; // a copy: parameters are not const
  // Until the stream has run this call: the slots its copies write, and the
  // cache (with its host tier) that its host function and copies use.
  for (auto& a : c.memory.slots) {
    enc.add_temporary(a);
  }
  enc.add_completed_handler([keep = c.shared_from_this()] {});
  enc.add_kernel_node(
      apply_plan_kernel(), dim3(32, g.max_stage), dim3(256),
      on_device ? g.table.plan : g.plan, g.max_stage, tier, tier_stride,
      g.segs, dsts, g.nseg, on_device ? nullptr : g.out,
      mlx::core::gpu_ptr<uint32_t>(out), int(n));
}

namespace {
// Host-side loads copy pinned tier records on this stream, all of a load's
// queued at once, and wait for them once (gpu_load_wait), not once a segment.
cudaStream_t load_stream() {
  static cudaStream_t s = [] {
    cudaStream_t made;
    check(cudaStreamCreateWithFlags(&made, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags");
    return made;
  }();
  return s;
}
} // namespace

void gpu_load_copy(ExpertCache& c, const uint8_t* record, int slot,
                   bool pinned) {
  cu::device(mlx::core::Device(mlx::core::Device::gpu)).make_current();
  std::vector<uint8_t> cast;
  for (size_t i = 0; i < c.memory.segments.size(); i++) {
    auto& seg = c.memory.segments[i];
    auto& a = c.memory.slots[i];
    size_t slot_bytes = a.nbytes() / a.shape(0);
    auto* dst = static_cast<uint8_t*>(mlx::core::gpu_ptr<void>(a)) +
        slot * slot_bytes;
    const void* src = record + seg.offset;
    size_t nbytes = seg.nbytes;
    if (seg.cast != Cast::None) {
      cast.resize(seg.nbytes / cast_src_size(seg.cast) * cast_dst_size(seg.cast));
      SlotArrays::cast_host(record + seg.offset, seg, cast.data());
      check(cudaMemcpy(dst, cast.data(), cast.size(), cudaMemcpyHostToDevice),
            "cudaMemcpy");
    } else if (pinned) { // the tier keeps the record until gpu_load_wait
      check(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice,
                            load_stream()),
            "cudaMemcpyAsync");
    } else {
      check(cudaMemcpy(dst, src, nbytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    }
  }
}

void gpu_load_wait() {
  check(cudaStreamSynchronize(load_stream()), "cudaStreamSynchronize");
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
