// MLX's CUDA headers include <fmt/format.h> for error messages in header
// templates, but the MLX wheel does not ship fmt. This covers that use only.
#pragma once
#include <sstream>
#include <string>
#include <string_view>

namespace fmt {
template <typename... Args>
std::string format(std::string_view pattern, Args&&... args) {
  std::ostringstream out;
  size_t pos = 0;
  auto put = [&](auto&& value) {
    size_t open = pattern.find("{}", pos);
    out << pattern.substr(pos, open == std::string_view::npos ? open : open - pos);
    if (open == std::string_view::npos) {
      pos = pattern.size();
      return;
    }
    out << value;
    pos = open + 2;
  };
  (put(args), ...);
  out << pattern.substr(std::min(pos, pattern.size()));
  return out.str();
}
} // namespace fmt
