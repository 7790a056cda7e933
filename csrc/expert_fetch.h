// The MLX primitive of one MoE call: routed expert ids in, slot ids out, the
// misses read inside the stream (eval_cpu here, eval_gpu in cuda_fetch.cu).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "expert_cache.h"

namespace moestream {

// routed expert ids -> slot ids, loading misses inside the stream.
class ExpertFetch : public mx::Primitive {
 public:
  ExpertFetch(mx::Stream s, std::shared_ptr<ExpertCache> cache, bool predicted,
              int64_t call)
      : mx::Primitive(s),
        cache_(std::move(cache)),
        predicted_(predicted),
        call_(call) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExpertFetch";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false; // stateful: never merged by compile
  }

 private:
  std::shared_ptr<ExpertCache> cache_;
  bool predicted_;
  int64_t call_;
};

// `inds` routed expert ids (any shape, uint32); `predicted` the next layer's
// likely experts or none; `call` the id its counts are recorded under.
// Returns slot ids of the same shape.
mx::array fetch(std::shared_ptr<ExpertCache> cache, const mx::array& inds,
                const std::optional<mx::array>& predicted, int64_t call);

// Implemented in cuda_fetch.cu when built with CUDA, else throw.
void gpu_fetch(ExpertCache& cache, const std::vector<mx::array>& inputs,
               mx::array& out, bool predicted, int64_t call, mx::Stream s);
// A host-side load's copy of `record` into `slot`; from a pinned tier record
// (which stays until the load ends) queued without waiting: gpu_load_wait.
void gpu_load_copy(ExpertCache& cache, const uint8_t* record, int slot,
                   bool pinned);
void gpu_load_wait();
// When the device resolves a layer's calls: wait for the device, then make
// the host's table current again (before a host-side load reads it).
void gpu_sync_host(ExpertCache& cache);
// Fold in what the device counted and recorded for calls that have run, and
// its error, if any. Both do nothing where the device has not resolved.
void gpu_collect(ExpertCache& cache);
// The tier's counts from the device into its counters; its table back to
// the host (`table`). Both do nothing where no kernel resolves its records.
void gpu_tier_collect(HostTier& tier);
void gpu_tier_sync_host(HostTier& tier);
bool built_with_cuda();

} // namespace moestream
