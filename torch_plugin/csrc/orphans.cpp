// Stale owners after slotpool's own restores (slotpool_torch.restore, variant groups) and
// mark_reusable: see "Stale owners" in slotpool_allocator.h.
#include "internal.h"

#include <c10/util/Exception.h>

namespace slotpool_torch {

namespace {

// A restore delta's freed (freed = true) or re-created allocations, in the delta's order.
std::vector<PtrSize> delta_list(const sp_restore_delta* d, bool freed) {
  std::vector<PtrSize> out;
  if (d == nullptr) {
    return out;
  }
  int created = freed ? 0 : 1;
  size_t n = 0;
  check(sp_delta_entries(d, created, nullptr, nullptr, 0, &n), "sp_delta_entries");
  std::vector<void*> ptrs(n);
  std::vector<size_t> sizes(n);
  check(sp_delta_entries(d, created, ptrs.data(), sizes.data(), n, &n), "sp_delta_entries");
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.emplace_back(ptrs[i], sizes[i]);
  }
  return out;
}

}  // namespace

bool SlotpoolAllocator::consume_orphan(void* ptr) {
  std::lock_guard<std::mutex> lk(orphan_mu_);
  auto it = orphans_.find(ptr);
  if (it == orphans_.end()) {
    return false;
  }
  if (--it->second.count == 0) {
    if (it->second.pinned) {
      unpin_locked(it->second);
    }
    orphans_.erase(it);
  }
  n_orphans_.fetch_sub(1, std::memory_order_acq_rel);
  return true;
}

void SlotpoolAllocator::unpin_locked(const Orphan& o) {
  auto key = std::make_tuple(o.device, o.pool.a, o.pool.b);
  auto it = pinned_pools_.find(key);
  if (it == pinned_pools_.end() || --it->second != 0) {
    return;
  }
  pinned_pools_.erase(it);
  // Called from deleters: report, never throw.
  sp_status st = sp_pool_release(o.device, o.pool, nullptr);
  if (st != SP_OK) {
    TORCH_WARN("slotpool: unpinning pool (", o.pool.a, ", ", o.pool.b, ") failed: ", describe(st));
  }
}

RestoreResult SlotpoolAllocator::absorb_delta(int device, sp_pool_id pool,
                                              sp_restore_delta* delta, bool free_created) {
  RestoreResult res;
  res.freed = delta_list(delta, true);
  res.created = delta_list(delta, false);
  if (!res.freed.empty()) {
    std::lock_guard<std::mutex> lk(orphan_mu_);
    for (const auto& f : res.freed) {
      Orphan& o = orphans_[f.first];
      ++o.count;
      if (!o.pinned) {
        o.pinned = true;
        o.device = device;
        o.pool = pool;
        size_t& pins = pinned_pools_[std::make_tuple(device, pool.a, pool.b)];
        if (pins++ == 0) {
          uint64_t uses = 0;
          sp_status st = sp_pool_create_or_incref(device, pool, nullptr, &uses);
          if (st != SP_OK) {
            TORCH_WARN("slotpool: pinning pool (", pool.a, ", ", pool.b, ") failed: ",
                       describe(st));
          }
        }
      }
    }
    n_orphans_.fetch_add(res.freed.size(), std::memory_order_acq_rel);
  }
  if (free_created) {
    // Re-created allocations were freed by their owners after the checkpoint: nobody holds them.
    for (const auto& c : res.created) {
      sp_status st = sp_free(c.first);
      if (st != SP_OK) {
        TORCH_WARN("slotpool: freeing re-created ", c.first, " failed: ", describe(st));
      }
    }
  }
  return res;
}

uint64_t SlotpoolAllocator::mark_reusable(void* ptr) {
  std::lock_guard<std::mutex> lk(orphan_mu_);
  uint64_t size = 0;
  check(sp_mark_reusable(ptr, &size), "sp_mark_reusable");
  ++orphans_[ptr].count;
  n_orphans_.fetch_add(1, std::memory_order_acq_rel);
  return size;
}

size_t SlotpoolAllocator::orphan_count() {
  return n_orphans_.load(std::memory_order_acquire);
}

}  // namespace slotpool_torch
