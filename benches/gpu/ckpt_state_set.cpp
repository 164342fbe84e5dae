// The allocator's part of torch._C._cuda_setCheckpointPoolState, for benches/gpu/ckpt_state_bench.py
// (built there with torch.utils.cpp_extension.load, under whichever allocator is installed).
#include <torch/extension.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <chrono>
#include <memory>
#include <vector>

namespace A = c10::cuda::CUDACachingAllocator;

// The allocator's setCheckpointPoolState alone, timed; then what torch._C._cuda_setCheckpointPoolState
// does with its delta, less its pointer sets and checks: the stale storages lose their deleters and
// the handed-back DataPtrs their ownership (as for storages_to_add_deleters_to = []).
// Returns {microseconds, len(ptrs_freed), len(dataptrs_allocd)}.
std::vector<double> set_state_timed(int64_t device, std::shared_ptr<A::AllocatorState> state,
                                    std::vector<size_t> stale) {
  auto t0 = std::chrono::steady_clock::now();
  A::CheckpointDelta delta =
      A::setCheckpointPoolState(static_cast<c10::DeviceIndex>(device), std::move(state));
  auto t1 = std::chrono::steady_clock::now();
  c10::DeleterFnPtr ours = A::get()->raw_deleter();
  for (size_t p : stale) {
    auto* s = reinterpret_cast<c10::StorageImpl*>(p);
    TORCH_CHECK(s->mutable_data_ptr().compare_exchange_deleter(ours, &c10::detail::deleteNothing),
                "a stale storage with another deleter");
  }
  for (auto& d : delta.dataptrs_allocd) {
    d.release_context();
  }
  return {std::chrono::duration<double, std::micro>(t1 - t0).count(),
          static_cast<double>(delta.ptrs_freed.size()),
          static_cast<double>(delta.dataptrs_allocd.size())};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("set_state_timed", &set_state_timed); }
