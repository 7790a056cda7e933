#include "read_error.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <mutex>

namespace moestream {

namespace {

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

std::string os_error(const std::string& what) {
  return what + ": " + std::strerror(errno);
}

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

} // namespace moestream
