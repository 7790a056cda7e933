// RuntimeConfig.mapped: the blob mapped read-only, records used where the page
// cache holds them; mincore tells which are there, MADV_POPULATE_READ reads.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>

#include "record_source.h"

namespace moestream {

class MappedBlob : public RecordSource {
 public:
  // Maps `fd` (the blob of `blob`, kept open by its owner); throws one line
  // when the file is shorter than its records.
  MappedBlob(const BlobLayout& blob, int fd);
  ~MappedBlob() override;
  MappedBlob(const MappedBlob&) = delete;
  MappedBlob& operator=(const MappedBlob&) = delete;

  const uint8_t* record(int expert) const {
    return map_ + blob_.offset(expert);
  }
  // A copy of mapped bytes (the engine reads records in place instead).
  void read_range(int expert, uint8_t* dst, int64_t begin,
                  int64_t end) override;
  // POSIX_FADV_WILLNEED, unless every page is in the page cache already.
  bool hint(int expert) override;
  // Bytes of the record's pages that are not in the page cache.
  int64_t absent_bytes(int expert) const;
  // Ask the kernel to read the record's pages now (MADV_WILLNEED).
  void will_need(int expert) const;
  // Map in the pages of [at, at + n) of `expert`'s record, reading those
  // absent from the page cache; a failed read throws a ReadError.
  void populate(int expert, const uint8_t* at, int64_t n) const;
  // The whole record mapped in: false where a read failed, what it mapped
  // before the failure let go again (a read of it then says what failed).
  bool map_in(int expert) const;
  // No huge page of the page cache mapped whole by one fault
  // (MADV_NOHUGEPAGE): unmap_span could only let such a page go whole,
  // records kept mapped with it.
  void page_by_page() const;
  // Take the pages out of this process's page tables (the page cache keeps
  // them, until dropped: a cold benchmark's start).
  void unmap_pages() const;
  // The same for one record's pages (a record copied out of the mapping no
  // longer counts in this process's resident memory).
  void unmap_record(int expert) const;
  // The pages a fault on the record may have mapped let go: a fault maps the
  // whole large folio of the page cache that holds its page (naturally
  // aligned, at most kFolioSpan), so parts of the records beside it too.
  // The pages of the records where `keep(r)` (the record's own included)
  // stay mapped.
  void unmap_span(int expert, const std::function<bool(int)>& keep) const;
  static constexpr int64_t kFolioSpan = 2 << 20; // a PMD of 4 KB pages

 private:
  // The whole pages of the mapping that hold a record.
  std::pair<uint8_t*, int64_t> record_pages(int expert) const;

  const BlobLayout blob_;
  const int fd_;
  uint8_t* map_{nullptr};
  int64_t map_len_{0};
};

} // namespace moestream
