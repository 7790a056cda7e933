#include "slot_arrays.h"

#include <cstring>
#include <stdexcept>

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
    if (seg.cast == Cast::None) {
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

} // namespace moestream
