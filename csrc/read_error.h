// An expert record that cannot be used: Python's ExpertReadError.
#pragma once

#include <stdexcept>
#include <string>

namespace moestream {

// Its words are remembered, since MLX's stream rethrows errors as plain
// runtime_errors.
class ReadError : public std::runtime_error {
 public:
  explicit ReadError(const std::string& what);
};
// Whether `what` is the message of a ReadError of this process.
bool is_read_error(const char* what);
// `what` followed by errno's words.
std::string os_error(const std::string& what);

} // namespace moestream
