// The CUDA side's host state: per layer (GpuState) and per host tier
// (TierGpu), and the service thread that reads what the device asks for.
#pragma once

#include <atomic>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

#include "cuda_shared.cuh"
#include "expert_cache.h"

namespace moestream {

// The tier's side on the GPU: its device table, mailbox and counts.
struct TierGpu {
  HostTier* tier;
  int mode{-1}; // -1 not decided yet, 0 the host function, 1 the device
  uint8_t* table_memory{nullptr};
  DevTier table{};
  Mailbox* box{nullptr}; // pinned
  int64_t* report{nullptr}; // pinned: hits, misses, evictions, late so far
  int64_t taken[4]{};
  int64_t served{0}; // the service thread's: the last request it served
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

// The tier's service thread (cuda_service.cu): it serves every registered
// tier's mailbox, spinning while calls are encoded.
void service_busy();
void service_register(TierGpu* tg);
void service_unregister(TierGpu* tg);

// The records a kernel posted, read on the tier's reader threads (this
// thread reads too), then `done` raised: the kernel goes on.
void serve(TierGpu& tg, int64_t seq);

} // namespace moestream
