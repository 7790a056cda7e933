// Reads whole expert records for one layer: from its record source, in pieces
// over the reader threads, checked once; a failed read is tried once more,
// from the blob opened again by path.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "mapped_blob.h"
#include "record_check.h"
#include "record_source.h"

namespace moestream {

// Host staging records (each the size of the largest record read): a
// call's misses are read through this many at once. The memory plan counts
// them (runtime/memory.py STAGING_RECORDS; a test checks the two agree).
constexpr int kStagingRecords = 2;

class RecordReader {
 public:
  RecordReader(const BlobLayout& blob, std::vector<uint32_t> checksums,
               bool verify);

  // The record into `dst` (record_nbytes), checked the first time. A record
  // that fails its read or its checksum is read once more (a transient error
  // heals); a second failure throws its ReadError.
  void read(int expert, uint8_t* dst);
  // Read `expert` into one host staging record shared by every layer (reads
  // run one at a time: the stream's, or the host's after a synchronize),
  // then hand it to `use`.
  void staged(int expert, const std::function<void(const uint8_t*)>& use);
  // staged() for several records, kStagingRecords at once (on the reader
  // threads and this one), each read into one of the staging records, then
  // use(i, record) there (so `use` must be safe on distinct i at once). If a
  // read fails, the records after it in its lane are not read; the error of
  // the lowest lane that failed is rethrown once every lane has stopped.
  void each_staged(const std::vector<int>& experts,
                   const std::function<void(size_t, const uint8_t*)>& use);
  static constexpr int64_t kMinPiece = 256 << 10, kPieceAlign = 64 << 10;
  // The pieces one record is read in: over `readers`, at least kMinPiece.
  int64_t piece_bytes() const;

  // RuntimeConfig.mapped: map the blob (once).
  void map();
  const MappedBlob* mapped() const {
    return mapped_.get();
  }
  // The source reads and hints go to: mapped, else buffered.
  RecordSource& source();

  // The test hook of fault injection: the next `count` reads of `expert`'s
  // record fail as an I/O error would (each read, or its retry, takes one).
  void inject_failures(int expert, int count);
  // Takes one injected failure of `expert`: true when one was left.
  bool injected(int expert);
  // Whether a failure of `expert` is injected (none taken).
  bool failing(int expert) const {
    return injected_[expert].load() > 0;
  }
  // The open blob, and how often a failed read has opened it again.
  int fd() const {
    return buffered_.fd();
  }
  std::atomic<int> reopens{0};

  const BlobLayout blob;
  RecordCheck check;
  int readers{8}; // RuntimeConfig.readers
  // A record the page cache holds all of is read whole on the calling thread
  // (PreadSource::read_cached); off, every read goes in pieces (tests).
  bool read_cached_whole{true};
  std::atomic<int64_t> bytes_read{0}; // by `read`, each record once

 private:
  void attempt(int expert, uint8_t* dst);

  PreadSource buffered_;
  std::unique_ptr<MappedBlob> mapped_;
  std::vector<std::atomic<int>> injected_;
};

// A ReadError as a failed read of `expert` would raise (errno EIO).
[[noreturn]] void injected_failure(const BlobLayout& blob, int expert);

} // namespace moestream
