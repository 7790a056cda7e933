#include "cpu_matmul.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/ops.h"

#include "cpu_experts.h"
#include "cpu_simd.h"

namespace moestream {

namespace {

// Built with -ffp-contract=off (CMakeLists.txt): each product and each sum
// rounds on its own, as in the reference BLAS.
#if defined(__AVX512F__)
constexpr int kVecs = 4; // 4 rows x 4 vectors of sums: 16 of 32 registers
#else
constexpr int kVecs = 2; // 4 rows x 2 vectors: 8 of AVX2's 16 registers
#endif
constexpr int kRowsTile = 4;
constexpr int64_t kRowsTask = 16; // rows of a task

inline VF load(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// c[r][v * kLanes + l] = sum over k of a[r][k] * bp[k][v * kLanes + l] for
// MR rows and NV vectors of columns, k ascending from +0.
template <int MR, int NV>
void tile(const float* a, int64_t lda, const float* bp, int64_t np, int64_t K,
          float* c, int64_t ldc) {
  VF acc[MR][NV] = {};
  for (int64_t k = 0; k < K; k++) {
    VF b[NV];
    for (int v = 0; v < NV; v++) {
      b[v] = load(bp + k * np + v * kLanes);
    }
    for (int r = 0; r < MR; r++) {
      float x = a[r * lda + k];
      for (int v = 0; v < NV; v++) {
        acc[r][v] = acc[r][v] + x * b[v];
      }
    }
  }
  for (int r = 0; r < MR; r++) {
    for (int v = 0; v < NV; v++) {
      std::memcpy(c + r * ldc + v * kLanes, &acc[r][v], sizeof(VF));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t,
                        float*, int64_t);

template <int MR>
TileFn tile_of(int nv) {
  switch (nv) {
    case 1: return tile<MR, 1>;
    case 2: return tile<MR, 2>;
#if defined(__AVX512F__)
    case 3: return tile<MR, 3>;
    case 4: return tile<MR, 4>;
#endif
  }
  throw std::logic_error("moestream matmul: a tile of no columns");
}

TileFn tile_fn(int mr, int nv) {
  switch (mr) {
    case 1: return tile_of<1>(nv);
    case 2: return tile_of<2>(nv);
    case 3: return tile_of<3>(nv);
    default: return tile_of<4>(nv);
  }
}

// One batch of b, `[K, N]` (or `[N, K]` where transposed) at row stride
// `rs` and column stride `cs` (a view of a cache reads in place), as
// `[K, np]`, np a whole number of vectors, the columns past N zero.
void pack(const float* b, int64_t rs, int64_t cs, int64_t K, int64_t N,
          int64_t np, bool transposed, float* bp) {
#if defined(__AVX512F__)
  if (transposed && cs == 1) { // [N, K] rows: 16 x 16 blocks turned in registers
    for (int64_t j0 = 0; j0 < np; j0 += 16) {
      for (int64_t k0 = 0; k0 < K; k0 += 16) {
        int64_t nk = std::min<int64_t>(16, K - k0);
        __mmask16 mask = nk >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nk) - 1);
        __m512i r[16];
        for (int j = 0; j < 16; j++) {
          r[j] = j0 + j < N ? _mm512_maskz_loadu_epi32(mask, b + (j0 + j) * rs + k0)
                            : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t k = 0; k < nk; k++) {
          _mm512_storeu_si512(bp + (k0 + k) * np + j0, r[k]);
        }
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; k++) {
    float* row = bp + k * np;
    if (transposed) {
      for (int64_t j = 0; j < N; j++) {
        row[j] = b[j * rs + k * cs];
      }
    } else if (cs == 1) {
      std::memcpy(row, b + k * rs, N * sizeof(float));
    } else {
      for (int64_t j = 0; j < N; j++) {
        row[j] = b[k * rs + j * cs];
      }
    }
    std::fill(row + N, row + np, 0.0f);
  }
}

// Rows [i0, i1) of one batch's product into out (`[M, N]`); bp's rows are
// `ldb` apart, np columns each (whole vectors).
void rows(const float* a, int64_t K, const float* bp, int64_t ldb, int64_t N,
          int64_t np, int64_t i0, int64_t i1, float* out) {
  std::vector<float> buf(kRowsTile * np);
  for (int64_t i = i0; i < i1; i += kRowsTile) {
    int mr = int(std::min<int64_t>(kRowsTile, i1 - i));
    for (int64_t j = 0; j < np; j += kVecs * kLanes) {
      int nv = int(std::min<int64_t>(kVecs, (np - j) / kLanes));
      tile_fn(mr, nv)(a + i * K, K, bp + j, ldb, K, buf.data() + j, np);
    }
    for (int r = 0; r < mr; r++) {
      std::memcpy(out + (i + r) * N, buf.data() + r * np, N * sizeof(float));
    }
  }
}

void run(const mx::array& a, const mx::array& b, mx::array& out,
         bool transposed, int threads) {
  int64_t batch = a.shape(0), M = a.shape(1), K = a.shape(2);
  int64_t N = transposed ? b.shape(1) : b.shape(2);
  int64_t np = (N + kLanes - 1) / kLanes * kLanes;
  std::vector<float> a_rows; // where a is a view (queries are not)
  const float* ap = row_major(a, a_rows);
  const float* bq = b.data<float>();
  float* op = out.data<float>();
  const auto& bs = b.strides();
  // b's rows as they are where they already are whole vectors of columns
  // (a cache's values), else packed.
  const bool direct = !transposed && bs[2] == 1 && N % kLanes == 0;
  std::vector<float> packed_spill;
  float* packed =
      direct ? nullptr : scratch(Scratch::MatmulPacked, batch * K * np, packed_spill);
  if (!direct) {
    parallel_for(int(batch), threads, [&](int n) {
      pack(bq + n * bs[0], bs[1], bs[2], K, N, np, transposed,
           packed + n * K * np);
    });
  }
  int64_t blocks = (M + kRowsTask - 1) / kRowsTask;
  parallel_for(int(batch * blocks), threads, [&](int task) {
    int64_t n = task / blocks, i0 = task % blocks * kRowsTask;
    const float* bn = direct ? bq + n * bs[0] : packed + n * K * np;
    rows(ap + n * M * K, K, bn, direct ? bs[1] : np, N, np, i0,
         std::min(M, i0 + kRowsTask), op + n * M * N);
  });
}

} // namespace

void ExactMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [a = inputs[0], b = inputs[1], out = outputs[0], t = transpose_b_,
            threads = threads_or_all(threads_)]() mutable {
             run(a, b, out, t, threads);
           });
}

bool ExactMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const ExactMatmul&>(other);
  return transpose_b_ == o.transpose_b_ && threads_ == o.threads_;
}

mx::array exact_matmul(const mx::array& a, const mx::array& b, bool transpose_b,
                       int threads) {
  if (a.dtype() != mx::float32 || b.dtype() != mx::float32) {
    throw std::invalid_argument("moestream matmul: a and b must be float32");
  }
  if (a.ndim() != 3 || b.ndim() != 3 || a.shape(0) != b.shape(0) ||
      a.shape(2) != (transpose_b ? b.shape(2) : b.shape(1))) {
    throw std::invalid_argument(
        "moestream matmul: a [batch, M, K] and b [batch, K, N] (or [batch, N, "
        "K] transposed) expected");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = {a.shape(0), a.shape(1),
                     transpose_b ? b.shape(1) : b.shape(2)};
  return mx::array(shape, mx::float32,
                   std::make_shared<ExactMatmul>(s, transpose_b, threads),
                   {a, b}); // read through their strides at eval
}

} // namespace moestream
