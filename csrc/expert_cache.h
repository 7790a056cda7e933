// The native expert engine: per-layer slot tables and record reads that run
// inside MLX's stream, so a decode step never returns to Python per layer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <optional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

#include "cast.h"
#include "host_tier.h"

namespace mx = mlx::core;

namespace moestream {

struct Segment {
  int64_t offset; // inside the record
  int64_t nbytes; // stored bytes of one expert
  Cast cast; // how the stored floats become the slot's (cast.h)
};

struct Counters {
  std::atomic<int64_t> hits{0}, misses{0}, evictions{0}, bytes_read{0};
  // calls: fetches resolved inside the stream (not host-side loads)
  std::atomic<int64_t> calls{0}, prefetched{0}, prefetched_used{0};
  std::atomic<int64_t> device_calls{0}; // of calls: resolved by a kernel
  std::atomic<int64_t> misses_prefetched{0}, prefetch_bytes{0};
};

// One call's counts, kept in call order when recording (RuntimeStats.events).
struct CallRecord {
  int64_t call; // the caller's id of the call (its event's step)
  int64_t hits{0}, misses{0}, bytes_read{0}; // distinct experts; blob bytes
  std::vector<uint32_t> prefetched; // read ahead for it since the last call
};

// Where a call's missed record is: (record, host tier slot or -1, slot).
using UseRecord = std::function<void(const uint8_t*, int64_t, int)>;

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);
// The CRC-32 of A then B, from crc32(A), crc32(B) and B's length (zlib's).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, int64_t len2);

// An expert record that cannot be used: Python's ExpertReadError. Its words
// are remembered, since MLX's stream rethrows errors as plain runtime_errors.
class ReadError : public std::runtime_error {
 public:
  explicit ReadError(const std::string& what);
};
// Whether `what` is the message of a ReadError of this process.
bool is_read_error(const char* what);

// The records of one mapped call still being read (and checked) when its
// fetch returned: the kernel computes the call's other experts first.
struct PendingReads {
  std::vector<int> experts; // the call's records in flight
  std::vector<char> absent, check; // per record: read it, check it
  std::vector<char> in_flight; // per expert of the layer
  std::vector<uint32_t> crcs; // per piece
  std::mutex mutex;
  std::condition_variable done;
  int left{0}; // pieces not yet done
  std::exception_ptr error;
};

struct GpuState; // CUDA side: pinned buffers and kernels (cuda_fetch.cu)

// One MoE layer: which expert sits in which slot, who is evicted next, and
// the reads that bring a record into its slot.
// Made in C++ (`std::make_shared`, see bindings.cpp) and shared from this:
// MLX's stream thread then holds plain references, never ones whose release
// needs Python's GIL (which the evaluating thread holds: a deadlock).
class ExpertCache : public std::enable_shared_from_this<ExpertCache> {
 public:
  ExpertCache(
      const std::string& path,
      int layer,
      int64_t data_offset,
      int64_t stride,
      int64_t record_nbytes,
      int num_experts,
      int capacity,
      std::vector<Segment> segments,
      std::vector<uint32_t> checksums,
      bool verify,
      bool lru,
      double decay,
      int max_calls_pairs,
      bool record_calls);
  ~ExpertCache();

  // The slot arrays, one per segment, `[capacity (+ spare), ...]`, evaluated.
  void bind(std::vector<mx::array> slots, bool on_gpu);
  void chain(std::shared_ptr<ExpertCache> next) {
    next_ = std::move(next);
  }
  // Read misses through `tier` (its readers, in parallel) from now on.
  void attach(std::shared_ptr<HostTier> tier) {
    tier_base_ = tier->add_layer(num_experts);
    tier_ = std::move(tier);
  }
  HostTier* tier() const {
    return tier_.get();
  }
  // Read every record of this layer into the host tier (while it has room).
  int64_t preload_tier() {
    return tier_ ? tier_->preload(shared_from_this(), tier_base_, num_experts)
                 : 0;
  }

  // One call: the slot of every routed pair in `experts` (unique count <=
  // capacity), each miss's record read (through the host tier if attached,
  // else into the staging record) and handed to `use`. When recording, its
  // counts are kept under `call` (a negative id keeps none); the loads of one
  // grouped call share its id and add up.
  void resolve_call(const uint32_t* experts, int64_t n, int tokens,
                    uint32_t* out, int64_t call, const UseRecord& use);
  // The records of the calls resolved since the last take, in call order.
  std::vector<CallRecord> take_records();
  // Keep one call's record (recording), its counts added to the last one's
  // when it has the same id (the loads of one grouped call).
  void add_record(CallRecord&& record);
  // Read `expert` into one host staging record shared by every layer (reads
  // run one at a time: the stream's, or the host's after a synchronize),
  // then hand it to `use`.
  void staged(int expert, const std::function<void(const uint8_t*)>& use);
  // Host-side read of a record into `dst` (record_nbytes), verified once;
  // in pieces of at least kMinPiece bytes over `readers` reader threads.
  void read_record(int expert, uint8_t* dst);
  static constexpr int64_t kMinPiece = 256 << 10, kPieceAlign = 64 << 10;
  // The pieces one record is read in: over `readers`, at least kMinPiece.
  int64_t piece_bytes() const;
  // RuntimeConfig.direct_io: open the blob a second time with O_DIRECT and
  // read records through it (bypassing the page cache). Throws one line
  // naming the file where its filesystem refuses direct reads. Once, at load.
  void open_direct();
  bool direct() const {
    return dfd_ >= 0;
  }
  // RuntimeConfig.mapped: map the blob read-only and resolve each call to
  // its experts' ids, not slots: the kernel (ExpertMlpMapped) reads each
  // routed record where the page cache holds it, and nothing is copied. A
  // call counts a record a hit when every page of it is in the page cache
  // (mincore), else a miss whose absent bytes it counts read; it asks the
  // kernel to read a call's misses at once (MADV_WILLNEED), has the readers
  // map them in and check each record's checksum the first time it is
  // routed, and leaves those reads in flight for the call's kernel
  // (take_pending). Once, at load; throws one line when the file is shorter
  // than its records.
  void map_blob();
  bool mapped() const {
    return map_ != nullptr;
  }
  // Take the mapping's pages out of this process's page tables (the page
  // cache keeps them, until dropped: a cold benchmark's start).
  void unmap_pages();
  const uint8_t* mapped_record(int expert) const {
    return map_ + data_offset_ + int64_t(expert) * stride_;
  }
  // O_DIRECT needs the file offset, the length and the destination aligned
  // to the device's logical block; 4 KiB covers every Linux block size.
  static constexpr int64_t kDirectAlign = 4096;
  // Ranges read through the buffered fd although direct_io is on, because
  // their destination was not kDirectAlign-aligned (tests: none on the
  // engine's paths).
  std::atomic<int64_t> unaligned_reads{0};
  int readers{8}; // RuntimeConfig.readers
  // Copy a read record into slot memory on the host (CPU slots).
  void fill_host(const uint8_t* record, int slot);
  // A stored float segment in the slot's float dtype, at `out` (cast.h).
  static void cast_host(const uint8_t* src, const Segment& seg, uint8_t* out);
  // Read ahead the predicted experts that are not resident: into the host
  // tier, else as kernel readahead.
  void hint(const uint32_t* experts, int64_t n);
  // The reads a mapped call left in flight, taken by its kernel (which
  // computes the call's other experts meanwhile); null where none.
  std::shared_ptr<struct PendingReads> take_pending() {
    return std::exchange(pending_, nullptr);
  }
  // Wait for a call's reads in flight: rethrows the first failed read, then
  // checks each record's checksum the first time.
  void finish(PendingReads& pending);

  // Make `experts` resident now (host-blocking; the caller has synchronized),
  // as (part of) call `call`.
  void load(const std::vector<int>& experts, int tokens, int64_t call);
  std::vector<int> table();

  const std::string path_;
  const int layer_;
  Counters counters;
  // Per expert: the calls resolved on the host that routed to it (hits plus
  // misses, one a call); the page's heat map (moestream/web).
  std::vector<std::atomic<int64_t>> uses;
  std::string error; // the first read error of a stream-side fetch
  std::mutex error_mutex;
  void set_error(const std::string& e);

  int num_experts, capacity, max_pairs;
  int64_t record_nbytes;
  std::vector<mx::array> slots;
  bool on_gpu{false};
  std::vector<Segment> segments;
  std::shared_ptr<GpuState> gpu; // made by the first GPU fetch
  // On a GPU: resolve each call's slots and tier records in a kernel, from
  // copies of the slot table and the tier's table on the device, instead of
  // in a host function of the stream; only records absent from the tier wait
  // on the host, and a chained layer reads the next one's ahead from there.
  bool device_resolve{true};
  int64_t tier_base() const {
    return tier_base_;
  }
  // The device's copy of the table is the current one (a kernel resolved
  // since the host last did): the host's is stale until gpu_sync_host.
  bool device_owned{false};

 private:
  void resolve(const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
               const std::function<void(int, int)>& write, CallRecord* rec);
  // `resolve` as a new call of the host tier: the misses' records are read
  // through the tier and handed to `use`. If a read fails, every miss of the
  // call leaves its slot and the error is rethrown.
  // The distinct experts of a call, in first-routed order, each marked in
  // `seen` (num_experts); an id out of range throws.
  std::vector<int> distinct(const uint32_t* experts, int64_t n,
                            std::vector<char>& seen) const;
  // Count a routed expert of a call: a hit or a miss, read ahead or not.
  void count(int expert, bool hit, CallRecord* rec);
  // `resolve` for a mapped blob: `out` is `experts`.
  void resolve_mapped(const uint32_t* experts, int64_t n, int tokens,
                      uint32_t* out, CallRecord* rec);
  // Start reading the records of `todo` (absent[e]: its pages; else only
  // checked) on the readers, kept in pending_ for the call's kernel.
  void read_behind(const std::vector<int>& todo, const std::vector<char>& absent);
  // Bytes of the record's pages that are not in the page cache.
  int64_t absent_bytes(int expert);
  // Map in the pages of [at, at + n) of `expert`'s record, reading those
  // absent from the page cache (MADV_POPULATE_READ); a failed read throws.
  void populate(int expert, const uint8_t* at, int64_t n);
  // The whole pages of the mapping that hold a record.
  std::pair<uint8_t*, int64_t> record_pages(int expert) const;
  // Combine a record's piece checksums (piece_bytes() each, in order) and
  // mark it verified, or throw a ReadError naming it.
  void check_pieces(int expert, const uint32_t* crcs);
  void resolve_through_tier(const uint32_t* experts, int64_t n, int tokens,
                            uint32_t* out, const UseRecord& use,
                            CallRecord* rec);
  int victim(const std::vector<char>& keep);
  void drop(int expert);
  void read_range(int expert, uint8_t* dst, int64_t begin, int64_t end);
  // pread until `n` bytes are read (or the file ends) through `fd`; the
  // bytes read, or -1 on an error (errno set).
  static int64_t pread_full(int fd, uint8_t* dst, int64_t n, int64_t offset,
                            bool direct);
  [[noreturn]] void read_failed(int expert, bool eof);
  void used(const std::vector<int>& experts, int tokens);

  friend struct GpuAccess; // cuda_fetch.cu: the table's device copy

  int fd_;
  int dfd_{-1}; // O_DIRECT, when direct_io
  uint8_t* map_{nullptr}; // the whole blob, read-only, when mapped
  int64_t map_len_{0};
  int64_t data_offset_, stride_;
  std::vector<uint32_t> checksums_;
  std::vector<char> verified_;
  bool verify_, lru_;
  double decay_;
  int64_t clock_{0};
  std::vector<double> score_;
  std::vector<int> slot_of_; // expert -> slot, -1 when absent
  std::vector<int> expert_in_; // slot -> expert, -1 when free
  std::vector<int> free_;
  std::vector<char> prefetched_; // hinted since its last call
  std::shared_ptr<PendingReads> pending_;
  const bool recording_;
  std::vector<uint32_t> hinted_; // read ahead since the last call (recording)
  std::mutex records_mutex_;
  std::vector<CallRecord> records_;
  std::shared_ptr<ExpertCache> next_;
  std::shared_ptr<HostTier> tier_;
  int64_t tier_base_{0};

 public:
  std::shared_ptr<ExpertCache> next() const {
    return next_;
  }
};

// routed expert ids -> slot ids, loading misses inside the stream.
class ExpertFetch : public mx::Primitive {
 public:
  ExpertFetch(mx::Stream s, std::shared_ptr<ExpertCache> cache, bool predicted,
              int64_t call)
      : mx::Primitive(s),
        cache_(std::move(cache)),
        predicted_(predicted),
        call_(call) {}
  void eval_cpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs,
                std::vector<mx::array>& outputs) override;
  const char* name() const override {
    return "ExpertFetch";
  }
  bool is_equivalent(const mx::Primitive&) const override {
    return false; // stateful: never merged by compile
  }

 private:
  std::shared_ptr<ExpertCache> cache_;
  bool predicted_;
  int64_t call_;
};

// `inds` routed expert ids (any shape, uint32); `predicted` the next layer's
// likely experts or none; `call` the id its counts are recorded under.
// Returns slot ids of the same shape.
mx::array fetch(std::shared_ptr<ExpertCache> cache, const mx::array& inds,
                const std::optional<mx::array>& predicted, int64_t call);

// Implemented in cuda_fetch.cu when built with CUDA, else throw.
void gpu_fetch(ExpertCache& cache, const std::vector<mx::array>& inputs,
               mx::array& out, bool predicted, int64_t call, mx::Stream s);
void gpu_load_copy(ExpertCache& cache, const uint8_t* record, int slot);
// When the device resolves a layer's calls: wait for the device, then make
// the host's table current again (before a host-side load reads it).
void gpu_sync_host(ExpertCache& cache);
// Fold in what the device counted and recorded for calls that have run, and
// its error, if any. Both do nothing where the device has not resolved.
void gpu_collect(ExpertCache& cache);
// The tier's counts from the device into its counters; its table back to
// the host (`table`). Both do nothing where no kernel resolves its records.
void gpu_tier_collect(HostTier& tier);
void gpu_tier_sync_host(HostTier& tier);
bool built_with_cuda();

} // namespace moestream
