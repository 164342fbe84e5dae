// Symbols of libtorch_cuda the shim references but the host programs (host_check.cpp,
// graph_state_bench.cpp) never reach (installing the allocator): defined here, once per
// program, so that only c10 is needed. Include it in one source file of a program.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <memory>

#include <c10/cuda/CUDACachingAllocator.h>

namespace torch::cuda::CUDAPluggableAllocator {
void changeCurrentAllocator(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>&) {
  std::fprintf(stderr, "changeCurrentAllocator called in a host program\n");
  std::abort();
}
}  // namespace torch::cuda::CUDAPluggableAllocator
