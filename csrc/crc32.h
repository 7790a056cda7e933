// zlib's CRC-32 of expert records, and the CRC of two pieces combined.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moestream {

uint32_t crc32(const uint8_t* data, size_t n, uint32_t crc = 0);
// The CRC-32 of A then B, from crc32(A), crc32(B) and B's length (zlib's).
uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, int64_t len2);

} // namespace moestream
