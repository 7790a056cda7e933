#include "expert_fetch.h"

#include <algorithm>
#include <cstring>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace moestream {

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
        [&](const uint8_t* record, int64_t, int s) { c.memory.fill_host(record, s); },
        c.pending_fills().on());
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
