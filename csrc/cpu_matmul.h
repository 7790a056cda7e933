// An exact CPU float32 matmul: what MLX's CPU `matmul` computes (cblas_sgemm
// with alpha 1 and beta 0, which the Linux wheel takes from the reference
// BLAS), bit for bit, at vector speed. Each output is the reference BLAS's
// sum, sum = sum + a[i, k] * b[k, j] from +0 with k ascending, one rounding
// per multiply and per add; outputs run sixteen (eight with AVX2) to a
// vector, several rows and vectors at once, split over threads.
#pragma once

#include <cstdint>
#include <limits>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "cpu_kernel.h"

namespace mx = mlx::core;

namespace moestream {

// a `[batch, M, K]` @ b `[batch, K, N]` (or b `[batch, N, K]` where
// transpose_b), float32, read through their strides.
class ExactMatmul : public CpuKernel {
 public:
  ExactMatmul(mx::Stream s, bool transpose_b, int64_t causal, int threads)
      : CpuKernel(s),
        transpose_b_(transpose_b),
        causal_(causal),
        threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExactMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  bool transpose_b_;
  int64_t causal_;
  int threads_;
};

// The matmul's pieces, for kernels that run products of their own (attention).
namespace matmul {

// The mask's value: MLX's sdpa puts float32's lowest where a query must not
// see a key.
constexpr float kMasked = -std::numeric_limits<float>::max();

// One batch of b `[K, N]` as products read it: in place where its rows are
// whole vectors, else packed in blocks of a tile's columns; `finite`: no
// infinity or NaN in it (a's trailing zeros may then be skipped).
struct Operand {
  const float* b;
  int64_t ldb, K, N;
  bool packed, finite;
};

// Floats a packed b `[K, N]` takes.
int64_t packed_floats(int64_t K, int64_t N);

// b `[K, N]` (`[N, K]` where transposed) at row and column strides rs, cs;
// `buf` (packed_floats) holds it where it is packed.
Operand prepare(const float* b, int64_t rs, int64_t cs, int64_t K, int64_t N,
                bool transposed, float* buf);

// `count` rows of a (`[count, K]`, row `first` of its batch). With `causal`
// (q_len), q @ k.T of masked scores: row m is query m % q_len of the last
// q_len of N keys, and each key past it gets kMasked, its score uncomputed.
struct Rows {
  const float* a;
  int64_t first, count, causal;
};

// out `[count, N]` = the rows' product with b, MLX's bits.
void product(const Rows& rows, const Operand& b, float* out);

} // namespace matmul

// mx.matmul(a, b) (b `[..., N, K]` read as its transpose where transpose_b)
// for float32 `[batch, M, K]` inputs with equal batch, bit for bit. With
// `causal` = q_len > 0 (q @ k.T of sdpa's scores, a's rows `rep * q_len`
// queries), what MLX's sdpa makes of it under its causal mask: row m is
// query m % q_len of the last q_len of N keys, and each key past it gets
// float32's lowest instead of its (uncomputed) score.
mx::array exact_matmul(const mx::array& a, const mx::array& b, bool transpose_b,
                       int threads, int64_t causal = 0);

} // namespace moestream
