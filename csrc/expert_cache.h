// One MoE layer of the native engine: its slot table, record reader, host
// tier and call log, coordinated per call inside MLX's stream.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mlx/array.h"

#include "call_log.h"
#include "crc32.h"
#include "host_tier.h"
#include "mapped_reads.h"
#include "mapped_window.h"
#include "pending_fills.h"
#include "read_error.h"
#include "record_reader.h"
#include "slot_arrays.h"
#include "slot_table.h"

namespace mx = mlx::core;

namespace moestream {

// What one layer's cache is made from (native.expert_cache's keywords).
struct CacheConfig {
  BlobLayout blob;
  int capacity;
  std::vector<Segment> segments;
  std::vector<uint32_t> checksums; // one per expert when verifying
  bool verify;
  PolicyConfig policy;
  int max_pairs; // routed pairs one call may hold
  bool record_calls; // RuntimeStats.events
};

// Where a call's missed record is: (record, host tier slot or -1, slot).
using UseRecord = std::function<void(const uint8_t*, int64_t, int)>;

struct GpuState; // CUDA side: pinned buffers and kernels (cuda_state.cuh)

// Made in C++ (`std::make_shared`, see bindings.cpp) and shared from this:
// MLX's stream thread then holds plain references, never ones whose release
// needs Python's GIL (which the evaluating thread holds: a deadlock).
class ExpertCache : public std::enable_shared_from_this<ExpertCache> {
 public:
  explicit ExpertCache(CacheConfig config);

  void bind(std::vector<mx::array> slots, bool on_gpu) {
    memory.bind(std::move(slots), on_gpu, capacity);
  }
  // The layer whose predicted experts this one's calls read ahead.
  void chain(std::shared_ptr<ExpertCache> next) {
    next_ = std::move(next);
  }
  std::shared_ptr<ExpertCache> next() const {
    return next_;
  }
  // Read misses through `tier` (its readers, in parallel) from now on.
  void attach(std::shared_ptr<HostTier> tier);
  HostTier* tier() const {
    return tier_.get();
  }
  int64_t tier_base() const {
    return tier_base_;
  }
  // Read every record of this layer into the host tier (while it has room).
  int64_t preload_tier();

  // One call: the slot of every routed pair in `experts` (unique count <=
  // capacity), each miss's record read (through the host tier if attached,
  // else into the staging record) and handed to `use`. When recording, its
  // counts are kept under `call` (a negative id keeps none); the loads of one
  // grouped call share its id and add up.
  // `defer`: CPU slots whose kernel fills them (fill_in_kernel) leave a miss
  // it can read in place to it.
  void resolve_call(const uint32_t* experts, int64_t n, int tokens,
                    uint32_t* out, int64_t call, const UseRecord& use,
                    bool defer = false);
  // CPU slots that only the kernel reads, given this cache (ExpertMlp's
  // `fills`): a fetch's miss whose record has been checked and lies whole in
  // the page cache is not read. Its slot waits for the kernel, which computes
  // the call's pairs of it from the blob's mapping and writes the slot as it
  // reads (pending_fills): one pass over the record instead of a read, a
  // copy into the slot and a pass over the slot. A fill no kernel took is
  // made when the layer's next call resolves.
  void fill_in_kernel(bool on);
  // Whether it is on, and the slots that wait for their kernel: the kernel
  // takes each one's mapped record (its pages mapped in) there.
  PendingFills& pending_fills() { return fills_; }
  // A taken fill the kernel did not finish: its expert leaves the slot.
  void drop(int expert) { table_.drop(expert); }
  // A taken fill's record read: its pages leave this process's page tables
  // (the page cache keeps them), with what its faults mapped beside them, so
  // the process's resident memory stays its slots', as when records are read.
  void filled(int expert) {
    fills_.view().unmap_span(expert, [](int) { return false; });
  }
  // A call on the records in place (expert_mlp_in_place; counted as `call`):
  // its distinct experts and their slots (-1: none; the others' records
  // checked and in the page cache, for the kernel to map in, then let go).
  std::vector<std::pair<int, int>> in_place(const uint32_t* experts, int64_t n, int tokens, int64_t call);
  const uint8_t* map_in_place(int expert);
  // The mapping an in-place call maps its records through: a mapped blob's,
  // else the kernel fills' view of the blob.
  const MappedBlob& in_place_view() {
    return mapped() ? *reader_.mapped() : fills_.view();
  }
  void release_in_place(); // the records mapped in leave the page tables
  // Make `experts` resident now (host-blocking; the caller has synchronized),
  // as (part of) call `call`.
  void load(const std::vector<int>& experts, int tokens, int64_t call);
  // Per expert its slot, `capacity` when absent.
  std::vector<int> table();
  // Read ahead the predicted experts that are not resident: into the host
  // tier, else as a hint to the record source.
  void hint(const uint32_t* experts, int64_t n);
  // The records of the calls resolved since the last take, in call order.
  std::vector<CallRecord> take_records();

  // A record into `dst` (record_nbytes), verified once, read again once.
  void read_record(int expert, uint8_t* dst) {
    reader_.read(expert, dst);
  }
  RecordReader& reader() {
    return reader_;
  }
  // RuntimeConfig.mapped: calls resolve to expert ids, read in place by the
  // kernel (ExpertMlpMapped); each miss left in flight (take_pending).
  // `window`: records kept in the page tables (MappedWindow; 0: all), each
  // page mapped on its own.
  void map_blob(int window = 0) {
    reader_.map();
    if (window > 0) {
      reader_.mapped()->page_by_page();
    }
    this->window.set_capacity(window, num_experts);
  }
  bool mapped() const { return reader_.mapped() != nullptr; }
  const uint8_t* mapped_record(int expert) const { return reader_.mapped()->record(expert); }
  std::shared_ptr<PendingReads> take_pending() {
    return mapped_reads_.take();
  }
  void finish(PendingReads& pending) {
    mapped_reads_.finish(pending);
  }

  const int num_experts, capacity, max_pairs;
  const int64_t record_nbytes;
  SlotArrays memory;
  MappedWindow window; // a mapped blob's, under a memory budget
  Counters counters;
  CallLog log;
  // Per expert: the calls resolved on the host that routed to it (hits plus
  // misses, one a call); the page's heat map (moestream/web).
  std::vector<std::atomic<int64_t>> uses;
  std::shared_ptr<GpuState> gpu; // made by the first GPU fetch
  // On a GPU: resolve each call in a kernel from the device's copies of the
  // slot and tier tables (cuda_resolve.cu), else in a host function.
  bool device_resolve{true};
  // The device's copy of the table is the current one (a kernel resolved
  // since the host last did): the host's is stale until gpu_sync_host.
  bool device_owned{false};
  const PolicyConfig& policy() const {
    return table_.policy;
  }

 private:
  // The distinct experts of a call, in first-routed order, each marked in
  // `seen` (num_experts); an id out of range throws.
  std::vector<int> distinct(const uint32_t* experts, int64_t n,
                            std::vector<char>& seen) const;
  // Count a routed expert of a call: a hit or a miss, read ahead or not.
  void count(int expert, bool hit, CallRecord* rec);
  // The slots of a call; `write(e, s)` fills each miss's.
  void resolve(const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
               const std::function<void(int, int)>& write, CallRecord* rec);
  // `resolve` with the misses read through the host tier and handed to
  // `use`; if a read fails, every miss leaves its slot and it rethrows.
  void resolve_through_tier(const uint32_t* experts, int64_t n, int tokens,
                            uint32_t* out, const UseRecord& use,
                            CallRecord* rec);
  // `resolve` with the misses read and written into their CPU slots after
  // it, several at once (RecordReader::each_staged); if a read fails, every
  // miss leaves its slot and it rethrows.
  void resolve_in_parallel(const uint32_t* experts, int64_t n, int tokens,
                           uint32_t* out, const UseRecord& use,
                           CallRecord* rec, bool defer);
  // Make the fills no kernel took (a failed read drops the slot instead: the
  // next call that routes to its expert reads it and says why).
  void settle_fills();
  // A miss the kernel can fill: cached (checked, no failure injected, every
  // page of its record in the page cache), and now mapped in.
  bool fillable(int expert);
  bool cached(int expert);
  // `resolve` for a mapped blob: `out` is `experts`.
  void resolve_mapped(const uint32_t* experts, int64_t n, int tokens,
                      uint32_t* out, CallRecord* rec);

  friend struct GpuAccess; // cuda_tables.cu: the table's device copy

  SlotTable table_;
  RecordReader reader_;
  MappedReads mapped_reads_{reader_};
  std::vector<char> prefetched_; // hinted since its last call
  std::shared_ptr<ExpertCache> next_;
  std::shared_ptr<HostTier> tier_;
  int64_t tier_base_{0};
  PendingFills fills_; // fill_in_kernel's
  std::vector<int> in_place_; // the records an in-place call mapped in
};

} // namespace moestream
