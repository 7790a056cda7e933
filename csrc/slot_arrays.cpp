#include "slot_arrays.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_experts.h"

namespace moestream {

void SlotArrays::bind(std::vector<mlx::core::array> s, bool gpu_slots,
                      int capacity) {
  on_gpu = gpu_slots;
  if (s.size() != segments.size()) {
    throw std::invalid_argument("one slot array per segment is needed");
  }
  for (size_t i = 0; i < s.size(); i++) {
    auto& seg = segments[i];
    int64_t bytes = seg.cast == Cast::None
        ? seg.nbytes
        : seg.nbytes / cast_src_size(seg.cast) * cast_dst_size(seg.cast);
    if (s[i].ndim() < 1 || s[i].shape(0) < capacity ||
        int64_t(s[i].nbytes() / s[i].shape(0)) != bytes) {
      throw std::invalid_argument("a slot array does not match its segment");
    }
    bool turned = seg.slot_blocked != seg.record_blocked;
    if ((seg.slot_blocked || seg.record_blocked) &&
        (gpu_slots || seg.rows <= 0 || seg.rows % kernel_block() ||
         seg.rows * seg.row_bytes != bytes ||
         (turned && (s[i].itemsize() != 4 || seg.row_bytes % 4)))) {
      throw std::invalid_argument(
          "a blocked segment or record needs CPU slots (of 4-byte elements "
          "where only one is blocked), its rows a multiple of kernel_block()");
    }
  }
  slots = std::move(s);
}

void SlotArrays::fill_host(const uint8_t* record, int slot) {
  for (size_t i = 0; i < segments.size(); i++) {
    const auto& seg = segments[i];
    auto& a = slots[i];
    size_t slot_bytes = a.nbytes() / a.shape(0);
    uint8_t* dst = a.data<uint8_t>() + slot * slot_bytes;
    const uint8_t* src = record + seg.offset;
    if (seg.slot_blocked != seg.record_blocked) {
      turn_host(src, seg, dst);
    } else if (seg.cast == Cast::None) {
      std::memcpy(dst, src, seg.nbytes);
    } else {
      cast_host(src, seg, dst);
    }
  }
}

void SlotArrays::cast_host(const uint8_t* src, const Segment& seg,
                           uint8_t* out) {
  int64_t n = seg.nbytes / cast_src_size(seg.cast);
  for (int64_t j = 0; j < n; j++) {
    cast_element(seg.cast, src, out, j);
  }
}

// Cast first where the segment is stored otherwise (a cast keeps the
// layout), then the kernel's block_rows or unblock_rows (cpu_experts.h).
void SlotArrays::turn_host(const uint8_t* src, const Segment& seg,
                           uint8_t* out) {
  const int64_t cols = seg.row_bytes / 4;
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  auto turn = seg.slot_blocked ? block_rows : unblock_rows;
  if (seg.cast == Cast::None) {
    turn(src, seg.rows, cols, dst);
    return;
  }
  std::vector<uint32_t> cast(seg.rows * cols);
  cast_host(src, seg, reinterpret_cast<uint8_t*>(cast.data()));
  turn(reinterpret_cast<const uint8_t*>(cast.data()), seg.rows, cols, dst);
}

} // namespace moestream
