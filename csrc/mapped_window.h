// The records a mapped layer keeps in this process's page tables under a
// memory budget (the mapped backend's `MemoryPlan.window`): the `capacity`
// most recently routed. The kernel lets the others go after each call.
#pragma once

#include <algorithm>
#include <vector>

namespace moestream {

class MappedWindow {
 public:
  // 0: every record stays mapped once read (no budget).
  void set_capacity(int capacity, int experts) {
    capacity_ = capacity;
    in_.assign(experts, 0);
    mapped_.assign(experts, 0);
    order_.clear();
  }
  bool on() const { return capacity_ > 0; }
  int capacity() const { return capacity_; }
  bool holds(int expert) const { return on() && in_[expert]; }
  // Whether a held record's pages are mapped, and what faults on them
  // mapped beside them let go since (run_windowed): a record taken in by a
  // prompt's call is held unmapped until a call reads it.
  bool mapped(int expert) const { return on() && mapped_[expert]; }
  void set_mapped(int expert, bool on) { mapped_[expert] = on; }
  // A call's experts become the most recent, in their order.
  void used(const std::vector<int>& experts) {
    auto routed = [&](int e) {
      return std::find(experts.begin(), experts.end(), e) != experts.end();
    };
    order_.erase(std::remove_if(order_.begin(), order_.end(), routed), order_.end());
    order_.insert(order_.begin(), experts.begin(), experts.end());
    for (int e : experts) {
      in_[e] = 1;
    }
  }
  // The experts past the capacity, least recent last: out of the window.
  std::vector<int> over() {
    std::vector<int> out;
    while (int(order_.size()) > capacity_) {
      out.push_back(order_.back());
      in_[order_.back()] = 0;
      mapped_[order_.back()] = 0;
      order_.pop_back();
    }
    return out;
  }

 private:
  int capacity_{0};
  std::vector<int> order_; // most recent first
  std::vector<char> in_;   // per expert: in order_
  std::vector<char> mapped_; // per expert: held and mapped
};

} // namespace moestream
