#include "lazy_output.h"

#include <memory>
#include <string_view>

#include "mlx/primitives.h"

namespace moestream {

namespace mx = mlx::core;

namespace {

// The arrays that hold `a`'s node. An mx::array is one shared pointer to its
// node (the graph's inputs and siblings, Python's objects, each a copy).
long holders(const mx::array& a) {
  static_assert(sizeof(mx::array) == sizeof(std::shared_ptr<void>),
                "mx::array is no longer one shared pointer");
  return reinterpret_cast<const std::shared_ptr<void>&>(a).use_count();
}

} // namespace

bool waits_for_unneeded(const mx::array& waiter) {
  if (waiter.status() != mx::array::Status::unscheduled ||
      !waiter.has_primitive() || waiter.inputs().size() != 2 ||
      std::string_view(waiter.primitive().name()) != "Depends") {
    return false;
  }
  const mx::array& output = waiter.inputs()[1];
  return output.status() == mx::array::Status::unscheduled && holders(output) == 1;
}

} // namespace moestream
