#include "record_check.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "crc32.h"
#include "read_error.h"

namespace moestream {

RecordCheck::RecordCheck(const BlobLayout& blob,
                         std::vector<uint32_t> checksums, bool verify)
    : blob_(blob),
      checksums_(std::move(checksums)),
      verify_(verify),
      verified_(blob.num_experts, 0) {
  if (verify_ && int(checksums_.size()) != blob.num_experts) {
    throw std::invalid_argument("one checksum per expert is needed");
  }
}

void RecordCheck::pieces(int expert, const uint32_t* crcs, int64_t piece) {
  int64_t n = blob_.record_nbytes;
  uint32_t crc = crcs[0];
  for (int64_t at = piece; at < n; at += piece) {
    crc = crc32_combine(crc, crcs[at / piece], std::min(piece, n - at));
  }
  if (crc != checksums_[expert]) {
    throw ReadError("Expert " + std::to_string(expert) + " of layer " +
                    std::to_string(blob_.layer) + " in " + blob_.path +
                    " fails its checksum; the file is corrupted: convert again.");
  }
  verified_[expert] = 1;
}

} // namespace moestream
