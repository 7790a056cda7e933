// What MLX's graph says of a layer's output before anything evaluates it.
#pragma once

#include "mlx/array.h"

namespace moestream {

// Whether `waiter` (mx.depends of a one-element array on one output, made
// by the engine to order a layer's next call after that output) is
// unscheduled and waits for an output that is unscheduled too and held by
// nothing but the waiter: unless the waiter is evaluated, that output is
// never computed, so no call need wait for it.
bool waits_for_unneeded(const mlx::core::array& waiter);

} // namespace moestream
