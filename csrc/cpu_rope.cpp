#include "cpu_rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/simd/math.h"
#include "mlx/ops.h"

#include "cpu_experts.h"

namespace moestream {

namespace {

// MLX's sin and cos of one float32 lane (their Cephes polynomials; libm past
// 2^23), from MLX's own header.
inline float sin_one(float x) {
  return mx::simd::sin(mx::simd::Simd<float, 1>(x)).value;
}
inline float cos_one(float x) {
  return mx::simd::cos(mx::simd::Simd<float, 1>(x)).value;
}

// The fallback's per-position tables: theta = ((t + offset) * scale) * inv[j]
// and its cos and sin, for t in [0, T) and j in [0, half).
void rope_tables(int64_t T, int32_t offset, float scale,
                 const std::vector<float>& inv, std::vector<float>& c,
                 std::vector<float>& s) {
  const int64_t half = int64_t(inv.size());
  c.resize(T * half);
  s.resize(T * half);
  float t_f = 0.0f; // MLX's arange: start, then start += step
  for (int64_t t = 0; t < T; t++, t_f += 1.0f) {
    float pos = (t_f + static_cast<float>(offset)) * scale;
    for (int64_t j = 0; j < half; j++) {
      float theta = pos * inv[j];
      c[t * half + j] = cos_one(theta);
      s[t * half + j] = sin_one(theta);
    }
  }
}

// One row of D features at table row (c, s): the rotated dims, the rest kept.
inline void rope_row(const float* x, float* o, const float* c, const float* s,
                     int64_t half, int64_t dims, int64_t d, bool traditional) {
  if (traditional) {
    for (int64_t j = 0; j < half; j++) {
      float x1 = x[2 * j], x2 = x[2 * j + 1];
      o[2 * j] = x1 * c[j] - x2 * s[j];
      o[2 * j + 1] = x1 * s[j] + x2 * c[j];
    }
  } else {
    for (int64_t j = 0; j < half; j++) {
      float x1 = x[j], x2 = x[half + j];
      o[j] = x1 * c[j] - x2 * s[j];
      o[half + j] = x1 * s[j] + x2 * c[j];
    }
  }
  for (int64_t j = dims; j < d; j++) {
    o[j] = x[j];
  }
}

} // namespace

void ExactRope::eval_cpu(const std::vector<mx::array>& inputs,
                         std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [x = inputs[0], offset = inputs[1],
            freqs = spec_.freqs ? inputs[2] : inputs[0], has_freqs = spec_.freqs,
            out = outputs[0], dims = int64_t(spec_.dims), trad = spec_.traditional,
            base = spec_.base, scale = spec_.scale]() mutable {
             const int64_t d = x.shape(-1), T = x.shape(-2);
             const int64_t B = x.shape(0);
             const int64_t heads = x.size() / (B * T * d);
             const int64_t half = dims / 2;
             std::vector<float> inv(half);
             if (has_freqs) { // reciprocal(freqs): 1 / f
               std::vector<float> ft;
               const float* f = row_major(freqs, ft);
               for (int64_t j = 0; j < half; j++) {
                 inv[j] = 1.0f / f[j];
               }
             } else { // exp(arange(0, -half, -1) * (log(base) / half))
               const float step = std::log(base) / float(half);
               float k = 0.0f;
               for (int64_t j = 0; j < half; j++, k -= 1.0f) {
                 inv[j] = mx::simd::exp(mx::simd::Simd<float, 1>(k * step)).value;
               }
             }
             const int32_t* off = offset.data<int32_t>();
             const bool per_batch = offset.size() > 1;
             const int64_t off_step = per_batch ? offset.strides()[0] : 0;
             std::vector<float> xt;
             const float* in = row_major(x, xt);
             float* o = out.data<float>();
             std::vector<float> c, s;
             for (int64_t b = 0; b < B; b++) {
               if (b == 0 || per_batch) {
                 rope_tables(T, off[b * off_step], scale, inv, c, s);
               }
               for (int64_t n = 0; n < heads; n++) {
                 for (int64_t t = 0; t < T; t++) {
                   int64_t row = (b * heads + n) * T + t;
                   rope_row(in + row * d, o + row * d, c.data() + t * half,
                            s.data() + t * half, half, dims, d, trad);
                 }
               }
             }
           });
}

bool ExactRope::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const ExactRope&>(other).spec_;
  return spec_.dims == o.dims && spec_.traditional == o.traditional &&
         spec_.base == o.base && spec_.scale == o.scale && spec_.freqs == o.freqs;
}

mx::array exact_rope(const mx::array& x, int dims, bool traditional,
                     float base, float scale, const mx::array& offset,
                     const std::optional<mx::array>& freqs) {
  if (x.dtype() != mx::float32 || x.ndim() < 3 || x.ndim() > 4) {
    throw std::invalid_argument(
        "moestream rope: x must be float32 [B, N, T, D] or [B, T, D]");
  }
  if (dims <= 0 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument(
        "moestream rope: dims must be even, positive and at most x's last "
        "axis");
  }
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != size_t(x.shape(0)))) {
    throw std::invalid_argument(
        "moestream rope: offset must be int32, one value or one per batch");
  }
  if (freqs && (freqs->dtype() != mx::float32 || freqs->ndim() != 1 ||
                freqs->shape(0) != dims / 2)) {
    throw std::invalid_argument(
        "moestream rope: freqs must be float32 with dims / 2 values");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  std::vector<mx::array> inputs = {x, offset}; // x read through its strides
  if (freqs) {
    inputs.push_back(*freqs);
  }
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<ExactRope>(
                       s, RopeSpec{dims, traditional, base, scale, bool(freqs)}),
                   std::move(inputs));
}

} // namespace moestream
