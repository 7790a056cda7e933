#include "direct_source.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>

#include "read_error.h"

namespace moestream {

namespace {

using Block = std::unique_ptr<uint8_t, decltype(&std::free)>;

Block aligned_block() {
  Block b(static_cast<uint8_t*>(std::aligned_alloc(kBlockAlign, kBlockAlign)),
          &std::free);
  if (!b) {
    throw std::bad_alloc();
  }
  return b;
}

} // namespace

DirectSource::DirectSource(const BlobLayout& blob, PreadSource& buffered)
    : blob_(blob), buffered_(buffered) {
  auto refuse = [&](const std::string& what) {
    return std::invalid_argument(
        os_error("Cannot " + what + " " + blob.path + " with O_DIRECT") +
        "; its filesystem does not take direct reads: leave direct_io off.");
  };
  fd_ = ::open(blob.path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd_ < 0) {
    throw refuse("open");
  }
  // Some filesystems take the flag at open and refuse the reads: read the
  // header block once to know.
  Block block(nullptr, &std::free);
  try {
    block = aligned_block();
  } catch (...) {
    ::close(fd_);
    throw;
  }
  if (PreadSource::pread_full(fd_, block.get(), kBlockAlign, 0, true) < 0) {
    auto error = refuse("read");
    ::close(fd_);
    throw error;
  }
}

DirectSource::~DirectSource() {
  ::close(fd_);
}

void DirectSource::read_range(int expert, uint8_t* dst, int64_t begin,
                              int64_t end) {
  int64_t at = blob_.offset(expert) + begin;
  int64_t n = end - begin;
  uint8_t* out = dst + begin;
  if (reinterpret_cast<uintptr_t>(out) % kBlockAlign || at % kBlockAlign) {
    unaligned_reads += 1; // through the page cache instead
    buffered_.read_range(expert, dst, begin, end);
    return;
  }
  // The whole blocks straight into `out`; a tail that does not fill a block
  // through a bounce block, so nothing past `end` is written.
  int64_t body = n / kBlockAlign * kBlockAlign, tail = n - body;
  if (body) {
    int64_t got = PreadSource::pread_full(fd_, out, body, at, true);
    if (got < body) {
      read_failed(blob_, expert, got >= 0);
    }
  }
  if (tail) {
    thread_local Block bounce = aligned_block();
    int64_t got = PreadSource::pread_full(fd_, bounce.get(), kBlockAlign,
                                          at + body, true);
    if (got < tail) {
      read_failed(blob_, expert, got >= 0);
    }
    std::memcpy(out + body, bounce.get(), tail);
  }
}

} // namespace moestream
