// The GPU read-ahead ring, host side: the service thread submits the reads
// kernels posted, and a table pull waits until they are done.
#include <atomic>
#include <chrono>
#include <thread>

#include "cuda_state.cuh"

namespace moestream {

// Until the service has submitted every read ahead the kernels posted and
// each has finished (the stream has run: no kernel posts more).
void wait_ahead_reads(TierGpu& tg) {
  if (!tg.ring) {
    return;
  }
  while (std::atomic_ref<int64_t>(tg.ring->head).load(
             std::memory_order_acquire) != tg.ring_taken.load() ||
         tg.ahead_pending.load() > 0) {
    service_busy();
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// The reads ahead kernels posted since the last look, queued behind the
// routed reads on the tier's readers; each tells the device when it is
// done through the slot's pinned state word (0 read, 2 failed).
void submit_ahead(TierGpu& tg) {
  int64_t head = std::atomic_ref<int64_t>(tg.ring->head).load(
      std::memory_order_acquire);
  int64_t taken = tg.ring_taken.load();
  if (head == taken) {
    return;
  }
  auto tier = tg.tier->weak_from_this().lock(); // null while it goes
  for (; taken < head; taken++) {
    AheadEntry e = tg.ring->entries[taken % tg.table.capacity];
    int* state = tg.table.state + e.slot;
    auto cache = e.cache->weak_from_this().lock();
    if (!tier || !cache) {
      std::atomic_ref<int>(*state).store(2);
      continue;
    }
    tg.ahead_pending += 1;
    submit_read([tier, cache, e, state, gpu = tier->gpu] {
      int result = 0;
      try {
        cache->read_record(e.expert, tier->data + e.slot * tier->record_bytes);
      } catch (const std::exception&) {
        result = 2; // routed later, it is read again and raises then
      }
      std::atomic_ref<int>(*state).store(result);
      gpu->ahead_pending -= 1;
    }, false, tier->readers());
  }
  tg.ring_taken.store(taken);
}

} // namespace moestream
