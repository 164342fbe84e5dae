"""What the PyTorch checks of test_torch_api.py run in other processes: an IPC receiver (spawned
by torch.multiprocessing, so importable by name), a probe of PyTorch's allocator settings, and a
C++ trace tracker."""

import os
import sys

PLUGIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def err_str(e):
    return (type(e).__name__ + ": " + str(e)).strip()[:2000]


def setup_allocator(alloc):
    """Installs slotpool in this process when `alloc` is "slotpool"."""
    if alloc == "slotpool":
        if PLUGIN not in sys.path:
            sys.path.insert(0, PLUGIN)
        import slotpool_torch

        slotpool_torch.install(conf=os.environ.get("SLOTPOOL_TORCH_CONF"))


def ipc_receiver(alloc, q_in, q_out):
    """A process that receives CUDA tensors (torch.multiprocessing, spawned), under `alloc`."""
    try:
        setup_allocator(alloc)
        import torch

        t = q_in.get(timeout=120)
        want = torch.arange(t.numel(), dtype=torch.float32, device=t.device)
        ok = bool(torch.equal(t, want))
        t[0] = -1.0  # the sender sees this write
        torch.cuda.synchronize()
        del t
        q_out.put("ok" if ok else "received different values")
    except Exception as e:  # noqa: BLE001 - reported to the sender
        q_out.put("receiver: " + err_str(e))
    q_in.get(timeout=120)  # the sender is done


ALLOC_CONF_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["PLUGIN"])
if os.environ["ALLOC"] == "slotpool":
    import slotpool_torch
    slotpool_torch.install(conf=os.environ.get("SLOTPOOL_TORCH_CONF"))
import torch
total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction((1536 << 20) / total)
out = {"max_split_size": torch.cuda.memory_stats().get("max_split_size")}
xs = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
del xs
out["reserved_before"] = torch.cuda.memory_reserved()
y = torch.empty(300 << 20, dtype=torch.uint8, device="cuda")
out["reserved_after"] = torch.cuda.memory_reserved()
settings = torch.cuda.memory._snapshot().get("allocator_settings", {})
out["gc_threshold"] = settings.get("garbage_collection_threshold")
out["settings"] = settings.get("PYTORCH_CUDA_ALLOC_CONF")
print(json.dumps(out))
"""


TRACKER_SRC = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <mutex>
#include <tuple>
#include <vector>

namespace {
std::mutex mu;
std::vector<std::tuple<int64_t, int64_t, int64_t>> events_seen;
}

void attach() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        std::lock_guard<std::mutex> lk(mu);
        events_seen.emplace_back(static_cast<int64_t>(te.action_), static_cast<int64_t>(te.addr_),
                                 static_cast<int64_t>(te.size_));
      });
}

std::vector<std::vector<int64_t>> take() {
  std::lock_guard<std::mutex> lk(mu);
  std::vector<std::vector<int64_t>> out;
  for (const auto& [a, addr, size] : events_seen) {
    out.push_back({a, addr, size});
  }
  events_seen.clear();
  return out;
}
"""
