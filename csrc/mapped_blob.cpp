#include "mapped_blob.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "read_error.h"

namespace moestream {

namespace {
const int64_t kPage = ::sysconf(_SC_PAGESIZE);
} // namespace

MappedBlob::MappedBlob(const BlobLayout& blob, int fd) : blob_(blob), fd_(fd) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    throw std::runtime_error(os_error("Cannot stat " + blob.path));
  }
  int64_t end = blob.end();
  if (st.st_size < end) {
    throw std::invalid_argument(
        blob.path + " holds " + std::to_string(st.st_size) + " bytes, its " +
        std::to_string(blob.num_experts) + " expert records need " +
        std::to_string(end) + ": the file is truncated; convert again.");
  }
  void* p = ::mmap(nullptr, end, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(os_error("Cannot map " + blob.path));
  }
  map_ = static_cast<uint8_t*>(p);
  map_len_ = end;
}

MappedBlob::~MappedBlob() {
  ::munmap(map_, map_len_);
}

std::pair<uint8_t*, int64_t> MappedBlob::record_pages(int expert) const {
  int64_t begin = blob_.offset(expert);
  int64_t first = begin / kPage * kPage;
  int64_t last = (begin + blob_.record_nbytes + kPage - 1) / kPage * kPage;
  return {map_ + first, last - first};
}

int64_t MappedBlob::absent_bytes(int expert) const {
  auto [pages, len] = record_pages(expert);
  std::vector<unsigned char> in(len / kPage);
  if (::mincore(pages, len, in.data()) != 0) {
    return blob_.record_nbytes; // unknown: count it read
  }
  int64_t absent = 0;
  for (auto v : in) {
    absent += (v & 1) ? 0 : kPage;
  }
  return std::min(absent, blob_.record_nbytes);
}

void MappedBlob::will_need(int expert) const {
  auto [pages, len] = record_pages(expert);
  ::madvise(pages, len, MADV_WILLNEED);
}

void MappedBlob::populate(int expert, const uint8_t* at, int64_t n) const {
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 // Linux 5.14
#endif
  auto first = reinterpret_cast<uintptr_t>(at) / kPage * kPage;
  auto* p = reinterpret_cast<uint8_t*>(first);
  int64_t len = at + n - p;
  if (::madvise(p, len, MADV_POPULATE_READ) == 0) {
    return;
  }
  if (errno != EINVAL) { // an I/O error: touching the page would fault
    read_failed(blob_, expert, false);
  }
  for (int64_t at_page = 0; at_page < len; at_page += kPage) { // older kernels
    static_cast<void>(*reinterpret_cast<volatile const uint8_t*>(p + at_page));
  }
}

void MappedBlob::read_range(int expert, uint8_t* dst, int64_t begin,
                            int64_t end) {
  populate(expert, record(expert) + begin, end - begin);
  std::memcpy(dst + begin, record(expert) + begin, end - begin);
}

bool MappedBlob::hint(int expert) {
  if (absent_bytes(expert) == 0) {
    return false;
  }
  ::posix_fadvise(fd_, blob_.offset(expert), blob_.record_nbytes,
                  POSIX_FADV_WILLNEED);
  return true;
}

bool MappedBlob::map_in(int expert) const {
  try {
    populate(expert, record(expert), blob_.record_nbytes);
  } catch (const std::exception&) {
    unmap_record(expert);
    return false;
  }
  return true;
}

void MappedBlob::page_by_page() const {
  ::madvise(map_, map_len_, MADV_NOHUGEPAGE);
}

void MappedBlob::unmap_pages() const {
  ::madvise(map_, map_len_, MADV_DONTNEED);
}

void MappedBlob::unmap_record(int expert) const {
  // A fault maps pages around it too (the kernel's fault-around, 64 KB by
  // default, aligned by address or by file offset as kernels differ): the
  // record's pages and that much on either side.
  constexpr int64_t kAround = 64 << 10;
  int64_t begin = std::max<int64_t>(0, blob_.offset(expert) - kAround);
  int64_t end = std::min<int64_t>(
      map_len_, blob_.offset(expert) + blob_.record_nbytes + kAround);
  begin = begin / kPage * kPage;
  ::madvise(map_ + begin, end - begin, MADV_DONTNEED);
}

void MappedBlob::unmap_span(int expert,
                            const std::function<bool(int)>& keep) const {
  const int64_t n = blob_.record_nbytes, stride = blob_.stride;
  const int64_t begin = blob_.offset(expert) / kFolioSpan * kFolioSpan;
  const int64_t end = std::min<int64_t>(
      map_len_, (blob_.offset(expert) + n + kFolioSpan - 1) / kFolioSpan * kFolioSpan);
  auto zap = [&](int64_t from, int64_t to) { // file offsets, page-aligned
    if (to > from) {
      ::madvise(map_ + from, to - from, MADV_DONTNEED);
    }
  };
  int first = int(std::max<int64_t>(0, (begin - blob_.data_offset) / stride));
  int64_t at = begin;
  for (int r = first; r < blob_.num_experts && blob_.offset(r) < end; r++) {
    if (keep(r)) {
      auto [pages, len] = record_pages(r);
      zap(at, pages - map_);
      at = std::max(at, pages - map_ + len);
    }
  }
  zap(at, end);
}

} // namespace moestream
