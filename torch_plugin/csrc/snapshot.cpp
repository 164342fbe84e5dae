// snapshot() (torch.cuda.memory._snapshot, memory_viz) and getExpandableSegmentSizes, read from
// one slotpool snapshot handle (sp_snapshot_take) through its segment, block and trace views.
#include "internal.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <tuple>

namespace slotpool_torch {

using detail::SnapshotGuard;

namespace {

// Takes a snapshot of device (-1: every device), with the recorded history if asked.
void take(int device, bool with_traces, SnapshotGuard& out) {
  check(sp_snapshot_take(device, with_traces ? 1 : 0, &out.p), "sp_snapshot_take");
}

sp_segment_view segment_at(const sp_snapshot* s, size_t i) {
  sp_segment_view v{};
  check(sp_snapshot_segment(s, i, &v), "sp_snapshot_segment");
  return v;
}

sp_block_view block_at(const sp_snapshot* s, size_t segment, size_t j) {
  sp_block_view v{};
  check(sp_snapshot_block(s, segment, j, &v), "sp_snapshot_block");
  return v;
}

int devices_in_use() {
  int n = 0;
  return sp_device_count(&n) == SP_OK ? n : 0;
}

}  // namespace

std::vector<CCA::StreamSegmentSize> SlotpoolAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex device) {
  ensure_initialized();
  // slotpool's vmm segments play the part of expandable segments: their sizes per (stream, pool
  // size class).
  SnapshotGuard snap;
  take(device, false, snap);
  std::map<std::pair<uint64_t, bool>, size_t> sizes;
  size_t n = sp_snapshot_segment_count(snap.p);
  for (size_t i = 0; i < n; ++i) {
    sp_segment_view seg = segment_at(snap.p, i);
    if (seg.is_expandable == 0) {
      continue;
    }
    sizes[{seg.stream, seg.is_large == 0}] += static_cast<size_t>(seg.total_size);
  }
  std::vector<CCA::StreamSegmentSize> out;
  for (const auto& [key, size] : sizes) {
    out.emplace_back(reinterpret_cast<cudaStream_t>(key.first), key.second, size);
  }
  return out;
}

// The recorded history as PyTorch's trace entries, less recordHistory's skip_actions, with the
// stacks the shim gathered. PyTorch's Python side reads time_.t_ as microseconds (its own
// allocator converts its approximate clock before returning); slotpool records microseconds
// already.
void SlotpoolAllocator::append_traces(const sp_snapshot* snap, CCA::SnapshotInfo& info) {
  std::vector<std::string> skip;
  // The gathered stacks of each (device, action, address), oldest first.
  std::map<std::tuple<int, int, uint64_t>, std::vector<std::shared_ptr<c10::GatheredContext>>> stacks;
  {
    std::lock_guard<std::mutex> lk(history_mu_);
    skip = history_skip_;
    for (const auto& t : trace_stacks_) {
      stacks[{t.device, static_cast<int>(t.action), t.addr}].push_back(t.ctx);
    }
  }
  // Each device's events, oldest first; one list per device slotpool knows.
  std::vector<std::vector<sp_trace_event>> by_device(
      std::max(info.device_traces.size(), static_cast<size_t>(devices_in_use())));
  size_t n = sp_snapshot_trace_count(snap);
  for (size_t i = 0; i < n; ++i) {
    sp_trace_event e{};
    check(sp_snapshot_trace(snap, i, &e), "sp_snapshot_trace");
    if (e.device < 0) {
      continue;
    }
    if (static_cast<size_t>(e.device) >= by_device.size()) {
      by_device.resize(static_cast<size_t>(e.device) + 1);
    }
    by_device[static_cast<size_t>(e.device)].push_back(e);
  }
  if (info.device_traces.size() < by_device.size()) {
    info.device_traces.resize(by_device.size());
  }
  for (size_t device = 0; device < by_device.size(); ++device) {
    const auto& entries = by_device[device];
    // Newest first, so that the k-th newest entry of a key gets the k-th newest stack.
    std::vector<CCA::TraceEntry> rev;
    std::map<std::tuple<int, int, uint64_t>, size_t> seen;
    for (auto e = entries.rbegin(); e != entries.rend(); ++e) {
      CCA::TraceEntry::Action a{};
      std::string_view name;
      if (!detail::trace_action(e->action, &a, &name)) {
        continue;  // an action this PyTorch does not know
      }
      std::shared_ptr<c10::GatheredContext> ctx;
      std::tuple<int, int, uint64_t> key{static_cast<int>(device), static_cast<int>(a), e->addr};
      if (auto it = stacks.find(key); it != stacks.end()) {
        size_t k = seen[key]++;
        if (k < it->second.size()) {
          ctx = it->second[it->second.size() - 1 - k];
        }
      }
      if (std::find(skip.begin(), skip.end(), name) != skip.end()) {
        continue;
      }
      rev.emplace_back(a, static_cast<c10::DeviceIndex>(device), static_cast<size_t>(e->addr),
                       static_cast<size_t>(e->size), reinterpret_cast<void*>(e->stream),
                       MempoolId_t{0, 0}, c10::approx_time_t{0}, std::move(ctx));
      rev.back().time_.t_ = static_cast<time_t>(e->time_us);
    }
    auto& out = info.device_traces[device];
    out.insert(out.end(), std::make_move_iterator(rev.rbegin()), std::make_move_iterator(rev.rend()));
  }
}

CCA::SnapshotInfo SlotpoolAllocator::snapshot(MempoolId_t mempool_id, bool include_traces) {
  ensure_initialized();
  CCA::SnapshotInfo info;
  SnapshotGuard snap;
  take(-1, include_traces, snap);
  decltype(block_stacks_) stacks;
  {
    std::lock_guard<std::mutex> lk(history_mu_);
    stacks = block_stacks_;
  }
  bool filter = mempool_id.first != 0 || mempool_id.second != 0;
  sp_pool_id want = to_sp(mempool_id);
  int max_device = std::max(device_count_.load(), 1) - 1;
  size_t n_segments = sp_snapshot_segment_count(snap.p);
  for (size_t i = 0; i < n_segments; ++i) {
    sp_segment_view seg = segment_at(snap.p, i);
    if (filter && (seg.pool.a != want.a || seg.pool.b != want.b)) {
      continue;
    }
    max_device = std::max(max_device, seg.device);
    c10::CachingDeviceAllocator::SegmentInfo proto;
    proto.device = static_cast<c10::DeviceIndex>(seg.device);
    proto.stream = reinterpret_cast<void*>(seg.stream);
    proto.is_large = seg.is_large != 0;
    proto.is_expandable = seg.is_expandable != 0;
    proto.owner_private_pool_id = from_sp(seg.pool);
    // PyTorch computes block addresses as segment address + sizes of the blocks before; a gap
    // (an unmapped range of a vmm segment) starts a new segment, as PyTorch reports each mapped
    // range of an expandable segment on its own.
    auto start = [&](uint64_t addr) {
      info.segments.push_back(proto);
      info.segments.back().address = static_cast<size_t>(addr);
    };
    if (seg.block_count == 0) {
      start(seg.address);
      info.segments.back().total_size = static_cast<size_t>(seg.total_size);
      continue;
    }
    uint64_t next = 0;
    bool open = false;
    for (size_t j = 0; j < seg.block_count; ++j) {
      sp_block_view b = block_at(snap.p, i, j);
      if (!open || b.address != next) {
        start(b.address);
        open = true;
      }
      auto& cur = info.segments.back();
      c10::CachingDeviceAllocator::BlockInfo bi;
      bi.size = static_cast<size_t>(b.size);
      bi.requested_size = static_cast<size_t>(b.requested_size);
      bi.allocated = b.state == SP_BLOCK_ACTIVE_ALLOCATED;
      bi.active = b.state != SP_BLOCK_INACTIVE;
      if (bi.allocated && !stacks.empty()) {
        if (auto it = stacks.find(b.address); it != stacks.end()) {
          bi.context_when_allocated = it->second.second;
        }
      }
      cur.total_size += bi.size;
      if (bi.allocated) {
        cur.allocated_size += bi.size;
      }
      if (bi.active) {
        cur.active_size += bi.size;
        cur.requested_size += bi.requested_size;
      }
      cur.blocks.push_back(std::move(bi));
      next = b.address + b.size;
    }
  }
  std::sort(info.segments.begin(), info.segments.end(),
            [](const auto& x, const auto& y) { return x.address < y.address; });
  info.device_traces.resize(static_cast<size_t>(max_device + 1));
  if (include_traces) {
    append_traces(snap.p, info);
  }
  CCA::AllocatorConfigInfo& cfg = info.config_metadata;
  // The threshold in effect (0: off).
  cfg.garbage_collection_threshold = config_number("garbage_collection_threshold");
  sp_memory_stats s{};
  cfg.max_split_size = sp_memory_stats_get(0, &s) == SP_OK && s.max_split_size >= 0
                           ? static_cast<size_t>(s.max_split_size)
                           : SIZE_MAX;
  cfg.pinned_num_register_threads = 1;
  // The configuration in effect, as slotpool reads it ("growth:vmm,...,vmm_page_mb:4"): PyTorch's
  // snapshot shows it as allocator_settings["PYTORCH_CUDA_ALLOC_CONF"].
  cfg.last_allocator_settings = config_string("conf");
  cfg.expandable_segments = config_string("growth") == "vmm";
  cfg.release_lock_on_malloc = false;
  cfg.pinned_use_host_register = false;
  cfg.graph_capture_record_stream_reuse = false;
  return info;
}

}  // namespace slotpool_torch
