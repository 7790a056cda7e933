// Exact CPU small ops, each what MLX's CPU op computes, bit for bit:
// - the RMS norm (MLX's `fast.rms_norm` fallback: square, a sum over the row
//   from +0 in order, times 1 / n, plus eps, 1 / sqrt, times x, times the
//   weight) as one op instead of seven;
// - the softmax over the last axis of float32 (MLX's CPU Softmax: the row's
//   maximum, MLX's own exp of each value less it, their sum in order, times
//   1 / sum), its exps sixteen to a vector and rows over threads.
#pragma once

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "cpu_kernel.h"

namespace mx = mlx::core;

namespace moestream {

// x `[..., D]` float32 normalized over D and times w `[D]`.
class ExactRmsNorm : public CpuKernel {
 public:
  ExactRmsNorm(mx::Stream s, float eps) : CpuKernel(s), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExactRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

// mx.fast.rms_norm(x, w, eps) for float32 x and w, bit for bit.
mx::array exact_rms_norm(const mx::array& x, const mx::array& w, float eps);

// Softmax of float32 x `[..., M]` over its last axis.
class ExactSoftmax : public CpuKernel {
 public:
  ExactSoftmax(mx::Stream s, int threads) : CpuKernel(s), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExactSoftmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int threads_;
};

// mx.softmax(x, axis=-1) for float32 x, bit for bit.
mx::array exact_softmax(const mx::array& x, int threads);

// Rows [r0, r1) of x `[*, m]`, row-contiguous, softmaxed into out (x may be
// out): ExactSoftmax's arithmetic, for kernels that hold their own rows.
void softmax_rows(const float* x, float* out, int64_t r0, int64_t r1,
                  int64_t m);

} // namespace moestream
