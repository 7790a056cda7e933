// Exact CPU small ops, each what MLX's CPU op computes, bit for bit:
// - the RMS norm (MLX's `fast.rms_norm` fallback: square, a sum over the row
//   from +0 in order, times 1 / n, plus eps, 1 / sqrt, times x, times the
//   weight) as one op instead of seven;
// - the softmax over the last axis of float32 (MLX's CPU Softmax: the row's
//   maximum, MLX's own exp of each value less it, their sum in order, times
//   1 / sum), its exps sixteen to a vector and rows over threads;
// - rotary position embedding (MLX's `fast.rope` fallback: positions, their
//   frequencies by MLX's exp, MLX's sin and cos, and the rotation's separate
//   products and sums) as one op instead of about thirty.
#pragma once

#include <optional>

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

// Softmax of float32 x `[..., M]` over its last axis.
class ExactSoftmax : public mx::Primitive {
 public:
  ExactSoftmax(mx::Stream s, int threads) : mx::Primitive(s), threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&,
                std::vector<mx::array>&) override;
  const char* name() const override {
    return "ExactSoftmax";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int threads_;
};

// mx.softmax(x, axis=-1) for float32 x, bit for bit.
mx::array exact_softmax(const mx::array& x, int threads);

// x `[B, N, T, D]` (or `[B, T, D]`) float32 with its first `dims` features
// rotated by position offset + t (offset `[1]` or `[B]` int32).
class ExactRope : public mx::Primitive {
 public:
  ExactRope(mx::Stream s, int dims, bool traditional, float base, float scale,
            bool freqs)
      : mx::Primitive(s), dims_(dims), traditional_(traditional), base_(base),
        scale_(scale), freqs_(freqs) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&,
                std::vector<mx::array>&) override;
  const char* name() const override {
    return "ExactRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
  bool freqs_;
};

// mx.fast.rope(x, dims, traditional, base, scale, offset, freqs) for float32
// x, bit for bit (base is ignored where freqs is given).
mx::array exact_rope(const mx::array& x, int dims, bool traditional,
                     float base, float scale, const mx::array& offset,
                     const std::optional<mx::array>& freqs);

} // namespace moestream
