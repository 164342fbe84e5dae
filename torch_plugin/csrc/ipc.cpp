// CUDA tensors between processes: shareIpcHandle and getIpcDevPtr in PyTorch's handle format.
#include "slotpool_allocator.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>

namespace slotpool_torch {


// CUDA IPC (torch.multiprocessing) in PyTorch's handle format, version 2: a version byte, then
//  - 'c' and the cudaIpcMemHandle_t of a cudaMalloc'd segment's base (slotpool's classic
//    segments are such allocations);
//  - 'e' and the pages of an expandable segment, which is what slotpool's vmm reservations are:
//    a header {pid_t pid; (4 bytes of padding); size_t page_size; size_t count} and `count` ints,
//    the sender's POSIX file descriptors of the physical pages that cover the block, in address
//    order (the layout PyTorch 2.11 writes, benches/gpu/ipc_probe.py on the H200). The receiver
//    duplicates them with pidfd_getfd and maps them in order.
// The block's offset (into its segment, or into its first page) travels beside the handle. Both
// kinds are opened here whichever allocator sent them, and slotpool's handles by PyTorch's own.
namespace {
constexpr char kIpcHandleVersion = 2;
constexpr char kIpcCudaMalloc = 'c';
constexpr char kIpcExpandable = 'e';

struct IpcPagesHeader {
  int32_t pid;
  int32_t padding;
  uint64_t page_size;
  uint64_t count;
};
static_assert(sizeof(IpcPagesHeader) == 24, "PyTorch's expandable-segment share header");
}  // namespace

CCA::ShareableHandle SlotpoolAllocator::shareIpcHandle(void* ptr) {
  void* base = nullptr;
  size_t size = 0;
  int vmm = 0;
  check(sp_segment_info(ptr, &base, &size, &vmm), "sp_segment_info");
  std::string bytes;
  bytes.push_back(kIpcHandleVersion);
  if (vmm == 0) {
    cudaIpcMemHandle_t handle;
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
    bytes.push_back(kIpcCudaMalloc);
    bytes.append(reinterpret_cast<const char*>(&handle), sizeof handle);
    return CCA::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base),
                                std::move(bytes)};
  }
  size_t count = 0, page_size = 0, offset = 0;
  // A first call with no room only reports how many pages cover the block.
  (void)sp_ipc_export(ptr, nullptr, 0, &count, &page_size, &offset);
  TORCH_CHECK(count > 0, "slotpool: sp_ipc_export: ", sp_last_error_message());
  std::vector<int> fds(count, -1);
  check(sp_ipc_export(ptr, fds.data(), fds.size(), &count, &page_size, &offset),
        "sp_ipc_export");
  IpcPagesHeader header{static_cast<int32_t>(getpid()), 0, page_size, count};
  bytes.push_back(kIpcExpandable);
  bytes.append(reinterpret_cast<const char*>(&header), sizeof header);
  bytes.append(reinterpret_cast<const char*>(fds.data()), fds.size() * sizeof(int));
  return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(bytes)};
}

std::shared_ptr<void> SlotpoolAllocator::getIpcDevPtr(std::string handle) {
  TORCH_CHECK(handle.size() >= 2 && handle[0] == kIpcHandleVersion,
              "slotpool: a CUDA IPC handle of an unknown format (not PyTorch's version ",
              static_cast<int>(kIpcHandleVersion), ")");
  const bool pages = handle[1] == kIpcExpandable;
  IpcPagesHeader header{};
  if (pages) {
    TORCH_CHECK(handle.size() >= 2 + sizeof header, "slotpool: a truncated 'e' IPC handle");
    std::memcpy(&header, handle.data() + 2, sizeof header);
    TORCH_CHECK(header.count > 0 && header.count <= (1u << 20) &&
                    handle.size() == 2 + sizeof header + header.count * sizeof(int),
                "slotpool: an 'e' IPC handle of the wrong size");
  } else {
    TORCH_CHECK(handle[1] == kIpcCudaMalloc && handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                "slotpool: a CUDA IPC handle of an unknown type or size");
  }
  std::lock_guard<std::mutex> lock(ipc_mu_);
  auto it = ipc_opened_.find(handle);
  if (it != ipc_opened_.end()) {
    if (auto open = it->second.lock()) {
      return open;
    }
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* dev_ptr = nullptr;
  if (pages) {
    ensure_initialized();
    std::vector<int> fds(header.count);
    std::memcpy(fds.data(), handle.data() + 2 + sizeof header, fds.size() * sizeof(int));
    check(sp_ipc_open(device, header.pid, fds.data(), fds.size(), header.page_size, &dev_ptr),
          "sp_ipc_open");
  } else {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + 2, sizeof h);
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&dev_ptr, h, cudaIpcMemLazyEnablePeerAccess));
  }
  // Closed on the device that opened it, once the last storage using it is gone.
  std::shared_ptr<void> open(dev_ptr, [this, handle, device, pages](void* p) {
    c10::cuda::CUDAGuard guard(device);
    std::lock_guard<std::mutex> lock(ipc_mu_);
    if (pages) {
      if (sp_ipc_close(device, p) != SP_OK) {
        TORCH_WARN("slotpool: sp_ipc_close: ", sp_last_error_message());
      }
    } else {
      C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(p));
    }
    auto entry = ipc_opened_.find(handle);
    if (entry != ipc_opened_.end() && entry->second.expired()) {
      ipc_opened_.erase(entry);
    }
  });
  ipc_opened_[handle] = open;
  return open;
}
}  // namespace slotpool_torch
