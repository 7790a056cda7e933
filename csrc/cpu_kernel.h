// The base of every exact CPU kernel (cpu_*.cpp): an MLX primitive that
// runs on a CPU only, and says so if asked to run on a GPU.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace moestream {

class CpuKernel : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&,
                std::vector<mx::array>&) final {
    throw std::runtime_error(std::string("moestream's ") + name() +
                             " runs on a CPU only");
  }
};

} // namespace moestream
