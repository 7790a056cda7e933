#include "mapped_reads.h"

#include <algorithm>
#include <exception>

#include "crc32.h"
#include "read_error.h"
#include "readers.h"

namespace moestream {

void MappedReads::call(const std::vector<int>& unique,
                       std::shared_ptr<void> keep,
                       const std::function<void(int, int64_t)>& seen,
                       const std::function<bool(int)>& kernel_maps) {
  const MappedBlob& blob = *reader_.mapped();
  std::vector<char> absent(reader_.blob.num_experts, 0);
  std::vector<int> todo;
  for (int e : unique) {
    int64_t bytes = blob.absent_bytes(e);
    seen(e, bytes);
    if (bytes) { // every miss of the call in flight before any is waited on
      absent[e] = 1;
      blob.will_need(e);
    }
    if ((absent[e] || reader_.check.needed(e)) && !kernel_maps(e)) {
      todo.push_back(e);
    }
  }
  if (!todo.empty()) { // measured in docs/beyond-ram.md
    start(todo, absent, std::move(keep));
  }
}

void MappedReads::start(const std::vector<int>& todo,
                        const std::vector<char>& absent,
                        std::shared_ptr<void> keep) {
  int64_t piece = reader_.piece_bytes(), n = reader_.blob.record_nbytes;
  int per = int((n + piece - 1) / piece);
  auto p = std::make_shared<PendingReads>();
  p->experts = todo;
  p->in_flight.assign(reader_.blob.num_experts, 0);
  for (int e : todo) {
    p->absent.push_back(absent[e]);
    p->check.push_back(reader_.check.needed(e));
    p->failed.push_back(reader_.injected(e)); // the test hook: as if it failed
    p->in_flight[e] = 1;
  }
  p->crcs.assign(todo.size() * per, 0);
  int pieces = int(todo.size()) * per;
  p->left = pieces;
  const MappedBlob& blob = *reader_.mapped();
  for (int i = 0; i < pieces; i++) {
    submit_read([keep, p, i, per, piece, n, &blob] {
      size_t r = size_t(i / per);
      int e = p->experts[r];
      int64_t at = int64_t(i % per) * piece;
      int64_t len = std::min(piece, n - at);
      bool failed = false;
      try {
        if (p->absent[r]) {
          blob.populate(e, blob.record(e) + at, len);
        }
        if (p->check[r]) {
          p->crcs[i] = crc32(blob.record(e) + at, len);
        }
      } catch (...) {
        failed = true;
      }
      std::lock_guard<std::mutex> lock(p->mutex);
      p->failed[r] = p->failed[r] || failed;
      if (--p->left == 0) {
        p->done.notify_all();
      }
    }, true, reader_.readers);
  }
  pending_ = std::move(p);
}

void MappedReads::finish(PendingReads& p) {
  {
    std::unique_lock<std::mutex> lock(p.mutex);
    p.done.wait(lock, [&] { return p.left == 0; });
  }
  int per = int(p.crcs.size() / std::max<size_t>(1, p.experts.size()));
  for (size_t r = 0; r < p.experts.size(); r++) {
    int e = p.experts[r];
    bool ok = !p.failed[r];
    if (ok && p.check[r] && reader_.check.needed(e)) {
      try {
        reader_.check.pieces(e, p.crcs.data() + r * per, reader_.piece_bytes());
      } catch (const ReadError&) {
        ok = false;
      }
    }
    if (!ok) {
      map_again(reader_, e, p.absent[r], p.check[r] && reader_.check.needed(e));
    }
  }
}

bool map_here(RecordReader& reader, int expert) {
  if (reader.injected(expert)) {
    return false;
  }
  const MappedBlob& blob = *reader.mapped();
  if (!blob.map_in(expert)) {
    return false;
  }
  int64_t n = reader.blob.record_nbytes;
  try {
    if (reader.check.needed(expert)) {
      uint32_t crc = crc32(blob.record(expert), n);
      reader.check.pieces(expert, &crc, n);
    }
  } catch (const std::exception&) {
    blob.unmap_record(expert);
    return false;
  }
  return true;
}

void map_again(RecordReader& reader, int expert, bool absent, bool check) {
  if (reader.injected(expert)) {
    injected_failure(reader.blob, expert);
  }
  const MappedBlob& blob = *reader.mapped();
  int64_t n = reader.blob.record_nbytes;
  if (absent) {
    blob.populate(expert, blob.record(expert), n);
  }
  if (check) {
    uint32_t crc = crc32(blob.record(expert), n);
    reader.check.pieces(expert, &crc, n);
  }
}

} // namespace moestream
