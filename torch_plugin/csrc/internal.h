// Pieces the shim's files share that are no part of its interface (slotpool_allocator.h): owners
// of slotpool's handles, and trace actions by PyTorch's names.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "slotpool_allocator.h"

namespace slotpool_torch {
namespace detail {

// Owns one slotpool handle; freed with Free when the owner goes (a null handle is left alone).
// Pass &owner.p as the out argument of the call that makes the handle.
template <typename T, sp_status (*Free)(T*)>
struct Owned {
  T* p = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (p != nullptr) {
      (void)Free(p);
    }
  }
};

using DeltaGuard = Owned<sp_restore_delta, &sp_delta_free>;
using SnapshotGuard = Owned<sp_snapshot, &sp_snapshot_free>;

// slotpool's trace action (sp_trace_action) as PyTorch's, with PyTorch's name for it ("alloc",
// "free_requested", ...: recordHistory's skip_actions spell them so); false for a value this
// PyTorch has no action for.
bool trace_action(int sp_action, CCA::TraceEntry::Action* action, std::string_view* name);

}  // namespace detail
}  // namespace slotpool_torch
