// Pools: lifetime (createOrIncrefPool, releasePool), options (setUseOnOOM, setNoSplit and the
// bindings' pool options, read back from slotpool and changed in place) and live allocations.
#include "slotpool_allocator.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace slotpool_torch {

void SlotpoolAllocator::releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  // Called from CUDAGraph::reset (a destructor) and ~MemPool: report, never throw.
  sp_status st = sp_pool_release(device, to_sp(mempool_id), nullptr);
  if (st != SP_OK) {
    TORCH_WARN("slotpool: releasing pool (", mempool_id.first, ", ", mempool_id.second,
               ") on device ", static_cast<int>(device), " failed: ", describe(st));
  }
}

int SlotpoolAllocator::getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) {
  ensure_initialized();
  uint64_t n = 0;
  sp_status st = sp_pool_use_count(device, to_sp(mempool_id), &n);
  if (st == SP_ERR_UNKNOWN_POOL) {
    return 0;
  }
  check(st, "sp_pool_use_count");
  return static_cast<int>(n);
}

void SlotpoolAllocator::createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                           std::shared_ptr<CCA::CUDAAllocator> allocator) {
  ensure_initialized();
  if (allocator != nullptr && allocator.get() != this) {
    TORCH_WARN_ONCE(
        "slotpool: MemPool(allocator=...) is not supported; the pool's memory comes from "
        "slotpool and the given allocator is ignored.");
  }
  check(sp_pool_create_or_incref(device, to_sp(mempool_id), nullptr, nullptr),
        "sp_pool_create_or_incref");
}

sp_status SlotpoolAllocator::update_pool_options(
    int device, sp_pool_id pool, const std::function<void(sp_pool_options&)>& change) {
  // sp_pool_set_options replaces every option: read what the pool has now, change the one asked,
  // write them back, with no other update in between.
  std::lock_guard<std::mutex> lk(options_mu_);
  sp_pool_options o{};
  sp_status st = sp_pool_options_get(device, pool, &o);
  if (st != SP_OK) {
    return st;
  }
  change(o);
  return sp_pool_set_options(device, pool, &o);
}

void SlotpoolAllocator::setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id,
                                    bool use_on_oom) {
  // ~MemPool calls this: report, never throw (a throw there aborts the process).
  sp_status st = update_pool_options(device, to_sp(mempool_id), [&](sp_pool_options& o) {
    o.use_on_oom = use_on_oom ? 1 : 0;
  });
  if (st != SP_OK) {
    TORCH_WARN("slotpool: setUseOnOOM on pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", describe(st));
  }
}

void SlotpoolAllocator::setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) {
  sp_status st =
      update_pool_options(device, to_sp(mempool_id), [](sp_pool_options& o) { o.no_split = 1; });
  if (st != SP_OK) {
    TORCH_WARN("slotpool: setNoSplit on pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", describe(st));
  }
}

std::vector<sp_allocation> SlotpoolAllocator::pool_live_allocations(int device, sp_pool_id pool) {
  // Room for what the pool held last time on this thread (graph trees restore the same pools over
  // and over); a second call when it has grown since.
  thread_local size_t last_total = 0;
  std::vector<sp_allocation> out(std::max<size_t>(last_total, 64));
  for (;;) {
    size_t total = 0;
    check(sp_pool_live_allocations(device, pool, out.data(), out.size(), &total),
          "sp_pool_live_allocations");
    last_total = total;
    if (total <= out.size()) {
      out.resize(total);
      return out;
    }
    out.resize(total);
  }
}

bool SlotpoolAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  ensure_initialized();
  std::vector<void*> ptrs(expected_live_allocations.begin(), expected_live_allocations.end());
  void* none[1] = {nullptr};  // a valid array pointer even when the set is empty
  sp_status st = sp_pool_verify_live(device, to_sp(mempool_id), ptrs.empty() ? none : ptrs.data(),
                                     ptrs.size());
  if (st == SP_OK) {
    return true;
  }
  if (st == SP_ERR_INVALID_STATE) {
    return false;
  }
  if (st == SP_ERR_UNKNOWN_POOL) {
    return ptrs.empty();
  }
  check(st, "sp_pool_verify_live");
  return false;
}

}  // namespace slotpool_torch
