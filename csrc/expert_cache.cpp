#include "expert_cache.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include "expert_fetch.h"

namespace moestream {

ExpertCache::ExpertCache(CacheConfig config)
    : num_experts(config.blob.num_experts),
      capacity(config.capacity),
      max_pairs(config.max_pairs),
      record_nbytes(config.blob.record_nbytes),
      memory(std::move(config.segments)),
      log(config.record_calls),
      uses(config.blob.num_experts),
      table_(config.blob.num_experts, config.capacity, config.policy),
      reader_(config.blob, std::move(config.checksums), config.verify),
      prefetched_(config.blob.num_experts, 0) {}

void ExpertCache::attach(std::shared_ptr<HostTier> tier) {
  tier_base_ = tier->add_layer(num_experts);
  tier_ = std::move(tier);
}

int64_t ExpertCache::preload_tier() {
  return tier_ ? tier_->preload(shared_from_this(), tier_base_, num_experts)
               : 0;
}

void ExpertCache::count(int expert, bool hit, CallRecord* rec) {
  uses[expert].fetch_add(1, std::memory_order_relaxed);
  if (prefetched_[expert]) {
    counters.prefetched_used += 1;
    counters.misses_prefetched += hit ? 0 : 1;
  }
  (hit ? counters.hits : counters.misses) += 1;
  if (rec) {
    (hit ? rec->hits : rec->misses) += 1;
  }
  prefetched_[expert] = 0;
}

std::vector<int> ExpertCache::distinct(const uint32_t* experts, int64_t n,
                                       std::vector<char>& seen) const {
  std::vector<int> unique;
  for (int64_t i = 0; i < n; i++) {
    uint32_t e = experts[i];
    if (e >= uint32_t(num_experts)) {
      throw std::runtime_error("routed expert id out of range");
    }
    if (!seen[e]) {
      seen[e] = 1;
      unique.push_back(int(e));
    }
  }
  return unique;
}

void ExpertCache::hint(const uint32_t* experts, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t e = experts[i];
    if (e >= uint32_t(num_experts) || table_.slot(int(e)) >= 0 ||
        prefetched_[e]) {
      continue;
    }
    if (tier_) {
      if (!tier_->read_ahead(shared_from_this(), tier_base_ + e, int(e))) {
        continue;
      }
    } else if (!reader_.source().hint(int(e))) {
      continue; // in the page cache already, or no use to the source
    }
    prefetched_[e] = 1;
    counters.prefetched += 1;
    counters.prefetch_bytes += record_nbytes;
    log.hinted(e);
  }
}

void ExpertCache::resolve_call(
    const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
    int64_t call, const UseRecord& use, bool defer) {
  CallRecord record{call};
  CallRecord* rec = log.recording() && call >= 0 ? &record : nullptr;
  if (fills_.on()) {
    settle_fills();
  }
  if (mapped()) {
    resolve_mapped(experts, n, tokens, out, rec);
  } else if (tier_) {
    resolve_through_tier(experts, n, tokens, out, use, rec);
  } else if (memory.on_gpu) { // one record at a time through the staging copy
    resolve(experts, n, tokens, out, [&](int e, int s) {
      reader_.staged(e, [&](const uint8_t* r) { use(r, -1, s); });
      if (rec) {
        rec->bytes_read += record_nbytes;
      }
    }, rec);
  } else {
    resolve_in_parallel(experts, n, tokens, out, use, rec, defer);
  }
  if (rec) {
    log.add(std::move(record));
  }
}

std::vector<CallRecord> ExpertCache::take_records() {
  gpu_collect(*this);
  return log.take();
}

void ExpertCache::resolve(
    const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
    const std::function<void(int, int)>& write, CallRecord* rec) {
  std::vector<char> keep(num_experts, 0);
  std::vector<int> unique = distinct(experts, n, keep);
  if (int(unique.size()) > capacity) {
    throw std::runtime_error("more routed experts than slots in one call");
  }
  if (rec) {
    rec->prefetched = log.take_hinted();
  }
  std::vector<int> evicted; // counted even when a fill fails
  auto seen = [&](int e, bool hit) { count(e, hit, rec); };
  try {
    table_.assign(unique, keep, seen, write, evicted);
  } catch (...) {
    counters.evictions += int64_t(evicted.size());
    throw;
  }
  counters.evictions += int64_t(evicted.size());
  table_.used(unique, tokens);
  for (int64_t i = 0; i < n; i++) {
    out[i] = uint32_t(table_.slot(int(experts[i])));
  }
}

void ExpertCache::load(const std::vector<int>& experts, int tokens,
                       int64_t call) {
  gpu_sync_host(*this);
  std::vector<uint32_t> ids(experts.begin(), experts.end());
  std::vector<uint32_t> out(ids.size());
  // The stream has run every earlier call: a tier's records they used may go.
  auto use = [&](const uint8_t* record, int64_t host, int s) {
    if (memory.on_gpu) { // a tier record (host >= 0) stays until we return
      gpu_load_copy(*this, record, s, host >= 0);
    } else {
      memory.fill_host(record, s);
    }
  };
  try {
    resolve_call(ids.data(), ids.size(), tokens, out.data(), call, use);
  } catch (...) {
    if (memory.on_gpu) {
      gpu_load_wait();
    }
    throw;
  }
  if (memory.on_gpu) {
    gpu_load_wait();
  }
}

std::vector<int> ExpertCache::table() {
  gpu_sync_host(*this);
  return table_.table();
}

} // namespace moestream
