#include "host_tier.h"

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>

#include "expert_cache.h"
#include "record_source.h"
#include "slot_policy.h"

namespace moestream {

HostTier::HostTier(int64_t capacity, int64_t record_bytes, int readers,
                   bool pinned)
    : capacity(capacity),
      record_bytes(record_bytes),
      pinned(pinned),
      key_in_(capacity, -1),
      stamp_(capacity, 0),
      state_(capacity, Empty),
      error_(capacity),
      held_(capacity, 0),
      readers_(readers) {
  if (capacity < 1 || record_bytes < 1 || readers < 1) {
    throw std::invalid_argument(
        "a host tier needs at least one record and one reader");
  }
  data = host_alloc(size_t(capacity) * record_bytes, pinned);
  for (int64_t s = capacity - 1; s >= 0; s--) {
    free_.push_back(s);
  }
}

HostTier::~HostTier() {
  host_free(data, pinned);
}

int64_t HostTier::add_layer(int num_experts) {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t base = slot_of_.size();
  slot_of_.resize(base + num_experts, -1);
  return base;
}

void HostTier::begin_call() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t s : held_list_) {
    held_[s] = 0;
  }
  held_list_.clear();
}

bool HostTier::holds(int64_t key) {
  std::lock_guard<std::mutex> lock(mutex_);
  return slot_of_[key] >= 0;
}

int64_t HostTier::filled() {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t n = 0;
  for (int64_t key : key_in_) {
    n += key >= 0;
  }
  return n;
}

std::vector<int64_t> HostTier::keys() {
  std::lock_guard<std::mutex> lock(mutex_);
  return key_in_;
}

int64_t HostTier::victim(std::unique_lock<std::mutex>& lock, bool wait) {
  while (true) {
    if (!free_.empty()) {
      int64_t s = free_.back();
      free_.pop_back();
      return s;
    }
    int64_t best = -1;
    for (int64_t s = 0; s < capacity; s++) {
      bool usable = (state_[s] == Ready || state_[s] == Failed) && !held_[s];
      if (usable && (best < 0 || policy::evicts_before(stamp_[s], s,
                                                       stamp_[best], best))) {
        best = s;
      }
    }
    if (best >= 0) {
      slot_of_[key_in_[best]] = -1;
      key_in_[best] = -1;
      state_[best] = Empty;
      counters.evictions += 1;
      return best;
    }
    if (!wait) {
      return -1;
    }
    if (loading_ == 0) {
      throw std::runtime_error(
          "the host tier holds fewer records than one call needs; give a "
          "larger host budget");
    }
    ready_.wait(lock); // a read ahead finishes, or a held record frees
  }
}

void HostTier::claim(int64_t slot, int64_t key) {
  key_in_[slot] = key;
  slot_of_[key] = slot;
  state_[slot] = Loading;
  stamp_[slot] = ++clock_;
  loading_ += 1;
}

void HostTier::enqueue(std::shared_ptr<ExpertCache> cache, int expert,
                       int64_t slot, int64_t key, bool front) {
  // The task keeps the tier and the cache alive until it has run.
  auto task = [tier = shared_from_this(), cache = std::move(cache), expert,
               slot, key] {
    std::string failure;
    try {
      cache->read_record(expert, tier->data + slot * tier->record_bytes);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    {
      std::lock_guard<std::mutex> lock(tier->mutex_);
      tier->state_[slot] = failure.empty() ? Ready : Failed;
      tier->error_[slot] = std::move(failure);
      tier->loading_ -= 1;
    }
    tier->ready_.notify_all();
  };
  submit_read(std::move(task), front, readers_);
}

int64_t HostTier::request(const std::shared_ptr<ExpertCache>& cache,
                          int64_t key, int expert, bool& read) {
  std::unique_lock<std::mutex> lock(mutex_);
  int64_t s = slot_of_[key];
  if (s >= 0 && state_[s] == Failed) { // a failed read ahead: read again
    slot_of_[key] = -1;
    key_in_[s] = -1;
    state_[s] = Empty;
    free_.push_back(s);
    s = -1;
  }
  read = s < 0;
  if (s >= 0) {
    (state_[s] == Ready ? counters.hits : counters.late) += 1;
    stamp_[s] = ++clock_;
  } else {
    s = victim(lock, true);
    claim(s, key);
    counters.misses += 1;
    enqueue(cache, expert, s, key, true);
  }
  if (!held_[s]) {
    held_[s] = 1;
    held_list_.push_back(s);
  }
  return s;
}

bool HostTier::read_ahead(const std::shared_ptr<ExpertCache>& cache,
                          int64_t key, int expert) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (slot_of_[key] >= 0 || 2 * loading_ >= capacity) {
    return false;
  }
  int64_t s = victim(lock, false);
  if (s < 0) {
    return false;
  }
  claim(s, key);
  enqueue(cache, expert, s, key, false);
  return true;
}

int64_t HostTier::preload(const std::shared_ptr<ExpertCache>& cache,
                          int64_t base, int num_experts) {
  std::unique_lock<std::mutex> lock(mutex_);
  int64_t queued = 0;
  for (int e = 0; e < num_experts; e++) { // in file order
    if (slot_of_[base + e] >= 0) {
      continue;
    }
    int64_t s = victim(lock, false);
    if (s < 0) {
      break;
    }
    claim(s, base + e);
    enqueue(cache, e, s, base + e, false);
    queued += 1;
  }
  return queued;
}

void HostTier::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  ready_.wait(lock, [&] { return loading_ == 0; });
}

const uint8_t* HostTier::wait(int64_t slot, int64_t key) {
  std::unique_lock<std::mutex> lock(mutex_);
  // The waiting thread reads too: routed reads are at the front of the queue,
  // so it takes its own call's misses before any read ahead.
  while (state_[slot] == Loading) {
    lock.unlock();
    bool ran = run_routed_read();
    lock.lock();
    if (!ran) {
      ready_.wait(lock, [&] { return state_[slot] != Loading; });
    }
  }
  if (state_[slot] == Failed) {
    std::string e = error_[slot];
    slot_of_[key] = -1;
    key_in_[slot] = -1;
    state_[slot] = Empty;
    held_[slot] = 0;
    free_.push_back(slot);
    throw std::runtime_error(e);
  }
  return data + slot * record_bytes;
}

uint8_t* host_alloc(size_t bytes, bool pinned) {
  if (pinned) {
    return pinned_alloc(bytes);
  }
  constexpr size_t align = kPageAlign;
  auto* p = static_cast<uint8_t*>(
      std::aligned_alloc(align, (bytes + align - 1) / align * align));
  if (!p) {
    throw std::bad_alloc();
  }
  return p;
}

void host_free(uint8_t* p, bool pinned) {
  if (pinned) {
    pinned_free(p);
  } else {
    std::free(p);
  }
}

} // namespace moestream
