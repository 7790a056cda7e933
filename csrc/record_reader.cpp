#include "record_reader.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <new>

#include "crc32.h"
#include "read_error.h"
#include "readers.h"

namespace moestream {

RecordReader::RecordReader(const BlobLayout& blob,
                           std::vector<uint32_t> checksums, bool verify)
    : blob(blob),
      check(blob, std::move(checksums), verify),
      buffered_(blob),
      injected_(blob.num_experts) {}

RecordSource& RecordReader::source() {
  if (mapped_) {
    return *mapped_;
  }
  return buffered_;
}

void RecordReader::map() {
  if (!mapped_) {
    mapped_ = std::make_unique<MappedBlob>(blob, buffered_.fd());
  }
}

void RecordReader::inject_failures(int expert, int count) {
  if (expert < 0 || expert >= blob.num_experts || count < 0) {
    throw std::invalid_argument("no such expert, or a negative count");
  }
  injected_[expert] = count;
}

bool RecordReader::injected(int expert) {
  auto& left = injected_[expert];
  int n = left.load();
  while (n > 0 && !left.compare_exchange_weak(n, n - 1)) {
  }
  return n > 0;
}

void injected_failure(const BlobLayout& blob, int expert) {
  errno = EIO;
  read_failed(blob, expert, false);
}

int64_t RecordReader::piece_bytes() const {
  int64_t piece = std::max<int64_t>(
      kMinPiece, (blob.record_nbytes + readers - 1) / std::max(readers, 1));
  return (piece + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
}

void RecordReader::read(int expert, uint8_t* dst) {
  try {
    attempt(expert, dst);
  } catch (const ReadError&) {
    buffered_.reopen(); // a blob replaced by a good copy heals too
    reopens += 1;
    attempt(expert, dst); // once more: a transient error heals
  }
  bytes_read += blob.record_nbytes;
}

void RecordReader::attempt(int expert, uint8_t* dst) {
  if (injected(expert)) {
    injected_failure(blob, expert);
  }
  bool checked = check.needed(expert);
  int64_t piece = piece_bytes(), n = blob.record_nbytes;
  // A record the page cache holds is one copy, here: waking reader threads
  // would cost more than it saves.
  if (!mapped_ && read_cached_whole && buffered_.read_cached(expert, dst)) {
    if (checked) {
      uint32_t crc = crc32(dst, n);
      check.pieces(expert, &crc, n);
    }
    return;
  }
  // Else in pieces on the reader threads: a miss waits for the slowest piece,
  // not the whole record (and the disk sees several reads in flight).
  int pieces = int((n + piece - 1) / piece);
  auto length = [&](int i) { return std::min(piece, n - i * piece); };
  std::vector<uint32_t> crcs(pieces, 0);
  RecordSource& from = source();
  parallel_reads(pieces, readers, [&](int i) {
    from.read_range(expert, dst, i * piece, i * piece + length(i));
    if (checked) {
      crcs[i] = crc32(dst + i * piece, length(i));
    }
  });
  if (checked) {
    check.pieces(expert, crcs.data(), piece);
  }
}

namespace {

// The host staging records every layer shares (reads into them run one call
// at a time: the stream's, or the host's after a synchronize), page-aligned,
// grown to the largest record read.
struct Free {
  void operator()(uint8_t* p) const { std::free(p); }
};

struct StagingRecords {
  std::mutex mutex;
  std::unique_ptr<uint8_t, Free> record[kStagingRecords];
  int64_t size[kStagingRecords] = {};

  uint8_t* at(int lane, int64_t nbytes) {
    if (size[lane] < nbytes) {
      int64_t bytes = (nbytes + kPageAlign - 1) / kPageAlign * kPageAlign;
      record[lane].reset(static_cast<uint8_t*>(std::aligned_alloc(kPageAlign, bytes)));
      size[lane] = record[lane] ? bytes : 0;
      if (!record[lane]) {
        throw std::bad_alloc();
      }
    }
    return record[lane].get();
  }
};

StagingRecords& staging() {
  static StagingRecords* s = new StagingRecords(); // reader threads outlive exit
  return *s;
}

} // namespace

void RecordReader::staged(int expert,
                          const std::function<void(const uint8_t*)>& use) {
  auto& s = staging();
  std::lock_guard<std::mutex> lock(s.mutex);
  uint8_t* record = s.at(0, blob.record_nbytes);
  read(expert, record);
  use(record);
}

void RecordReader::each_staged(
    const std::vector<int>& experts,
    const std::function<void(size_t, const uint8_t*)>& use) {
  if (experts.size() == 1) {
    staged(experts[0], [&](const uint8_t* r) { use(0, r); });
    return;
  }
  auto& s = staging();
  std::lock_guard<std::mutex> lock(s.mutex);
  const int lanes = int(std::min<size_t>(kStagingRecords, experts.size()));
  for (int j = 0; j < lanes; j++) {
    s.at(j, blob.record_nbytes);
  }
  // Lane j reads records j, j + lanes, ... through its staging record.
  parallel_reads(lanes, readers, [&](int j) {
    for (size_t i = j; i < experts.size(); i += lanes) {
      read(experts[i], s.record[j].get());
      use(i, s.record[j].get());
    }
  });
}

} // namespace moestream
