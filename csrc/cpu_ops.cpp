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
#include "cpu_simd.h"

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

#if defined(__AVX512F__)
constexpr int kWide = 16;
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

// exp(in - top) into o, a vector at a time.
inline void row_exp(const float* in, float top, float* o, int64_t m) {
  int64_t i = 0;
  for (; i + kLanes <= m; i += kLanes) {
    VF v;
    std::memcpy(&v, in + i, sizeof v);
    v = exp_lanes(v - top);
    std::memcpy(o + i, &v, sizeof v);
  }
  for (; i < m; i++) {
    o[i] = exp_one(in[i] - top);
  }
}

// Where a row's closing run of one repeated value starts (a causal mask's
// float32 lowest): its exps are one exp, and zeros add nothing to a sum.
inline int64_t run_start(const float* in, int64_t m) {
  const float last = in[m - 1];
  int64_t j = m - 1;
#if defined(__AVX512F__)
  const __m512 v = _mm512_set1_ps(last);
  while (j >= kWide &&
         _mm512_cmp_ps_mask(_mm512_loadu_ps(in + j - kWide), v, _CMP_EQ_OQ) ==
             0xFFFF) {
    j -= kWide;
  }
#endif
  while (j > 0 && in[j - 1] == last) {
    j--;
  }
  return j;
}

} // namespace

// Rows [r0, r1) of x `[*, m]` into out; each row's sum in order from +0,
// four rows' sums side by side (four chains of adds in flight). A row's
// closing run of one value takes one exp, and its adds only where that exp
// is not zero.
void softmax_rows(const float* x, float* out, int64_t r0, int64_t r1,
                  int64_t m) {
  constexpr int kTogether = 4;
  for (int64_t r = r0; r < r1; r += kTogether) {
    int n = int(std::min<int64_t>(kTogether, r1 - r));
    float* o[kTogether];
    float sum[kTogether] = {}, tail[kTogether];
    int64_t run[kTogether], most = 0;
    for (int k = 0; k < n; k++) {
      const float* in = x + (r + k) * m;
      o[k] = out + (r + k) * m;
      run[k] = run_start(in, m);
      float top = max_one(in[m - 1], row_max(in, run[k]));
      row_exp(in, top, o[k], run[k]);
      tail[k] = exp_one(in[m - 1] - top);
      most = std::max(most, run[k]);
    }
    for (int64_t j = 0; j < most; j++) {
      for (int k = 0; k < n; k++) {
        if (j < run[k]) {
          sum[k] = sum[k] + o[k][j];
        }
      }
    }
    for (int k = 0; k < n; k++) {
      if (tail[k] != 0.0f) {
        for (int64_t j = run[k]; j < m; j++) {
          sum[k] = sum[k] + tail[k];
        }
      }
      float inv = 1 / sum[k];
      for (int64_t j = 0; j < run[k]; j++) {
        o[k][j] = o[k][j] * inv;
      }
      std::fill(o[k] + run[k], o[k] + m, tail[k] * inv);
    }
  }
}


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
