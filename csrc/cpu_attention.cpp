#include "cpu_attention.h"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cpu_experts.h"
#include "cpu_matmul.h"
#include "cpu_ops.h"

namespace moestream {

namespace {

constexpr int64_t kBlockRows = 16; // query rows of a task

void run(const mx::array& q, const mx::array& k, const mx::array& v,
         mx::array& out, int64_t causal, int threads) {
  const int64_t batch = q.shape(0), M = q.shape(1), D = q.shape(2);
  const int64_t S = k.shape(1), Dv = v.shape(2);
  std::vector<float> q_rows;
  const float* qp = row_major(q, q_rows);
  const auto &ks = k.strides(), &vs = v.strides();
  const int64_t kp = matmul::packed_floats(D, S), vp = matmul::packed_floats(S, Dv);
  std::vector<float> k_spill, v_spill;
  float* kbuf = scratch(Scratch::MatmulPacked, batch * kp, k_spill);
  float* vbuf = scratch(Scratch::AttentionValues, batch * vp, v_spill);
  std::vector<matmul::Operand> kt(batch), vb(batch);
  parallel_for(int(batch), threads, [&](int n) {
    kt[n] = matmul::prepare(k.data<float>() + n * ks[0], ks[1], ks[2], D, S,
                            true, kbuf + n * kp);
    vb[n] = matmul::prepare(v.data<float>() + n * vs[0], vs[1], vs[2], S, Dv,
                            false, vbuf + n * vp);
  });
  float* op = out.data<float>();
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  parallel_for(int(batch * blocks), threads, [&](int task) {
    const int64_t n = task / blocks, i0 = task % blocks * kBlockRows;
    const int64_t count = std::min(M, i0 + kBlockRows) - i0;
    std::vector<float> spill;
    float* scores = scratch(Scratch::AttentionScores, count * S, spill);
    matmul::product({qp + (n * M + i0) * D, i0, count, causal}, kt[n], scores);
    softmax_rows(scores, scores, 0, count, S);
    matmul::product({scores, 0, count, 0}, vb[n], op + (n * M + i0) * Dv);
  });
}

} // namespace

void ExactAttention::eval_cpu(const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [q = inputs[0], k = inputs[1], v = inputs[2], out = outputs[0],
            causal = causal_, threads = threads_or_all(threads_)]() mutable {
             run(q, k, v, out, causal, threads);
           });
}

bool ExactAttention::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const ExactAttention&>(other);
  return causal_ == o.causal_ && threads_ == o.threads_;
}

mx::array exact_attention(const mx::array& q, const mx::array& k,
                          const mx::array& v, int64_t causal, int threads) {
  for (const auto* a : {&q, &k, &v}) {
    if (a->dtype() != mx::float32 || a->ndim() != 3) {
      throw std::invalid_argument(
          "moestream attention: q, k and v must be float32 [batch, rows, dim]");
    }
  }
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) ||
      k.shape(2) != q.shape(2) || v.shape(1) != k.shape(1)) {
    throw std::invalid_argument(
        "moestream attention: q [batch, M, D], k [batch, S, D] and v [batch, "
        "S, Dv] expected");
  }
  if (causal < 0 || (causal && (q.shape(1) % causal || causal > k.shape(1)))) {
    throw std::invalid_argument(
        "moestream attention: causal must be 0 or the query length (q's rows a "
        "multiple of it, at most the keys)");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  return mx::array({q.shape(0), q.shape(1), v.shape(2)}, mx::float32,
                   std::make_shared<ExactAttention>(s, causal, threads),
                   {q, k, v}); // read through their strides at eval
}

} // namespace moestream
