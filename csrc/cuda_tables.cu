// GpuAccess: the slot table's and the tier's device copies made, pushed and
// pulled, and the device's counts and records folded into the host's.
#include <algorithm>

#include "cuda_tables.cuh"

namespace moestream {

// Whether this layer's calls resolve on the device, decided at its first
// call for good, as the cache asks (the tier's first such decision holds
// for all its layers).
bool GpuAccess::device_mode(ExpertCache& c, GpuState& g) {
  if (g.device_mode < 0) {
    HostTier& t = *c.tier();
    if (!t.gpu) {
      t.gpu = std::make_shared<TierGpu>();
      t.gpu->tier = &t;
    }
    TierGpu& tg = *t.gpu;
    bool on = c.device_resolve;
    if (tg.mode < 0) {
      if (on) {
        allocate_tier(tg);
      }
      tg.mode = on;
    } else if (tg.mode == 1 && !on) {
      throw std::runtime_error(
          "the layers of one host tier must all resolve on the device or "
          "none; give them one device_resolve");
    }
    on = on && tg.mode == 1;
    if (on) {
      allocate(c, g);
    }
    g.device_mode = on;
  }
  return g.device_mode == 1;
}

void GpuAccess::allocate(ExpertCache& c, GpuState& g) {
  int E = c.num_experts, C = c.capacity;
  size_t bytes = sizeof(double) * E + sizeof(int64_t) * (2 + NCOUNTS + E) +
      sizeof(int) * (2 * E + 2 * C + 1) + sizeof(int) * (2 * g.max_stage + 1) +
      E + 64;
  uint8_t* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  g.table_memory = p;
  auto& t = g.table;
  t.score = take<double>(p, E);
  t.clock = take<int64_t>(p, 1);
  t.loaded = take<int64_t>(p, E);
  t.loads = take<int64_t>(p, 1);
  t.counts = take<int64_t>(p, NCOUNTS);
  t.slot_of = take<int>(p, E);
  t.expert_in = take<int>(p, C);
  t.free_stack = take<int>(p, C);
  t.free_n = take<int>(p, 1);
  t.plan = reinterpret_cast<Plan*>(take<int>(p, 2 * g.max_stage + 1));
  t.prefetched = take<unsigned char>(p, E);
  check(cudaMemset(t.counts, 0, sizeof(int64_t) * NCOUNTS), "cudaMemset");
  g.report = pinned<DevReport>(1);
  *g.report = DevReport{};
}

void GpuAccess::allocate_tier(TierGpu& tg) {
  HostTier& h = *tg.tier;
  int64_t K = h.slot_of_.size(), C = h.capacity;
  size_t bytes = sizeof(int) * (K + 2 * C + 2) + sizeof(int64_t) * (2 * C + 6) +
      C + 64;
  uint8_t* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemset(p, 0, bytes), "cudaMemset");
  tg.table_memory = p;
  auto& t = tg.table;
  t.stamp = take<int64_t>(p, C);
  t.held = take<int64_t>(p, C);
  t.clock = take<int64_t>(p, 1);
  t.epoch = take<int64_t>(p, 1);
  t.counts = take<int64_t>(p, 4);
  t.slot_of = take<int>(p, K);
  t.key_in = take<int>(p, C);
  t.free_stack = take<int>(p, C);
  t.free_n = take<int>(p, 1);
  t.loading = take<int>(p, 1);
  t.ahead = take<unsigned char>(p, C);
  t.capacity = int(C);
  t.state = pinned<int>(C);
  std::fill(t.state, t.state + C, 0);
  tg.box = reinterpret_cast<Mailbox*>(
      pinned<uint8_t>(sizeof(Mailbox) + sizeof(int) * 3 * C));
  *tg.box = Mailbox{};
  tg.report = pinned<int64_t>(4);
  std::fill(tg.report, tg.report + 4, 0);
  service_register(&tg);
}

// The host's table to the device (the device's copy is not in use).
void GpuAccess::push(ExpertCache& c, GpuState& g) {
  auto& t = g.table;
  int E = c.num_experts, C = c.capacity;
  int free_n = int(c.table_.free_.size());
  std::vector<int> free_stack(c.table_.free_.begin(), c.table_.free_.end());
  free_stack.resize(C, -1);
  up(t.slot_of, c.table_.slot_of_.data(), sizeof(int) * E);
  up(t.expert_in, c.table_.expert_in_.data(), sizeof(int) * C);
  up(t.score, c.table_.score_.data(), sizeof(double) * E);
  up(t.free_stack, free_stack.data(), sizeof(int) * C);
  up(t.free_n, &free_n, sizeof(int));
  up(t.clock, &c.table_.clock_, sizeof(int64_t));
  up(t.loaded, c.table_.loaded_.data(), sizeof(int64_t) * E);
  up(t.loads, &c.table_.loads_, sizeof(int64_t));
  up(t.prefetched, c.prefetched_.data(), E);
  c.device_owned = true;
}

void GpuAccess::up(void* dst, const void* src, size_t n) {
  check(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice), "cudaMemcpy");
}

void GpuAccess::down(void* dst, const void* src, size_t n) {
  check(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
}

// The device's table to the host, once every call on it has run.
void GpuAccess::pull(ExpertCache& c, GpuState& g) {
  auto& t = g.table;
  int E = c.num_experts, C = c.capacity;
  int free_n = 0;
  std::vector<int> free_stack(C);
  down(c.table_.slot_of_.data(), t.slot_of, sizeof(int) * E);
  down(c.table_.expert_in_.data(), t.expert_in, sizeof(int) * C);
  down(c.table_.score_.data(), t.score, sizeof(double) * E);
  down(free_stack.data(), t.free_stack, sizeof(int) * C);
  down(&free_n, t.free_n, sizeof(int));
  down(&c.table_.clock_, t.clock, sizeof(int64_t));
  down(c.table_.loaded_.data(), t.loaded, sizeof(int64_t) * E);
  down(&c.table_.loads_, t.loads, sizeof(int64_t));
  down(c.prefetched_.data(), t.prefetched, E);
  c.table_.free_.assign(free_stack.begin(), free_stack.begin() + free_n);
  c.device_owned = false;
}

// The tier's table to the device, once no read is in flight. A record
// whose read failed leaves the tier (as its next request would have it).
void GpuAccess::push_tier(TierGpu& tg) {
  HostTier& h = *tg.tier;
  h.drain();
  std::lock_guard<std::mutex> lock(h.mutex_);
  int64_t K = h.slot_of_.size(), C = h.capacity;
  std::vector<int> slot_of(K, -1), key_in(C, -1);
  std::vector<int> free_stack(h.free_.begin(), h.free_.end());
  for (int64_t s = 0; s < C; s++) {
    if (h.state_[s] == HostTier::Ready) {
      key_in[s] = int(h.key_in_[s]);
      slot_of[h.key_in_[s]] = int(s);
    } else if (h.state_[s] == HostTier::Failed) {
      free_stack.push_back(int(s));
    }
  }
  int free_n = int(free_stack.size());
  free_stack.resize(C, -1);
  std::vector<int64_t> held(C, 0);
  auto& t = tg.table;
  up(t.slot_of, slot_of.data(), sizeof(int) * K);
  up(t.key_in, key_in.data(), sizeof(int) * C);
  up(t.stamp, h.stamp_.data(), sizeof(int64_t) * C);
  up(t.held, held.data(), sizeof(int64_t) * C);
  up(t.free_stack, free_stack.data(), sizeof(int) * C);
  up(t.free_n, &free_n, sizeof(int));
  up(t.clock, &h.clock_, sizeof(int64_t));
  std::vector<unsigned char> ahead(C, 0);
  int loading = 0;
  up(t.ahead, ahead.data(), C);
  up(t.loading, &loading, sizeof(int));
  std::fill(t.state, t.state + C, 0);
  tg.device_owned = true;
}

// The device's tier table to the host, once every call on it has run.
void GpuAccess::pull_tier(TierGpu& tg) {
  HostTier& h = *tg.tier;
  auto& t = tg.table;
  int64_t K = h.slot_of_.size(), C = h.capacity;
  std::vector<int> slot_of(K), key_in(C), free_stack(C);
  std::vector<unsigned char> ahead(C);
  int free_n = 0;
  std::lock_guard<std::mutex> lock(h.mutex_);
  down(ahead.data(), t.ahead, C);
  down(slot_of.data(), t.slot_of, sizeof(int) * K);
  down(key_in.data(), t.key_in, sizeof(int) * C);
  down(h.stamp_.data(), t.stamp, sizeof(int64_t) * C);
  down(free_stack.data(), t.free_stack, sizeof(int) * C);
  down(&free_n, t.free_n, sizeof(int));
  down(&h.clock_, t.clock, sizeof(int64_t));
  h.slot_of_.assign(slot_of.begin(), slot_of.end());
  for (int64_t s = 0; s < C; s++) {
    h.key_in_[s] = key_in[s];
    // A read ahead that failed: its next request reads it again.
    bool failed = ahead[s] == 2 || (ahead[s] == 1 && t.state[s] == 2);
    h.state_[s] = key_in[s] < 0 ? HostTier::Empty
        : failed               ? HostTier::Failed
                               : HostTier::Ready;
    h.error_[s].clear();
    h.held_[s] = 0;
  }
  h.held_list_.clear();
  h.free_.assign(free_stack.begin(), free_stack.begin() + free_n);
  tg.device_owned = false;
}

// Counts and records of the calls that have run, and the error flag.
void GpuAccess::collect(ExpertCache& c, GpuState& g) {
  int64_t now[NCOUNTS], d[NCOUNTS];
  for (int k = 0; k < NCOUNTS; k++) {
    now[k] = reinterpret_cast<volatile int64_t*>(g.report->counts)[k];
    d[k] = now[k] - g.taken[k];
  }
  c.counters.hits += d[Hits];
  c.counters.misses += d[Misses];
  c.counters.evictions += d[Evictions];
  c.counters.prefetched += d[Prefetched];
  c.counters.prefetch_bytes += d[Prefetched] * c.record_nbytes;
  c.counters.prefetched_used += d[PrefetchedUsed];
  c.counters.misses_prefetched += d[MissesPrefetched];
  std::copy(now, now + NCOUNTS, g.taken);
  int error = reinterpret_cast<volatile int*>(&g.report->error)[0];
  if (error) {
    g.report->error = 0;
    if (error != 3) { // a read's error: its words are set already
      c.log.set_error(error == 1   ? "routed expert id out of range"
                      : error == 2 ? "more routed experts than slots in one call"
                                   : "the host tier holds fewer records than "
                                     "one call needs; give a larger host budget");
    }
  }
  std::lock_guard<std::mutex> lock(g.records_mutex);
  while (!g.pending.empty()) {
    auto [call, r] = g.pending.front();
    int64_t hits = reinterpret_cast<volatile int64_t*>(&r->hits)[0];
    if (hits == -1) {
      break; // not run yet, nor any after it
    }
    if (hits >= 0) { // -2: the call failed, and keeps no record
      CallRecord record{call};
      record.hits = hits;
      record.misses = r->misses;
      record.bytes_read = r->bytes_read;
      c.log.add(std::move(record));
    }
    g.spare.push_back(r);
    g.pending.pop_front();
  }
}

// The tier's counts of the calls that have run.
void GpuAccess::collect_tier(TierGpu& tg) {
  auto& k = tg.tier->counters;
  int64_t now[4];
  for (int i = 0; i < 4; i++) {
    now[i] = reinterpret_cast<volatile int64_t*>(tg.report)[i];
  }
  k.hits += now[0] - tg.taken[0];
  k.misses += now[1] - tg.taken[1];
  k.evictions += now[2] - tg.taken[2];
  k.late += now[3] - tg.taken[3];
  std::copy(now, now + 4, tg.taken);
}

// A pinned record for the call being encoded, marked not run.
DevRecord* GpuAccess::record(GpuState& g, int64_t call) {
  std::lock_guard<std::mutex> lock(g.records_mutex);
  if (g.spare.empty()) {
    constexpr int CHUNK = 1024; // reused once collected
    auto* chunk = pinned<DevRecord>(CHUNK);
    g.chunks.push_back(chunk);
    for (int i = 0; i < CHUNK; i++) {
      g.spare.push_back(chunk + i);
    }
  }
  auto* r = g.spare.back();
  g.spare.pop_back();
  r->misses = 0;
  r->bytes_read = 0;
  r->hits = -1;
  g.pending.push_back({call, r});
  return r;
}

} // namespace moestream
