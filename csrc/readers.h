// The reader threads every layer and tier shares: routed reads at the front
// of one queue, reads ahead behind them.
#pragma once

#include <functional>

namespace moestream {

// Run `task` on a reader thread (at least `threads` of them from now on).
void submit_read(std::function<void()> task, bool front, int threads);
// Run the routed read at the front of the queue, if there is one, here.
bool run_routed_read();
// body(0) .. body(n - 1) on the reader threads (at least `threads`) and this
// one, each index once; returns when all have run, rethrowing the error of the
// lowest index that failed. Safe on a reader thread: this thread takes every
// index no reader has taken, so it never waits on queued work.
void parallel_reads(int n, int threads, const std::function<void(int)>& body);

} // namespace moestream
