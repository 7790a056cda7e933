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
constexpr int64_t kRowsTask = 64; // rows of a task

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

constexpr int64_t kBlockCols = kVecs * kLanes; // columns of one tile

// n rounded up to whole vectors.
inline int64_t whole_vectors(int64_t n) {
  return (n + kLanes - 1) / kLanes * kLanes;
}

// Where b's (k, j) lies once packed: blocks of a tile's columns, each
// `[K, kBlockCols]` (a plain `[K, np]`'s rows share an L1 set).
inline int64_t packed_at(int64_t k, int64_t j, int64_t K) {
  return j / kBlockCols * K * kBlockCols + k * kBlockCols + j % kBlockCols;
}

// One batch of b, `[K, N]` (or `[N, K]` where transposed) at row stride
// `rs` and column stride `cs` (a view of a cache reads in place), packed
// (packed_at), np columns a whole number of vectors, those past N zero.
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
          _mm512_storeu_si512(bp + packed_at(k0 + k, j0, K), r[k]);
        }
      }
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; k++) {
    for (int64_t j = 0; j < np; j++) {
      bp[packed_at(k, j, K)] =
          j >= N ? 0.0f : transposed ? b[j * rs + k * cs] : b[k * rs + j * cs];
    }
  }
}

// Row m's causal limit: with `causal` (q_len) rows a query block, row m is
// query m % causal of the last `causal` of N keys and sees keys up to it.
inline int64_t causal_limit(int64_t m, int64_t causal, int64_t N) {
  return N - causal + m % causal;
}

} // namespace

namespace matmul {

int64_t packed_floats(int64_t K, int64_t N) {
  return K * ((N + kBlockCols - 1) / kBlockCols * kBlockCols);
}

Operand prepare(const float* b, int64_t rs, int64_t cs, int64_t K, int64_t N,
                bool transposed, float* buf) {
  Operand o{b, rs, K, N, false, false};
  if (transposed || cs != 1 || N % kLanes) {
    pack(b, rs, cs, K, N, whole_vectors(N), transposed, buf);
    o = {buf, kBlockCols, K, N, true, false};
  }
  // trailing zeros of a skipped only against a finite b
  o.finite = !transposed && all_finite(b, rs, cs, K, N);
  return o;
}

// A column block of b (L1's worth) at a time, under every tile of the rows;
// written in place where N is whole vectors.
void product(const Rows& r, const Operand& b, float* out) {
  const int64_t N = b.N, np = whole_vectors(N);
  const bool in_place = np == N;
  std::vector<float> buf(in_place ? 0 : r.count * np);
  float* c = in_place ? out : buf.data();
  const int64_t ldc = in_place ? N : np;
  const int tiles = int((r.count + kRowsTile - 1) / kRowsTile);
  std::vector<int64_t> cols(tiles, np), kend(tiles, b.K);
  int64_t widest = r.causal ? 0 : np;
  for (int t = 0; t < tiles; t++) {
    int64_t i = t * kRowsTile;
    int mr = int(std::min<int64_t>(kRowsTile, r.count - i));
    if (r.causal) {
      int64_t top = 0;
      for (int q = 0; q < mr; q++) {
        top = std::max(top, causal_limit(r.first + i + q, r.causal, N));
      }
      cols[t] = std::min(np, (top + kLanes) / kLanes * kLanes);
      widest = std::max(widest, cols[t]);
    }
    if (b.finite) {
      kend[t] = 0;
      for (int q = 0; q < mr; q++) {
        kend[t] = std::max(kend[t], until_zeros(r.a + (i + q) * b.K, b.K));
      }
    }
  }
  for (int64_t j = 0; j < widest; j += kBlockCols) {
    const float* bj = b.packed ? b.b + j / kBlockCols * b.K * kBlockCols : b.b + j;
    for (int t = 0; t < tiles; t++) {
      if (j < cols[t]) {
        int64_t i = t * kRowsTile;
        int mr = int(std::min<int64_t>(kRowsTile, r.count - i));
        int nv = int(std::min<int64_t>(kVecs, (cols[t] - j) / kLanes));
        tile_fn(mr, nv)(r.a + i * b.K, b.K, bj, b.ldb, kend[t], c + i * ldc + j,
                        ldc);
      }
    }
  }
  for (int64_t i = 0; i < r.count; i++) {
    int64_t seen =
        r.causal ? std::min(N, causal_limit(r.first + i, r.causal, N) + 1) : N;
    if (!in_place) {
      std::memcpy(out + i * N, buf.data() + i * np, seen * sizeof(float));
    }
    std::fill(out + i * N + seen, out + (i + 1) * N, kMasked);
  }
}

} // namespace matmul

namespace {

void run(const mx::array& a, const mx::array& b, mx::array& out,
         bool transposed, int64_t causal, int threads) {
  int64_t batch = a.shape(0), M = a.shape(1), K = a.shape(2);
  int64_t N = transposed ? b.shape(1) : b.shape(2);
  std::vector<float> a_rows; // where a is a view (queries are not)
  const float* ap = row_major(a, a_rows);
  const float* bq = b.data<float>();
  float* op = out.data<float>();
  const auto& bs = b.strides();
  const int64_t per = matmul::packed_floats(K, N);
  std::vector<float> spill;
  float* packed = scratch(Scratch::MatmulPacked, batch * per, spill);
  std::vector<matmul::Operand> bn(batch);
  parallel_for(int(batch), threads, [&](int n) {
    bn[n] = matmul::prepare(bq + n * bs[0], bs[1], bs[2], K, N, transposed,
                            packed + n * per);
  });
  int64_t blocks = (M + kRowsTask - 1) / kRowsTask;
  parallel_for(int(batch * blocks), threads, [&](int task) {
    int64_t n = task / blocks, i0 = task % blocks * kRowsTask;
    int64_t count = std::min(M, i0 + kRowsTask) - i0;
    matmul::product({ap + (n * M + i0) * K, i0, count, causal}, bn[n],
                    op + (n * M + i0) * N);
  });
}

} // namespace

void ExactMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [a = inputs[0], b = inputs[1], out = outputs[0], t = transpose_b_,
            causal = causal_, threads = threads_or_all(threads_)]() mutable {
             run(a, b, out, t, causal, threads);
           });
}

bool ExactMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const ExactMatmul&>(other);
  return transpose_b_ == o.transpose_b_ && causal_ == o.causal_ &&
         threads_ == o.threads_;
}

mx::array exact_matmul(const mx::array& a, const mx::array& b, bool transpose_b,
                       int threads, int64_t causal) {
  if (a.dtype() != mx::float32 || b.dtype() != mx::float32) {
    throw std::invalid_argument("moestream matmul: a and b must be float32");
  }
  if (a.ndim() != 3 || b.ndim() != 3 || a.shape(0) != b.shape(0) ||
      a.shape(2) != (transpose_b ? b.shape(2) : b.shape(1))) {
    throw std::invalid_argument(
        "moestream matmul: a [batch, M, K] and b [batch, K, N] (or [batch, N, "
        "K] transposed) expected");
  }
  if (causal < 0 || (causal && (!transpose_b || a.shape(1) % causal ||
                                causal > b.shape(1)))) {
    throw std::invalid_argument(
        "moestream matmul: causal must be 0 or the query rows of q @ k.T (a's "
        "rows a multiple of it, at most the keys)");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  mx::Shape shape = {a.shape(0), a.shape(1),
                     transpose_b ? b.shape(1) : b.shape(2)};
  return mx::array(shape, mx::float32,
                   std::make_shared<ExactMatmul>(s, transpose_b, causal, threads),
                   {a, b}); // read through their strides at eval
}

} // namespace moestream
