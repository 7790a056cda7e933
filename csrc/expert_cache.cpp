#include "expert_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <deque>
#include <stdexcept>
#include <utility>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace moestream {

namespace {

// zlib's CRC-32 (reflected 0xEDB88320), slice-by-8.
struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++) {
        c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      }
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
      for (int s = 1; s < 8; s++) {
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
      }
    }
  }
};

const CrcTables& crc_tables() {
  static CrcTables tables;
  return tables;
}

std::string os_error(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

// The messages of recent ReadErrors (the same failure gives the same words).
struct ReadErrors {
  static constexpr size_t KEEP = 256;
  std::mutex mutex;
  std::deque<std::string> recent;
};

ReadErrors& read_errors() {
  static auto* r = new ReadErrors(); // never destroyed: errors may outlive exit
  return *r;
}

} // namespace

ReadError::ReadError(const std::string& what) : std::runtime_error(what) {
  auto& r = read_errors();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (std::find(r.recent.begin(), r.recent.end(), what) == r.recent.end()) {
    r.recent.push_back(what);
    if (r.recent.size() > ReadErrors::KEEP) {
      r.recent.pop_front();
    }
  }
}

bool is_read_error(const char* what) {
  auto& r = read_errors();
  std::lock_guard<std::mutex> lock(r.mutex);
  return std::find(r.recent.begin(), r.recent.end(), what) != r.recent.end();
}

namespace {

// The register form (not inverted) of zlib's CRC-32, slice-by-8.
uint32_t crc32_tables(const uint8_t* p, size_t n, uint32_t crc) {
  const auto& t = crc_tables().t;
  while (n >= 8) {
    uint32_t a, b;
    std::memcpy(&a, p, 4);
    std::memcpy(&b, p + 4, 4);
    a ^= crc;
    crc = t[7][a & 0xFF] ^ t[6][(a >> 8) & 0xFF] ^ t[5][(a >> 16) & 0xFF] ^
        t[4][a >> 24] ^ t[3][b & 0xFF] ^ t[2][(b >> 8) & 0xFF] ^
        t[1][(b >> 16) & 0xFF] ^ t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) {
    crc = t[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
  }
  return crc;
}

#if defined(__x86_64__)
// The same CRC by carry-less multiplication: four 128-bit lanes folded over
// 64 bytes at a time, then into one, then Barrett-reduced to 32 bits (Intel,
// "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", 2009; the
// bit-reflected constants of zlib's polynomial as in Chromium's zlib).
#define CLMUL __attribute__((target("pclmul,sse4.1")))

CLMUL inline __m128i load(const uint8_t* q) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
}

// x's two halves multiplied by k's, summed with the next 16 bytes.
CLMUL inline __m128i fold(__m128i x, __m128i k, __m128i next) {
  __m128i lo = _mm_clmulepi64_si128(x, k, 0x00);
  __m128i hi = _mm_clmulepi64_si128(x, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(hi, lo), next);
}

// `n` >= 64 and a multiple of 16; register form in and out.
CLMUL uint32_t crc32_fold(const uint8_t* p, size_t n, uint32_t crc) {
  alignas(16) static const uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const uint64_t poly[] = {0x01db710641, 0x01f7011641};
  __m128i x1 = _mm_xor_si128(load(p), _mm_cvtsi32_si128(int(crc)));
  __m128i x2 = load(p + 16), x3 = load(p + 32), x4 = load(p + 48);
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  p += 64;
  n -= 64;
  while (n >= 64) {
    x1 = fold(x1, k, load(p));
    x2 = fold(x2, k, load(p + 16));
    x3 = fold(x3, k, load(p + 32));
    x4 = fold(x4, k, load(p + 48));
    p += 64;
    n -= 64;
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = fold(x1, k, x2);
  x1 = fold(x1, k, x3);
  x1 = fold(x1, k, x4);
  while (n >= 16) {
    x1 = fold(x1, k, load(p));
    p += 16;
    n -= 16;
  }
  // 128 -> 64 bits
  const __m128i mask = _mm_setr_epi32(~0, 0, ~0, 0);
  x2 = _mm_clmulepi64_si128(x1, k, 0x10);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2 = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x00), x2);
  // Barrett reduction -> 32 bits
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, mask), k, 0x10);
  x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, mask), k, 0x00);
  return uint32_t(_mm_extract_epi32(_mm_xor_si128(x1, x2), 1));
}

bool has_clmul() {
  static const bool yes =
      __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return yes;
}
#endif

} // namespace

uint32_t crc32(const uint8_t* p, size_t n, uint32_t crc) {
  crc = ~crc;
#if defined(__x86_64__)
  if (n >= 64 && has_clmul()) {
    size_t blocks = n & ~size_t(15);
    crc = crc32_fold(p, blocks, crc);
    p += blocks;
    n -= blocks;
  }
#endif
  return ~crc32_tables(p, n, crc);
}

// zlib's crc32_combine: the CRC of A followed by B from crc(A), crc(B) and
// B's length, multiplying by x^(8 len) modulo the polynomial.
namespace {

uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) {
        break;
      }
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ 0xEDB88320u : b >> 1;
  }
  return p;
}

} // namespace

uint32_t crc32_combine(uint32_t crc1, uint32_t crc2, int64_t len2) {
  uint32_t x2n = 1u << 30; // x^1, squared to x^(2^k) as k climbs
  uint32_t p = 1u << 31; // x^0
  // x^(8 len2) = product of x^(2^k) over the set bits of 8 len2
  for (uint64_t n = uint64_t(len2) << 3; n; n >>= 1) {
    if (n & 1) {
      p = multmodp(x2n, p);
    }
    x2n = multmodp(x2n, x2n);
  }
  return multmodp(p, crc1) ^ crc2;
}

ExpertCache::ExpertCache(
    const std::string& path,
    int layer,
    int64_t data_offset,
    int64_t stride,
    int64_t record_nbytes,
    int num_experts,
    int capacity,
    std::vector<Segment> segments,
    std::vector<uint32_t> checksums,
    bool verify,
    bool lru,
    double decay,
    int max_pairs,
    bool record_calls)
    : path_(path),
      layer_(layer),
      num_experts(num_experts),
      capacity(capacity),
      max_pairs(max_pairs),
      record_nbytes(record_nbytes),
      segments(std::move(segments)),
      data_offset_(data_offset),
      stride_(stride),
      checksums_(std::move(checksums)),
      verified_(num_experts, 0),
      verify_(verify),
      lru_(lru),
      decay_(decay),
      score_(num_experts, 0.0),
      slot_of_(num_experts, -1),
      expert_in_(capacity, -1),
      prefetched_(num_experts, 0),
      recording_(record_calls) {
  if (capacity < 1 || capacity > num_experts) {
    throw std::invalid_argument("capacity must be in 1..num_experts");
  }
  if (verify_ && int(checksums_.size()) != num_experts) {
    throw std::invalid_argument("one checksum per expert is needed");
  }
  for (int s = capacity - 1; s >= 0; s--) {
    free_.push_back(s);
  }
  uses = std::vector<std::atomic<int64_t>>(num_experts);
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    throw std::runtime_error(os_error("Cannot open " + path));
  }
}

ExpertCache::~ExpertCache() {
  if (map_) {
    ::munmap(map_, map_len_);
  }
  if (fd_ >= 0) {
    ::close(fd_);
  }
  if (dfd_ >= 0) {
    ::close(dfd_);
  }
}

void ExpertCache::bind(std::vector<mx::array> s, bool gpu_slots) {
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

void ExpertCache::set_error(const std::string& e) {
  std::lock_guard<std::mutex> lock(error_mutex);
  if (error.empty()) {
    error = e;
  }
}

int64_t ExpertCache::pread_full(int fd, uint8_t* dst, int64_t n,
                                int64_t offset, bool direct) {
  int64_t done = 0;
  while (done < n) {
    ssize_t got = ::pread(fd, dst + done, n - done, offset + done);
    if (got < 0 && errno == EINTR) {
      continue;
    }
    if (got < 0) {
      return -1;
    }
    done += got;
    if (got == 0 || (direct && got % kDirectAlign)) { // the end of the file
      break;
    }
  }
  return done;
}

void ExpertCache::read_failed(int expert, bool eof) {
  // The Python engine's words (ExpertReadError), so both read alike.
  std::string where = "Cannot read expert " + std::to_string(expert) +
      " of layer " + std::to_string(layer_) + " from " + path_;
  throw ReadError(
      eof ? where + ": the record lies past the end of the file; "
                    "convert again."
          : os_error(where));
}

void ExpertCache::read_range(int expert, uint8_t* dst, int64_t begin,
                             int64_t end) {
  int64_t at = data_offset_ + int64_t(expert) * stride_ + begin;
  int64_t n = end - begin;
  uint8_t* out = dst + begin;
  bool aligned = reinterpret_cast<uintptr_t>(out) % kDirectAlign == 0 &&
      at % kDirectAlign == 0;
  if (dfd_ >= 0 && !aligned) {
    unaligned_reads += 1; // through the page cache instead
  }
  if (dfd_ < 0 || !aligned) {
    int64_t got = pread_full(fd_, out, n, at, false);
    if (got < n) {
      read_failed(expert, got >= 0);
    }
    return;
  }
  // Direct: the whole blocks straight into `out`; a tail that does not fill
  // a block through a bounce block, so nothing past `end` is written.
  int64_t body = n / kDirectAlign * kDirectAlign, tail = n - body;
  if (body) {
    int64_t got = pread_full(dfd_, out, body, at, true);
    if (got < body) {
      read_failed(expert, got >= 0);
    }
  }
  if (tail) {
    thread_local std::unique_ptr<uint8_t, decltype(&std::free)> bounce(
        static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, kDirectAlign)),
        &std::free);
    if (!bounce) {
      throw std::bad_alloc();
    }
    int64_t got = pread_full(dfd_, bounce.get(), kDirectAlign, at + body, true);
    if (got < tail) {
      read_failed(expert, got >= 0);
    }
    std::memcpy(out + body, bounce.get(), tail);
  }
}

void ExpertCache::open_direct() {
  if (dfd_ >= 0) {
    return;
  }
  auto refuse = [&](const std::string& what) {
    return std::invalid_argument(
        os_error("Cannot " + what + " " + path_ + " with O_DIRECT") +
        "; its filesystem does not take direct reads: leave direct_io off.");
  };
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  if (fd < 0) {
    throw refuse("open");
  }
  // Some filesystems take the flag at open and refuse the reads: read the
  // header block once to know.
  std::unique_ptr<uint8_t, decltype(&std::free)> block(
      static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, kDirectAlign)),
      &std::free);
  if (!block) {
    ::close(fd);
    throw std::bad_alloc();
  }
  if (pread_full(fd, block.get(), kDirectAlign, 0, true) < 0) {
    auto error = refuse("read");
    ::close(fd);
    throw error;
  }
  dfd_ = fd;
}

void ExpertCache::check_pieces(int expert, const uint32_t* crcs) {
  int64_t piece = piece_bytes();
  uint32_t crc = crcs[0];
  for (int64_t at = piece; at < record_nbytes; at += piece) {
    crc = crc32_combine(crc, crcs[at / piece],
                        std::min(piece, record_nbytes - at));
  }
  if (crc != checksums_[expert]) {
    throw ReadError("Expert " + std::to_string(expert) + " of layer " +
                    std::to_string(layer_) + " in " + path_ +
                    " fails its checksum; the file is corrupted: convert again.");
  }
  verified_[expert] = 1;
}

void ExpertCache::map_blob() {
  if (map_) {
    return;
  }
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    throw std::runtime_error(os_error("Cannot stat " + path_));
  }
  int64_t end = data_offset_ + int64_t(num_experts - 1) * stride_ + record_nbytes;
  if (st.st_size < end) {
    throw std::invalid_argument(
        path_ + " holds " + std::to_string(st.st_size) + " bytes, its " +
        std::to_string(num_experts) + " expert records need " +
        std::to_string(end) + ": the file is truncated; convert again.");
  }
  void* p = ::mmap(nullptr, end, PROT_READ, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error(os_error("Cannot map " + path_));
  }
  map_ = static_cast<uint8_t*>(p);
  map_len_ = end;
}

namespace {
const int64_t kPage = ::sysconf(_SC_PAGESIZE);
} // namespace

std::pair<uint8_t*, int64_t> ExpertCache::record_pages(int expert) const {
  int64_t begin = data_offset_ + int64_t(expert) * stride_;
  int64_t first = begin / kPage * kPage;
  int64_t last = (begin + record_nbytes + kPage - 1) / kPage * kPage;
  return {map_ + first, last - first};
}

void ExpertCache::populate(int expert, const uint8_t* at, int64_t n) {
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
    read_failed(expert, false);
  }
  for (int64_t at_page = 0; at_page < len; at_page += kPage) { // older kernels
    static_cast<void>(*reinterpret_cast<volatile const uint8_t*>(p + at_page));
  }
}

void ExpertCache::unmap_pages() {
  if (map_) {
    ::madvise(map_, map_len_, MADV_DONTNEED);
  }
}

int64_t ExpertCache::absent_bytes(int expert) {
  auto [pages, len] = record_pages(expert);
  std::vector<unsigned char> in(len / kPage);
  if (::mincore(pages, len, in.data()) != 0) {
    return record_nbytes; // unknown: count it read
  }
  int64_t absent = 0;
  for (auto v : in) {
    absent += (v & 1) ? 0 : kPage;
  }
  return std::min(absent, record_nbytes);
}

void ExpertCache::count(int expert, bool hit, CallRecord* rec) {
  uses[expert].fetch_add(1, std::memory_order_relaxed);
  if (prefetched_[expert]) {
    counters.prefetched_used += 1;
    counters.misses_prefetched += hit ? 0 : 1;
  }
  (hit ? counters.hits : counters.misses) += 1;
  if (rec) {
    (hit ? rec->hits : rec->misses) += 1;
  }
  prefetched_[expert] = 0;
}

std::vector<int> ExpertCache::distinct(const uint32_t* experts, int64_t n,
                                       std::vector<char>& seen) const {
  std::vector<int> unique;
  for (int64_t i = 0; i < n; i++) {
    uint32_t e = experts[i];
    if (e >= uint32_t(num_experts)) {
      throw std::runtime_error("routed expert id out of range");
    }
    if (!seen[e]) {
      seen[e] = 1;
      unique.push_back(int(e));
    }
  }
  return unique;
}

void ExpertCache::resolve_mapped(const uint32_t* experts, int64_t n,
                                 int tokens, uint32_t* out, CallRecord* rec) {
  if (pending_) { // a call whose kernel never ran: its reads end first
    finish(*take_pending());
  }
  std::vector<char> seen(num_experts, 0), absent(num_experts, 0);
  std::vector<int> unique = distinct(experts, n, seen), todo;
  if (rec) {
    rec->prefetched = std::exchange(hinted_, {});
  }
  for (int e : unique) {
    int64_t bytes = absent_bytes(e);
    count(e, bytes == 0, rec);
    if (bytes) { // every miss of the call in flight before any is waited on
      absent[e] = 1;
      counters.bytes_read += bytes;
      if (rec) {
        rec->bytes_read += bytes;
      }
      auto [pages, len] = record_pages(e);
      ::madvise(pages, len, MADV_WILLNEED);
    }
    if (absent[e] || (verify_ && !verified_[e])) {
      todo.push_back(e);
    }
  }
  // Then the misses, and records routed for the first time, in pieces over
  // the readers, left in flight for the kernel: a piece's pages mapped in
  // (read where absent) and, the first time, checksummed, as a read into a
  // slot does, with no copy. The kernel computes the call's other experts
  // meanwhile and waits for these before their pairs (ExpertMlpMapped;
  // measured in docs/beyond-ram.md).
  if (!todo.empty()) {
    read_behind(todo, absent);
  }
  used(unique, tokens);
  for (int64_t i = 0; i < n; i++) {
    out[i] = experts[i];
  }
}

void ExpertCache::read_behind(const std::vector<int>& todo,
                              const std::vector<char>& absent) {
  int64_t piece = piece_bytes();
  int per = int((record_nbytes + piece - 1) / piece);
  auto p = std::make_shared<PendingReads>();
  p->experts = todo;
  p->in_flight.assign(num_experts, 0);
  for (int e : todo) {
    p->absent.push_back(absent[e]);
    p->check.push_back(verify_ && !verified_[e]);
    p->in_flight[e] = 1;
  }
  p->crcs.assign(todo.size() * per, 0);
  int pieces = int(todo.size()) * per;
  p->left = pieces;
  for (int i = 0; i < pieces; i++) {
    submit_read([self = shared_from_this(), p, i, per, piece] {
      size_t r = size_t(i / per);
      int e = p->experts[r];
      int64_t at = int64_t(i % per) * piece;
      int64_t len = std::min(piece, self->record_nbytes - at);
      std::exception_ptr error;
      try {
        if (p->absent[r]) {
          self->populate(e, self->mapped_record(e) + at, len);
        }
        if (p->check[r]) {
          p->crcs[i] = crc32(self->mapped_record(e) + at, len);
        }
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(p->mutex);
      if (error && !p->error) {
        p->error = error;
      }
      if (--p->left == 0) {
        p->done.notify_all();
      }
    }, true, readers);
  }
  pending_ = std::move(p);
}

void ExpertCache::finish(PendingReads& p) {
  {
    std::unique_lock<std::mutex> lock(p.mutex);
    p.done.wait(lock, [&] { return p.left == 0; });
  }
  if (p.error) {
    std::rethrow_exception(p.error);
  }
  int per = int(p.crcs.size() / std::max<size_t>(1, p.experts.size()));
  for (size_t r = 0; r < p.experts.size(); r++) {
    if (p.check[r] && !verified_[p.experts[r]]) {
      check_pieces(p.experts[r], p.crcs.data() + r * per);
    }
  }
}

int64_t ExpertCache::piece_bytes() const {
  int64_t piece = std::max<int64_t>(
      kMinPiece, (record_nbytes + readers - 1) / std::max(readers, 1));
  return (piece + kPieceAlign - 1) / kPieceAlign * kPieceAlign;
}

void ExpertCache::read_record(int expert, uint8_t* dst) {
  bool check = verify_ && !verified_[expert];
  // One record in pieces on the reader threads: a miss waits for the slowest
  // piece, not the whole record (and the disk sees several reads in flight).
  int64_t piece = piece_bytes();
  int pieces = int((record_nbytes + piece - 1) / piece);
  auto length = [&](int i) { return std::min(piece, record_nbytes - i * piece); };
  std::vector<uint32_t> crcs(pieces, 0);
  parallel_reads(pieces, readers, [&](int i) {
    read_range(expert, dst, i * piece, i * piece + length(i));
    if (check) {
      crcs[i] = crc32(dst + i * piece, length(i));
    }
  });
  if (check) {
    check_pieces(expert, crcs.data());
  }
  counters.bytes_read += record_nbytes;
}

void ExpertCache::staged(
    int expert,
    const std::function<void(const uint8_t*)>& use) {
  // Block-aligned, so a direct read lands in it (read_range).
  static std::mutex mutex;
  static std::unique_ptr<uint8_t, decltype(&std::free)> record(nullptr,
                                                               &std::free);
  static int64_t size = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (size < record_nbytes) {
    int64_t bytes = (record_nbytes + kDirectAlign - 1) / kDirectAlign *
        kDirectAlign;
    record.reset(static_cast<uint8_t*>(std::aligned_alloc(kDirectAlign, bytes)));
    size = record ? bytes : 0;
    if (!record) {
      throw std::bad_alloc();
    }
  }
  read_record(expert, record.get());
  use(record.get());
}

void ExpertCache::fill_host(const uint8_t* record, int slot) {
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

void ExpertCache::cast_host(const uint8_t* src, const Segment& seg,
                            uint8_t* out) {
  int64_t n = seg.nbytes / cast_src_size(seg.cast);
  for (int64_t j = 0; j < n; j++) {
    cast_element(seg.cast, src, out, j);
  }
}

void ExpertCache::hint(const uint32_t* experts, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t e = experts[i];
    if (e >= uint32_t(num_experts) || slot_of_[e] >= 0 || prefetched_[e]) {
      continue;
    }
    if (tier_) {
      if (!tier_->read_ahead(shared_from_this(), tier_base_ + e, int(e))) {
        continue;
      }
    } else if (map_ && absent_bytes(int(e)) == 0) {
      continue; // mapped, and in the page cache already
    } else if (dfd_ >= 0) {
      continue; // kernel readahead fills a page cache direct reads skip
    } else {
      ::posix_fadvise(
          fd_, data_offset_ + int64_t(e) * stride_, record_nbytes,
          POSIX_FADV_WILLNEED);
    }
    prefetched_[e] = 1;
    counters.prefetched += 1;
    counters.prefetch_bytes += record_nbytes;
    if (recording_) {
      hinted_.push_back(e);
    }
  }
}

int ExpertCache::victim(const std::vector<char>& keep) {
  if (!free_.empty()) {
    int s = free_.back();
    free_.pop_back();
    return s;
  }
  int best = -1;
  for (int s = 0; s < capacity; s++) {
    int e = expert_in_[s];
    if (!keep[e] && (best < 0 || score_[e] < score_[expert_in_[best]])) {
      best = s;
    }
  }
  slot_of_[expert_in_[best]] = -1;
  counters.evictions += 1;
  return best;
}

void ExpertCache::drop(int expert) {
  int s = slot_of_[expert];
  if (s >= 0) {
    slot_of_[expert] = -1;
    expert_in_[s] = -1;
    free_.push_back(s);
  }
}

void ExpertCache::resolve_call(
    const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
    int64_t call, const UseRecord& use) {
  CallRecord record{call};
  CallRecord* rec = recording_ && call >= 0 ? &record : nullptr;
  if (map_) {
    resolve_mapped(experts, n, tokens, out, rec);
  } else if (tier_) {
    resolve_through_tier(experts, n, tokens, out, use, rec);
  } else {
    resolve(experts, n, tokens, out, [&](int e, int s) {
      staged(e, [&](const uint8_t* r) { use(r, -1, s); });
      if (rec) {
        rec->bytes_read += record_nbytes;
      }
    }, rec);
  }
  if (rec) {
    add_record(std::move(record));
  }
}

void ExpertCache::add_record(CallRecord&& record) {
  std::lock_guard<std::mutex> lock(records_mutex_);
  if (!records_.empty() && records_.back().call == record.call) { // grouped
    auto& last = records_.back();
    last.hits += record.hits;
    last.misses += record.misses;
    last.bytes_read += record.bytes_read;
    last.prefetched.insert(last.prefetched.end(), record.prefetched.begin(),
                           record.prefetched.end());
  } else {
    records_.push_back(std::move(record));
  }
}

std::vector<CallRecord> ExpertCache::take_records() {
  gpu_collect(*this);
  std::lock_guard<std::mutex> lock(records_mutex_);
  return std::exchange(records_, {});
}

void ExpertCache::resolve_through_tier(
    const uint32_t* experts, int64_t n, int tokens, uint32_t* out,
    const UseRecord& use, CallRecord* rec) {
  tier_->begin_call();
  std::vector<std::pair<int, int>> misses;
  resolve(experts, n, tokens, out,
          [&](int e, int s) { misses.push_back({e, s}); }, rec);
  std::vector<int64_t> host(misses.size());
  std::string failure;
  for (size_t i = 0; i < misses.size(); i++) {
    try { // queued first, so the readers work on all of them at once
      bool read = false;
      host[i] = tier_->request(shared_from_this(), tier_base_ + misses[i].first,
                               misses[i].first, read);
      if (rec && read) {
        rec->bytes_read += record_nbytes;
      }
    } catch (const std::exception& e) {
      host[i] = -1;
      failure = failure.empty() ? e.what() : failure;
    }
  }
  for (size_t i = 0; i < misses.size(); i++) {
    if (host[i] < 0) {
      continue;
    }
    try {
      auto* record = tier_->wait(host[i], tier_base_ + misses[i].first);
      if (failure.empty()) {
        use(record, host[i], misses[i].second);
      }
    } catch (const std::exception& e) {
      failure = failure.empty() ? e.what() : failure;
    }
  }
  if (!failure.empty()) {
    for (auto& [e, s] : misses) {
      drop(e);
    }
    throw std::runtime_error(failure);
  }
}

void ExpertCache::used(const std::vector<int>& experts, int tokens) {
  if (lru_) {
    clock_ += 1;
    for (int e : experts) {
      score_[e] = double(clock_);
    }
    return;
  }
  double f = 1.0;
  for (int t = 0; t < tokens; t++) {
    f *= decay_;
  }
  for (auto& s : score_) {
    s *= f;
  }
  for (int e : experts) {
    score_[e] += 1.0;
  }
}

void ExpertCache::resolve(
    const uint32_t* experts,
    int64_t n,
    int tokens,
    uint32_t* out,
    const std::function<void(int, int)>& write,
    CallRecord* rec) {
  std::vector<char> keep(num_experts, 0);
  std::vector<int> unique = distinct(experts, n, keep);
  if (int(unique.size()) > capacity) {
    throw std::runtime_error("more routed experts than slots in one call");
  }
  if (rec) {
    rec->prefetched = std::exchange(hinted_, {});
  }
  for (int e : unique) {
    count(e, slot_of_[e] >= 0, rec);
    if (slot_of_[e] >= 0) {
      continue;
    }
    int s = victim(keep);
    expert_in_[s] = -1;
    try {
      write(e, s);
    } catch (...) {
      free_.push_back(s); // its content is partial: the slot stays free
      throw;
    }
    expert_in_[s] = e;
    slot_of_[e] = s;
  }
  used(unique, tokens);
  for (int64_t i = 0; i < n; i++) {
    out[i] = uint32_t(slot_of_[experts[i]]);
  }
}

void ExpertCache::load(const std::vector<int>& experts, int tokens,
                       int64_t call) {
  gpu_sync_host(*this);
  std::vector<uint32_t> ids(experts.begin(), experts.end());
  std::vector<uint32_t> out(ids.size());
  // The stream has run every earlier call: a tier's records they used may go.
  resolve_call(ids.data(), ids.size(), tokens, out.data(), call,
               [&](const uint8_t* record, int64_t, int s) {
                 if (on_gpu) {
                   gpu_load_copy(*this, record, s);
                 } else {
                   fill_host(record, s);
                 }
               });
}

std::vector<int> ExpertCache::table() {
  gpu_sync_host(*this);
  std::vector<int> t(num_experts);
  for (int e = 0; e < num_experts; e++) {
    t[e] = slot_of_[e] < 0 ? capacity : slot_of_[e];
  }
  return t;
}


void ExpertFetch::eval_cpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  auto& inds = inputs[0];
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  std::optional<mx::array> predicted;
  if (predicted_) {
    predicted = inputs[1];
  }
  enc.dispatch([cache = cache_, inds, predicted, out, call = call_]() mutable {
    int64_t n = inds.size();
    int tokens = int(n / std::max<int64_t>(1, inds.shape(-1)));
    auto& c = *cache;
    c.counters.calls += 1;
    // Slot 0 wherever a failed read leaves a pair unresolved: the ops after a
    // failed fetch still run, and must never see an id past the slots.
    std::memset(out.data<uint32_t>(), 0, out.nbytes());
    c.resolve_call(
        inds.data<uint32_t>(), n, tokens, out.data<uint32_t>(), call,
        [&](const uint8_t* record, int64_t, int s) { c.fill_host(record, s); });
    if (predicted && c.next()) {
      c.next()->hint(predicted->data<uint32_t>(), predicted->size());
    }
  });
}

void ExpertFetch::eval_gpu(
    const std::vector<mx::array>& inputs,
    std::vector<mx::array>& outputs) {
  gpu_fetch(*cache_, inputs, outputs[0], predicted_, call_, stream());
}

mx::array fetch(
    std::shared_ptr<ExpertCache> cache,
    const mx::array& inds,
    const std::optional<mx::array>& predicted,
    int64_t call) {
  auto s = mx::default_stream(mx::default_device());
  std::vector<mx::array> inputs = {
      mx::contiguous(mx::astype(inds, mx::uint32, s), false, s)};
  if (predicted) {
    inputs.push_back(
        mx::contiguous(mx::astype(*predicted, mx::uint32, s), false, s));
  }
  auto shape = inds.shape();
  return mx::array(
      shape,
      mx::uint32,
      std::make_shared<ExpertFetch>(
          s, std::move(cache), bool(predicted), call),
      std::move(inputs));
}

} // namespace moestream
