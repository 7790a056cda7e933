// What a layer's calls leave behind for Python: counts, one record per call
// (when recording, RuntimeStats.events), the first error of a stream call.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace moestream {

// A layer's counts since Python last took them (RuntimeStats).
struct Counters {
  std::atomic<int64_t> hits{0}, misses{0}, evictions{0}, bytes_read{0};
  // calls: fetches resolved inside the stream (not host-side loads)
  std::atomic<int64_t> calls{0}, prefetched{0}, prefetched_used{0};
  std::atomic<int64_t> device_calls{0}; // of calls: resolved by a kernel
  std::atomic<int64_t> misses_prefetched{0}, prefetch_bytes{0};
  std::atomic<int64_t> kernel_fills{0}; // of misses: left to the kernel
};

// One call's counts, kept in call order when recording.
struct CallRecord {
  int64_t call; // the caller's id of the call (its event's step)
  int64_t hits{0}, misses{0}, bytes_read{0}; // distinct experts; blob bytes
  std::vector<uint32_t> prefetched; // read ahead for it since the last call
};

class CallLog {
 public:
  explicit CallLog(bool recording) : recording_(recording) {}
  bool recording() const {
    return recording_;
  }
  // Keep one call's record, added to the last one's when it has the same id
  // (the loads of one grouped call).
  void add(CallRecord&& record);
  // The records kept since the last take, in call order.
  std::vector<CallRecord> take();
  // An expert read ahead for the next call (recording only).
  void hinted(uint32_t expert);
  std::vector<uint32_t> take_hinted();
  // The first error since the last take wins: later ones follow from it.
  void set_error(const std::string& error);
  std::string take_error();

 private:
  const bool recording_;
  std::mutex mutex_;
  std::vector<CallRecord> records_;
  std::vector<uint32_t> hinted_; // only the stream's thread touches it
  std::string error_;
};

} // namespace moestream
