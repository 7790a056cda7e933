#include "cpu_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "mlx/backend/cpu/simd/math.h"
#include "mlx/ops.h"

#include "cpu_experts.h"

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

// MLX's CPU exp (mlx/backend/cpu/simd/math.h), lane by lane: x * log2(e);
// its integer part floor(x + 0.5) taken in double (MLX adds the double 0.5 to
// a float); a polynomial of fused multiply-adds in the fraction; times 2 to
// that integer; NaN kept, above 88 infinity, below -88 zero.
#if defined(__AVX512F__)
constexpr int kWide = 16;
using VFw = __m512;
inline VFw exp_lanes(VFw in) {
  __m512 x = _mm512_mul_ps(in, _mm512_set1_ps(1.442695f));
  __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
  const __m512d half = _mm512_set1_pd(0.5);
  lo = _mm512_roundscale_pd(_mm512_add_pd(lo, half), _MM_FROUND_TO_NEG_INF);
  hi = _mm512_roundscale_pd(_mm512_add_pd(hi, half), _MM_FROUND_TO_NEG_INF);
  __m512 ipart = _mm512_insertf32x8(
      _mm512_castps256_ps512(_mm512_cvtpd_ps(lo)), _mm512_cvtpd_ps(hi), 1);
  __m512 f = _mm512_sub_ps(x, ipart);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000000000000f));
  __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(ipart), _mm512_set1_epi32(127)), 23);
  __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(e), p);
  __mmask16 nan = _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q);
  r = _mm512_mask_mov_ps(r, nan, in);
  r = _mm512_mask_mov_ps(
      r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(88.0f), _CMP_GT_OQ),
      _mm512_set1_ps(std::numeric_limits<float>::infinity()));
  r = _mm512_mask_mov_ps(
      r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(-88.0f), _CMP_LT_OQ),
      _mm512_setzero_ps());
  return r;
}
inline VFw load_w(const float* p) {
  return _mm512_loadu_ps(p);
}
inline void store_w(float* p, VFw v) {
  _mm512_storeu_ps(p, v);
}
inline VFw sub_w(VFw a, float b) {
  return _mm512_sub_ps(a, _mm512_set1_ps(b));
}
#endif

// One lane of MLX's exp: its own code, on its one-lane Simd.
inline float exp_one(float x) {
  return mx::simd::exp(mx::simd::Simd<float, 1>(x)).value;
}

// MLX's maximum: a NaN stays.
inline float max_one(float a, float b) {
  return std::isnan(a) ? a : (a > b ? a : b);
}

// A row's maximum as MLX's loop takes it: its first NaN where it has one
// (taken by MLX's own loop), else the largest value (in lanes: which of two
// equal zeros wins does not change an exp of the difference).
inline float row_max(const float* in, int64_t m) {
  int64_t i = 0;
  float top = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(top);
  __mmask16 nan = 0;
  for (; i + kWide <= m; i += kWide) {
    __m512 v = _mm512_loadu_ps(in + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(v, best);
  }
  if (nan) {
    i = 0;
  } else {
    top = _mm512_reduce_max_ps(best);
  }
#endif
  for (; i < m; i++) {
    top = max_one(in[i], top);
  }
  return top;
}

// exp(in - top) into o, sixteen lanes at a time where the CPU has them.
inline void row_exp(const float* in, float top, float* o, int64_t m) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + kWide <= m; i += kWide) {
    store_w(o + i, exp_lanes(sub_w(load_w(in + i), top)));
  }
#endif
  for (; i < m; i++) {
    o[i] = exp_one(in[i] - top);
  }
}

// Rows [r0, r1) of x `[*, m]` into out; each row's sum in order from +0,
// four rows' sums side by side (four chains of adds in flight).
void softmax_rows(const float* x, float* out, int64_t r0, int64_t r1,
                  int64_t m) {
  constexpr int kTogether = 4;
  for (int64_t r = r0; r < r1; r += kTogether) {
    int n = int(std::min<int64_t>(kTogether, r1 - r));
    float* o[kTogether];
    float sum[kTogether] = {};
    for (int k = 0; k < n; k++) {
      const float* in = x + (r + k) * m;
      o[k] = out + (r + k) * m;
      row_exp(in, row_max(in, m), o[k], m);
    }
    for (int64_t j = 0; j < m; j++) {
      for (int k = 0; k < n; k++) {
        sum[k] = sum[k] + o[k][j];
      }
    }
    for (int k = 0; k < n; k++) {
      float inv = 1 / sum[k];
      for (int64_t j = 0; j < m; j++) {
        o[k][j] = o[k][j] * inv;
      }
    }
  }
}

} // namespace

void ExactSoftmax::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [x = inputs[0], out = outputs[0],
            threads = threads_or_all(threads_)]() mutable {
             int64_t m = x.shape(-1), rows = x.size() / m;
             constexpr int64_t kTask = 16; // rows of a task
             int64_t tasks = (rows + kTask - 1) / kTask;
             std::vector<float> tmp;
             const float* in = row_major(x, tmp);
             float* o = out.data<float>();
             parallel_for(int(tasks), threads, [&](int t) {
               softmax_rows(in, o, t * kTask, std::min(rows, (t + 1) * kTask),
                            m);
             });
           });
}

bool ExactSoftmax::is_equivalent(const mx::Primitive& other) const {
  return threads_ == static_cast<const ExactSoftmax&>(other).threads_;
}

mx::array exact_softmax(const mx::array& x, int threads) {
  if (x.dtype() != mx::float32 || x.ndim() < 1) {
    throw std::invalid_argument("moestream softmax: x must be float32");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<ExactSoftmax>(s, threads), {x});
}

void ExactRmsNorm::eval_cpu(const std::vector<mx::array>& inputs,
                            std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [x = inputs[0], w = inputs[1], out = outputs[0],
            eps = eps_]() mutable {
             int64_t d = x.shape(-1);
             std::vector<float> xt, wt;
             rows(row_major(x, xt), row_major(w, wt), out.data<float>(),
                  x.size() / d, d, eps);
           });
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
                   {x, w}); // read through their strides at eval
}

} // namespace moestream
