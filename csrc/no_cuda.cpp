// Builds without CUDA: the GPU entry points say so.
#include <stdexcept>

#include "expert_fetch.h"

namespace moestream {

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error(
      "moestream's native engine was built without CUDA; reinstall it where "
      "nvcc is on the PATH, or use engine='python'.");
}
} // namespace

void gpu_fetch(ExpertCache&, const std::vector<mx::array>&, mx::array&, bool,
               int64_t, mx::Stream) {
  no_cuda();
}

void gpu_load_copy(ExpertCache&, const uint8_t*, int, bool) {
  no_cuda();
}

void gpu_load_wait() {}

void gpu_sync_host(ExpertCache&) {} // nothing resolves on a device here

void gpu_collect(ExpertCache&) {}

void gpu_tier_collect(HostTier&) {}

void gpu_tier_sync_host(HostTier&) {}

uint8_t* pinned_alloc(size_t) {
  no_cuda();
}

void pinned_free(uint8_t*) {
  no_cuda();
}

bool built_with_cuda() {
  return false;
}

} // namespace moestream
