// Where a layer's expert records are read from: one interface, with the
// buffered pread source here (mapped_blob.h: mmap).
#pragma once

#include <cstdint>
#include <string>

namespace moestream {

// Where one layer's records lie in its blob.
struct BlobLayout {
  std::string path;
  int layer;
  int64_t data_offset, stride, record_nbytes;
  int num_experts;
  int64_t offset(int expert) const {
    return data_offset + int64_t(expert) * stride;
  }
  // The end of the last record: the size the file must have at least.
  int64_t end() const {
    return offset(num_experts - 1) + record_nbytes;
  }
};

// Host buffers of records (the staging record, a tier) are page-aligned.
constexpr int64_t kPageAlign = 4096;

// The Python engine's words for a failed read (ExpertReadError), so both
// read alike: past the end of the file (`eof`), else errno's.
[[noreturn]] void read_failed(const BlobLayout& blob, int expert, bool eof);

class RecordSource {
 public:
  virtual ~RecordSource() = default;
  // Bytes [begin, end) of `expert`'s record into dst + begin; a failed read
  // throws a ReadError.
  virtual void read_range(int expert, uint8_t* dst, int64_t begin,
                          int64_t end) = 0;
  // Ask for the record ahead of its read; false where that does not help.
  virtual bool hint(int expert) = 0;
};

// Buffered reads through the page cache.
class PreadSource : public RecordSource {
 public:
  explicit PreadSource(const BlobLayout& blob);
  ~PreadSource() override;
  PreadSource(const PreadSource&) = delete;
  PreadSource& operator=(const PreadSource&) = delete;
  void read_range(int expert, uint8_t* dst, int64_t begin,
                  int64_t end) override;
  bool hint(int expert) override; // POSIX_FADV_WILLNEED
  // The whole record into dst on this thread if the page cache holds all of
  // it (a read that never waits on the disk: RWF_NOWAIT); false, with dst
  // partly written, if it does not.
  bool read_cached(int expert, uint8_t* dst);
  // Open the path again, in place of the open file, where it holds every
  // record (a blob replaced by a good copy is read from then on).
  void reopen();
  int fd() const {
    return fd_;
  }
  // pread until `n` bytes are read (or the file ends) through `fd`; the
  // bytes read, or -1 on an error (errno set).
  static int64_t pread_full(int fd, uint8_t* dst, int64_t n, int64_t offset);

 private:
  const BlobLayout blob_;
  int fd_;
};

} // namespace moestream
