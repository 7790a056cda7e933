#include "record_source.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <stdexcept>

#include "read_error.h"

namespace moestream {

void read_failed(const BlobLayout& blob, int expert, bool eof) {
  std::string where = "Cannot read expert " + std::to_string(expert) +
      " of layer " + std::to_string(blob.layer) + " from " + blob.path;
  throw ReadError(
      eof ? where + ": the record lies past the end of the file; "
                    "convert again."
          : os_error(where));
}

PreadSource::PreadSource(const BlobLayout& blob) : blob_(blob) {
  fd_ = ::open(blob.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    throw std::runtime_error(os_error("Cannot open " + blob.path));
  }
}

PreadSource::~PreadSource() {
  ::close(fd_);
}

int64_t PreadSource::pread_full(int fd, uint8_t* dst, int64_t n,
                                int64_t offset) {
  int64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd, dst + done, n - done, offset + done);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got < 0) {
      return -1;
    }
    done += got;
    if (got == 0) { // the end of the file
      break;
    }
  }
  return done;
}

void PreadSource::read_range(int expert, uint8_t* dst, int64_t begin,
                             int64_t end) {
  int64_t n = end - begin;
  int64_t got = pread_full(fd_, dst + begin, n, blob_.offset(expert) + begin);
  if (got < n) {
    read_failed(blob_, expert, got >= 0);
  }
}

bool PreadSource::read_cached(int expert, uint8_t* dst) {
#if defined(RWF_NOWAIT)
  const int64_t n = blob_.record_nbytes, offset = blob_.offset(expert);
  int64_t done = 0;
  while (done < n) {
    struct iovec v{dst + done, size_t(n - done)};
    ssize_t got = ::preadv2(fd_, &v, 1, offset + done, RWF_NOWAIT);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got <= 0) { // not cached (EAGAIN), unsupported, an error or the end
      return false;
    }
    done += got;
  }
  return true;
#else
  static_cast<void>(expert);
  static_cast<void>(dst);
  return false;
#endif
}

void PreadSource::reopen() {
  int fd = ::open(blob_.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return; // gone: the open file is all there is
  }
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size >= blob_.end()) {
    ::dup2(fd, fd_); // atomic: a read in flight sees one file or the other
  }
  ::close(fd);
}

bool PreadSource::hint(int expert) {
  ::posix_fadvise(fd_, blob_.offset(expert), blob_.record_nbytes,
                  POSIX_FADV_WILLNEED);
  return true;
}

} // namespace moestream
