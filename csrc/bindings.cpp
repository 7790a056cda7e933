// Python bindings of the native expert engine: moestream._native.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu_experts.h"
#include "cpu_attention.h"
#include "cpu_matmul.h"
#include "cpu_ops.h"
#include "cpu_rope.h"
#include "expert_cache.h"
#include "expert_fetch.h"
#include "lazy_output.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;
using moestream::ExpertCache;
using moestream::HostTier;
using moestream::SlotTable;

namespace {
// Python's class for read errors (moestream.runtime.store.ExpertReadError).
PyObject* read_error_class = nullptr;
} // namespace

NB_MODULE(_native, m) {
  m.doc() = "moestream's native expert engine (an MLX extension)";
  m.attr("mlx_version") = mlx::core::version();
  // In MLX's nanobind domain, so errors that mx.eval and its kin rethrow
  // from the stream pass here too: a read error's words raise its class.
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const std::runtime_error& e) {
      if (!read_error_class || !moestream::is_read_error(e.what())) {
        throw;
      }
      PyErr_SetString(read_error_class, e.what());
    }
  });
  m.def(
      "set_read_error_class",
      [](nb::handle cls) {
        Py_XDECREF(read_error_class);
        read_error_class = cls.inc_ref().ptr(); // kept until exit
      },
      "cls"_a, "The exception class the engine's read errors raise.");
  m.def("is_read_error", [](const std::string& what) {
    return moestream::is_read_error(what.c_str());
  }, "what"_a, "Whether `what` is the message of one of the engine's read errors.");
  m.def("built_with_cuda", &moestream::built_with_cuda);
  m.def(
      "cast",
      [](nb::bytes data, int cast) {
        moestream::Segment seg{0, int64_t(data.size()), moestream::Cast(cast)};
        if (cast < 1 || cast > 6 ||
            seg.nbytes % moestream::cast_src_size(seg.cast)) {
          throw std::invalid_argument("not a cast of these bytes");
        }
        std::string out(seg.nbytes / moestream::cast_src_size(seg.cast) *
                            moestream::cast_dst_size(seg.cast), '\0');
        moestream::SlotArrays::cast_host(reinterpret_cast<const uint8_t*>(data.c_str()),
                               seg, reinterpret_cast<uint8_t*>(out.data()));
        return nb::bytes(out.data(), out.size());
      },
      "data"_a, "cast"_a,
      "Stored floats converted as a record's segment is into its slot "
      "(native.CASTS gives `cast`).");
  m.def("crc32", [](nb::bytes b, uint32_t crc) {
    return moestream::crc32(
        reinterpret_cast<const uint8_t*>(b.c_str()), b.size(), crc);
  }, "data"_a, "crc"_a = 0);
  m.def("crc32_combine", &moestream::crc32_combine, "crc1"_a, "crc2"_a,
        "len2"_a, "The CRC-32 of A then B from crc32(A), crc32(B), len(B).");

  nb::class_<HostTier>(m, "HostTier")
      .def(
          nb::new_([](int64_t capacity, int64_t record_bytes, int readers,
                      bool pinned) {
            return std::make_shared<HostTier>(
                capacity, record_bytes, readers, pinned);
          }),
          "capacity"_a, "record_bytes"_a, "readers"_a, "pinned"_a)
      .def("drain", &HostTier::drain, nb::call_guard<nb::gil_scoped_release>())
      .def_ro("capacity", &HostTier::capacity)
      .def_ro("record_bytes", &HostTier::record_bytes)
      .def(
          "take_counters",
          [](HostTier& t) {
            moestream::gpu_tier_collect(t);
            auto& k = t.counters;
            nb::dict d;
            d["host_hits"] = k.hits.exchange(0);
            d["host_late"] = k.late.exchange(0);
            d["host_misses"] = k.misses.exchange(0);
            d["host_evictions"] = k.evictions.exchange(0);
            return d;
          },
          "The counters since the last call (they restart at zero).")
      .def(
          "keys",
          [](HostTier& t) {
            moestream::gpu_tier_sync_host(t);
            return t.keys();
          },
          "The record key in each slot (-1: empty), the device's table "
          "brought back first where a kernel resolves the tier.");

  nb::class_<ExpertCache>(m, "ExpertCache")
      .def(
          nb::new_([](const std::string& path, int layer,
             int64_t data_offset,
             int64_t stride, int64_t record_nbytes, int num_experts,
             int capacity,
             const std::vector<std::tuple<int64_t, int64_t, int, int64_t,
                                          int64_t, bool, bool>>& segments,
             std::vector<uint32_t> checksums, bool verify,
             const std::string& policy, double decay, int max_pairs,
             bool record_calls) {
            moestream::CacheConfig config{
                {path, layer, data_offset, stride, record_nbytes, num_experts},
                capacity, {}, std::move(checksums), verify,
                {policy == "lru", decay}, max_pairs, record_calls};
            for (auto& [offset, nbytes, cast, rows, row_bytes, slot_blocked,
                        record_blocked] : segments) {
              config.segments.push_back({offset, nbytes, moestream::Cast(cast),
                                         rows, row_bytes, slot_blocked,
                                         record_blocked});
            }
            return std::make_shared<ExpertCache>(std::move(config));
          }),
          "path"_a, "layer"_a, "data_offset"_a, "stride"_a, "record_nbytes"_a,
          "num_experts"_a, "capacity"_a, "segments"_a, "checksums"_a,
          "verify"_a, "policy"_a, "decay"_a, "max_pairs"_a,
          "record_calls"_a = false)
      .def("bind", &ExpertCache::bind, "slots"_a, "on_gpu"_a)
      .def("chain", &ExpertCache::chain, "next"_a)
      .def("attach", &ExpertCache::attach, "tier"_a)
      .def("preload_tier", &ExpertCache::preload_tier)
      .def("load", &ExpertCache::load, "experts"_a, "tokens"_a, "call"_a = -1,
           nb::call_guard<nb::gil_scoped_release>())
      .def(
          "take_records",
          [](ExpertCache& c) {
            nb::list out;
            for (auto& r : c.take_records()) {
              nb::list prefetched;
              for (uint32_t e : r.prefetched) {
                prefetched.append(e);
              }
              out.append(nb::make_tuple(r.call, r.hits, r.misses, r.bytes_read,
                                        prefetched));
            }
            return out;
          },
          "(call, hits, misses, bytes_read, prefetched) of each call resolved "
          "since the last take, in call order (record_calls only).")
      .def("table", &ExpertCache::table)
      .def("map_blob", &ExpertCache::map_blob, "window"_a = 0,
           "Map the blob read-only (RuntimeConfig.mapped): calls resolve to "
           "expert ids, read in place by expert_mlp_mapped, at most `window` "
           "records kept mapped (0: all); ValueError when the file is short.")
      .def_prop_ro("mapped", &ExpertCache::mapped)
      .def("unmap_pages",
           [](ExpertCache& c) {
             if (c.mapped()) {
               c.reader().mapped()->unmap_pages();
             }
           },
           "Take a mapped blob's pages out of this process's page tables (the "
           "page cache keeps them until dropped).")
      .def_prop_rw(
          "readers", [](ExpertCache& c) { return c.reader().readers; },
          [](ExpertCache& c, int n) { c.reader().readers = n; },
          "Reader threads one record's read is split over (in pieces).")
      .def_prop_rw(
          "fill_in_kernel",
          [](ExpertCache& c) { return c.pending_fills().on(); },
          [](ExpertCache& c, bool on) { c.fill_in_kernel(on); },
          "CPU slots that only the kernel reads, given this cache as its "
          "`fills`: a miss whose record the page cache holds is filled by "
          "that kernel as it computes from the mapped record, not read.")
      .def_prop_rw(
          "read_cached_whole",
          [](ExpertCache& c) { return c.reader().read_cached_whole; },
          [](ExpertCache& c, bool on) { c.reader().read_cached_whole = on; },
          "A record the page cache holds is read whole on the calling thread "
          "(else in pieces, as one from the disk; tests turn it off).")
      .def(
          "inject_read_failures",
          [](ExpertCache& c, int expert, int count) {
            c.reader().inject_failures(expert, count);
          },
          "expert"_a, "count"_a,
          "Tests: the next `count` reads of `expert`'s record fail as an I/O "
          "error would; a read is tried twice before its call fails.")
      .def_rw("device_resolve", &ExpertCache::device_resolve,
              "On a GPU, unless a layer reads ahead into the host tier: slots "
              "and tier records resolved by a kernel, else by a host function "
              "of the stream.")
      .def("take_error", [](ExpertCache& c) {
        moestream::gpu_collect(c);
        return c.log.take_error();
      })
      .def(
          "take_counters",
          [](ExpertCache& c) {
            moestream::gpu_collect(c);
            auto& k = c.counters;
            nb::dict d;
            d["hits"] = k.hits.exchange(0);
            int64_t misses = k.misses.exchange(0);
            d["misses"] = misses;
            d["fill_bytes"] = misses * c.record_nbytes; // one record a miss
            d["evictions"] = k.evictions.exchange(0);
            d["bytes_read"] = k.bytes_read.exchange(0) +
                c.reader().bytes_read.exchange(0);
            d["native_calls"] = k.calls.exchange(0);
            d["device_calls"] = k.device_calls.exchange(0);
            d["prefetched"] = k.prefetched.exchange(0);
            d["prefetched_used"] = k.prefetched_used.exchange(0);
            d["misses_prefetched"] = k.misses_prefetched.exchange(0);
            d["prefetch_bytes"] = k.prefetch_bytes.exchange(0);
            d["kernel_fills"] = k.kernel_fills.exchange(0);
            return d;
          },
          "The counters since the last call (they restart at zero).");

  // The eviction policy alone, as the engine runs it (tests hold it to
  // runtime/pool.py's SlotPool).
  nb::class_<SlotTable>(m, "SlotPolicy")
      .def(
          "__init__",
          [](SlotTable* t, int num_experts, int capacity,
             const std::string& policy, double decay) {
            if (policy != "lru" && policy != "lrfu") {
              throw std::invalid_argument("policy must be 'lru' or 'lrfu'");
            }
            new (t) SlotTable(num_experts, capacity, {policy == "lru", decay});
          },
          "num_experts"_a, "capacity"_a, "policy"_a, "decay"_a = 0.0)
      .def("access", &SlotTable::access, "experts"_a, "tokens"_a = 1,
           "One call routing `experts`: the experts it evicts, in order.")
      .def("table", &SlotTable::table);

  m.def(
      "fetch",
      [](std::shared_ptr<ExpertCache> cache, const mlx::core::array& inds,
         const std::optional<mlx::core::array>& predicted, int64_t call) {
        return moestream::fetch(std::move(cache), inds, predicted, call);
      },
      "cache"_a, "inds"_a, "predicted"_a = nb::none(), "call"_a = -1,
      "Slot ids for routed expert ids; misses are read inside the stream.");

  // What the serve page draws (each expert's uses, the tier's fill), read while the stream runs.
  m.def(
      "take_uses",
      [](ExpertCache& c) {
        std::vector<int64_t> out(c.uses.size());
        for (size_t e = 0; e < out.size(); e++) {
          out[e] = c.uses[e].exchange(0);
        }
        return out;
      },
      "cache"_a, "Per expert, the calls that routed to it since the last take.");
  m.def("tier_filled", &HostTier::filled, "tier"_a,
        "Records the host tier holds or is reading.");
  m.def("waits_for_unneeded", &moestream::waits_for_unneeded, "waiter"_a,
        "Whether a layer's waiter waits for an output nothing else can ask for.");

  // The exact CPU kernel (cpu_experts.h): expert MLPs and quantized matmuls.
  m.def(
      "expert_mlp",
      [](const mlx::core::array& x, const mlx::core::array& inds,
         const std::vector<mlx::core::array>& weights,
         const std::vector<std::tuple<int, int, bool>>& specs, int threads,
         bool blocked, std::shared_ptr<ExpertCache> fills) {
        std::vector<moestream::QuantSpec> s;
        for (auto& [bits, group_size, fma] : specs) {
          s.push_back({bits, group_size, fma});
        }
        return moestream::expert_mlp(x, inds, weights, s, threads, blocked,
                                     std::move(fills));
      },
      "x"_a, "inds"_a, "weights"_a, "specs"_a, "threads"_a = 0,
      "blocked"_a = false, "fills"_a = nb::none(),
      "SwitchGLU with SwiGLU over slot arrays, bit for bit MLX's CPU ops "
      "(cpu_experts.h): `weights` gate, up, down (weight, scales, biases), "
      "`specs` their (bits, group_size, fma); `threads` 0: every core.");
  m.def(
      "huge_pages",
      [](const mlx::core::array& a) {
        if (!a.is_available() || a.data<uint8_t>() == nullptr) {
          throw std::invalid_argument("huge_pages: an evaluated array is needed"); }
        moestream::huge_pages(const_cast<uint8_t*>(a.data<uint8_t>()), a.nbytes());
      },
      "a"_a, "Back an evaluated CPU array's 2 MiB-aligned interior with huge pages.");
  m.def("kernel_lanes", &moestream::kernel_lanes,
        "The rows of one of the CPU kernel's vectors: 16 with AVX-512, else 8.");
  m.attr("staging_records") = moestream::kStagingRecords;
  m.def("kernel_block", &moestream::kernel_block,
        "The rows of one block of the blocked layout (slots and records): 16.");
  m.def("kernel_fma", &moestream::kernel_fma,
        "Whether the blocked kernels dequantize with one fused multiply-add "
        "where a spec allows it (this CPU has vector FMA).");
  m.def("set_pool_spin", &moestream::set_pool_spin, "micros"_a,
        "How long the CPU kernel's idle threads wait awake (pausing) before "
        "they sleep; 0: they sleep at once. One pool per process.");
  m.def(
      "expert_mlp_mapped",
      [](const mlx::core::array& x, const mlx::core::array& experts,
         std::shared_ptr<ExpertCache> cache,
         const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t,
                                      int64_t, int64_t, int, int, int, bool,
                                      bool>>& proj,
         int threads, bool in_place, int64_t call) {
        std::vector<moestream::MappedProjection> p;
        for (auto& [w, s, b, rows, row_bytes, groups, format, bits, gs,
                    blocked, fma] : proj) {
          if (format < 0 || format > 2) {
            throw std::invalid_argument(
                "moestream kernel: scale format must be 0 (float32), 1 "
                "(bfloat16) or 2 (float16)");
          }
          p.push_back({w, s, b, rows, row_bytes, groups,
                       moestream::ScaleFormat(format), {bits, gs, fma},
                       blocked});
        }
        return moestream::expert_mlp_mapped(x, experts, std::move(cache), p,
                                            threads, in_place, call);
      },
      "x"_a, "experts"_a, "cache"_a, "projections"_a, "threads"_a = 0,
      "in_place"_a = false, "call"_a = -1,
      "expert_mlp on a cache's records in place (cpu_experts.h): `projections` "
      "gate, up, down as (weight, scales, biases offsets, rows, row_bytes, groups, "
      "format, bits, group_size, blocked, fma); `in_place`: a CPU slot cache's.");
  m.def(
      "quant_matmul",
      [](const mlx::core::array& x, const mlx::core::array& w,
         const mlx::core::array& scales, const mlx::core::array& biases,
         int bits, int group_size, int threads, bool fma, bool blocked) {
        return moestream::quant_matmul(
            x, w, scales, biases, {bits, group_size, fma}, threads, blocked);
      },
      "x"_a, "w"_a, "scales"_a, "biases"_a, "bits"_a, "group_size"_a,
      "threads"_a = 0, "fma"_a = false, "blocked"_a = false,
      "mx.quantized_matmul(x, w, scales, biases, transpose=True) on the CPU, "
      "bit for bit, over `threads` threads (0: every core); `blocked`: w, "
      "scales and biases stored kernel_block() rows at a time, `fma`: their "
      "products exact (fused dequantization; blocked only).");
  m.def(
      "exact_matmul",
      [](const mlx::core::array& a, const mlx::core::array& b, bool transpose_b,
         int threads, int64_t causal) {
        return moestream::exact_matmul(a, b, transpose_b, threads, causal);
      },
      "a"_a, "b"_a, "transpose_b"_a = false, "threads"_a = 0, "causal"_a = 0,
      "mx.matmul(a, b) of float32 [batch, M, K] @ [batch, K, N] ([batch, N, K] "
      "read transposed where transpose_b) on the CPU, bit for bit, over "
      "`threads` threads (0: every core). causal = q_len: q @ k.T under sdpa's "
      "causal mask (float32's lowest past each query's key).");
  m.def(
      "exact_attention",
      [](const mlx::core::array& q, const mlx::core::array& k,
         const mlx::core::array& v, int64_t causal, int threads) {
        return moestream::exact_attention(q, k, v, causal, threads);
      },
      "q"_a, "k"_a, "v"_a, "causal"_a = 0, "threads"_a = 0,
      "softmax(q @ k.T) @ v of float32 [batch, M, D] q (scaled), [batch, S, D] "
      "k and [batch, S, Dv] v, as MLX's sdpa fallback computes it, bit for "
      "bit; causal = q_len masks each query's later keys.");
  m.def("exact_rms_norm", &moestream::exact_rms_norm, "x"_a, "w"_a, "eps"_a,
      "mx.fast.rms_norm(x, w, eps) of float32 on the CPU, bit for bit, as one "
      "op.");
  m.def(
      "exact_rope",
      [](const mlx::core::array& x, int dims, bool traditional, float base,
         float scale, const mlx::core::array& offset,
         const std::optional<mlx::core::array>& freqs) {
        return moestream::exact_rope(x, dims, traditional, base, scale, offset,
                                     freqs);
      },
      "x"_a, "dims"_a, "traditional"_a, "base"_a, "scale"_a, "offset"_a,
      "freqs"_a = nb::none(),
      "mx.fast.rope(x, dims, ...) of float32 on the CPU, bit for bit, as one "
      "op (offset: int32, one value or one per batch).");
  m.def("exact_softmax", &moestream::exact_softmax, "x"_a, "threads"_a = 0,
      "mx.softmax(x, axis=-1) of float32 on the CPU, bit for bit, over "
      "`threads` threads (0: every core).");
}
