#include "cpu_experts.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/backend/cpu/unary_ops.h"
#include "mlx/ops.h"

#include "cast.h"
#include "cpu_simd.h"
#include "expert_cache.h"

namespace moestream {

namespace {

// One output row's running sum in each lane (cpu_simd.h).
constexpr int kRows = 2 * kLanes; // of one rows_block call

// Threads that wait for work; the caller takes tasks too. A thread with
// nothing to do first waits awake for up to spin_us (set_pool_spin), then
// sleeps: a decode step runs about a hundred calls a few microseconds apart,
// and a sleeping thread (a sleeping core of a VM most) is slow to wake.
class Pool {
 public:
  void set_spin(int64_t micros) { spin_us_.store(micros); }

  // `single`: each thread takes one task at a time (tasks of uneven size,
  // the largest first), not runs of them.
  void run(int n, int threads, const std::function<void(int)>& fn,
           bool single = false) {
    int helpers = std::min(threads, n) - 1;
    if (helpers <= 0) {
      for (int i = 0; i < n; i++) {
        fn(i);
      }
      return;
    }
    std::lock_guard<std::mutex> one(run_mutex_);
    {
      std::lock_guard<std::mutex> lock(m_);
      while (int(workers_.size()) < helpers) {
        workers_.emplace_back([this] { work(); }).detach();
      }
      fn_ = &fn;
      n_ = n;
      single_ = single;
      threads_ = helpers + 1;
      next_.store(0);
      wanted_ = helpers;
      busy_ = helpers;
      generation_++;
    }
    wake_.notify_all();
    take();
    spin_until([this] { return busy_.load() == wanted_.load(); });
    std::unique_lock<std::mutex> lock(m_);
    // Helpers not yet awake (a busy machine) are not waited for.
    busy_ -= wanted_;
    wanted_ = 0;
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  // Whether ready() came true within spin_us (checked between pauses).
  template <typename Ready>
  bool spin_until(Ready ready) {
    int64_t micros = spin_us_.load(std::memory_order_relaxed);
    if (micros <= 0) {
      return ready();
    }
    auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
    while (!ready()) {
      if (std::chrono::steady_clock::now() > end) {
        return false;
      }
#if defined(__x86_64__)
      __builtin_ia32_pause();
#else
      std::this_thread::yield();
#endif
    }
    return true;
  }

  // Runs of consecutive tasks, each a share of those left (at least one):
  // a thread's rows stream from memory in order (a task's neighbours are the
  // rows after its own), and the last tasks still balance the threads.
  void take() {
    while (true) {
      int start = next_.load(std::memory_order_relaxed), run;
      do {
        if (start >= n_) {
          return;
        }
        run = single_ ? 1 : std::max(1, (n_ - start) / (2 * threads_));
      } while (!next_.compare_exchange_weak(start, start + run));
      for (int i = start; i < start + run; i++) {
        (*fn_)(i);
      }
    }
  }
  void work() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(m_);
    while (true) {
      lock.unlock();
      spin_until([&] { return generation_.load() != seen; });
      lock.lock();
      wake_.wait(lock, [&] { return generation_.load() != seen && wanted_ > 0; });
      seen = generation_.load();
      wanted_--;
      lock.unlock();
      take();
      lock.lock();
      if (--busy_ == 0) {
        done_.notify_one();
      }
    }
  }

  std::mutex run_mutex_, m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* fn_{nullptr};
  int n_{0}, threads_{1};
  bool single_{false};
  std::atomic<int> wanted_{0}, busy_{0};
  std::atomic<int> next_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> spin_us_{0};
};

Pool& pool() {
  static Pool* p = new Pool(); // never destroyed: its threads outlive exit
  return *p;
}

// One projection of one expert: row r's packed values at w + r * row_bytes;
// scales and biases stored as float32, or as bfloat16 / float16 where the
// kernel reads a record in place (ExpertMlpMapped: each value widened exactly,
// as the slot's cast would have written it). A blocked matrix (blocked
// slots, or a record converted with --layout blocked; read by the blocked
// kernels, kernels(spec, format, true)) holds its rows kBlock at a time:
// word w of row r at ((r / kBlock) * words + w) * kBlock + r % kBlock, scale
// or bias g at ((r / kBlock) * groups + g) * kBlock + r % kBlock.
struct Matrix;
using RowsFn = void (*)(const Matrix&, int64_t, const float*, float*);

struct Matrix {
  const uint8_t* w;
  const uint8_t* scales;
  const uint8_t* biases;
  int64_t rows, cols, row_bytes, groups;
  int group_size;
  ScaleFormat format{ScaleFormat::F32};
  // The fused rows of this matrix where they are not its projection's
  // (a record read in place among slots: KernelFills).
  RowsFn rows_fn{nullptr};
  // A blocked slot the fused rows write as they read (blocked words; scales
  // and biases widened to float32, or as stored where `fill_stored`: a slot
  // that keeps its record's dtype), or none: rows_blocked<bits, F, true>.
  uint32_t* fill_w{nullptr};
  uint8_t* fill_scales{nullptr};
  uint8_t* fill_biases{nullptr};
  bool fill_stored{false};
};

// Scale or bias i of a row, as float32: cast.h's widening, bit for bit.
template <ScaleFormat F>
inline float scale_at(const uint8_t* row, int64_t i) {
  if constexpr (F == ScaleFormat::F32) {
    return reinterpret_cast<const float*>(row)[i];
  } else {
    uint16_t h = reinterpret_cast<const uint16_t*>(row)[i];
    uint32_t u = F == ScaleFormat::BF16 ? uint32_t(h) << 16 : f16_to_f32(h);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

template <ScaleFormat F>
constexpr int64_t scale_size() {
  return F == ScaleFormat::F32 ? 4 : 2;
}

// Value I of a 32-value chunk in every lane, its bits not yet masked.
template <int bits, int I>
inline VU unpack(const VU* w) {
  constexpr int off = I * bits, word = off / 32, shift = off % 32;
  VU q = w[word] >> shift;
  if constexpr (shift + bits > 32) {
    q |= w[word + 1] << (32 - shift);
  }
  return q;
}

// Whether to_float<bits> is a table lookup: with AVX-512 and at most 4 bits.
template <int bits>
constexpr bool kLookup =
#if defined(__AVX512F__)
    bits <= 4;
#else
    false;
#endif

// float(q & mask) in every lane. Where kLookup, a lookup in a 16-entry table
// of those floats (vpermps reads an index's low 4 bits: the mask comes free,
// one instruction instead of an and and a convert, the same values); else a
// mask and a convert.
template <int bits>
inline VF to_float(VU q) {
  constexpr uint32_t mask = (1u << bits) - 1;
#if defined(__AVX512F__)
  if constexpr (kLookup<bits>) {
    const __m512 table = _mm512_setr_ps(
        float(0 & mask), float(1 & mask), float(2 & mask), float(3 & mask),
        float(4 & mask), float(5 & mask), float(6 & mask), float(7 & mask),
        float(8 & mask), float(9 & mask), float(10 & mask), float(11 & mask),
        float(12 & mask), float(13 & mask), float(14 & mask), float(15 & mask));
    return VF(_mm512_permutexvar_ps(__m512i(q), table));
  }
#endif
  return __builtin_convertvector(VI(q & mask), VF);
}

// scale * q + bias in every lane: MLX's multiply and add, or (`Fma`, where
// every product is exact: QuantSpec::fma) one fused multiply-add, the same
// float with one rounding fewer to compute.
template <bool Fma>
inline VF dequant(VF q, VF scale, VF bias) {
  if constexpr (Fma) {
    return fma_lanes(q, scale, bias);
  } else {
    return q * scale + bias;
  }
}

// Value I of a 32-value chunk in every lane, dequantized, times x, added.
template <int bits, int I, bool Fma = false>
inline VF step(VF acc, const VU* w, VF scale, VF bias, float x) {
  VF d = dequant<Fma>(to_float<bits>(unpack<bits, I>(w)), scale, bias);
  acc = acc + x * d;
  if constexpr (kLookup<bits>) {
    // The steps in program order: else the compiler hoists a chunk's
    // lookups ahead of the sums and spills them.
    __asm__ volatile("" : "+v"(acc));
  }
  return acc;
}


inline VF load_vf(const float* p) {
  VF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_vf(float* p, VF v) {
  std::memcpy(p, &v, sizeof v);
}

// The two vectors of sums of rows [r0, r0 + kRows), those before `rows`.
inline void store_rows(float* out, int64_t r0, int64_t rows, VF acc0, VF acc1) {
  for (int j = 0; j < kLanes; j++) {
    if (r0 + j < rows) {
      out[r0 + j] = acc0[j];
    }
    if (r0 + kLanes + j < rows) {
      out[r0 + kLanes + j] = acc1[j];
    }
  }
}

#if defined(__AVX512F__)
// Words [w0, w0 + n) (n <= 16) of sixteen rows, one 64-byte load a row (masked
// at the rows' end), turned so that ring[w & 31] holds word w of every row;
// the same line of the rows `ahead` words on (the next block) is asked for.
inline void load_words(const uint32_t* const* row, int64_t w0, int n,
                       int64_t ahead, VU* ring) {
  __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512i r[16];
  for (int j = 0; j < 16; j++) {
    r[j] = _mm512_maskz_loadu_epi32(mask, row[j] + w0);
    if (ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(row[j] + w0 + ahead),
                   _MM_HINT_T1);
    }
  }
  transpose16(r);
  for (int i = 0; i < 16; i++) {
    ring[(w0 + i) & 31] = VU(r[i]);
  }
}

// Sixteen rows' float32 scales (or biases) of groups [g0, g0 + 16), one
// 64-byte load a row (masked at the rows' end), turned: out[i] holds group
// g0 + i of every row.
inline void load_groups(const uint8_t* const* row, int64_t g0, int64_t groups,
                        VF* out) {
  int64_t n = std::min<int64_t>(16, groups - g0);
  __mmask16 mask = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  __m512i r[16];
  for (int j = 0; j < 16; j++) {
    r[j] = _mm512_maskz_loadu_epi32(
        mask, reinterpret_cast<const float*>(row[j]) + g0);
  }
  transpose16(r);
  for (int i = 0; i < 16; i++) {
    out[i] = VF(_mm512_castsi512_ps(r[i]));
  }
}

// Rows [r0, r0 + kRows) of m @ x, each lane's sum in MLX's _qmm_t order:
// sum += x[k] * (scale * q + bias), k ascending. Two vectors of sixteen rows,
// so two sums are in flight. Each row's words come in 64-byte lines, turned
// so that lane j holds row j's word: a chunk of 32 values is `bits` words,
// value i at bit i * bits (LSB first, as MLX's byte-wise unpacking reads
// it). Float32 scales and biases come the same way, sixteen groups a line.
// The next block's lines are asked for as these are read. Rows past the
// end repeat the last row and are not stored.
template <int bits, ScaleFormat F>
void rows_block(const Matrix& m, int64_t r0, const float* x, float* out) {
  constexpr int64_t size = scale_size<F>();
  const uint32_t* row[2][kLanes];
  const uint8_t* sc[2][kLanes];
  const uint8_t* bi[2][kLanes];
  for (int v = 0; v < 2; v++) {
    for (int j = 0; j < kLanes; j++) {
      int64_t r = std::min(r0 + v * kLanes + j, m.rows - 1);
      row[v][j] = reinterpret_cast<const uint32_t*>(m.w + r * m.row_bytes);
      sc[v][j] = m.scales + r * m.groups * size;
      bi[v][j] = m.biases + r * m.groups * size;
    }
  }
  const int64_t words = m.row_bytes / 4, chunks = m.cols / 32;
  const int per_group = m.group_size / 32;
  // The next block, where this matrix has one: its words as they are read,
  // its scales and biases now.
  const int64_t ahead = r0 + kRows < m.rows ? kRows * words : 0;
  if (ahead) {
    const int64_t bytes = kRows * m.groups * size;
    const int64_t at = (r0 + kRows) * m.groups * size;
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(m.scales + at + b), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(m.biases + at + b), _MM_HINT_T1);
    }
  }
  alignas(64) VU ring[2][32];
  alignas(64) VF gs[2][16], gb[2][16]; // float32 scales, biases: 16 groups
  VF acc0 = {}, acc1 = acc0, s0 = {}, s1 = {}, b0 = {}, b1 = {};
  int64_t c = 0;
  for (int64_t w0 = 0; w0 < words; w0 += 16) {
    int n = int(std::min<int64_t>(16, words - w0));
    load_words(row[0], w0, n, ahead, ring[0]);
    load_words(row[1], w0, n, ahead, ring[1]);
    for (; c < chunks && (c + 1) * bits <= w0 + n; c++) {
      if (c % per_group == 0) {
        int64_t g = c / per_group;
        if constexpr (F == ScaleFormat::F32) {
          if (g % 16 == 0) {
            for (int v = 0; v < 2; v++) {
              load_groups(sc[v], g, m.groups, gs[v]);
              load_groups(bi[v], g, m.groups, gb[v]);
            }
          }
          s0 = gs[0][g & 15], b0 = gb[0][g & 15];
          s1 = gs[1][g & 15], b1 = gb[1][g & 15];
        } else {
          for (int j = 0; j < kLanes; j++) {
            s0[j] = scale_at<F>(sc[0][j], g);
            b0[j] = scale_at<F>(bi[0][j], g);
            s1[j] = scale_at<F>(sc[1][j], g);
            b1[j] = scale_at<F>(bi[1][j], g);
          }
        }
      }
      VU w0v[bits], w1v[bits];
      for (int b = 0; b < bits; b++) {
        w0v[b] = ring[0][(c * bits + b) & 31];
        w1v[b] = ring[1][(c * bits + b) & 31];
      }
      const float* xc = x + c * 32;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((acc0 = step<bits, I>(acc0, w0v, s0, b0, xc[I]),
          acc1 = step<bits, I>(acc1, w1v, s1, b1, xc[I])),
         ...);
      }(std::make_integer_sequence<int, 32>{});
    }
  }
  store_rows(out, r0, m.rows, acc0, acc1);
}
#else
// Ask for every line of rows [r0, r0 + kRows) (the next call's): the rows
// are short, and this many at once defeat the hardware prefetcher.
template <ScaleFormat F>
inline void prefetch_block(const Matrix& m, int64_t r0) {
  int64_t r1 = std::min(r0 + kRows, m.rows);
  if (r0 >= r1) {
    return;
  }
  const uint8_t* w = m.w + r0 * m.row_bytes;
  for (int64_t at = 0; at < (r1 - r0) * m.row_bytes; at += 64) {
    __builtin_prefetch(w + at);
  }
  constexpr int64_t size = scale_size<F>();
  for (int64_t at = 0; at < (r1 - r0) * m.groups * size; at += 64) {
    __builtin_prefetch(m.scales + r0 * m.groups * size + at);
    __builtin_prefetch(m.biases + r0 * m.groups * size + at);
  }
}

// Rows [r0, r0 + kRows) of m @ x, each lane's sum in MLX's _qmm_t order:
// sum += x[k] * (scale * q + bias), k ascending. Two vectors of kLanes rows,
// so two sums are in flight. Lane j unpacks its row's words: a chunk of 32
// values is `bits` words of each row, value i at bit i * bits (LSB first, as
// MLX's byte-wise unpacking reads it). Rows past the end repeat the last row
// and are not stored.
template <int bits, ScaleFormat F>
void rows_block(const Matrix& m, int64_t r0, const float* x, float* out) {
  constexpr int n = kRows;
  constexpr int64_t size = scale_size<F>();
  const uint32_t* row[n];
  const uint8_t *sc[n], *bi[n];
  for (int j = 0; j < n; j++) {
    int64_t r = std::min(r0 + j, m.rows - 1);
    row[j] = reinterpret_cast<const uint32_t*>(m.w + r * m.row_bytes);
    sc[j] = m.scales + r * m.groups * size;
    bi[j] = m.biases + r * m.groups * size;
  }
  const int chunks = m.group_size / 32;
  prefetch_block<F>(m, r0 + n);
  VF acc0 = {}, acc1 = acc0;
  for (int64_t g = 0; g < m.groups; g++) {
    VF s0, s1, b0, b1;
    for (int j = 0; j < kLanes; j++) {
      s0[j] = scale_at<F>(sc[j], g);
      b0[j] = scale_at<F>(bi[j], g);
      s1[j] = scale_at<F>(sc[j + kLanes], g);
      b1[j] = scale_at<F>(bi[j + kLanes], g);
    }
    for (int c = 0; c < chunks; c++) {
      int64_t word = (g * chunks + c) * bits;
      VU w0[bits], w1[bits];
      for (int b = 0; b < bits; b++) {
        for (int j = 0; j < kLanes; j++) {
          w0[b][j] = row[j][word + b];
          w1[b][j] = row[j + kLanes][word + b];
        }
      }
      const float* xc = x + (g * chunks + c) * 32;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((acc0 = step<bits, I>(acc0, w0, s0, b0, xc[I]),
          acc1 = step<bits, I>(acc1, w1, s1, b1, xc[I])),
         ...);
      }(std::make_integer_sequence<int, 32>{});
    }
  }
  store_rows(out, r0, m.rows, acc0, acc1);
}

#endif

// kLanes scales or biases of a blocked matrix's block at `p` (side by side),
// as float32: cast.h's widening, bit for bit.
template <ScaleFormat F>
inline VF load_scales(const uint8_t* p) {
  if constexpr (F == ScaleFormat::F32) {
    return load_vf(reinterpret_cast<const float*>(p));
  } else if constexpr (F == ScaleFormat::BF16) {
    using VH = uint16_t __attribute__((vector_size(2 * kLanes)));
    VH h;
    std::memcpy(&h, p, sizeof h);
    VU u = __builtin_convertvector(h, VU) << 16;
    VF f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else {
    VF f;
    for (int j = 0; j < kLanes; j++) {
      f[j] = scale_at<F>(p, j);
    }
    return f;
  }
}

// `bits` words of one vector's rows in a blocked matrix, word b at p + b *
// kBlock (a whole block's words are one load where a vector is a block).
template <int bits>
inline void load_block_words(const uint32_t* p, VU* w) {
  if constexpr (kLanes == kBlock) {
    std::memcpy(w, p, bits * sizeof(VU));
  } else {
    for (int b = 0; b < bits; b++) {
      std::memcpy(&w[b], p + b * kBlock, sizeof(VU));
    }
  }
}

// load_block_words' words stored at `p` as they were loaded.
template <int bits>
inline void store_block_words(uint32_t* p, const VU* w) {
  for (int b = 0; b < bits; b++) {
    std::memcpy(p + b * kBlock, &w[b], sizeof(VU));
  }
}

// The index of element 0 of row r in a blocked matrix of `cols` elements a
// row: element c of rows [r, r + kLanes) at that + c * kBlock, side by side.
inline int64_t block_at(int64_t r, int64_t cols) {
  return (r / kBlock) * cols * kBlock + r % kBlock;
}

// rows_block on a blocked matrix (cpu_experts.h): a chunk's `bits` words of
// a vector's rows are `bits` vectors as stored, and a group's scales and
// biases one vector each: no turning. Each lane's arithmetic is
// rows_block's, in its order. Blocks are rows in order, so the next call's
// words, scales and biases follow ours: they are asked for as these are
// read. A vector past the last row reads the last rows and is not stored.
// `Fill`: every word, scale and bias read is also written, as float32, at
// its place in m's fill slot (which then holds these rows as a slot would).
template <int bits, ScaleFormat F, bool Fill = false, bool Fma = false>
void rows_blocked(const Matrix& m, int64_t r0, const float* x, float* out) {
  constexpr int64_t size = scale_size<F>();
  const int64_t words = m.row_bytes / 4, chunks = m.cols / 32;
  const int per_group = m.group_size / 32;
  const uint32_t* w[2];
  const uint8_t *sc[2], *bi[2];
  for (int v = 0; v < 2; v++) {
    int64_t r = std::min(r0 + v * kLanes, m.rows - kLanes);
    w[v] = reinterpret_cast<const uint32_t*>(m.w) + block_at(r, words);
    sc[v] = m.scales + block_at(r, m.groups) * size;
    bi[v] = m.biases + block_at(r, m.groups) * size;
  }
  uint32_t* fw[2] = {};
  uint8_t *fs[2] = {}, *fb[2] = {};
  const int64_t fill_size = m.fill_stored ? size : 4; // a slot's element
  if constexpr (Fill) {
    for (int v = 0; v < 2; v++) {
      int64_t r = std::min(r0 + v * kLanes, m.rows - kLanes);
      fw[v] = m.fill_w + block_at(r, words);
      fs[v] = m.fill_scales + block_at(r, m.groups) * fill_size;
      fb[v] = m.fill_biases + block_at(r, m.groups) * fill_size;
    }
  }
  const int64_t ahead = r0 + kRows < m.rows ? kRows * words : 0;
  if (ahead) {
    const int64_t bytes = kRows * m.groups * size;
    const int64_t at = (r0 + kRows) * m.groups * size;
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(m.scales + at + b, 0, 2);
      __builtin_prefetch(m.biases + at + b, 0, 2);
    }
  }
  // The bytes of a chunk's words of one vector's block, for the prefetch.
  constexpr int kChunkBytes = bits * kBlock * 4;
  VF acc0 = {}, acc1 = acc0, s0 = {}, s1 = {}, b0 = {}, b1 = {};
  for (int64_t c = 0; c < chunks; c++) {
    if (c % per_group == 0) {
      int64_t g = c / per_group;
      s0 = load_scales<F>(sc[0] + g * kBlock * size);
      b0 = load_scales<F>(bi[0] + g * kBlock * size);
      s1 = load_scales<F>(sc[1] + g * kBlock * size);
      b1 = load_scales<F>(bi[1] + g * kBlock * size);
      if constexpr (Fill) {
        const int64_t at = g * kBlock * fill_size;
        if (m.fill_stored) { // the stored elements as they are
          std::memcpy(fs[0] + at, sc[0] + g * kBlock * size, kLanes * size);
          std::memcpy(fb[0] + at, bi[0] + g * kBlock * size, kLanes * size);
          std::memcpy(fs[1] + at, sc[1] + g * kBlock * size, kLanes * size);
          std::memcpy(fb[1] + at, bi[1] + g * kBlock * size, kLanes * size);
        } else {
          store_vf(reinterpret_cast<float*>(fs[0] + at), s0);
          store_vf(reinterpret_cast<float*>(fb[0] + at), b0);
          store_vf(reinterpret_cast<float*>(fs[1] + at), s1);
          store_vf(reinterpret_cast<float*>(fb[1] + at), b1);
        }
      }
    }
    VU w0v[bits], w1v[bits];
    load_block_words<bits>(w[0] + c * bits * kBlock, w0v);
    load_block_words<bits>(w[1] + c * bits * kBlock, w1v);
    if constexpr (Fill) {
      store_block_words<bits>(fw[0] + c * bits * kBlock, w0v);
      store_block_words<bits>(fw[1] + c * bits * kBlock, w1v);
    }
    if (ahead) {
      const char* n0 = reinterpret_cast<const char*>(w[0] + ahead + c * bits * kBlock);
      const char* n1 = reinterpret_cast<const char*>(w[1] + ahead + c * bits * kBlock);
      for (int at = 0; at < kChunkBytes; at += 64) {
        __builtin_prefetch(n0 + at, 0, 2);
        if constexpr (kLanes == kBlock) {
          __builtin_prefetch(n1 + at, 0, 2);
        }
      }
    }
    const float* xc = x + c * 32;
    [&]<int... I>(std::integer_sequence<int, I...>) {
      ((acc0 = step<bits, I, Fma>(acc0, w0v, s0, b0, xc[I]),
        acc1 = step<bits, I, Fma>(acc1, w1v, s1, b1, xc[I])),
       ...);
    }(std::make_integer_sequence<int, 32>{});
  }
  store_rows(out, r0, m.rows, acc0, acc1);
}

template <ScaleFormat F>
RowsFn rows_fn_of(int bits) {
  switch (bits) {
    case 2: return rows_block<2, F>;
    case 3: return rows_block<3, F>;
    case 4: return rows_block<4, F>;
    case 5: return rows_block<5, F>;
    case 6: return rows_block<6, F>;
    case 8: return rows_block<8, F>;
  }
  throw std::invalid_argument("moestream kernel: bits must be 2, 3, 4, 5, 6 or 8");
}

RowsFn rows_fn(int bits, ScaleFormat format = ScaleFormat::F32) {
  switch (format) {
    case ScaleFormat::BF16: return rows_fn_of<ScaleFormat::BF16>(bits);
    case ScaleFormat::F16: return rows_fn_of<ScaleFormat::F16>(bits);
    default: return rows_fn_of<ScaleFormat::F32>(bits);
  }
}

// Rows [begin, end) of m @ x.
void matvec(const Matrix& m, RowsFn fn, int64_t begin, int64_t end,
            const float* x, float* out) {
  for (int64_t r = begin; r < end; r += kRows) {
    fn(m, r, x, out);
  }
}

// How an array holds scales or biases: float32, or (blocked slots that keep
// their records' dtype) bfloat16 or float16.
ScaleFormat scale_format(mx::Dtype d) {
  return d == mx::bfloat16  ? ScaleFormat::BF16
         : d == mx::float16 ? ScaleFormat::F16
                            : ScaleFormat::F32;
}

// Expert `e` of a stacked `[E, rows, cols]` projection (weight, scales, biases).
Matrix matrix(const mx::array& w, const mx::array& s, const mx::array& b,
              QuantSpec spec, int64_t e) {
  Matrix m;
  m.rows = w.shape(-2);
  m.row_bytes = int64_t(w.shape(-1)) * 4;
  m.cols = m.row_bytes * 8 / spec.bits;
  m.groups = s.shape(-1);
  m.group_size = spec.group_size;
  m.w = w.data<uint8_t>() + e * m.rows * m.row_bytes;
  m.scales = s.data<uint8_t>() + e * m.rows * m.groups * s.itemsize();
  m.biases = b.data<uint8_t>() + e * m.rows * m.groups * b.itemsize();
  m.format = scale_format(s.dtype());
  return m;
}

// mlx-lm's swiglu(gate, up) = silu(gate) * up, silu(g) = g * sigmoid(g),
// with MLX's own sigmoid (its exp approximation).
inline float swiglu(float gate, float up) {
  auto sig = mx::detail::Sigmoid{}(mx::simd::Simd<float, 1>(gate)).value;
  return (gate * sig) * up;
}

// h[i] = swiglu(gate[i], up[i]) for i < n: MLX's sigmoid, lanes at a time.
inline void swiglu_n(const float* gate, const float* up, float* h, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    VF g, u;
    std::memcpy(&g, gate + i, sizeof g);
    std::memcpy(&u, up + i, sizeof u);
    VI bits;
    std::memcpy(&bits, &g, sizeof bits);
    bits &= 0x7fffffff; // |g|, as std::abs
    VF a;
    std::memcpy(&a, &bits, sizeof a);
    VF y = 1.0f / (1.0f + exp_lanes(a));
    VF sig = g < 0.0f ? y : 1.0f - y;
    VF out = (g * sig) * u;
    std::memcpy(h + i, &out, sizeof out);
  }
  for (; i < n; i++) {
    h[i] = swiglu(gate[i], up[i]);
  }
}

constexpr int64_t kTaskRows = 64; // rows of one task

void check_spec(QuantSpec s, int64_t cols) {
  if (s.group_size != 32 && s.group_size != 64 && s.group_size != 128) {
    throw std::invalid_argument(
        "moestream kernel: group size must be 32, 64 or 128");
  }
  if (cols % s.group_size) {
    throw std::invalid_argument(
        "moestream kernel: input dims must be a multiple of the group size");
  }
  rows_fn(s.bits);
}

// Prefill: a panel of rows is dequantized once per k-chunk into a buffer
// (k-major, the panel's rows in lanes), then each token's sums run over it:
// a multiply and an add per weight and token, each sum still in k order.
#if defined(__AVX512F__)
constexpr int kPanelVecs = 4; // 16 sums and 4 weights of 32 registers
#else
constexpr int kPanelVecs = 2; // 8 sums and 2 weights of 16 registers
#endif
constexpr int kPanel = kPanelVecs * kLanes; // rows of one panel
constexpr int kChunk = 64;                  // k values dequantized at once
constexpr int kPrefetchChunks = 4;          // how far ahead words are asked for
#if defined(__AVX512F__)
constexpr int kTile = 6; // tokens whose sums stay in registers: 24 sums
#else
constexpr int kTile = 4;
#endif
constexpr int64_t kTokenBlock = 256;        // tokens of one task, at most
// Tokens on one matrix from which dequantizing once beats the fused rows.
constexpr int64_t kMinTokens = 3;

// w[i] (lane j) = row[j][i] for i in [0, n): each row's words read four at a
// time (a masked load past n) and turned in registers, four rows a vector.
inline void load_words(const uint32_t* const row[kLanes], int n, VU* w) {
  for (int i = 0; i < n; i += 4) {
    int left = std::min(4, n - i);
#if defined(__AVX512F__)
    __mmask8 keep = __mmask8((1u << left) - 1);
    __m512i z[4]; // z[r], 128-bit lane l: words i.. of row 4 l + r
    for (int r = 0; r < 4; r++) {
      z[r] = _mm512_castsi128_si512(_mm_maskz_loadu_epi32(keep, row[r] + i));
      z[r] = _mm512_inserti32x4(
          z[r], _mm_maskz_loadu_epi32(keep, row[4 + r] + i), 1);
      z[r] = _mm512_inserti32x4(
          z[r], _mm_maskz_loadu_epi32(keep, row[8 + r] + i), 2);
      z[r] = _mm512_inserti32x4(
          z[r], _mm_maskz_loadu_epi32(keep, row[12 + r] + i), 3);
    }
    __m512i lo01 = _mm512_unpacklo_epi32(z[0], z[1]);
    __m512i hi01 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i lo23 = _mm512_unpacklo_epi32(z[2], z[3]);
    __m512i hi23 = _mm512_unpackhi_epi32(z[2], z[3]);
    __m512i t[4] = {_mm512_unpacklo_epi64(lo01, lo23),
                    _mm512_unpackhi_epi64(lo01, lo23),
                    _mm512_unpacklo_epi64(hi01, hi23),
                    _mm512_unpackhi_epi64(hi01, hi23)};
#elif defined(__AVX2__)
    __m128i keep = _mm_cmpgt_epi32(_mm_set1_epi32(left), _mm_setr_epi32(0, 1, 2, 3));
    __m256i z[4]; // z[r], 128-bit lane l: words i.. of row 4 l + r
    for (int r = 0; r < 4; r++) {
      z[r] = _mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_maskload_epi32(
              reinterpret_cast<const int*>(row[r] + i), keep)),
          _mm_maskload_epi32(reinterpret_cast<const int*>(row[4 + r] + i), keep),
          1);
    }
    __m256i lo01 = _mm256_unpacklo_epi32(z[0], z[1]);
    __m256i hi01 = _mm256_unpackhi_epi32(z[0], z[1]);
    __m256i lo23 = _mm256_unpacklo_epi32(z[2], z[3]);
    __m256i hi23 = _mm256_unpackhi_epi32(z[2], z[3]);
    __m256i t[4] = {_mm256_unpacklo_epi64(lo01, lo23),
                    _mm256_unpackhi_epi64(lo01, lo23),
                    _mm256_unpacklo_epi64(hi01, hi23),
                    _mm256_unpackhi_epi64(hi01, hi23)};
#else
    VU t[4];
    for (int q = 0; q < left; q++) {
      for (int j = 0; j < kLanes; j++) {
        t[q][j] = row[j][i + q];
      }
    }
#endif
    for (int q = 0; q < left; q++) {
      std::memcpy(&w[i + q], &t[q], sizeof(VU));
    }
  }
}

// dq[k - k0][j] = scale * q + bias of row r0 + j at k, for k in [k0, k0 + kc)
// (rows past the end repeat the last row).
template <int bits, ScaleFormat F>
void dequant_chunk(const Matrix& m, int64_t r0, int64_t k0, int kc, float* dq) {
  constexpr int64_t size = scale_size<F>();
  for (int v = 0; v < kPanelVecs; v++) {
    const uint32_t* row[kLanes];
    const uint8_t *sc[kLanes], *bi[kLanes];
    for (int j = 0; j < kLanes; j++) {
      int64_t r = std::min(r0 + v * kLanes + j, m.rows - 1);
      row[j] = reinterpret_cast<const uint32_t*>(m.w + r * m.row_bytes) +
               k0 / 32 * bits;
      sc[j] = m.scales + r * m.groups * size;
      bi[j] = m.biases + r * m.groups * size;
    }
    // Sixty-four rows are more streams than the hardware prefetcher
    // follows: ask for the words kPrefetchChunks chunks ahead.
    for (int j = 0; j < kLanes; j++) {
      __builtin_prefetch(row[j] + kPrefetchChunks * kChunk / 32 * bits);
    }
    VU words[kChunk / 32 * bits];
    load_words(row, kc / 32 * bits, words);
    VF s = {}, b = {};
    int64_t last = -1;
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      if (int64_t g = k / m.group_size; g != last) {
        for (int j = 0; j < kLanes; j++) {
          s[j] = scale_at<F>(sc[j], g);
          b[j] = scale_at<F>(bi[j], g);
        }
        last = g;
      }
      const VU* w = words + (k - k0) / 32 * bits;
      float* out = dq + (k - k0) * kPanel + v * kLanes;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((*reinterpret_cast<VF*>(out + I * kPanel) =
              to_float<bits>(unpack<bits, I>(w)) * s +
              b),
         ...);
      }(std::make_integer_sequence<int, 32>{});
    }
  }
}

// dequant_chunk on a blocked matrix: each vector's words and a group's
// scales and biases loaded as stored. The words kPrefetchChunks chunks ahead
// are asked for.
template <int bits, ScaleFormat F, bool Fma = false>
void dequant_blocked(const Matrix& m, int64_t r0, int64_t k0, int kc,
                     float* dq) {
  constexpr int64_t size = scale_size<F>();
  constexpr int kWords = kChunk / 32 * bits; // of one chunk, per row
  const int64_t words = m.row_bytes / 4;
  for (int v = 0; v < kPanelVecs; v++) {
    int64_t r = std::min(r0 + v * kLanes, m.rows - kLanes);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(m.w) +
                        block_at(r, words) + k0 / 32 * bits * kBlock;
    const uint8_t* sc = m.scales + block_at(r, m.groups) * size;
    const uint8_t* bi = m.biases + block_at(r, m.groups) * size;
    if (kLanes == kBlock || v % 2 == 0) { // a block's lines, once
      const char* ahead =
          reinterpret_cast<const char*>(w + kPrefetchChunks * kWords * kBlock);
      for (int at = 0; at < kWords * kBlock * 4; at += 64) {
        __builtin_prefetch(ahead + at);
      }
    }
    VF s = {}, b = {};
    int64_t last_group = -1;
    for (int64_t k = k0; k < k0 + kc; k += 32) {
      if (int64_t g = k / m.group_size; g != last_group) {
        s = load_scales<F>(sc + g * kBlock * size);
        b = load_scales<F>(bi + g * kBlock * size);
        last_group = g;
      }
      VU wv[bits];
      load_block_words<bits>(w + (k - k0) / 32 * bits * kBlock, wv);
      float* out = dq + (k - k0) * kPanel + v * kLanes;
      [&]<int... I>(std::integer_sequence<int, I...>) {
        ((*reinterpret_cast<VF*>(out + I * kPanel) =
              dequant<Fma>(to_float<bits>(unpack<bits, I>(wv)), s, b)),
         ...);
      }(std::make_integer_sequence<int, 32>{});
    }
  }
}

// acc[t] (kPanel sums of token t) += x_t[k0 + k] * dq[k] for k in [0, kc), in
// k order: TT tokens times kPanelVecs vectors of sums in registers.
template <int TT>
void panel_tile(const float* dq, int kc, const float* const* xs, int64_t k0,
                float* acc) {
  VF a[TT][kPanelVecs];
  for (int t = 0; t < TT; t++) {
    for (int v = 0; v < kPanelVecs; v++) {
      a[t][v] = load_vf(acc + t * kPanel + v * kLanes);
    }
  }
  const float* x[TT];
  for (int t = 0; t < TT; t++) {
    x[t] = xs[t] + k0;
  }
  for (int k = 0; k < kc; k++) {
    const VF* w = reinterpret_cast<const VF*>(dq + k * kPanel);
    for (int t = 0; t < TT; t++) {
      float xt = x[t][k];
      for (int v = 0; v < kPanelVecs; v++) {
        a[t][v] = a[t][v] + xt * w[v];
      }
    }
  }
  for (int t = 0; t < TT; t++) {
    for (int v = 0; v < kPanelVecs; v++) {
      store_vf(acc + t * kPanel + v * kLanes, a[t][v]);
    }
  }
}

// acc[t][j] = row r0 + j of m @ x_t for n tokens (acc zeroed: n * kPanel);
// `Blocked`: m is a blocked matrix; `Fma`: dequantized as step's.
template <int bits, ScaleFormat F, bool Blocked = false, bool Fma = false>
void panel_block(const Matrix& m, int64_t r0, int n, const float* const* xs,
                 float* acc) {
  alignas(64) float dq[kChunk * kPanel];
  for (int64_t k0 = 0; k0 < m.cols; k0 += kChunk) {
    int kc = int(std::min<int64_t>(kChunk, m.cols - k0));
    if constexpr (Blocked) {
      dequant_blocked<bits, F, Fma>(m, r0, k0, kc, dq);
    } else {
      dequant_chunk<bits, F>(m, r0, k0, kc, dq);
    }
    int t = 0;
    for (; t + kTile <= n; t += kTile) {
      panel_tile<kTile>(dq, kc, xs + t, k0, acc + t * kPanel);
    }
    switch (n - t) {
      case 5: panel_tile<5>(dq, kc, xs + t, k0, acc + t * kPanel); break;
      case 4: panel_tile<4>(dq, kc, xs + t, k0, acc + t * kPanel); break;
      case 3: panel_tile<3>(dq, kc, xs + t, k0, acc + t * kPanel); break;
      case 2: panel_tile<2>(dq, kc, xs + t, k0, acc + t * kPanel); break;
      case 1: panel_tile<1>(dq, kc, xs + t, k0, acc + t * kPanel); break;
    }
  }
}

using PanelFn = void (*)(const Matrix&, int64_t, int, const float* const*,
                         float*);

template <ScaleFormat F>
PanelFn panel_fn_of(int bits) {
  switch (bits) {
    case 2: return panel_block<2, F>;
    case 3: return panel_block<3, F>;
    case 4: return panel_block<4, F>;
    case 5: return panel_block<5, F>;
    case 6: return panel_block<6, F>;
    case 8: return panel_block<8, F>;
  }
  throw std::invalid_argument("moestream kernel: bits must be 2, 3, 4, 5, 6 or 8");
}

PanelFn panel_fn(int bits, ScaleFormat format = ScaleFormat::F32) {
  switch (format) {
    case ScaleFormat::BF16: return panel_fn_of<ScaleFormat::BF16>(bits);
    case ScaleFormat::F16: return panel_fn_of<ScaleFormat::F16>(bits);
    default: return panel_fn_of<ScaleFormat::F32>(bits);
  }
}

// One projection's kernels: the fused rows (a token or two) and the panel;
// a blocked matrix's also the rows that write a fill slot as they read
// (rows_blocked<bits, F, true>; KernelFills).
struct Kernels {
  RowsFn rows;
  PanelFn panel;
  RowsFn fill{nullptr};
};

template <int bits, ScaleFormat F, bool Fma>
Kernels blocked_kernels() {
  return {rows_blocked<bits, F, false, Fma>, panel_block<bits, F, true, Fma>,
          rows_blocked<bits, F, true, Fma>};
}

template <ScaleFormat F, bool Fma>
Kernels blocked_kernels_of(int bits) {
  switch (bits) {
    case 2: return blocked_kernels<2, F, Fma>();
    case 3: return blocked_kernels<3, F, Fma>();
    case 4: return blocked_kernels<4, F, Fma>();
    case 5: return blocked_kernels<5, F, Fma>();
    case 6: return blocked_kernels<6, F, Fma>();
    case 8: return blocked_kernels<8, F, Fma>();
  }
  throw std::invalid_argument("moestream kernel: bits must be 2, 3, 4, 5, 6 or 8");
}

template <bool Fma>
Kernels blocked_kernels_in(int bits, ScaleFormat format) {
  switch (format) {
    case ScaleFormat::BF16: return blocked_kernels_of<ScaleFormat::BF16, Fma>(bits);
    case ScaleFormat::F16: return blocked_kernels_of<ScaleFormat::F16, Fma>(bits);
    default: return blocked_kernels_of<ScaleFormat::F32, Fma>(bits);
  }
}

// The kernels of a row-major matrix, or of a blocked one (dequantizing with
// one fused multiply-add where `spec` allows it and the CPU has it).
Kernels kernels(QuantSpec spec, ScaleFormat format = ScaleFormat::F32,
                bool blocked = false) {
  if (!blocked) {
    return {rows_fn(spec.bits, format), panel_fn(spec.bits, format)};
  }
  return spec.fma && kVectorFma ? blocked_kernels_in<true>(spec.bits, format)
                                : blocked_kernels_in<false>(spec.bits, format);
}

} // namespace

int kernel_lanes() {
  return kLanes;
}

int kernel_block() {
  return kBlock;
}

bool kernel_fma() {
  return kVectorFma;
}

// Rows [r0, r0 + kBlock) between row-major (`rows`, row r at + r * cols)
// and blocked (`blk`, element c at + c * kBlock): `to_blocked` says which way.
static void turn_block(const uint32_t* src, int64_t cols, uint32_t* dst,
                       bool to_blocked) {
  int64_t c0 = 0;
#if defined(__AVX512F__)
  static_assert(kBlock == 16);
  for (; c0 + 16 <= cols; c0 += 16) { // sixteen rows' 16 words, turned
    __m512i r[16];
    for (int j = 0; j < 16; j++) {
      const uint32_t* at = to_blocked ? src + j * cols + c0 : src + (c0 + j) * 16;
      r[j] = _mm512_loadu_si512(at);
    }
    transpose16(r);
    for (int i = 0; i < 16; i++) {
      uint32_t* at = to_blocked ? dst + (c0 + i) * 16 : dst + i * cols + c0;
      _mm512_storeu_si512(at, r[i]);
    }
  }
#endif
  for (; c0 < cols; c0++) {
    for (int j = 0; j < kBlock; j++) {
      if (to_blocked) {
        dst[c0 * kBlock + j] = src[j * cols + c0];
      } else {
        dst[j * cols + c0] = src[c0 * kBlock + j];
      }
    }
  }
}

void block_rows(const uint8_t* src, int64_t rows, int64_t cols,
                uint32_t* dst) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    turn_block(s + r0 * cols, cols, dst + r0 * cols, true);
  }
}

void unblock_rows(const uint8_t* src, int64_t rows, int64_t cols,
                  uint32_t* dst) {
  const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    turn_block(s + r0 * cols, cols, dst + r0 * cols, false);
  }
}

void parallel_for(int n, int threads, const std::function<void(int)>& fn) {
  pool().run(n, threads, fn);
}

void parallel_each(int n, int threads, const std::function<void(int)>& fn) {
  pool().run(n, threads, fn, true);
}

void set_pool_spin(int64_t micros) {
  pool().set_spin(micros);
}

int threads_or_all(int threads) {
  if (threads > 0) {
    return threads;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

// The routed experts of `pairs` (token, k) pairs: gate and up, SwiGLU, down,
// each pair's output rows split over threads. mat(p, pair) is projection p
// (gate, up, down) of the pair's expert, on its own fused rows where it
// names them (Matrix::rows_fn), else on fn[p]'s.
// `which` (when given) names the pairs to compute, `pairs` of them; a pair's
// arithmetic is the same whichever others run beside it.
using MatFn = std::function<Matrix(int, int64_t)>;

// The fused rows of `m`: its own where it names them, else its projection's.
static RowsFn rows_of(const Matrix& m, const Kernels& fn) {
  return m.rows_fn ? m.rows_fn : fn.rows;
}

static void run_pairs(const float* x, int64_t pairs, int64_t k, int64_t d_in,
                      int64_t hidden, int64_t d_out, const MatFn& mat,
                      const Kernels (&fn)[3], float* y, int threads,
                      const int64_t* which = nullptr) {
  if (pairs == 0) {
    return;
  }
  std::vector<float> h_spill, g_spill;
  float* h = scratch(Scratch::PairsUp, pairs * hidden, h_spill);
  float* g = scratch(Scratch::PairsGate, pairs * hidden, g_spill);
  auto pair_at = [&](int64_t i) { return which ? which[i] : i; };
  int64_t hb = (hidden + kTaskRows - 1) / kTaskRows;
  parallel_for(int(pairs * hb), threads, [&](int task) {
    int64_t i = task / hb, r0 = task % hb * kTaskRows, pair = pair_at(i);
    int64_t r1 = std::min(hidden, r0 + kTaskRows);
    const float* xt = x + pair / k * d_in;
    float* hp = h + i * hidden;
    float* gp = g + i * hidden;
    Matrix gate = mat(0, pair), up = mat(1, pair);
    matvec(gate, rows_of(gate, fn[0]), r0, r1, xt, gp);
    matvec(up, rows_of(up, fn[1]), r0, r1, xt, hp);
    swiglu_n(gp + r0, hp + r0, hp + r0, r1 - r0);
  });
  int64_t db = (d_out + kTaskRows - 1) / kTaskRows;
  parallel_for(int(pairs * db), threads, [&](int task) {
    int64_t i = task / db, r0 = task % db * kTaskRows, pair = pair_at(i);
    int64_t r1 = std::min(d_out, r0 + kTaskRows);
    Matrix down = mat(2, pair);
    matvec(down, rows_of(down, fn[2]), r0, r1, h + i * hidden, y + pair * d_out);
  });
}

// Pairs grouped by their expert: a group of kMinTokens or more runs on
// panels, the others (decode's) on fused rows.
struct Groups {
  std::vector<int64_t> singles; // pairs on fused rows
  std::vector<int64_t> order;   // the grouped pairs, group after group
  std::vector<int64_t> start;   // group g: order[start[g], start[g + 1])
};

static Groups group_pairs(const uint32_t* key, uint32_t keys, int64_t pairs,
                          const int64_t* which) {
  std::vector<std::vector<int64_t>> of(keys);
  for (int64_t i = 0; i < pairs; i++) {
    int64_t p = which ? which[i] : i;
    of[key[p]].push_back(p);
  }
  Groups gr;
  gr.start.push_back(0);
  for (auto& ps : of) {
    auto& to = int64_t(ps.size()) >= kMinTokens ? gr.order : gr.singles;
    to.insert(to.end(), ps.begin(), ps.end());
    if (int64_t(ps.size()) >= kMinTokens) {
      gr.start.push_back(int64_t(gr.order.size()));
    }
  }
  return gr;
}

// A panel task: rows [r0, r0 + kPanel) for tokens [t0, t0 + n) of group g.
struct PanelTask {
  int64_t group, t0, n, r0;
};

static std::vector<PanelTask> panel_tasks(const Groups& gr, int64_t rows) {
  std::vector<PanelTask> tasks;
  for (size_t g = 0; g + 1 < gr.start.size(); g++) {
    int64_t size = gr.start[g + 1] - gr.start[g];
    for (int64_t t0 = 0; t0 < size; t0 += kTokenBlock) {
      for (int64_t r0 = 0; r0 < rows; r0 += kPanel) {
        tasks.push_back({int64_t(g), t0, std::min(kTokenBlock, size - t0), r0});
      }
    }
  }
  return tasks;
}

// The grouped pairs of `gr` on panels: gate and up, SwiGLU, down.
static void run_groups(const float* x, const Groups& gr, int64_t k,
                       int64_t d_in, int64_t hidden, int64_t d_out,
                       const MatFn& mat, const Kernels (&fn)[3], float* y,
                       int threads) {
  if (gr.order.empty()) {
    return;
  }
  std::vector<float> spill;
  float* h = scratch(Scratch::PanelsHidden, gr.order.size() * hidden, spill);
  auto up = panel_tasks(gr, hidden);
  parallel_for(int(up.size()), threads, [&](int task) {
    const PanelTask& t = up[task];
    int64_t at = gr.start[t.group] + t.t0;
    const int64_t* ps = gr.order.data() + at;
    std::vector<const float*> xs(t.n);
    for (int64_t i = 0; i < t.n; i++) {
      xs[i] = x + ps[i] / k * d_in;
    }
    std::vector<float> ag(t.n * kPanel), au(t.n * kPanel);
    fn[0].panel(mat(0, ps[0]), t.r0, int(t.n), xs.data(), ag.data());
    fn[1].panel(mat(1, ps[0]), t.r0, int(t.n), xs.data(), au.data());
    int64_t rows = std::min<int64_t>(kPanel, hidden - t.r0);
    for (int64_t i = 0; i < t.n; i++) {
      float* hp = h + (at + i) * hidden + t.r0;
      swiglu_n(ag.data() + i * kPanel, au.data() + i * kPanel, hp, rows);
    }
  });
  auto down = panel_tasks(gr, d_out);
  parallel_for(int(down.size()), threads, [&](int task) {
    const PanelTask& t = down[task];
    int64_t at = gr.start[t.group] + t.t0;
    const int64_t* ps = gr.order.data() + at;
    std::vector<const float*> xs(t.n);
    for (int64_t i = 0; i < t.n; i++) {
      xs[i] = h + (at + i) * hidden;
    }
    std::vector<float> acc(t.n * kPanel);
    fn[2].panel(mat(2, ps[0]), t.r0, int(t.n), xs.data(), acc.data());
    int64_t rows = std::min<int64_t>(kPanel, d_out - t.r0);
    for (int64_t i = 0; i < t.n; i++) {
      std::memcpy(y + ps[i] * d_out + t.r0, acc.data() + i * kPanel,
                  rows * sizeof(float));
    }
  });
}

// The pairs of `which` (or all `pairs`), key[pair] their slot or expert id
// (< keys): experts with many tokens on panels, the rest on fused rows.
static void run_calls(const float* x, const uint32_t* key, uint32_t keys,
                      int64_t pairs, int64_t k, int64_t d_in, int64_t hidden,
                      int64_t d_out, const MatFn& mat, const Kernels (&fn)[3],
                      float* y, int threads, const int64_t* which = nullptr) {
  if (pairs < kMinTokens) {
    run_pairs(x, pairs, k, d_in, hidden, d_out, mat, fn, y, threads, which);
    return;
  }
  Groups gr = group_pairs(key, keys, pairs, which);
  run_pairs(x, int64_t(gr.singles.size()), k, d_in, hidden, d_out, mat, fn, y,
            threads, gr.singles.data());
  run_groups(x, gr, k, d_in, hidden, d_out, mat, fn, y, threads);
}

// The scale format a segment's record stores: its slot's (`slot`, no cast),
// or the one its cast widens to float32 slots.
static bool record_format(Cast cast, ScaleFormat slot, ScaleFormat& format) {
  switch (cast) {
    case Cast::None: format = slot; return true;
    case Cast::Bf16ToF32: format = ScaleFormat::BF16; return true;
    case Cast::F16ToF32: format = ScaleFormat::F16; return true;
    default: return false;
  }
}

// The slots of one ExpertMlp call that wait for their records
// (ExpertCache::fill_in_kernel). A slot's pairs are computed from its mapped
// record; where the slot and the record are both blocked and the slot's
// pairs run on fused rows, its first pair writes the slot as it reads the
// record (rows_blocked<bits, F, true>), else the slot is filled first and
// read as any other.
class KernelFills {
 public:
  explicit KernelFills(ExpertCache* cache) : cache_(cache) {}

  // Take the fills of the call's slots (`pairs` of them at `slot`, of
  // `slots`) from the cache, if any: nothing to do where none is pending
  // (every hit); the kernel computes from `in` (ExpertMlp's inputs).
  void take(const std::vector<mx::array>& in,
            const std::vector<QuantSpec>& specs, const uint32_t* slot,
            int64_t pairs, uint32_t slots) {
    if (!cache_ || !cache_->pending_fills().pending()) {
      return;
    }
    ExpertCache* cache = cache_;
    record_.assign(slots, nullptr);
    expert_.assign(slots, -1);
    copier_.assign(slots, -1);
    std::vector<int64_t> uses(slots, 0);
    for (int64_t p = 0; p < pairs; p++) {
      uint32_t s = slot[p];
      if (uses[s]++ == 0) {
        record_[s] = cache->pending_fills().take(int(s), expert_[s]);
        if (record_[s]) {
          taken_.push_back(int(s));
          copier_[s] = p;
        }
      }
    }
    if (taken_.empty()) {
      return;
    }
    try {
      bool fused = plan_projections(in, specs);
      for (int s : taken_) {
        if (!fused || uses[s] >= kMinTokens) { // panels read slots: fill first
          cache->memory.fill_host(record_[s], s);
          record_[s] = nullptr;
        }
      }
    } catch (...) {
      drop();
      throw;
    }
  }

  // Projection p of `pair` (on slot s): the slot's matrix `m`, or the
  // record's where the slot waits for it.
  Matrix at(int p, int64_t pair, uint32_t s, Matrix m) const {
    const uint8_t* r = record_[s];
    if (!r) {
      return m;
    }
    const Projection& q = proj_[p];
    if (copier_[s] == pair) {
      m.fill_w = reinterpret_cast<uint32_t*>(const_cast<uint8_t*>(m.w));
      m.fill_scales = const_cast<uint8_t*>(m.scales);
      m.fill_biases = const_cast<uint8_t*>(m.biases);
      m.fill_stored = m.format != ScaleFormat::F32; // the slot keeps the record's
      m.rows_fn = q.fill;
    } else {
      m.rows_fn = q.rows;
    }
    m.w = r + q.weight;
    m.scales = r + q.scales;
    m.biases = r + q.biases;
    m.format = q.format;
    return m;
  }

  // The call failed: a slot the kernel may have half written leaves the table.
  void drop() {
    for (int s : taken_) {
      cache_->drop(expert_[s]);
    }
    done();
  }

  // The call is over: the records read leave the process's page tables.
  void done() {
    for (int s : taken_) {
      cache_->filled(expert_[s]);
    }
  }

  bool any() const {
    return !taken_.empty();
  }

 private:
  struct Projection {
    int64_t weight, scales, biases;
    ScaleFormat format;
    RowsFn rows, fill;
  };

  // Each projection's segments in the record, found by the slot arrays the
  // kernel reads: true where every one is blocked in its record and slot.
  bool plan_projections(const std::vector<mx::array>& in,
                        const std::vector<QuantSpec>& specs) {
    const auto& memory = cache_->memory;
    const Segment* seg[9];
    for (int i = 0; i < 9; i++) {
      seg[i] = nullptr;
      for (size_t j = 0; j < memory.slots.size(); j++) {
        if (memory.slots[j].data<uint8_t>() == in[2 + i].data<uint8_t>()) {
          seg[i] = &memory.segments[j];
        }
      }
      if (!seg[i] || !seg[i]->slot_blocked || !seg[i]->record_blocked) {
        return false;
      }
    }
    for (int p = 0; p < 3; p++) {
      const Segment &w = *seg[3 * p], &sc = *seg[3 * p + 1], &bi = *seg[3 * p + 2];
      ScaleFormat f, fb, slot = scale_format(in[3 + 3 * p].dtype());
      if (w.cast != Cast::None || !record_format(sc.cast, slot, f) ||
          !record_format(bi.cast, slot, fb) || f != fb) {
        return false;
      }
      Kernels k = kernels(specs[p], f, true);
      proj_[p] = {w.offset, sc.offset, bi.offset, f, k.rows, k.fill};
    }
    return true;
  }

  ExpertCache* cache_;
  std::vector<const uint8_t*> record_; // per slot: its mapped record, or null
  std::vector<int> expert_;
  std::vector<int64_t> copier_; // per slot: the pair that writes it
  std::vector<int> taken_;
  Projection proj_[3] = {};
};

static void expert_mlp_run(const std::vector<mx::array>& in, mx::array& out,
                           const std::vector<QuantSpec>& specs, int threads,
                           bool blocked, ExpertCache* cache) {
  const auto& x = in[0];
  const auto& inds = in[1];
  int64_t pairs = inds.size(), k = inds.shape(-1), d_in = x.shape(-1);
  int64_t hidden = in[2].shape(-2), d_out = in[8].shape(-2);
  const uint32_t* slot = inds.data<uint32_t>();
  uint32_t slots = uint32_t(in[2].shape(0));
  // Ids from a fetch that failed upstream may be anything: never read past
  // the slots.
  for (int64_t p = 0; p < pairs; p++) {
    if (slot[p] >= slots) {
      throw std::out_of_range("moestream kernel: a slot id past the slots");
    }
  }
  Kernels fn[3];
  for (int p = 0; p < 3; p++) { // slots hold float32, or blocked their records'
    fn[p] = kernels(specs[p], scale_format(in[3 + 3 * p].dtype()), blocked);
  }
  std::vector<float> xt;
  KernelFills fills(cache);
  fills.take(in, specs, slot, pairs, slots);
  auto mat = [&](int p, int64_t pair) {
    Matrix m = matrix(in[2 + 3 * p], in[3 + 3 * p], in[4 + 3 * p], specs[p],
                      slot[pair]);
    return fills.any() ? fills.at(p, pair, slot[pair], m) : m;
  };
  try {
    run_calls(row_major(x, xt), slot, slots, pairs, k, d_in, hidden, d_out,
              mat, fn, out.data<float>(), threads);
  } catch (...) {
    fills.drop();
    throw;
  }
  fills.done();
}

// Projection `q` of the expert whose record is at `record`.
static Matrix record_matrix(const MappedProjection& q, const uint8_t* record) {
  Matrix m;
  m.rows = q.rows;
  m.row_bytes = q.row_bytes;
  m.cols = q.row_bytes * 8 / q.spec.bits;
  m.groups = q.groups;
  m.group_size = q.spec.group_size;
  m.w = record + q.weight;
  m.scales = record + q.scales;
  m.biases = record + q.biases;
  m.format = q.format;
  return m;
}

// The kernels of gate, up and down as their records store them.
static void record_kernels(const std::vector<MappedProjection>& proj,
                           Kernels (&fn)[3]) {
  for (int p = 0; p < 3; p++) {
    fn[p] = kernels(proj[p].spec, proj[p].format, proj[p].blocked);
  }
}

// The expert ids of a call, checked against the layer's.
static const uint32_t* expert_ids(const mx::array& ids, int experts) {
  const uint32_t* expert = ids.data<uint32_t>();
  for (int64_t p = 0; p < int64_t(ids.size()); p++) {
    if (expert[p] >= uint32_t(experts)) {
      throw std::out_of_range("moestream kernel: an expert id past the layer's");
    }
  }
  return expert;
}

// One call of ExpertMlp on records (a mapped cache's, or a CPU slot
// cache's in place): its activations, routing and output, the records'
// projections and kernels, its threads and cache.
struct RecordCall {
  const float* x;
  const uint32_t* expert; // per pair
  uint32_t experts;
  int64_t pairs, k, d_in, hidden, d_out;
  const std::vector<MappedProjection>& proj;
  const Kernels (&fn)[3];
  float* y;
  int threads;
  ExpertCache& cache;

  // The pairs of `which` (n of them; all where null) on `threads`.
  void run(const MatFn& mat, const Kernels (&kernels)[3], int64_t n,
           int on_threads, const int64_t* which = nullptr) const {
    run_calls(x, expert, experts, n, k, d_in, hidden, d_out, mat, kernels, y,
              on_threads, which);
  }
};

// An in-place call's expert whose record a mapped layer's window keeps
// mapped (MappedWindow): read where it is, left mapped.
constexpr int kInWindow = -2;

// The slots of an in-place call's experts that a slot holds: each
// projection's weight, scales and biases among the slot arrays (one a record
// segment, found by its offset), and the kernels of the slots' layout.
struct SlotSource {
  const mx::array* part[3][3]; // projection, then weight, scales, biases
  Kernels fn[3];
};

static SlotSource slot_source(const SlotArrays& memory,
                              const std::vector<MappedProjection>& proj) {
  if (memory.on_gpu) {
    throw std::logic_error("in-place call: its slots are on a GPU");
  }
  SlotSource src;
  for (int p = 0; p < 3; p++) {
    const int64_t at[3] = {proj[p].weight, proj[p].scales, proj[p].biases};
    bool blocked = false;
    for (int j = 0; j < 3; j++) {
      src.part[p][j] = nullptr;
      for (size_t i = 0; i < memory.segments.size() && i < memory.slots.size(); i++) {
        if (memory.segments[i].offset == at[j]) {
          src.part[p][j] = &memory.slots[i];
          blocked = blocked || (j == 0 && memory.segments[i].slot_blocked);
        }
      }
      if (!src.part[p][j]) {
        throw std::logic_error("in-place call: the slots lack a record segment");
      }
    }
    src.fn[p] = kernels(proj[p].spec, scale_format(src.part[p][1]->dtype()), blocked);
  }
  return src;
}

// An in-place call's experts (a CPU slot cache's prefill past its slots, or
// a mapped call wider than its window), each on one thread from start to
// end: its record mapped in (a mapped blob's checked there the first time;
// its slot, where one holds it), its pairs' gate, up, SwiGLU and down, its
// record let go. No thread waits for another between experts, and no more
// records are mapped at once than threads run. A record that fails to map
// is mapped again afterwards on this thread by the cache (map_in_place),
// which says what failed.
static void run_in_place(const RecordCall& c,
                         const std::vector<std::pair<int, int>>& routed_in) {
  const uint32_t* expert = c.expert;
  ExpertCache& cache = c.cache;
  const bool mapped = cache.mapped(); // a mapped blob's window, not slots
  std::vector<std::vector<int64_t>> of(c.experts);
  for (int64_t p = 0; p < c.pairs; p++) {
    of[expert[p]].push_back(p);
  }
  // The experts with the most pairs first, each thread taking the next one
  // when done (parallel_each): the last a thread takes is short, so neither
  // waits long for the other at the call's end (the pool's runs of
  // consecutive tasks would give one thread many large experts at once).
  std::vector<std::pair<int, int>> routed(routed_in);
  std::stable_sort(routed.begin(), routed.end(), [&](auto a, auto b) {
    return of[a.first].size() > of[b.first].size();
  });
  std::vector<const uint8_t*> at(c.experts, nullptr);
  auto mat = [&](int p, int64_t pair) {
    return record_matrix(c.proj[p], at[expert[pair]]);
  };
  auto one = [&](int e) {
    c.run(mat, c.fn, int64_t(of[e].size()), 1, of[e].data());
  };
  const SlotSource src =
      mapped ? SlotSource{} : slot_source(cache.memory, c.proj);
  auto from_slot = [&](int e, int slot) {
    auto in_slot = [&](int p, int64_t) {
      auto& part = src.part[p];
      return matrix(*part[0], *part[1], *part[2], c.proj[p].spec, slot);
    };
    c.run(in_slot, src.fn, int64_t(of[e].size()), 1, of[e].data());
  };
  const MappedBlob& view = cache.in_place_view();
  std::vector<char> failed(routed.size(), 0);
  // A record let go takes what its faults mapped beside it, but the window's
  // records and those other threads compute on (MappedBlob::unmap_span).
  std::vector<std::atomic<char>> in_use(c.experts); // zeros (C++20)
  auto keep = [&](int r) {
    return (mapped && cache.window.holds(r)) || in_use[r].load() != 0;
  };
  auto expert_at = [&](int i) {
    auto [e, slot] = routed[i];
    if (slot >= 0) {
      from_slot(e, slot);
      return;
    }
    if (slot == kInWindow) {
      at[e] = view.record(e);
      one(e);
      return;
    }
    in_use[e].store(1);
    if (mapped ? !map_here(cache.reader(), e) : !view.map_in(e)) {
      in_use[e].store(0);
      failed[i] = 1;
      return;
    }
    at[e] = view.record(e);
    one(e);
    in_use[e].store(0);
    view.unmap_span(e, keep);
  };
  parallel_each(int(routed.size()), c.threads, expert_at);
  for (size_t i = 0; i < routed.size(); i++) {
    if (failed[i]) {
      int e = routed[i].first;
      try {
        at[e] = cache.map_in_place(e);
        one(e);
      } catch (...) {
        cache.release_in_place();
        throw;
      }
      cache.release_in_place();
    }
  }
}

// A mapped cache's call: its pairs whose records are here first, while the
// rest are read (MappedReads), then those.
static void run_mapped(const RecordCall& c) {
  auto mat = [&](int p, int64_t pair) {
    const uint8_t* record = c.cache.mapped_record(int(c.expert[pair]));
    return record_matrix(c.proj[p], record);
  };
  auto pending = c.cache.take_pending();
  if (!pending) {
    c.run(mat, c.fn, c.pairs, c.threads);
    return;
  }
  std::vector<int64_t> ready, later;
  for (int64_t p = 0; p < c.pairs; p++) {
    (pending->in_flight[c.expert[p]] ? later : ready).push_back(p);
  }
  c.run(mat, c.fn, int64_t(ready.size()), c.threads, ready.data());
  c.cache.finish(*pending);
  c.run(mat, c.fn, int64_t(later.size()), c.threads, later.data());
}

// A mapped cache's call under a memory budget (MappedWindow): one of no
// more experts than the window runs as any mapped call; a larger one (a
// prefill) reads the window's records where they are and maps in, checks
// and computes each other record on one thread, letting it go after
// (run_in_place; its fetch left those unread). Then the window takes
// the call's experts, the last tokens' first, and the records it no longer
// holds leave the page tables, with what faults on its new records mapped
// beside them.
static void run_windowed(const RecordCall& c) {
  ExpertCache& cache = c.cache;
  MappedWindow& window = cache.window;
  std::vector<char> seen(c.experts, 0), held(c.experts, 0), was(c.experts, 0);
  std::vector<int> unique; // the most recently routed first: the last token's
  for (int64_t p = c.pairs - 1; p >= 0; p--) {
    int e = int(c.expert[p]);
    if (!seen[e]) {
      seen[e] = 1;
      held[e] = window.holds(e);
      was[e] = window.mapped(e);
      unique.push_back(e);
    }
  }
  const bool narrow = int(unique.size()) <= window.capacity();
  if (narrow) {
    run_mapped(c);
  } else {
    if (auto pending = cache.take_pending()) {
      cache.finish(*pending);
    }
    std::vector<std::pair<int, int>> routed;
    for (int e : unique) {
      routed.push_back({e, held[e] ? kInWindow : -1});
    }
    run_in_place(c, routed);
  }
  window.used(unique);
  const MappedBlob& view = *cache.reader().mapped();
  auto holds = [&](int r) { return window.holds(r); };
  for (int e : window.over()) {
    view.unmap_span(e, holds);
  }
  for (int e : unique) { // what faults on the records it mapped mapped beside
    if (!window.holds(e)) {
      continue;
    }
    bool now = narrow || held[e]; // (a wide call lets the others go)
    if (now && !was[e]) {
      view.unmap_span(e, holds);
    }
    window.set_mapped(e, now);
  }
}

// ExpertMlp on records read in place: a mapped cache's (the pairs whose
// records its fetch left being read run last, once those reads end), or
// (`in_place`, ExpertMlpInPlace) a CPU slot cache's, for a prefill with more
// experts than slots: no record copied into a slot, the slots as they are.
static void expert_mlp_records_run(const std::vector<mx::array>& in,
                                   mx::array& out, ExpertCache& cache,
                                   const std::vector<MappedProjection>& proj,
                                   int threads, bool in_place, int64_t call) {
  const auto& x = in[0];
  const auto& ids = in[1];
  int64_t pairs = ids.size(), k = ids.shape(-1), d_in = x.shape(-1);
  const uint32_t* expert = expert_ids(ids, cache.num_experts);
  uint32_t experts = uint32_t(cache.num_experts);
  Kernels fn[3];
  record_kernels(proj, fn);
  std::vector<float> xt;
  const float* xp = row_major(x, xt);
  float* y = out.data<float>();
  int64_t hidden = proj[0].rows, d_out = proj[2].rows;
  const RecordCall c{xp,    expert, experts, pairs, k,     d_in, hidden,
                     d_out, proj,   fn,      y,     threads, cache};
  if (in_place) {
    run_in_place(c, cache.in_place(expert, pairs, int(x.shape(0)), call));
  } else if (cache.window.on()) {
    run_windowed(c);
  } else {
    run_mapped(c);
  }
}

void ExpertMlp::eval_cpu(const std::vector<mx::array>& inputs,
                         std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [inputs, out = outputs[0], specs = specs_,
            threads = threads_or_all(threads_), blocked = blocked_,
            fills = fills_]() mutable {
             expert_mlp_run(inputs, out, specs, threads, blocked, fills.get());
           });
}

bool ExpertMlp::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const ExpertMlp&>(other);
  return !fills_ && !o.fills_ && specs_ == o.specs_ &&
         threads_ == o.threads_ && blocked_ == o.blocked_;
}

void ExpertMlpMapped::eval_cpu(const std::vector<mx::array>& inputs,
                               std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [inputs, out = outputs[0], cache = cache_, proj = projections_,
            threads = threads_or_all(threads_), in_place = in_place(),
            call = this->call()]() mutable {
             expert_mlp_records_run(inputs, out, *cache, proj, threads, in_place,
                                    call);
           });
}

static void quant_matmul_run(const std::vector<mx::array>& in, mx::array& out,
                             QuantSpec spec, int threads, bool blocked) {
  Matrix m = matrix(in[1], in[2], in[3], spec, 0);
  Kernels fn = kernels(spec, m.format, blocked); // row-major: spec.fma has no say
  int64_t tokens = in[0].size() / m.cols;
  std::vector<float> xt;
  const float* x = row_major(in[0], xt);
  float* y = out.data<float>();
  if (tokens < kMinTokens) {
    int64_t blocks = (m.rows + kTaskRows - 1) / kTaskRows;
    parallel_for(int(tokens * blocks), threads, [&](int task) {
      int64_t t = task / blocks, r0 = task % blocks * kTaskRows;
      matvec(m, fn.rows, r0, std::min(m.rows, r0 + kTaskRows), x + t * m.cols,
             y + t * m.rows);
    });
    return;
  }
  int64_t panels = (m.rows + kPanel - 1) / kPanel;
  int64_t blocks = (tokens + kTokenBlock - 1) / kTokenBlock;
  parallel_for(int(blocks * panels), threads, [&](int task) {
    int64_t t0 = task / panels * kTokenBlock, r0 = task % panels * kPanel;
    int64_t n = std::min(kTokenBlock, tokens - t0);
    std::vector<const float*> xs(n);
    for (int64_t i = 0; i < n; i++) {
      xs[i] = x + (t0 + i) * m.cols;
    }
    std::vector<float> acc(n * kPanel);
    fn.panel(m, r0, int(n), xs.data(), acc.data());
    int64_t rows = std::min<int64_t>(kPanel, m.rows - r0);
    for (int64_t i = 0; i < n; i++) {
      std::memcpy(y + (t0 + i) * m.rows + r0, acc.data() + i * kPanel,
                  rows * sizeof(float));
    }
  });
}

void QuantMatmul::eval_cpu(const std::vector<mx::array>& inputs,
                           std::vector<mx::array>& outputs) {
  dispatch(stream(), inputs, outputs[0],
           [inputs, out = outputs[0], spec = spec_,
            threads = threads_or_all(threads_), blocked = blocked_]() mutable {
             quant_matmul_run(inputs, out, spec, threads, blocked);
           });
}

bool QuantMatmul::is_equivalent(const mx::Primitive& other) const {
  auto& o = static_cast<const QuantMatmul&>(other);
  return spec_ == o.spec_ && threads_ == o.threads_ && blocked_ == o.blocked_;
}

static void check_float32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) {
    throw std::invalid_argument(std::string("moestream kernel: ") + what +
                                " must be float32 (the kernel runs float32)");
  }
}

// A projection's scales and biases, and its rows where `blocked`: float32 as
// MLX holds them; blocked, also bfloat16 or float16 (both the same), and
// rows in whole blocks.
static void check_quantized(const mx::array& w, const mx::array& sc,
                            const mx::array& bi, bool blocked) {
  if (!blocked || sc.dtype() != bi.dtype() || sc.dtype() == mx::float32) {
    check_float32(sc, "scales"); // blocked ones may be bfloat16 or float16
    check_float32(bi, "biases");
  } else if (sc.dtype() != mx::bfloat16 && sc.dtype() != mx::float16) {
    throw std::invalid_argument(
        "moestream kernel: blocked scales and biases must be float32, "
        "bfloat16 or float16");
  }
  if (blocked && w.shape(-2) % kBlock) {
    throw std::invalid_argument(
        "moestream kernel: blocked weights need rows in multiples of " +
        std::to_string(kBlock));
  }
}

mx::array expert_mlp(const mx::array& x, const mx::array& inds,
                     const std::vector<mx::array>& weights,
                     const std::vector<QuantSpec>& specs, int threads,
                     bool blocked, std::shared_ptr<ExpertCache> fills) {
  if (weights.size() != 9 || specs.size() != 3) {
    throw std::invalid_argument(
        "moestream kernel: gate, up, down (weight, scales, biases) expected");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  int64_t d_in = x.shape(-1);
  check_float32(x, "x");
  std::vector<mx::array> inputs = {
      mx::reshape(x, {-1, int(d_in)}, s), // read through its strides
      row_contiguous(mx::astype(inds, mx::uint32, s), s)};
  if (inputs[0].shape(0) * inds.shape(-1) != inds.size()) {
    throw std::invalid_argument(
        "moestream kernel: x and inds disagree on the tokens");
  }
  for (int p = 0; p < 3; p++) {
    check_spec(specs[p], weights[3 * p].shape(-1) * 32 / specs[p].bits);
    check_quantized(weights[3 * p], weights[3 * p + 1], weights[3 * p + 2],
                    blocked);
  }
  for (auto& w : weights) {
    inputs.push_back(row_contiguous(w, s));
  }
  auto shape = inds.shape();
  shape.push_back(weights[6].shape(-2));
  return mx::array(shape, mx::float32,
                   std::make_shared<ExpertMlp>(s, specs, threads, blocked,
                                               std::move(fills)),
                   std::move(inputs));
}

mx::array expert_mlp_mapped(const mx::array& x, const mx::array& experts,
                            std::shared_ptr<ExpertCache> cache,
                            std::vector<MappedProjection> projections,
                            int threads, bool in_place, int64_t call) {
  if (projections.size() != 3) {
    throw std::invalid_argument(
        "moestream kernel: gate, up and down projections expected");
  }
  if (in_place ? !cache->pending_fills().on() : !cache->mapped()) {
    throw std::invalid_argument(
        in_place ? "moestream kernel: the cache does not fill in the kernel"
                 : "moestream kernel: the cache has not mapped its blob (map_blob)");
  }
  int64_t d_in = x.shape(-1);
  check_float32(x, "x");
  for (auto& q : projections) {
    int64_t size = q.format == ScaleFormat::F32 ? 4 : 2;
    check_spec(q.spec, q.row_bytes * 8 / q.spec.bits);
    if (q.rows <= 0 || q.groups * q.spec.group_size != q.row_bytes * 8 / q.spec.bits ||
        q.weight < 0 || q.scales < 0 || q.biases < 0 ||
        q.weight + q.rows * q.row_bytes > cache->record_nbytes ||
        q.scales + q.rows * q.groups * size > cache->record_nbytes ||
        q.biases + q.rows * q.groups * size > cache->record_nbytes) {
      throw std::invalid_argument(
          "moestream kernel: a projection does not fit its expert record");
    }
    if (q.blocked && q.rows % kBlock) {
      throw std::invalid_argument(
          "moestream kernel: a blocked projection needs rows in multiples of " +
          std::to_string(kBlock));
    }
  }
  if (projections[0].row_bytes * 8 / projections[0].spec.bits != d_in ||
      projections[1].rows != projections[0].rows ||
      projections[2].row_bytes * 8 / projections[2].spec.bits !=
          projections[0].rows) {
    throw std::invalid_argument(
        "moestream kernel: gate, up and down disagree with x on their sizes");
  }
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  std::vector<mx::array> inputs = {
      mx::reshape(x, {-1, int(d_in)}, s), // read through its strides
      row_contiguous(mx::astype(experts, mx::uint32, s), s)};
  if (inputs[0].shape(0) * experts.shape(-1) != experts.size()) {
    throw std::invalid_argument(
        "moestream kernel: x and the expert ids disagree on the tokens");
  }
  auto shape = experts.shape();
  shape.push_back(int(projections[2].rows));
  auto primitive =
      in_place ? std::make_shared<ExpertMlpInPlace>(
                     s, std::move(cache), std::move(projections), threads, call)
               : std::make_shared<ExpertMlpMapped>(s, std::move(cache),
                                                   std::move(projections), threads);
  return mx::array(shape, mx::float32, std::move(primitive), std::move(inputs));
}

mx::array quant_matmul(const mx::array& x, const mx::array& w,
                       const mx::array& scales, const mx::array& biases,
                       QuantSpec spec, int threads, bool blocked) {
  auto s = mx::default_stream(mx::Device(mx::Device::cpu));
  int64_t cols = int64_t(w.shape(-1)) * 32 / spec.bits;
  check_spec(spec, cols);
  check_float32(x, "x");
  if (x.shape(-1) != cols || w.ndim() != 2) {
    throw std::invalid_argument(
        "moestream kernel: x's last dim must match the 2-D weight's input dims");
  }
  check_quantized(w, scales, biases, blocked);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> inputs = {x, // read through its strides
                                   row_contiguous(w, s),
                                   row_contiguous(scales, s),
                                   row_contiguous(biases, s)};
  return mx::array(shape, mx::float32,
                   std::make_shared<QuantMatmul>(s, spec, threads, blocked),
                   std::move(inputs));
}

} // namespace moestream
