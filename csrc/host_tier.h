// The host tier: expert records held in host memory (pinned on a GPU) between
// the blob and the device slots, filled by reader threads -- for the routed
// misses of a call, in parallel, and ahead of the router for the experts the
// next layer is predicted to route to (promoted to a slot only when routed).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "readers.h"

namespace moestream {

class ExpertCache;
struct TierGpu; // CUDA side: the tier's table on the device (cuda_state.cuh)

struct TierCounters {
  // hits: routed records found read; late: found still being read ahead;
  // misses: read when routed (reads ahead count in the layer's Counters).
  std::atomic<int64_t> hits{0}, late{0}, misses{0}, evictions{0};
};

// One per loaded model, shared by its layers; records of every layer in one
// bounded buffer (`capacity` records of `record_bytes`, the largest record).
class HostTier : public std::enable_shared_from_this<HostTier> {
 public:
  HostTier(int64_t capacity, int64_t record_bytes, int readers, bool pinned);
  ~HostTier();
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  // A layer's first key (its experts are keys base .. base + num_experts - 1).
  int64_t add_layer(int num_experts);
  // A new call of the stream: the records the previous one used may go now
  // (the stream ran its copies from them before this call began).
  void begin_call();
  // Host slot of a routed record, read now if absent (then `read` is set);
  // held until the next call begins.
  int64_t request(const std::shared_ptr<ExpertCache>& cache, int64_t key,
                  int expert, bool& read);
  // Read a predicted record if it is absent and there is room; true if queued.
  bool read_ahead(const std::shared_ptr<ExpertCache>& cache, int64_t key,
                  int expert);
  // Queue a read of every record of `cache`'s layer that the tier does not
  // hold, while it has room; returns how many were queued.
  int64_t preload(const std::shared_ptr<ExpertCache>& cache, int64_t base,
                  int num_experts);
  // Wait until no read is in flight (a failed one is read again when routed).
  void drain();
  // The record in `slot` once read (rethrows its read error).
  const uint8_t* wait(int64_t slot, int64_t key);
  bool holds(int64_t key);
  // The key in each slot (-1: empty), for tests that compare two tiers.
  std::vector<int64_t> keys();
  // Records held or being read (the page's tier fill, moestream/web).
  int64_t filled();
  // Reader threads its reads run on, at least.
  int readers() const {
    return readers_;
  }

  const int64_t capacity, record_bytes;
  const bool pinned;
  uint8_t* data{nullptr};
  TierCounters counters;
  // On a GPU whose kernels resolve the tier's records: its table there,
  // current when `gpu->device_owned` (cuda_tables.cu); else null.
  std::shared_ptr<TierGpu> gpu;

 private:
  enum State : uint8_t { Empty, Loading, Ready, Failed };
  int64_t victim(std::unique_lock<std::mutex>& lock, bool wait);
  void claim(int64_t slot, int64_t key);
  void enqueue(std::shared_ptr<ExpertCache> cache, int expert, int64_t slot,
               int64_t key, bool front);

  std::mutex mutex_;
  std::condition_variable ready_;
  std::vector<int64_t> slot_of_; // key -> slot, -1 when absent
  std::vector<int64_t> key_in_; // slot -> key, -1 when empty
  std::vector<int64_t> stamp_; // last use, for LRU
  std::vector<State> state_;
  std::vector<std::string> error_;
  std::vector<char> held_;
  std::vector<int64_t> held_list_, free_;
  int64_t clock_{0}, loading_{0};
  int readers_;

  friend struct GpuAccess; // cuda_tables.cu: the table's device copy
};

// Host memory for the tier: pinned and mapped on a GPU, else aligned.
uint8_t* host_alloc(size_t bytes, bool pinned);
void host_free(uint8_t* p, bool pinned);
// The pinned kind, from the GPU backend (cuda_fetch.cu; no_cuda.cpp throws).
uint8_t* pinned_alloc(size_t bytes);
void pinned_free(uint8_t* p);

} // namespace moestream
