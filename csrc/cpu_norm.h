// An exact CPU RMS norm: what MLX's CPU `fast.rms_norm` computes (its
// fallback: square, a sum over the row from +0 in order, times 1 / n, plus
// eps, 1 / sqrt, times x, times the weight), bit for bit, as one op instead
// of seven.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace moestream {

// x `[..., D]` float32 normalized over D and times w `[D]`.
class ExactRmsNorm : public mx::Primitive {
 public:
  ExactRmsNorm(mx::Stream s, float eps) : mx::Primitive(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&,
                std::vector<mx::array>&) override;
  const char* name() const override {
    return "ExactRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

// mx.fast.rms_norm(x, w, eps) for float32 x and w, bit for bit.
mx::array exact_rms_norm(const mx::array& x, const mx::array& w, float eps);

} // namespace moestream
