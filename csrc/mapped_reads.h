// The reads of one mapped call still in flight when its fetch returned: the
// kernel (ExpertMlpMapped) computes the call's other experts first, then
// waits for these (finish).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "record_reader.h"

namespace moestream {

struct PendingReads {
  std::vector<int> experts; // the call's records in flight
  std::vector<char> absent, check; // per record: read it, check it
  std::vector<char> failed; // per record: a piece's read failed
  std::vector<char> in_flight; // per expert of the layer
  std::vector<uint32_t> crcs; // per piece
  std::mutex mutex;
  std::condition_variable done;
  int left{0}; // pieces not yet done
};

class MappedReads {
 public:
  explicit MappedReads(RecordReader& reader) : reader_(reader) {}
  // A call's routed records: `seen(e, absent bytes)` for each; every miss
  // asked of the kernel at once, then the misses and the records routed for
  // the first time read (and checked) on the readers, left in flight for the
  // kernel, which computes the call's other experts meanwhile. Those where
  // `kernel_maps(e)` the kernel maps in and checks itself, a record a thread
  // (map_here: a call wider than its layer's MappedWindow).
  void call(const std::vector<int>& unique, std::shared_ptr<void> keep,
            const std::function<void(int, int64_t)>& seen,
            const std::function<bool(int)>& kernel_maps);
  // Start reading the records of `todo` (absent[e]: map its pages in; else
  // only check it) in pieces on the readers; `keep` holds their owner alive.
  void start(const std::vector<int>& todo, const std::vector<char>& absent,
             std::shared_ptr<void> keep);
  // The reads in flight, taken by the call's kernel; null where none.
  std::shared_ptr<PendingReads> take() {
    return std::exchange(pending_, nullptr);
  }
  // Wait for them, then check each record's checksum the first time; a
  // record whose read or check failed is read once more, and a second
  // failure throws its ReadError.
  void finish(PendingReads& pending);

 private:
  RecordReader& reader_;
  std::shared_ptr<PendingReads> pending_;
};

// A mapped record's pages mapped in and the record checked the first time,
// on this thread: false where either failed (or a failure is injected), its
// pages let go again; map_again then says why.
bool map_here(RecordReader& reader, int expert);
// A mapped record's pages mapped in (`absent`) and the record checked
// (`check`) once more on this thread; a failure throws its ReadError.
void map_again(RecordReader& reader, int expert, bool absent, bool check);

} // namespace moestream
