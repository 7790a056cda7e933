// A layer's slot memory: one MLX array per record segment, `[capacity (+
// spare), ...]`, and how a read record is copied (and cast) into a slot.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

#include "cast.h"

namespace moestream {

struct Segment {
  int64_t offset; // inside the record
  int64_t nbytes; // stored bytes of one expert
  Cast cast; // how the stored floats become the slot's (cast.h)
  // Where the slot or the record is blocked (kernel_block() rows at a time,
  // element c of a block's rows side by side, cpu_experts.h): its `rows`
  // rows of `row_bytes` slot bytes (4-byte elements); else 0.
  int64_t rows{0};
  int64_t row_bytes{0};
  bool slot_blocked{false};   // the CPU kernel's blocked slots
  bool record_blocked{false}; // stored so (convert-moe --layout blocked)
};

// Back [p, p + n) with huge pages where the kernel allows it (its 2 MiB
// aligned interior: MADV_HUGEPAGE, then MADV_COLLAPSE for what is there).
void huge_pages(uint8_t* p, int64_t n);

class SlotArrays {
 public:
  explicit SlotArrays(std::vector<Segment> segments)
      : segments(std::move(segments)) {}
  // The evaluated slot arrays (at least `capacity` slots), one per segment.
  void bind(std::vector<mlx::core::array> slots, bool on_gpu, int capacity);
  // Copy a read record into slot memory on the host (CPU slots).
  void fill_host(const uint8_t* record, int slot);
  // A stored float segment in the slot's float dtype, at `out` (cast.h).
  static void cast_host(const uint8_t* src, const Segment& seg, uint8_t* out);
  // A segment whose slot and record disagree on the blocked layout, at `out`
  // (slot elements of `elem` bytes): cast where it is stored otherwise, then
  // blocked or unblocked.
  static void turn_host(const uint8_t* src, const Segment& seg, int elem,
                        uint8_t* out);

  const std::vector<Segment> segments;
  std::vector<mlx::core::array> slots;
  bool on_gpu{false};
};

} // namespace moestream
