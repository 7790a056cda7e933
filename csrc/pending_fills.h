// CPU slots that the kernel fills (ExpertCache::fill_in_kernel): the blob's
// read-only mapping the kernel reads missed records from, and per slot the
// expert whose record the slot waits for.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "mapped_blob.h"

namespace moestream {

class PendingFills {
 public:
  // Map the blob through `fd`, for `slots` slots; `opens` names the open
  // file (the reader's count of reopens), so a reopened one is mapped again.
  void map(const BlobLayout& blob, int fd, int opens, int slots) {
    view_ = std::make_unique<MappedBlob>(blob, fd);
    view_->page_by_page(); // the slots' budget counts a record a thread
    opens_ = opens;
    fills_.assign(slots, -1);
    pending_ = 0;
  }
  void unmap() {
    view_.reset();
  }
  bool on() const {
    return bool(view_);
  }
  int opens() const {
    return opens_;
  }
  const MappedBlob& view() const {
    return *view_;
  }
  void put(int slot, int expert) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_ += fills_[slot] < 0;
    fills_[slot] = expert;
  }
  // Whether any slot waits for its record.
  bool pending() const {
    return pending_.load() > 0;
  }
  // The pending fill of `slot`, taken: its expert's mapped record (and
  // `expert`), or null.
  const uint8_t* take(int slot, int& expert) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!view_ || slot < 0 || slot >= int(fills_.size()) || fills_[slot] < 0) {
      return nullptr;
    }
    expert = std::exchange(fills_[slot], -1);
    pending_ -= 1;
    return view_->record(expert);
  }
  // Every pending fill, taken: (expert, slot).
  std::vector<std::pair<int, int>> take_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<int, int>> left;
    for (size_t s = 0; s < fills_.size(); s++) {
      if (fills_[s] >= 0) {
        left.push_back({std::exchange(fills_[s], -1), int(s)});
      }
    }
    pending_ = 0;
    return left;
  }

 private:
  std::unique_ptr<MappedBlob> view_;
  int opens_{0};
  std::mutex mutex_;
  std::vector<int> fills_; // per slot: the expert it waits for, or -1
  std::atomic<int> pending_{0}; // slots that wait
};

} // namespace moestream
