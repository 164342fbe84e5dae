// Routes: PyTorch's beginAllocateToPool filters, evaluated by the shim as PyTorch evaluates them,
// and the variant block's thread route (see "Routing" in slotpool_allocator.h).
#include "slotpool_allocator.h"

#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <typeinfo>

namespace slotpool_torch {

sp_pool_id SlotpoolAllocator::route_for(c10::DeviceIndex device, cudaStream_t stream) {
  auto& r = routes_[device];
  std::shared_lock<std::shared_mutex> lk(r.mu);
  // PyTorch's get_pool: captures_underway in order of begin, the first filter that accepts the
  // allocation's stream wins.
  for (const Route& e : r.list) {
    if (!e.filter || e.filter(stream)) {
      return to_sp(e.id);
    }
  }
  if (r.variant && r.variant->first == std::this_thread::get_id()) {
    return to_sp(r.variant->second);
  }
  return sp_pool_id{0, 0};
}

void SlotpoolAllocator::beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                            std::function<bool(cudaStream_t)> filter) {
  ensure_initialized();
  check_device(device);
  // Which kind of filter is this? PyTorch 2.11 passes (a) CUDAGraph's capture filters (capture
  // id of the allocation's stream == the graph's; called before cudaStreamBeginCapture, so the id
  // is not known yet), (b) use_mem_pool's thread filter, (c) the current-stream filter and (d)
  // "always". A capture filter names CUDAGraph in its type, or rejects the current stream now (the
  // capture has not started, or a conditional node's child capture has not).
  bool capture = false;
  std::string tname = filter ? filter.target_type().name() : "";
  if (tname.find("CUDAGraph") != std::string::npos) {
    capture = true;
  } else if (filter) {
    cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device).stream();
    capture = !filter(cur);
  }
  auto& r = routes_[device];
  std::unique_lock<std::shared_mutex> lk(r.mu);
  for (const Route& e : r.list) {
    TORCH_CHECK(e.id != mempool_id, "beginAllocateToPool: already recording to mempool_id (",
                mempool_id.first, ", ", mempool_id.second, ")");
  }
  sp_status st = capture ? sp_begin_allocate_to_pool(device, to_sp(mempool_id), SP_ROUTE_CAPTURE,
                                                     kNeverCaptureId)
                         : sp_begin_allocate_to_pool(device, to_sp(mempool_id),
                                                     SP_ROUTE_CURRENT_THREAD, 0);
  check(st, "sp_begin_allocate_to_pool");
  r.list.push_back(Route{mempool_id, std::move(filter), capture,
                         capture ? "capture" : "thread/stream/all"});
  r.active.store(static_cast<int>(r.list.size()) + (r.variant ? 1 : 0),
                 std::memory_order_release);
}

void SlotpoolAllocator::endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  check_device(device);
  auto& r = routes_[device];
  std::unique_lock<std::shared_mutex> lk(r.mu);
  auto it = std::find_if(r.list.begin(), r.list.end(),
                         [&](const Route& e) { return e.id == mempool_id; });
  TORCH_CHECK(it != r.list.end(), "endAllocatePool: not currently recording to mempool_id (",
              mempool_id.first, ", ", mempool_id.second, ")");
  r.list.erase(it);
  r.active.store(static_cast<int>(r.list.size()) + (r.variant ? 1 : 0),
                 std::memory_order_release);
  check(sp_end_allocate_to_pool(device, to_sp(mempool_id)), "sp_end_allocate_to_pool");
}

void SlotpoolAllocator::begin_variant_route(int device, MempoolId_t pool) {
  check_device(static_cast<c10::DeviceIndex>(device));
  auto& r = routes_[device];
  std::unique_lock<std::shared_mutex> lk(r.mu);
  TORCH_CHECK(!r.variant, "slotpool: a variant block is already routing on device ", device);
  r.variant = std::make_pair(std::this_thread::get_id(), pool);
  r.active.store(static_cast<int>(r.list.size()) + 1, std::memory_order_release);
}

void SlotpoolAllocator::end_variant_route(int device) {
  check_device(static_cast<c10::DeviceIndex>(device));
  auto& r = routes_[device];
  std::unique_lock<std::shared_mutex> lk(r.mu);
  r.variant.reset();
  r.active.store(static_cast<int>(r.list.size()), std::memory_order_release);
}

std::vector<std::pair<MempoolId_t, std::string>> SlotpoolAllocator::routes(int device) {
  check_device(static_cast<c10::DeviceIndex>(device));
  auto& r = routes_[device];
  std::shared_lock<std::shared_mutex> lk(r.mu);
  std::vector<std::pair<MempoolId_t, std::string>> out;
  for (const Route& e : r.list) {
    out.emplace_back(e.id, e.kind);
  }
  if (r.variant) {
    out.emplace_back(r.variant->second, "variant thread");
  }
  return out;
}

}  // namespace slotpool_torch
