// An exact CPU kernel for quantized expert MLPs and quantized matmuls:
// MLX's CPU arithmetic (mlx/backend/cpu/quantized.cpp `_qmm_t`, the path a
// Linux build takes: simd::max_size<float> is 1 there) bit for bit, with
// sixteen output rows in the lanes of a vector and rows split over threads.
// Every output's sum runs over the reduction in MLX's order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "cpu_kernel.h"

namespace mx = mlx::core;

namespace moestream {

// One affine-quantized projection: `[E, out, in * bits / 32]` uint32 weights
// with float32 scales and biases `[E, out, in / group_size]`.
// `fma`: every scale of the matrix makes scale * q exact in float32 for
// q < 2^bits (the runtime tells from the converter's record of the largest
// scale), so one fused multiply-add gives the float MLX's multiply and add
// give; the blocked kernels then dequantize so (where kernel_fma()).
struct QuantSpec {
  int bits, group_size;
  bool fma{false};
  bool operator==(const QuantSpec&) const = default;
};

// How a record stores a projection's scales and biases: float32 is what the
// kernel computes in; bfloat16 and float16 widen exactly (cast.h).
enum class ScaleFormat : int { F32 = 0, BF16 = 1, F16 = 2 };

// One projection inside an expert record (RuntimeConfig.mapped): offsets of
// its packed weight `[rows, row_bytes / 4]` and its scales and biases
// `[rows, groups]` from the record's start; `blocked`: all three stored
// kernel_block() rows at a time (a record converted with --layout blocked).
struct MappedProjection {
  int64_t weight, scales, biases;
  int64_t rows, row_bytes, groups;
  ScaleFormat format;
  QuantSpec spec;
  bool blocked{false};
};

class ExpertCache; // expert_cache.h

// Runs fn(0..n-1) over `threads` threads (the caller's among them), each
// taking runs of consecutive tasks (rows stream from memory in order).
void parallel_for(int n, int threads, const std::function<void(int)>& fn);
// The same, each thread taking the next task when done: tasks of uneven
// size, given largest first.
void parallel_each(int n, int threads, const std::function<void(int)>& fn);
// How long the kernel's idle threads wait awake before they sleep (the
// pool is one per process).
void set_pool_spin(int64_t micros);

// `threads`, or every core where it is 0.
int threads_or_all(int threads);

// Allocates `out` and runs `task` on the CPU stream's thread, inputs kept
// alive: every CPU kernel's eval_cpu.
template <typename Task>
void dispatch(mx::Stream stream, const std::vector<mx::array>& inputs,
              mx::array& out, Task&& task) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  enc.dispatch(std::forward<Task>(task));
}

// `a` as a kernel's row-contiguous input: itself where it is already
// evaluated so (weights, slots: no graph node), else MLX's contiguous op.
inline mx::array row_contiguous(const mx::array& a, mx::Stream s) {
  if (a.is_available() && a.flags().row_contiguous) {
    return a;
  }
  return mx::contiguous(a, false, s);
}


// Large temporaries of a kernel call, kept on the calling thread for the
// next call: a fresh one would cost page faults each time (a memory budget
// pins glibc's mmap threshold at kScratchKept, loader.MMAP_THRESHOLD, so
// every larger block is a new mapping). One buffer per `Scratch` use, never zeroed; a call's parallel
// tasks use none of them. Up to kScratchKept bytes each are kept (a decode
// step's, so that the process's memory stays within its plan); a larger
// one (a long prompt's, whose page faults its arithmetic dwarfs) lives in
// the caller's `spill` for the call.
enum class Scratch {
  PairsGate,
  PairsUp,
  PanelsHidden,
  MatmulPacked,
  AttentionValues,
  AttentionScores,
  Count
};
constexpr size_t kScratchKept = 8 << 20;

inline float* scratch(Scratch use, size_t n, std::vector<float>& spill) {
  if (n * sizeof(float) > kScratchKept) {
    spill.resize(n);
    return spill.data();
  }
  thread_local std::vector<float> buffers[static_cast<int>(Scratch::Count)];
  auto& b = buffers[static_cast<int>(use)];
  if (b.size() < n) {
    b.resize(n);
  }
  return b.data();
}

// A float32 input's elements in row-major order, at eval: its own buffer
// where it is row-contiguous, else copied into `tmp` through its strides (a
// view: a cache's slice, a transpose). Kernels that read an activation this
// way need no Contiguous node in the graph.
inline const float* row_major(const mx::array& a, std::vector<float>& tmp) {
  if (a.flags().row_contiguous) {
    return a.data<float>();
  }
  tmp.resize(a.size());
  const float* src = a.data<float>();
  const auto& shape = a.shape();
  const auto& strides = a.strides();
  const int nd = int(a.ndim());
  const int64_t inner = nd ? shape[nd - 1] : 1;
  const int64_t step = nd ? strides[nd - 1] : 1;
  std::vector<int64_t> idx(std::max(nd - 1, 0), 0);
  for (int64_t done = 0; done < int64_t(a.size()); done += inner) {
    int64_t off = 0;
    for (int d = 0; d + 1 < nd; d++) {
      off += idx[d] * strides[d];
    }
    for (int64_t i = 0; i < inner; i++) {
      tmp[done + i] = src[off + i * step];
    }
    for (int d = nd - 2; d >= 0 && ++idx[d] == shape[d]; d--) {
      idx[d] = 0;
    }
  }
  return tmp.data();
}

// The rows of one vector: 16 with AVX-512, else 8.
int kernel_lanes();

// The rows of one block of the blocked layout: 16 on every CPU.
int kernel_block();
// Whether the blocked kernels dequantize with one fused multiply-add where a
// spec allows it (QuantSpec::fma): a CPU with vector FMA.
bool kernel_fma();

// `rows` rows of `cols` 4-byte words at `src` (row r at src + r * cols * 4)
// into `dst` blocked, as blocked slots and records hold them: word c of row
// r at ((r / 16) * cols + c) * 16 + r % 16; rows % kernel_block() == 0.
void block_rows(const uint8_t* src, int64_t rows, int64_t cols, uint32_t* dst);

// block_rows' inverse: blocked words at `src` into rows at `dst`.
void unblock_rows(const uint8_t* src, int64_t rows, int64_t cols, uint32_t* dst);

// SwitchGLU with SwiGLU on slots: out[t, j] = down(silu(gate(x_t)) * up(x_t))
// with the experts of slot inds[t, j]. Inputs: x `[T, D]`, inds `[T, k]`,
// then gate, up, down (weight, scales, biases) each. Output `[T, k, D]`.
// Blocked slots hold each projection kernel_block() rows at a time: an
// expert's weights `[rows / 16, words, 16]` (word w of a block's rows side
// by side), its float32 scales and biases `[rows / 16, groups, 16]`, in
// arrays of the row-major shapes.
// With `fills` (the slots' cache, ExpertCache::fill_in_kernel), the slots a
// call's fetch left waiting for their records are computed from the mapped
// records and written as they are read.
class ExpertMlp : public CpuKernel {
 public:
  ExpertMlp(mx::Stream s, std::vector<QuantSpec> specs, int threads,
            bool blocked, std::shared_ptr<ExpertCache> fills = nullptr)
      : CpuKernel(s),
        specs_(std::move(specs)),
        threads_(threads),
        blocked_(blocked),
        fills_(std::move(fills)) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExpertMlp";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  std::vector<QuantSpec> specs_; // gate, up, down
  int threads_;
  bool blocked_;
  std::shared_ptr<ExpertCache> fills_;
};

// x `[..., K]` @ dequantized(w `[N, K * bits / 32]`).T: mx.quantized_matmul
// with transpose=True, exactly. `blocked`: w, scales and biases stored
// kernel_block() rows at a time (as blocked slots hold an expert), read by the
// blocked kernels (with one fused multiply-add where spec.fma says it is exact).
class QuantMatmul : public CpuKernel {
 public:
  QuantMatmul(mx::Stream s, QuantSpec spec, int threads, bool blocked)
      : CpuKernel(s), spec_(spec), threads_(threads), blocked_(blocked) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "QuantMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  QuantSpec spec_;
  int threads_;
  bool blocked_;
};

// ExpertMlp on records read in place: inputs x `[T, D]` and the routed
// expert ids `[T, k]` (a mapped cache's fetch), each expert's gate, up and
// down read from the cache's mapping of its blob. The pairs whose records
// the fetch left being read (or checked) run last, once those reads end.
class ExpertMlpMapped : public CpuKernel {
 public:
  ExpertMlpMapped(mx::Stream s, std::shared_ptr<ExpertCache> cache,
                  std::vector<MappedProjection> projections, int threads)
      : CpuKernel(s),
        cache_(std::move(cache)),
        projections_(std::move(projections)),
        threads_(threads) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExpertMlpMapped";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false; // reads a mapping, not its inputs
  }
  // Whether the cache is a CPU slot cache (ExpertMlpInPlace), and the
  // call's id in its records (RuntimeStats.events), or -1.
  virtual bool in_place() const {
    return false;
  }
  virtual int64_t call() const {
    return -1;
  }

 protected:
  std::shared_ptr<ExpertCache> cache_;
  std::vector<MappedProjection> projections_; // gate, up, down
  int threads_;
};

// ExpertMlpMapped on CPU slots' records (a cache that fills in the kernel):
// a call with more experts than slots computed from every routed record in
// place (ExpertCache::in_place), the slots left as they are.
class ExpertMlpInPlace : public ExpertMlpMapped {
 public:
  ExpertMlpInPlace(mx::Stream s, std::shared_ptr<ExpertCache> cache,
                   std::vector<MappedProjection> projections, int threads,
                   int64_t call)
      : ExpertMlpMapped(s, std::move(cache), std::move(projections), threads),
        call_(call) {}
  const char* name() const override {
    return "ExpertMlpInPlace";
  }
  bool in_place() const override {
    return true;
  }
  int64_t call() const override {
    return call_;
  }

 private:
  int64_t call_;
};

// `in_place`: on a CPU slot cache's records (ExpertMlpInPlace), its counts
// recorded under `call` (the fetch's ids) where the cache records calls.
mx::array expert_mlp_mapped(const mx::array& x, const mx::array& experts,
                            std::shared_ptr<ExpertCache> cache,
                            std::vector<MappedProjection> projections,
                            int threads, bool in_place = false,
                            int64_t call = -1);

mx::array expert_mlp(const mx::array& x, const mx::array& inds,
                     const std::vector<mx::array>& weights,
                     const std::vector<QuantSpec>& specs, int threads,
                     bool blocked = false,
                     std::shared_ptr<ExpertCache> fills = nullptr);
mx::array quant_matmul(const mx::array& x, const mx::array& w,
                       const mx::array& scales, const mx::array& biases,
                       QuantSpec spec, int threads, bool blocked = false);

} // namespace moestream
