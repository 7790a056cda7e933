#include "slot_table.h"

#include <stdexcept>

namespace moestream {

SlotTable::SlotTable(int num_experts, int capacity, PolicyConfig policy)
    : num_experts(num_experts),
      capacity(capacity),
      policy(policy),
      score_(num_experts, 0.0),
      slot_of_(num_experts, -1),
      expert_in_(capacity, -1),
      loaded_(num_experts, 0) {
  if (capacity < 1 || capacity > num_experts) {
    throw std::invalid_argument("capacity must be in 1..num_experts");
  }
  for (int s = capacity - 1; s >= 0; s--) {
    free_.push_back(s);
  }
}

int SlotTable::victim(const std::vector<char>& keep) const {
  int best = -1;
  for (int s = 0; s < capacity; s++) {
    int e = expert_in_[s];
    if (!keep[e] &&
        (best < 0 ||
         policy::evicts_before(score_[e], loaded_[e], score_[expert_in_[best]],
                               loaded_[expert_in_[best]]))) {
      best = s;
    }
  }
  return best;
}

void SlotTable::assign(const std::vector<int>& unique,
                       const std::vector<char>& keep,
                       const std::function<void(int, bool)>& seen,
                       const std::function<void(int, int)>& fill,
                       std::vector<int>& evicted) {
  std::vector<int> missed;
  for (int e : unique) {
    seen(e, slot_of_[e] >= 0);
    if (slot_of_[e] >= 0) {
      continue;
    }
    int s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else {
      s = victim(keep);
      evicted.push_back(expert_in_[s]);
      slot_of_[expert_in_[s]] = -1;
    }
    expert_in_[s] = -1;
    try {
      fill(e, s);
    } catch (...) {
      free_.push_back(s); // its content is partial: the slot stays free
      loaded(missed);
      throw;
    }
    expert_in_[s] = e;
    slot_of_[e] = s;
    missed.push_back(e);
  }
  loaded(missed);
}

void SlotTable::loaded(const std::vector<int>& missed) {
  int n = int(missed.size());
  for (int j = 0; j < n; j++) {
    loaded_[missed[j]] = policy::load_key(missed.data(), n, j, loads_);
  }
  loads_ += n;
}

void SlotTable::used(const std::vector<int>& experts, int tokens) {
  if (policy.lru) {
    clock_ += 1;
    for (int e : experts) {
      score_[e] = policy::lru_used(clock_);
    }
    return;
  }
  double f = policy::decay_factor(policy.decay, tokens);
  for (auto& s : score_) {
    s = policy::mul(s, f);
  }
  for (int e : experts) {
    score_[e] = policy::lrfu_used(score_[e]);
  }
}

void SlotTable::drop(int expert) {
  int s = slot_of_[expert];
  if (s >= 0) {
    slot_of_[expert] = -1;
    expert_in_[s] = -1;
    free_.push_back(s);
  }
}

std::vector<int> SlotTable::table() const {
  std::vector<int> t(num_experts);
  for (int e = 0; e < num_experts; e++) {
    t[e] = slot_of_[e] < 0 ? capacity : slot_of_[e];
  }
  return t;
}

std::vector<int> SlotTable::access(const std::vector<int>& experts,
                                   int tokens) {
  std::vector<char> keep(num_experts, 0);
  std::vector<int> unique;
  for (int e : experts) {
    if (e < 0 || e >= num_experts) {
      throw std::invalid_argument("routed expert id out of range");
    }
    if (!keep[e]) {
      keep[e] = 1;
      unique.push_back(e);
    }
  }
  if (int(unique.size()) > capacity) {
    throw std::invalid_argument("more routed experts than slots in one call");
  }
  std::vector<int> evicted;
  assign(unique, keep, [](int, bool) {}, [](int, int) {}, evicted);
  used(unique, tokens);
  return evicted;
}

} // namespace moestream
