// RuntimeConfig.direct_io: records read with O_DIRECT, past the page cache.
#pragma once

#include <atomic>

#include "record_source.h"

namespace moestream {

class DirectSource : public RecordSource {
 public:
  // Opens the blob a second time; throws one line naming the file where its
  // filesystem refuses direct reads. Unaligned ranges go to `buffered`.
  DirectSource(const BlobLayout& blob, PreadSource& buffered);
  ~DirectSource() override;
  DirectSource(const DirectSource&) = delete;
  DirectSource& operator=(const DirectSource&) = delete;
  void read_range(int expert, uint8_t* dst, int64_t begin,
                  int64_t end) override;
  // Kernel readahead fills a page cache that direct reads skip.
  bool hint(int) override {
    return false;
  }
  // Ranges read through the buffered source because their destination was
  // not block-aligned (tests: none on the engine's paths).
  std::atomic<int64_t> unaligned_reads{0};

 private:
  const BlobLayout blob_;
  PreadSource& buffered_;
  int fd_;
};

} // namespace moestream
