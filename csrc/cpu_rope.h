// Exact CPU rotary position embedding: what MLX's CPU `fast.rope` computes
// (its fallback: positions, their frequencies by MLX's exp, MLX's own sin
// and cos, and the rotation's separate products and sums), bit for bit, as
// one op instead of about thirty.
#pragma once

#include <optional>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "cpu_kernel.h"

namespace mx = mlx::core;

namespace moestream {

// What a rope rotates: the first `dims` features, pairs half apart (or
// neighbours where traditional), by base's frequencies (or given ones).
struct RopeSpec {
  int dims;
  bool traditional;
  float base;
  float scale;
  bool freqs; // frequencies given as an input
};

// x `[B, N, T, D]` (or `[B, T, D]`) float32 with its first `dims` features
// rotated by position offset + t (offset `[1]` or `[B]` int32).
class ExactRope : public CpuKernel {
 public:
  ExactRope(mx::Stream s, RopeSpec spec) : CpuKernel(s), spec_(spec) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExactRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  RopeSpec spec_;
};

// mx.fast.rope(x, dims, traditional, base, scale, offset, freqs) for float32
// x, bit for bit (base is ignored where freqs is given).
mx::array exact_rope(const mx::array& x, int dims, bool traditional,
                     float base, float scale, const mx::array& offset,
                     const std::optional<mx::array>& freqs);

} // namespace moestream
