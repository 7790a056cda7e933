// ExpertCache's calls whose misses are read after the slot table has given
// them their slots: through the host tier's readers, or several records at
// once into CPU slots.
#include "expert_cache.h"

#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moestream {

void ExpertCache::resolve_through_tier(
    const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
    const UseRecord& use, CallRecord* rec) {
  tier_->begin_call();
  std::vector<std::pair<int, int>> misses;
  resolve(experts, n, tokens, out,
          [&](int e, int s) { misses.push_back({e, s}); }, rec);
  std::vector<int64_t> host(misses.size());
  std::string failure;
  for (size_t i = 0; i < misses.size(); i++) {
    try { // queued first, so the readers work on all of them at once
      bool read = false;
      host[i] = tier_->request(shared_from_this(), tier_base_ + misses[i].first,
                               misses[i].first, read);
      if (rec && read) {
        rec->bytes_read += record_nbytes;
      }
    } catch (const std::exception& e) {
      host[i] = -1;
      failure = failure.empty() ? e.what() : failure;
    }
  }
  for (size_t i = 0; i < misses.size(); i++) {
    if (host[i] < 0) {
      continue;
    }
    try {
      auto* record = tier_->wait(host[i], tier_base_ + misses[i].first);
      if (failure.empty()) {
        use(record, host[i], misses[i].second);
      }
    } catch (const std::exception& e) {
      failure = failure.empty() ? e.what() : failure;
    }
  }
  if (!failure.empty()) {
    for (auto& [e, s] : misses) {
      table_.drop(e);
    }
    throw std::runtime_error(failure);
  }
}

void ExpertCache::resolve_in_parallel(const uint32_t* experts, int64_t n,
                                      int tokens, uint32_t* out,
                                      const UseRecord& use, CallRecord* rec) {
  std::vector<int> missed, slots;
  resolve(experts, n, tokens, out, [&](int e, int s) {
    missed.push_back(e);
    slots.push_back(s);
  }, rec);
  if (missed.empty()) {
    return;
  }
  try {
    reader_.each_staged(missed, [&](size_t i, const uint8_t* r) {
      use(r, -1, slots[i]);
    });
  } catch (...) { // no slot keeps a record that may not have been written
    for (int e : missed) {
      table_.drop(e);
    }
    throw;
  }
  if (rec) {
    rec->bytes_read += record_nbytes * int64_t(missed.size());
  }
}

} // namespace moestream
