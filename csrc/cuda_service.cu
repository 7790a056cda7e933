// The tier's service thread: it has the records a kernel posted to a tier's
// mailbox read on the reader threads.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda_state.cuh"

namespace moestream {

namespace {

// The thread that serves every tier's mailbox: it has the records a kernel
// posted read on the tier's reader threads, then raises `done`. Process-wide
// and never destroyed (as the readers are); it holds no tier or cache (a
// posted call keeps its own alive). It spins for a second after a call is
// encoded or served, else looks every millisecond: a kernel that waits finds
// it within that, however late the stream runs.
struct Service {
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<TierGpu*> tiers;
  std::atomic<int64_t> busy_until{0}; // steady clock, ns
  bool started{false};
};

Service& service() {
  static auto* s = new Service();
  return *s;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void service_loop();

} // namespace

void service_busy() {
  service().busy_until = now_ns() + 1000000000;
  service().wake.notify_one();
}

void service_register(TierGpu* tg) {
  auto& sv = service();
  std::lock_guard<std::mutex> lock(sv.mutex);
  sv.tiers.push_back(tg);
  if (!sv.started) {
    sv.started = true;
    std::thread(service_loop).detach();
  }
  sv.wake.notify_one();
}

void service_unregister(TierGpu* tg) {
  auto& sv = service();
  std::lock_guard<std::mutex> lock(sv.mutex);
  std::erase(sv.tiers, tg);
}

TierGpu::~TierGpu() {
  if (box) { // registered with the service
    service_unregister(this);
    cudaFreeHost(box);
    cudaFreeHost(table.state);
    cudaFreeHost(report);
  }
  cudaFree(table_memory);
}

// Copies of ExpertCache's and HostTier's tables between the host and the

// The records a kernel posted, read on the tier's reader threads (this
// thread reads too), then `done` raised: the kernel goes on.
void serve(TierGpu& tg, int64_t seq) {
  Mailbox* b = tg.box;
  HostTier* h = tg.tier;
  ExpertCache* cache = b->cache;
  int capacity = tg.table.capacity, n = b->n;
  int* expert = b->entries;
  int* slot = expert + capacity;
  int* status = slot + capacity;
  struct Left {
    std::mutex mutex;
    std::condition_variable done;
    int n;
  };
  auto left = std::make_shared<Left>();
  left->n = n;
  for (int i = 0; i < n; i++) {
    submit_read([=] {
      int failed = 0;
      try {
        cache->read_record(expert[i], h->data + slot[i] * h->record_bytes);
      } catch (const std::exception& e) {
        failed = 1;
        cache->log.set_error(e.what());
      }
      status[i] = failed;
      std::lock_guard<std::mutex> lock(left->mutex);
      if (--left->n == 0) {
        left->done.notify_all();
      }
    }, true, h->readers());
  }
  while (run_routed_read()) {
  }
  {
    std::unique_lock<std::mutex> lock(left->mutex);
    left->done.wait(lock, [&] { return left->n == 0; });
  }
  int failed = 0;
  for (int i = 0; i < n; i++) {
    failed += status[i];
  }
  b->failed = failed;
  std::atomic_ref<int64_t>(b->done).store(seq, std::memory_order_seq_cst);
  tg.served = seq;
}

namespace {

void service_loop_body(Service& sv) {
  TierGpu* found = nullptr;
  int64_t seq = 0;
  {
    std::unique_lock<std::mutex> lock(sv.mutex);
    if (sv.tiers.empty()) {
      sv.wake.wait(lock);
      return;
    }
    for (auto* tg : sv.tiers) {
      seq = std::atomic_ref<int64_t>(tg->box->posted).load(
          std::memory_order_acquire);
      if (seq != tg->served) {
        found = tg;
        break;
      }
    }
    if (!found && now_ns() > sv.busy_until) {
      sv.wake.wait_for(lock, std::chrono::milliseconds(1));
      return;
    }
  }
  if (found) { // its call is in flight: the tier and cache are alive
    serve(*found, seq);
    sv.busy_until = now_ns() + 1000000000;
  } else {
    std::this_thread::yield();
  }
}

void service_loop() {
  auto& sv = service();
  while (true) {
    service_loop_body(sv);
  }
}
} // namespace

} // namespace moestream
