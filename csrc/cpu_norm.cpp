#include "cpu_norm.h"

#include <cmath>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace moestream {

namespace {

// Built with -ffp-contract=off: every product and sum rounds on its own.
void rows(const float* x, const float* w, float* out, int64_t n, int64_t d,
          float eps) {
  // mean's normalizer: 1 / d in double, then float (MLX's NumberOfElements)
  const float inv = static_cast<float>(1.0 / double(d));
  for (int64_t r = 0; r < n; r++) {
    const float* xr = x + r * d;
    float sum = 0.0f;
    for (int64_t i = 0; i < d; i++) {
      float sq = xr[i] * xr[i];
      sum = sum + sq;
    }
    sum = 0.0f + sum; // the reduction adds its row to the output's +0
    float scale = 1.0f / std::sqrt(sum * inv + eps);
    float* o = out + r * d;
    for (int64_t i = 0; i < d; i++) {
      float y = xr[i] * scale;
      o[i] = y * w[i];
    }
  }
}

} // namespace

void ExactRmsNorm::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch([x = inputs[0], w = inputs[1], out, eps = eps_]() mutable {
    int64_t d = x.shape(-1);
    rows(x.data<float>(), w.data<float>(), out.data<float>(), x.size() / d, d,
         eps);
  });
}

void ExactRmsNorm::eval_gpu(const std::vector<mx::array>&,
                            std::vector<mx::array>&) {
  throw std::runtime_error("moestream's CPU norm has no GPU version");
}

bool ExactRmsNorm::is_equivalent(const mx::Primitive& other) const {
  return eps_ == static_cast<const ExactRmsNorm&>(other).eps_;
}

mx::array exact_rms_norm(const mx::array& x, const mx::array& w, float eps) {
  if (x.dtype() != mx::float32 || w.dtype() != mx::float32) {
    throw std::invalid_argument("moestream norm: x and w must be float32");
  }
  if (x.ndim() < 1 || w.ndim() != 1 || w.shape(0) != x.shape(-1)) {
    throw std::invalid_argument(
        "moestream norm: w must be one weight per element of x's last axis");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<ExactRmsNorm>(s, eps),
                   {mx::contiguous(x, false, s), mx::contiguous(w, false, s)});
}

} // namespace moestream
