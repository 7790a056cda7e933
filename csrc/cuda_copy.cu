// The copy kernels of a call: routed ids out to pinned host memory (the host
// function path), and a call's records from the host tier into their slots.
#include "cuda_shared.cuh"

namespace moestream {


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

CUfunction export_ids_kernel() {
  static CUfunction f = function_of(reinterpret_cast<const void*>(&export_ids));
  return f;
}

CUfunction apply_plan_kernel() {
  static CUfunction f = function_of(reinterpret_cast<const void*>(&apply_plan));
  return f;
}

} // namespace moestream
