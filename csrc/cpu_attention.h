// Exact CPU attention in one op: MLX's sdpa fallback on a CPU (scores =
// (scale * q) @ k.T, the causal mask's lowest past each query's key, a
// precise softmax, @ v), bit for bit, a block of query rows at a time so that
// no `[heads, L, S]` scores array is ever written: each block's scores,
// softmax and product stay in the cache. Its steps are the matmul's and the
// softmax's own (cpu_matmul.h, cpu_ops.h).
#pragma once

#include <cstdint>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "cpu_kernel.h"

namespace mx = mlx::core;

namespace moestream {

// q `[batch, M, D]` (already scaled), k `[batch, S, D]`, v `[batch, S, Dv]`
// float32, read through their strides; out `[batch, M, Dv]`.
class ExactAttention : public CpuKernel {
 public:
  ExactAttention(mx::Stream s, int64_t causal, int threads)
      : CpuKernel(s), causal_(causal), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExactAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int64_t causal_; // 0: no mask; else q_len (M = rep * q_len)
  int threads_;
};

// softmax(q @ k.T [masked]) @ v per batch, as MLX's sdpa fallback computes
// it after its scale: with causal = q_len, row m is query m % q_len of the
// last q_len of S keys.
mx::array exact_attention(const mx::array& q, const mx::array& k,
                          const mx::array& v, int64_t causal, int threads);

} // namespace moestream
