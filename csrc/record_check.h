// RuntimeConfig.verify: each record's CRC-32 checked against the manifest's
// the first time it is read, from the CRCs of the pieces it was read in.
#pragma once

#include <cstdint>
#include <vector>

#include "record_source.h"

namespace moestream {

class RecordCheck {
 public:
  RecordCheck(const BlobLayout& blob, std::vector<uint32_t> checksums,
              bool verify);
  // Whether the record's next read is checked (verify, and not yet).
  bool needed(int expert) const {
    return verify_ && !verified_[expert];
  }
  // Combine a record's piece CRCs (`piece` bytes each, in order) and mark it
  // verified, or throw a ReadError naming it.
  void pieces(int expert, const uint32_t* crcs, int64_t piece);

 private:
  const BlobLayout blob_;
  const std::vector<uint32_t> checksums_;
  const bool verify_;
  std::vector<char> verified_; // each written by its record's reader only
};

} // namespace moestream
