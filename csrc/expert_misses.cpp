// ExpertCache's calls whose misses are read after the slot table has given
// them their slots: through the host tier's readers, or several records at
// once into CPU slots; the calls computed from the records in place, and a
// mapped blob's calls.
#include "expert_cache.h"

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace moestream {

// Read `expert`'s record once into a buffer that is then dropped: the read
// checks it (and leaves it in the page cache), or throws what failed.
static void read_to_check(RecordReader& reader, int expert, int64_t nbytes) {
  std::vector<uint8_t> scratch(static_cast<size_t>(nbytes));
  reader.read(expert, scratch.data());
}

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
                                      const UseRecord& use, CallRecord* rec,
                                      bool defer) {
  std::vector<int> missed, slots;
  resolve(experts, n, tokens, out, [&](int e, int s) {
    missed.push_back(e);
    slots.push_back(s);
  }, rec);
  if (defer && fills_.on()) { // the kernel fills what it can read in place
    size_t kept = 0;
    for (size_t i = 0; i < missed.size(); i++) {
      if (!fillable(missed[i])) {
        missed[kept] = missed[i];
        slots[kept++] = slots[i];
        continue;
      }
      fills_.put(slots[i], missed[i]);
      counters.kernel_fills += 1;
      counters.bytes_read += record_nbytes; // through the mapping
      if (rec) {
        rec->bytes_read += record_nbytes;
      }
    }
    missed.resize(kept);
    slots.resize(kept);
  }
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

void ExpertCache::fill_in_kernel(bool on) {
  if (!on) {
    settle_fills();
    fills_.unmap();
    return;
  }
  if (mapped() || tier_ || memory.on_gpu) {
    throw std::invalid_argument(
        "fill_in_kernel: only CPU slots without a host tier fill in the kernel");
  }
  if (!fills_.on()) {
    fills_.map(reader_.blob, reader_.fd(), reader_.reopens.load(), capacity);
  }
}

bool ExpertCache::cached(int expert) {
  if (reader_.reopens.load() != fills_.opens()) { // no fill is pending now
    fills_.map(reader_.blob, reader_.fd(), reader_.reopens.load(), capacity);
  }
  return !reader_.check.needed(expert) && !reader_.failing(expert) &&
         fills_.view().absent_bytes(expert) == 0;
}

bool ExpertCache::fillable(int expert) {
  if (!cached(expert)) {
    return false;
  }
  // map its pages in now: the kernel's reads never fault; if that fails,
  // it is read as any miss, which says what failed
  return fills_.view().map_in(expert);
}

std::vector<std::pair<int, int>> ExpertCache::in_place(const uint32_t* experts,
                                                      int64_t n, int tokens,
                                                      int64_t call) {
  if (!fills_.on()) {
    throw std::logic_error("in_place: the cache does not fill in the kernel");
  }
  release_in_place(); // a call whose kernel never ran
  settle_fills();     // none waits while cached() may map the blob again
  std::vector<char> seen(num_experts, 0);
  std::vector<std::pair<int, int>> routed;
  CallRecord record{call};
  CallRecord* rec = log.recording() && call >= 0 ? &record : nullptr;
  if (rec) {
    rec->prefetched = log.take_hinted();
  }
  const std::vector<int> unique = distinct(experts, n, seen);
  for (int e : unique) {
    routed.push_back({e, table_.slot(e)});
    count(e, routed.back().second >= 0, rec);
    if (routed.back().second >= 0) { // computed from its slot
      continue;
    }
    if (!cached(e)) {
      if (rec) { // (the reader counts it)
        rec->bytes_read += record_nbytes;
      }
      read_to_check(reader_, e, record_nbytes);
    }
    counters.bytes_read += record_nbytes; // through the mapping
    if (rec) {
      rec->bytes_read += record_nbytes;
    }
  }
  table_.used(unique, tokens);
  if (rec) {
    log.add(std::move(record));
  }
  return routed;
}

void ExpertCache::resolve_mapped(const uint32_t* experts, int64_t n,
                                 int tokens, uint32_t* out, CallRecord* rec) {
  if (auto pending = mapped_reads_.take()) { // a call whose kernel never ran
    mapped_reads_.finish(*pending);
  }
  std::vector<char> seen(num_experts, 0);
  std::vector<int> unique = distinct(experts, n, seen);
  if (rec) {
    rec->prefetched = log.take_hinted();
  }
  // A call wider than the window: the kernel maps in (and checks) each
  // record the window does not hold on one thread, so no more are mapped
  // at once than its threads and the window's (run_windowed).
  const bool wide = window.on() && int(unique.size()) > window.capacity();
  auto kernel_maps = [&](int e) { return wide && !window.holds(e); };
  mapped_reads_.call(unique, shared_from_this(), [&](int e, int64_t absent) {
    count(e, absent == 0, rec);
    counters.bytes_read += absent;
    if (rec) {
      rec->bytes_read += absent;
    }
  }, kernel_maps);
  table_.used(unique, tokens);
  std::copy(experts, experts + n, out);
}

const uint8_t* ExpertCache::map_in_place(int expert) {
  in_place_.push_back(expert);
  if (mapped()) { // read through the mapping: no read of its own
    map_again(reader_, expert, true, reader_.check.needed(expert));
    return mapped_record(expert);
  }
  const MappedBlob& view = fills_.view();
  try {
    view.populate(expert, view.record(expert), record_nbytes);
  } catch (const std::exception&) { // read it: that says what failed
    view.unmap_record(expert);
    read_to_check(reader_, expert, record_nbytes);
    view.populate(expert, view.record(expert), record_nbytes);
  }
  return view.record(expert);
}

void ExpertCache::release_in_place() {
  auto holds = [&](int r) { return window.holds(r); }; // (none without one)
  for (int e : in_place_) {
    in_place_view().unmap_span(e, holds);
  }
  in_place_.clear();
}

void ExpertCache::settle_fills() {
  if (!fills_.on()) {
    return;
  }
  const MappedBlob& view = fills_.view();
  for (auto [e, s] : fills_.take_all()) {
    try {
      view.populate(e, view.record(e), record_nbytes);
      memory.fill_host(view.record(e), s);
    } catch (const std::exception&) {
      table_.drop(e);
    }
    filled(e);
  }
}

} // namespace moestream
