#include "call_log.h"

#include <utility>

namespace moestream {

void CallLog::add(CallRecord&& record) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!records_.empty() && records_.back().call == record.call) { // grouped
    auto& last = records_.back();
    last.hits += record.hits;
    last.misses += record.misses;
    last.bytes_read += record.bytes_read;
    last.prefetched.insert(last.prefetched.end(), record.prefetched.begin(),
                           record.prefetched.end());
  } else {
    records_.push_back(std::move(record));
  }
}

std::vector<CallRecord> CallLog::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(records_, {});
}

void CallLog::hinted(uint32_t expert) {
  if (recording_) {
    hinted_.push_back(expert);
  }
}

std::vector<uint32_t> CallLog::take_hinted() {
  return std::exchange(hinted_, {});
}

void CallLog::set_error(const std::string& error) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_.empty()) {
    error_ = error;
  }
}

std::string CallLog::take_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(error_, std::string());
}

} // namespace moestream
