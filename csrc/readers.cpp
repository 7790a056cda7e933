#include "readers.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace moestream {

namespace {

// Process-wide and never destroyed: a reader may run a task whose captures
// are the last references to a tier, and no thread is joined at exit.
struct Readers {
  std::mutex mutex;
  std::condition_variable work;
  std::deque<std::pair<bool, std::function<void()>>> queue; // (routed, read)
  int threads{0};

  void run() {
    while (true) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex);
        work.wait(lock, [&] { return !queue.empty(); });
        task = std::move(queue.front().second);
        queue.pop_front();
      }
      task();
    }
  }
};

Readers& readers() {
  static auto* r = new Readers();
  return *r;
}

} // namespace

void submit_read(std::function<void()> task, bool front, int threads) {
  auto& r = readers();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    for (; r.threads < threads; r.threads++) {
      std::thread([&r] { r.run(); }).detach();
    }
    if (front) {
      r.queue.emplace_front(true, std::move(task));
    } else {
      r.queue.emplace_back(false, std::move(task));
    }
  }
  r.work.notify_one();
}

bool run_routed_read() {
  auto& r = readers();
  std::function<void()> task;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    if (r.queue.empty() || !r.queue.front().first) {
      return false;
    }
    task = std::move(r.queue.front().second);
    r.queue.pop_front();
  }
  task();
  return true;
}

void parallel_reads(int n, int threads, const std::function<void(int)>& body) {
  if (n <= 1) {
    if (n == 1) {
      body(0);
    }
    return;
  }
  struct Share {
    std::atomic<int> next{0};
    std::mutex mutex;
    std::condition_variable done;
    int finished{0};
    std::vector<std::exception_ptr> errors;
  };
  auto share = std::make_shared<Share>();
  share->errors.resize(n);
  // A helper that starts after every index is taken touches nothing but
  // `share`, so `body` is only used while this call waits.
  auto run = [share, n, fn = &body] {
    for (int i; (i = share->next.fetch_add(1)) < n;) {
      std::exception_ptr error;
      try {
        (*fn)(i);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(share->mutex);
      share->errors[i] = error;
      if (++share->finished == n) {
        share->done.notify_all();
      }
    }
  };
  for (int k = 1; k < std::min(n, threads); k++) {
    submit_read(run, true, threads);
  }
  run();
  std::unique_lock<std::mutex> lock(share->mutex);
  share->done.wait(lock, [&] { return share->finished == n; });
  for (auto& e : share->errors) {
    if (e) {
      std::rethrow_exception(e);
    }
  }
}

} // namespace moestream
