// A set of addresses for the shim's hot paths (graph_state.cpp, checkpoints.cpp): open
// addressing with linear probing in a power-of-two table at most half full, in a vector the
// caller keeps. Address 0 is the empty slot; a null pointer is kept apart. std::unordered_set
// allocates a node per element, which is what makes PyTorch's setCheckpointPoolState slow.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace slotpool_torch {

class PtrSet {
 public:
  // An empty set for up to n addresses in `slots` (cleared; its capacity is kept, so a caller
  // that keeps the vector from call to call allocates nothing).
  PtrSet(size_t n, std::vector<uintptr_t>& slots) : slots_(&slots) {
    size_t cap = 16;
    while (cap < 2 * n) {
      cap *= 2;
    }
    slots.assign(cap, 0);
    size_mask(cap);
  }
  // The set that a PtrSet without a null pointer left in `slots`.
  static PtrSet filled(std::vector<uintptr_t>& slots) { return PtrSet(slots); }

  // True if p was not in the set.
  bool insert(const void* p) {
    auto v = reinterpret_cast<uintptr_t>(p);
    if (v == 0) {
      bool fresh = !has_null_;
      has_null_ = true;
      return fresh;
    }
    std::vector<uintptr_t>& t = *slots_;
    for (size_t i = slot_of(v);; i = (i + 1) & mask_) {
      if (t[i] == v) {
        return false;
      }
      if (t[i] == 0) {
        t[i] = v;
        return true;
      }
    }
  }
  // Ask for the cache line where p's probe starts (a lookup a few steps later then finds it).
  void prefetch(const void* p) const {
    __builtin_prefetch(slots_->data() + slot_of(reinterpret_cast<uintptr_t>(p)));
  }
  bool contains(const void* p) const {
    return p == nullptr ? has_null_ : find(p) != kNone;
  }
  // The slot that holds p (non-null), or kNone: a caller can keep a bit per slot beside the
  // set (graph_state.cpp marks the checkpoint's pointers it has handed out), below capacity().
  static constexpr size_t kNone = SIZE_MAX;
  size_t find(const void* p) const {
    auto v = reinterpret_cast<uintptr_t>(p);
    const std::vector<uintptr_t>& t = *slots_;
    for (size_t i = slot_of(v);; i = (i + 1) & mask_) {
      if (t[i] == v) {
        return i;
      }
      if (t[i] == 0) {
        return kNone;
      }
    }
  }
  size_t capacity() const { return mask_ + 1; }

 private:
  explicit PtrSet(std::vector<uintptr_t>& slots) : slots_(&slots) { size_mask(slots.size()); }
  void size_mask(size_t cap) {
    int bits = 0;
    while ((size_t{1} << bits) < cap) {
      bits++;
    }
    mask_ = cap - 1;
    shift_ = 64 - bits;
  }
  size_t slot_of(uintptr_t v) const {
    // Fibonacci hashing: the product's top bits mix every bit of the address, so neither the
    // 512-byte alignment of blocks nor the spacing of StorageImpls clusters the slots (middle
    // bits of the product did, measured: 40x slower on block addresses).
    return static_cast<size_t>((v * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  std::vector<uintptr_t>* slots_;
  size_t mask_ = 0;
  int shift_ = 60;
  bool has_null_ = false;
};

}  // namespace slotpool_torch
