// Checkpoints: getCheckpointState / setCheckpointPoolState (CUDA graph trees), slotpool_torch's
// checkpoint and restore, and variant groups. See "Checkpoints" in slotpool_allocator.h.
#include "internal.h"
#include "phases.h"
#include "ptr_set.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <utility>

namespace slotpool_torch {

using detail::DeltaGuard;

namespace {

bool current_stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // unknown: assume the worst
  }
  return status != cudaStreamCaptureStatusNone;
}

// A restore delta's freed (created false) or re-created pointers, read in one call into `out`
// (its capacity kept).
void delta_ptrs(const sp_restore_delta* d, bool created, std::vector<void*>& out) {
  size_t n = 0;
  check(sp_delta_entries(d, created ? 1 : 0, nullptr, nullptr, 0, &n), "sp_delta_entries");
  out.resize(n);
  check(sp_delta_entries(d, created ? 1 : 0, out.data(), nullptr, n, &n), "sp_delta_entries");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Checkpoint state and variant groups

CheckpointState::~CheckpointState() {
  if (cp != nullptr) {
    sp_checkpoint_free(cp);
    cp = nullptr;
  }
}

VariantGroup::~VariantGroup() {
  close();
}

void VariantGroup::close() {
  std::lock_guard<std::mutex> lk(mu);
  if (g != nullptr) {
    sp_variant_group_free(g);
    g = nullptr;
  }
  active.reset();
}

RestoreResult VariantGroup::begin(size_t k, bool free_created) {
  std::lock_guard<std::mutex> lk(mu);
  TORCH_CHECK(g != nullptr, "slotpool: the variant group is closed");
  TORCH_CHECK(k < count, "slotpool: variant ", k, " of a group of ", count);
  TORCH_CHECK(!active.has_value(), "slotpool: variant ", *active, " has not ended");
  SlotpoolAllocator* a = instance();
  TORCH_CHECK(a != nullptr, "slotpool: the allocator is not installed");
  // Frees that wait on cross-stream events make a restore refuse; retire the completed ones.
  (void)sp_process_events(device);
  DeltaGuard delta;
  check(sp_variant_begin(g, k, &delta.p), "sp_variant_begin");
  active = k;
  return a->absorb_delta(device, pool, delta.p, free_created);
}

void VariantGroup::end() {
  std::lock_guard<std::mutex> lk(mu);
  TORCH_CHECK(g != nullptr, "slotpool: the variant group is closed");
  check(sp_variant_end(g), "sp_variant_end");
  active.reset();
}

// ---- checkpoints ----

std::shared_ptr<CheckpointState> SlotpoolAllocator::take_checkpoint(int device, sp_pool_id pool) {
  ensure_initialized();
  (void)sp_process_events(device);
  sp_checkpoint* cp = nullptr;
  sp_status st = sp_checkpoint_take(device, pool, &cp);
  if (st == SP_ERR_INVALID_STATE && !current_stream_capturing()) {
    // Frees that wait on cross-stream events: let them complete, retire them, try once more
    // (PyTorch's allocator requires the same: "Events should have synchronized").
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    (void)sp_process_events(device);
    st = sp_checkpoint_take(device, pool, &cp);
  }
  check(st, "sp_checkpoint_take");
  auto state = std::make_shared<CheckpointState>(device, pool, cp, std::vector<void*>{});
  // Owned from here on: a failure below frees the checkpoint with the state.
  std::vector<sp_allocation> live = pool_live_allocations(device, pool);
  state->live.reserve(live.size());
  for (const sp_allocation& a : live) {
    state->live.push_back(a.ptr);
  }
  std::sort(state->live.begin(), state->live.end());
  PtrSet set(state->live.size(), state->live_set);
  for (void* p : state->live) {
    set.insert(p);
  }
  return state;
}

std::shared_ptr<CCA::AllocatorState> SlotpoolAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                          MempoolId_t id) {
  return take_checkpoint(device, to_sp(id));
}

std::shared_ptr<CheckpointState> graph_checkpoint_state(
    c10::DeviceIndex device, const std::shared_ptr<CCA::AllocatorState>& pps) {
  auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
  TORCH_CHECK(state != nullptr,
              "slotpool: setCheckpointPoolState needs a state from slotpool's getCheckpointState");
  TORCH_CHECK(state->device == device, "slotpool: checkpoint of device ", state->device,
              " restored on device ", static_cast<int>(device));
  TORCH_CHECK(state->cp != nullptr, "slotpool: checkpoint already freed");
  return state;
}

void SlotpoolAllocator::restore_graph_state(std::shared_ptr<CheckpointState> state,
                                            GraphRestore& out) {
  ensure_initialized();
  (void)sp_process_events(state->device);
  phase("events");
  out.reset();
  DeltaGuard delta;
  void* none[1] = {nullptr};  // keep nothing (PyTorch's restore has no keep set)
  check(sp_checkpoint_restore(state->cp, none, 0, &delta.p), "sp_checkpoint_restore");
  phase("restore");
  delta_ptrs(delta.p, /*created=*/false, out.freed);
  out.delta_.reset(std::exchange(delta.p, nullptr));
  out.state = std::move(state);
  phase("lists");
}

const std::vector<void*>& GraphRestore::created() const {
  if (!created_read_) {
    TORCH_CHECK(delta_ != nullptr, "slotpool: a restore's created list read after reset");
    delta_ptrs(delta_.get(), /*created=*/true, created_);
    created_read_ = true;
  }
  return created_;
}

void GraphRestore::reset() {
  state.reset();
  delta_.reset();
  created_read_ = false;
}

PtrSet GraphRestore::created_set(std::vector<uintptr_t>& slots) const {
  const std::vector<void*>& made = created();
  PtrSet set(made.size(), slots);
  for (void* p : made) {
    set.insert(p);
  }
  return set;
}

void GraphRestore::for_each_survivor(const std::function<void(void*)>& f) const {
  std::vector<uintptr_t> slots;
  const PtrSet made = created_set(slots);
  for (void* p : state->live) {
    if (!made.contains(p)) {
      f(p);
    }
  }
}

CCA::CheckpointDelta SlotpoolAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) {
  // PyTorch's contract: every allocation live before is "freed", every allocation of the
  // checkpoint is "allocated" (survivors, live in both, appear in both lists). Live before: what
  // the restore freed, and the survivors, which are the checkpoint's allocations the restore did
  // not re-create.
  GraphRestore r;
  restore_graph_state(graph_checkpoint_state(device, pps), r);
  const std::vector<void*>& live_after = r.state->live;
  CCA::CheckpointDelta out;
  out.ptrs_freed = std::move(r.freed);
  out.ptrs_freed.reserve(out.ptrs_freed.size() + live_after.size());
  r.for_each_survivor([&](void* p) { out.ptrs_freed.push_back(p); });
  out.dataptrs_allocd.reserve(live_after.size());
  const c10::Device dev(c10::DeviceType::CUDA, device);
  for (void* p : live_after) {
    out.dataptrs_allocd.emplace_back(p, p, &slotpool_delete, dev);
  }
  return out;
}

RestoreResult SlotpoolAllocator::restore(int device, sp_pool_id pool, const CheckpointState& cp,
                                         const std::vector<void*>& keep_live, bool free_created) {
  ensure_initialized();
  TORCH_CHECK(cp.cp != nullptr, "slotpool: checkpoint already freed");
  TORCH_CHECK(cp.device == device, "slotpool: checkpoint of device ", cp.device,
              " restored on device ", device);
  TORCH_CHECK(cp.pool.a == pool.a && cp.pool.b == pool.b, "slotpool: a checkpoint of pool (",
              cp.pool.a, ", ", cp.pool.b, ") cannot restore pool (", pool.a, ", ", pool.b, ")");
  (void)sp_process_events(device);
  DeltaGuard delta;
  void* none[1] = {nullptr};
  check(sp_checkpoint_restore(cp.cp, keep_live.empty() ? none : keep_live.data(), keep_live.size(),
                              &delta.p),
        "sp_checkpoint_restore");
  return absorb_delta(device, pool, delta.p, free_created);
}

}  // namespace slotpool_torch
