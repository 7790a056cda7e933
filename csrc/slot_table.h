// Which expert sits in which device (or host) slot of one layer, and which
// goes when a routed expert needs room: the policy of slot_policy.h.
#pragma once

#include <functional>
#include <vector>

#include "slot_policy.h"

namespace moestream {

class SlotTable {
 public:
  SlotTable(int num_experts, int capacity, PolicyConfig policy);

  // The expert's slot, -1 when absent.
  int slot(int expert) const {
    return slot_of_[expert];
  }
  // Slots for `unique` (distinct experts, each marked in `keep`): `seen(e,
  // hit)` for each in order, then each absent one takes a free slot or the
  // victim's and is written by `fill(e, slot)` (a throw leaves that slot free
  // and propagates). Each evicted expert is added to `evicted`, in order.
  void assign(const std::vector<int>& unique, const std::vector<char>& keep,
              const std::function<void(int, bool)>& seen,
              const std::function<void(int, int)>& fill,
              std::vector<int>& evicted);
  // The scores after a call of `tokens` tokens that routed `experts`.
  void used(const std::vector<int>& experts, int tokens);
  // The expert leaves its slot (its content is no longer trusted).
  void drop(int expert);
  // Per expert its slot, `capacity` when absent.
  std::vector<int> table() const;
  // One call of the policy alone (the test against runtime/pool.py): the
  // experts `experts` evicts, in order.
  std::vector<int> access(const std::vector<int>& experts, int tokens);

  const int num_experts, capacity;
  const PolicyConfig policy;

 private:
  int victim(const std::vector<char>& keep) const;
  // Load keys for the misses placed by one call, in expert order.
  void loaded(const std::vector<int>& missed);

  friend struct GpuAccess; // cuda_tables.cu: the table's device copy

  std::vector<double> score_;
  std::vector<int> slot_of_; // expert -> slot, -1 when absent
  std::vector<int> expert_in_; // slot -> expert, -1 when free
  std::vector<int> free_; // a stack: the last one is taken first
  int64_t clock_{0};
  std::vector<int64_t> loaded_; // expert -> its load's key (slot_policy.h)
  int64_t loads_{0}; // load keys given so far
};

} // namespace moestream
