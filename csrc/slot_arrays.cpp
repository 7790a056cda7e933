#include "slot_arrays.h"

#include <sys/mman.h>

#if defined(__linux__) && !defined(MADV_COLLAPSE) // Linux 6.1; older C libraries lack it
#define MADV_COLLAPSE 25
#endif

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
         (turned && seg.row_bytes % s[i].itemsize()) ||
         (seg.slot_blocked && s[i].itemsize() != 4 && s[i].itemsize() != 2))) {
      throw std::invalid_argument(
          "a blocked segment or record needs CPU slots (blocked slots of "
          "4- or 2-byte elements), its rows a multiple of kernel_block()");
    }
  }
  slots = std::move(s);
  if (!gpu_slots) {
    for (auto& a : slots) {
      huge_pages(a.data<uint8_t>(), int64_t(a.nbytes()));
    }
  }
}

void huge_pages(uint8_t* p, int64_t n) {
#if defined(__linux__)
  constexpr int64_t kHuge = 2 << 20;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~uintptr_t(kHuge - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(p) + n) & ~uintptr_t(kHuge - 1);
  if (end <= begin) {
    return;
  }
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_COLLAPSE);
#else
  (void)p; // transparent huge pages are Linux's
  (void)n;
#endif
}

void SlotArrays::fill_host(const uint8_t* record, int slot) {
  for (size_t i = 0; i < segments.size(); i++) {
    const auto& seg = segments[i];
    auto& a = slots[i];
    size_t slot_bytes = a.nbytes() / a.shape(0);
    uint8_t* dst = a.data<uint8_t>() + slot * slot_bytes;
    const uint8_t* src = record + seg.offset;
    if (seg.slot_blocked != seg.record_blocked) {
      turn_host(src, seg, int(a.itemsize()), dst);
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
// layout), then blocked or unblocked: the kernel's block_rows and
// unblock_rows (cpu_experts.h) for 4-byte elements, element by element for
// 2-byte ones (bfloat16 or float16 slots).
void SlotArrays::turn_host(const uint8_t* src, const Segment& seg, int elem,
                           uint8_t* out) {
  const int64_t cols = seg.row_bytes / elem;
  std::vector<uint8_t> cast;
  if (seg.cast != Cast::None) {
    cast.resize(seg.rows * seg.row_bytes);
    cast_host(src, seg, cast.data());
    src = cast.data();
  }
  if (elem == 4) {
    auto turn = seg.slot_blocked ? block_rows : unblock_rows;
    turn(src, seg.rows, cols, reinterpret_cast<uint32_t*>(out));
    return;
  }
  const int64_t block = kernel_block();
  for (int64_t r = 0; r < seg.rows; r++) {
    for (int64_t c = 0; c < cols; c++) {
      int64_t rows_at = r * cols + c;
      int64_t blocked_at = ((r / block) * cols + c) * block + r % block;
      int64_t from = seg.slot_blocked ? rows_at : blocked_at;
      int64_t to = seg.slot_blocked ? blocked_at : rows_at;
      std::memcpy(out + to * elem, src + from * elem, elem);
    }
  }
}

} // namespace moestream
