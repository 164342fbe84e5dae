// The memory history: recordHistory (slotpool records the entries, the shim gathers the stacks),
// and attachAllocatorTraceTracker (every event as it happens).
#include "internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <iterator>
#include <utility>

namespace slotpool_torch {

namespace detail {

bool trace_action(int sp_action, CCA::TraceEntry::Action* action, std::string_view* name) {
  using Action = CCA::TraceEntry::Action;
  // By sp_trace_action's value (include/slotpool.h), with parseTraceEntryAction's names.
  static constexpr std::pair<Action, std::string_view> kActions[] = {
      {Action::ALLOC, "alloc"},
      {Action::FREE_REQUESTED, "free_requested"},
      {Action::FREE_COMPLETED, "free_completed"},
      {Action::SEGMENT_ALLOC, "segment_alloc"},
      {Action::SEGMENT_FREE, "segment_free"},
      {Action::SEGMENT_MAP, "segment_map"},
      {Action::SEGMENT_UNMAP, "segment_unmap"},
      {Action::OOM, "oom"}};
  static_assert(SP_TRACE_OOM + 1 == std::size(kActions), "one entry per sp_trace_action");
  if (sp_action < 0 || sp_action >= static_cast<int>(std::size(kActions))) {
    return false;
  }
  if (action != nullptr) {
    *action = kActions[sp_action].first;
  }
  if (name != nullptr) {
    *name = kActions[sp_action].second;
  }
  return true;
}

}  // namespace detail

bool SlotpoolAllocator::isHistoryEnabled() {
  return history_enabled_.load();
}

// torch.cuda.memory._record_memory_history: slotpool records every device's events (alloc,
// free_requested, free_completed, segment_*, oom) into a ring of alloc_trace_max_entries, and
// snapshot() hands them to PyTorch as device_traces. The shim calls context_recorder for the
// stacks, at PyTorch's levels (see note_alloc).
void SlotpoolAllocator::recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                                      size_t alloc_trace_max_entries, CCA::RecordContext when,
                                      bool clearHistory,
                                      const std::vector<std::string>& skip_actions) {
  ensure_initialized();
  size_t entries = enabled ? std::max<size_t>(alloc_trace_max_entries, 1) : 0;
  std::vector<TracedStack> dropped;  // destroyed after the lock is released (see history_mu_)
  std::lock_guard<std::mutex> lk(history_mu_);
  // As PyTorch's allocator: stopping forgets the trace too (live blocks keep their stacks).
  if (!enabled || clearHistory) {
    check(sp_clear_history(-1), "sp_clear_history");
    dropped.assign(std::make_move_iterator(trace_stacks_.begin()),
                   std::make_move_iterator(trace_stacks_.end()));
    trace_stacks_.clear();
  }
  check(sp_record_history(-1, entries), "sp_record_history");
  history_skip_ = skip_actions;
  bool stacks = enabled && context_recorder != nullptr;
  history_recorder_ = stacks ? context_recorder : nullptr;
  if (enabled) {
    history_max_ = entries;
    trim_trace_stacks_locked(dropped);
  }
  gather_when_.store(stacks ? static_cast<int>(when) : 0, std::memory_order_relaxed);
  history_enabled_.store(enabled);
}

std::shared_ptr<c10::GatheredContext> SlotpoolAllocator::gather(CCA::RecordContext at_least) {
  if (gather_when_.load(std::memory_order_relaxed) < static_cast<int>(at_least)) {
    return nullptr;
  }
  CCA::CreateContextFn recorder = nullptr;
  {
    std::lock_guard<std::mutex> lk(history_mu_);
    recorder = history_recorder_;
  }
  if (recorder == nullptr) {
    return nullptr;
  }
  // Outside the lock: PyTorch's recorder takes the GIL to read the Python stack. A failure costs
  // the stack, never the allocation or free it describes.
  try {
    return recorder();
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE("slotpool: the memory history's stack recorder failed: ", e.what());
  } catch (...) {
    TORCH_WARN_ONCE("slotpool: the memory history's stack recorder failed");
  }
  return nullptr;
}

void SlotpoolAllocator::trim_trace_stacks_locked(std::vector<TracedStack>& dropped) {
  while (trace_stacks_.size() > history_max_) {
    dropped.push_back(std::move(trace_stacks_.front()));
    trace_stacks_.pop_front();
  }
}

// PyTorch's levels: STATE keeps live blocks' stacks, ALLOC also the alloc trace entries', ALL
// also the free entries'. Stacks leave the maps into `dropped`, destroyed once history_mu_ is
// released: destroying a Python stack takes the GIL, and snapshot() takes history_mu_ under it.
void SlotpoolAllocator::note_alloc(c10::DeviceIndex device, void* p) {
  auto ctx = gather(CCA::RecordContext::STATE);
  bool traced = gather_when_.load(std::memory_order_relaxed) >=
                static_cast<int>(CCA::RecordContext::ALLOC);
  uint64_t addr = reinterpret_cast<uint64_t>(p);
  std::vector<TracedStack> dropped;
  std::lock_guard<std::mutex> lk(history_mu_);
  auto it = block_stacks_.find(addr);
  if (it != block_stacks_.end()) {
    // A stack left by a block that went without free_ptr (a restore took it) is not this one's.
    dropped.push_back({it->second.first, CCA::TraceEntry::ALLOC, addr, std::move(it->second.second)});
    block_stacks_.erase(it);
  }
  if (ctx != nullptr) {
    block_stacks_.emplace(addr, std::make_pair(static_cast<int>(device), ctx));
    if (traced) {
      trace_stacks_.push_back({static_cast<int>(device), CCA::TraceEntry::ALLOC, addr, ctx});
      trim_trace_stacks_locked(dropped);
    }
  }
  n_block_stacks_.store(block_stacks_.size(), std::memory_order_relaxed);
}

void SlotpoolAllocator::note_free(void* p) {
  uint64_t addr = reinterpret_cast<uint64_t>(p);
  auto ctx = gather(CCA::RecordContext::ALL);
  int device = -1;
  std::vector<TracedStack> dropped;
  std::unique_lock<std::mutex> lk(history_mu_);
  auto it = block_stacks_.find(addr);
  if (it != block_stacks_.end()) {
    device = it->second.first;
    dropped.push_back({device, CCA::TraceEntry::ALLOC, addr, std::move(it->second.second)});
    block_stacks_.erase(it);
    n_block_stacks_.store(block_stacks_.size(), std::memory_order_relaxed);
  }
  if (ctx == nullptr) {
    return;
  }
  if (device < 0) {  // allocated before stacks were gathered
    lk.unlock();
    void* base = nullptr;
    size_t size = 0;
    size_t requested = 0;
    if (sp_allocation_info(p, &base, &size, &requested, &device) != SP_OK) {
      return;  // not ours: sp_free refuses it and records nothing
    }
    lk.lock();
  }
  trace_stacks_.push_back({device, CCA::TraceEntry::FREE_REQUESTED, addr, std::move(ctx)});
  trim_trace_stacks_locked(dropped);
}

void SlotpoolAllocator::attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) {
  ensure_initialized();
  bool first = false;
  {
    std::lock_guard<std::mutex> lk(trackers_mu_);
    auto next = std::make_shared<std::vector<CCA::AllocatorTraceTracker>>();
    if (trace_trackers_) {
      *next = *trace_trackers_;
    }
    first = next->empty();
    next->push_back(std::move(tracker));
    trace_trackers_ = std::move(next);
  }
  if (first) {
    check(sp_set_trace_callback(&SlotpoolAllocator::on_trace_event, this),
          "sp_set_trace_callback");
  }
}

// slotpool's trace callback: each event as PyTorch's TraceEntry, to every attached tracker (as
// PyTorch calls them, under the allocator's lock, with no stack). Never throws into slotpool.
void SlotpoolAllocator::on_trace_event(const sp_trace_event* e, void* self) {
  CCA::TraceEntry::Action action{};
  if (e == nullptr || !detail::trace_action(e->action, &action, nullptr)) {
    return;
  }
  auto* a = static_cast<SlotpoolAllocator*>(self);
  std::shared_ptr<const std::vector<CCA::AllocatorTraceTracker>> trackers;
  {
    std::lock_guard<std::mutex> lk(a->trackers_mu_);
    trackers = a->trace_trackers_;
  }
  if (!trackers) {
    return;
  }
  try {
    CCA::TraceEntry te(action, static_cast<c10::DeviceIndex>(e->device),
                       static_cast<size_t>(e->addr), static_cast<size_t>(e->size),
                       reinterpret_cast<void*>(e->stream), MempoolId_t{0, 0},
                       c10::approx_time_t{0}, nullptr);
    te.time_.t_ = static_cast<time_t>(e->time_us);
    for (const auto& t : *trackers) {
      t(te);
    }
  } catch (...) {
    // No TORCH_WARN here: its handler may call into Python under slotpool's lock.
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      std::fprintf(stderr, "slotpool: an allocator trace tracker threw; its event was dropped\n");
    }
  }
}
}  // namespace slotpool_torch
