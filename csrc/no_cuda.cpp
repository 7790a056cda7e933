// Builds without CUDA: the GPU entry points say so.
#include <cstdlib>
#include <new>
#include <stdexcept>

#include "expert_cache.h"

namespace moestream {

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error(
      "moestream's native engine was built without CUDA; reinstall it where "
      "nvcc is on the PATH, or use engine='python'.");
}
} // namespace

void gpu_fetch(ExpertCache&, const std::vector<mx::array>&, mx::array&, bool,
               mx::Stream) {
  no_cuda();
}

void gpu_load_copy(ExpertCache&, const uint8_t*, int) {
  no_cuda();
}

uint8_t* host_alloc(size_t bytes, bool) {
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64));
  if (!p) {
    throw std::bad_alloc();
  }
  return p;
}

void host_free(uint8_t* p, bool) {
  std::free(p);
}

bool built_with_cuda() {
  return false;
}

} // namespace moestream
