// torch._C._cuda_setCheckpointPoolState under slotpool: what CUDA graph trees call at every branch
// switch. slotpool_torch.install() puts set_checkpoint_pool_state in its place (PyTorch's own stays
// reachable as slotpool_torch.torch_set_checkpoint_pool_state).
//
// PyTorch's binding asks the allocator for a CheckpointDelta (one owning DataPtr per allocation
// live in the checkpoint, one pointer per allocation live before) and then builds four node-based
// hash sets over it, one of them copied by value, to check the stale storages and hand out
// deleters. At 10,000 live blocks that bookkeeping alone costs milliseconds, more than slotpool's
// restore. This file does the same work on the restore's own lists (GraphRestore), and a DataPtr
// only for a storage that takes one. Each storage is visited once: its deleter changes when it
// is checked, and a call that fails puts every changed deleter back. The usual call builds no
// set: a storage met twice is told by the deleter it was given, a pointer handed out twice by a
// bit beside the checkpoint's live set (ptr_set.h, built once, with the checkpoint), and the
// stale pointers are matched with the freed ones by fingerprint; an open-addressing set is
// built only where those do not settle a check.
//
// Same contract as PyTorch's binding (torch/csrc/cuda/Module.cpp, PyTorch 2.11):
//   1. stale storages are taken once each, in the caller's order;
//   2. every pointer the restore frees for good (freed, not live in the checkpoint) has its stale
//      storage: fewer stale storages than such pointers is an error;
//   3. each stale storage's pointer was freed (by the restore, or a survivor: PyTorch lists those
//      as freed too), and its deleter is the allocator's: it becomes deleteNothing;
//   4. each storage in storages_to_add_deleters_to whose pointer is live in the checkpoint, and
//      which has no deleter context, takes an owning DataPtr with the allocator's deleter (the
//      last such storage of a pointer wins, as in PyTorch's map).
// It checks more before it restores: a state that is not slotpool's, a stale storage with a
// foreign deleter, or a storage to add a deleter to that already has one is refused before the
// restore, and such a call changes nothing. The checks that need the restore's lists (2, 3) come
// after it, as in PyTorch; a call they refuse has restored the pool and changed no storage.
#include "internal.h"
#include "phases.h"
#include "ptr_set.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

namespace slotpool_torch {

namespace {

// Buffers kept from call to call, one set per thread. At 10,000 live blocks the sets and lists
// below hold a few hundred KB, which a fresh allocation takes page by page from a heap that was
// trimmed in between: graph trees call this at every branch switch.
struct Scratch {
  std::vector<uintptr_t> seen, freed, created;  // PtrSet tables, built only when needed
  std::vector<uint64_t> claimed;                // (4): a bit per slot of the checkpoint's live set
  std::vector<c10::StorageImpl*> stale;         // (1), each storage once
  std::vector<void*> stale_ptrs;                // their data pointers, read once
  std::vector<void*> add_ptrs;                  // (4): each storage's data pointer, read once
  std::vector<size_t> take;                     // (4): which of them take a deleter
  // (4): each storage that took a deleter, with the deleter and device its DataPtr had.
  struct Taken {
    c10::StorageImpl* s;
    c10::DeleterFnPtr deleter;
    c10::Device device;
  };
  std::vector<Taken> taken;
  GraphRestore restore;  // the restore's lists
};

// (4)'s probes of the checkpoint's live set are asked for this many storages ahead: a slot lies
// anywhere in a table of twice the live blocks. (The storages themselves are read in order,
// without prefetching: that did not shorten the stale storages' pass on the H200 host and
// lengthened it on a 2-core VM, 100 us against 80 for 5,000 storages.)
constexpr size_t kAhead = 16;

// A list of pointers as a count and a sum of keyed mixes of each (splitmix64's finaliser of the
// pointer xor a key drawn once a process). Two lists with equal fingerprints hold the same
// pointers as many times each, unless their sums collide: about 2^-64 for lists that differ, and
// no list can be built to collide without the key. (3) compares the stale pointers with the
// freed ones this way, in the pass that reads them, instead of through a set of either.
class Fingerprint {
 public:
  void add(const void* p) {
    uint64_t z = reinterpret_cast<uintptr_t>(p) ^ key_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    sum_ += z ^ (z >> 31);
    n_++;
  }
  bool operator==(const Fingerprint& o) const { return n_ == o.n_ && sum_ == o.sum_; }

 private:
  static uint64_t key() {
    static const uint64_t k = [] {
      std::random_device rd;
      return (uint64_t{rd()} << 32) ^ rd();
    }();
    return k;
  }
  uint64_t key_ = key();
  uint64_t sum_ = 0;
  size_t n_ = 0;
};

// The storages' deleters as a call found them, until it commits: stale storages get ours back,
// storages that took a DataPtr their bare one.
struct Undo {
  Scratch& sc;
  const c10::DeleterFnPtr ours;
  bool committed = false;
  ~Undo() {
    if (committed) {
      return;
    }
    for (c10::StorageImpl* s : sc.stale) {
      (void)s->mutable_data_ptr().compare_exchange_deleter(&c10::detail::deleteNothing, ours);
    }
    for (const Scratch::Taken& t : sc.taken) {
      // Ours lets go of the block first: dropped with its context, it would free it.
      void* p = t.s->mutable_data_ptr().release_context();
      t.s->set_data_ptr_noswap(c10::DataPtr(p, nullptr, t.deleter, t.device));
    }
  }
};

}  // namespace

void set_checkpoint_pool_state(SlotpoolAllocator& a, c10::DeviceIndex device,
                               const std::shared_ptr<CCA::AllocatorState>& state,
                               const std::vector<c10::StorageImpl*>& stale_storages,
                               const std::vector<c10::StorageImpl*>& storages_to_add_deleters_to) {
  const c10::DeleterFnPtr ours = &slotpool_delete;
  thread_local Scratch sc;
  sc.stale.clear();
  sc.stale_ptrs.clear();
  sc.taken.clear();
  // The restore's lists hold the checkpoint state: let it go however this call ends.
  struct Release {
    Scratch& sc;
    ~Release() { sc.restore.reset(); }
  } release{sc};
  std::shared_ptr<CheckpointState> cp = graph_checkpoint_state(device, state);
  const PtrSet live_set = PtrSet::filled(cp->live_set);
  Undo undo{sc, ours};

  // (1, 3) Each stale storage once, in order: a foreign deleter is refused, ours becomes
  // deleteNothing. Each storage is read and written here once. A storage that does not hold
  // ours is either one met before in this list (this loop gave it deleteNothing) or refused;
  // only then is a set of the storages taken built, to tell the two apart. Their pointers'
  // fingerprint is for (3).
  Fingerprint stale_fp;
  phase("setup");
  {
    std::optional<PtrSet> seen;  // the storages taken, once one has deleteNothing
    for (size_t i = 0; i < stale_storages.size(); ++i) {
      c10::StorageImpl* s = stale_storages[i];
      TORCH_CHECK(s != nullptr, "slotpool: a null stale storage");
      c10::DataPtr& d = s->mutable_data_ptr();
      if (d.compare_exchange_deleter(ours, &c10::detail::deleteNothing)) {
        sc.stale.push_back(s);
        sc.stale_ptrs.push_back(d.get());
        if (seen) {
          seen->insert(s);
        }
        continue;
      }
      if (!seen) {
        seen.emplace(stale_storages.size(), sc.seen);
        for (c10::StorageImpl* t : sc.stale) {
          seen->insert(t);
        }
      }
      TORCH_CHECK(d.get_deleter() == &c10::detail::deleteNothing && seen->contains(s),
                  "Unexpected deleter function on storage, could not swap function");
    }
  }
  // Apart from the loop above, whose reads miss the cache one storage after another: there,
  // the mixing's multiplies kept fewer of those reads in flight.
  for (void* p : sc.stale_ptrs) {
    stale_fp.add(p);
  }
  phase("stale");
  // (4) The storages that take a deleter: the last one per pointer that is live in the
  // checkpoint. Each must have no deleter context; it takes an owning DataPtr. A bit per slot
  // of the checkpoint's live set marks the pointers handed out, so one probe a storage does.
  // Three passes, each with one kind of wait: the storages' pointers read in order (a cache
  // miss each, nothing depending on it, so many in flight); their probes of the set, a few
  // slots ahead, backwards (the last storage of a pointer wins); then the storages chosen, now
  // cached, take their DataPtrs. One loop doing all three took twice as long on a 2-core VM.
  {
    const std::vector<c10::StorageImpl*>& add = storages_to_add_deleters_to;
    sc.add_ptrs.resize(add.size());
    for (size_t i = 0; i < add.size(); ++i) {
      TORCH_CHECK(add[i] != nullptr, "slotpool: a null storage to add a deleter to");
      sc.add_ptrs[i] = add[i]->data_ptr().get();
    }
    sc.take.clear();
    if (!add.empty()) {
      sc.claimed.assign((live_set.capacity() + 63) / 64, 0);
    }
    for (size_t i = add.size(); i-- > 0;) {
      if (i >= kAhead && sc.add_ptrs[i - kAhead] != nullptr) {
        live_set.prefetch(sc.add_ptrs[i - kAhead]);
      }
      void* p = sc.add_ptrs[i];
      const size_t slot = p == nullptr ? PtrSet::kNone : live_set.find(p);
      if (slot == PtrSet::kNone) {
        continue;
      }
      uint64_t& word = sc.claimed[slot / 64];
      const uint64_t bit = uint64_t{1} << (slot % 64);
      if ((word & bit) == 0) {
        word |= bit;
        sc.take.push_back(i);
      }
    }
    const c10::Device dev(c10::DeviceType::CUDA, device);
    for (size_t i : sc.take) {
      c10::StorageImpl* s = add[i];
      const c10::DataPtr& d = s->data_ptr();
      TORCH_CHECK(d.get_context() == nullptr, " Not expecting deleter function");
      sc.taken.push_back({s, d.get_deleter(), d.device()});
      s->set_data_ptr_noswap(c10::DataPtr(sc.add_ptrs[i], sc.add_ptrs[i], ours, dev));
    }
  }

  phase("add");
  GraphRestore& r = sc.restore;
  a.restore_graph_state(std::move(cp), r);

  // (2) Every pointer freed for good comes with its stale storage (counted only when there are
  // fewer stale storages than pointers freed: with as many, the check cannot fail).
  if (sc.stale.size() < r.freed.size()) {
    size_t definitely_freed = 0;
    for (void* p : r.freed) {
      definitely_freed += live_set.contains(p) ? 0 : 1;
    }
    TORCH_CHECK(sc.stale.size() >= definitely_freed,
                "Any stale tensors which are being manually freed must be passed to set checkpoint");
  }

  // (3) Stale storages point at freed memory: what the restore freed, or a survivor (live
  // before and after: PyTorch lists those as freed too). When the stale pointers are the freed
  // ones, each once (the usual case: equal fingerprints), that settles it; else each is looked up.
  if (!sc.stale.empty()) {
    Fingerprint freed_fp;
    for (void* p : r.freed) {
      freed_fp.add(p);
    }
    if (!(freed_fp == stale_fp)) {
      PtrSet freed(r.freed.size(), sc.freed);
      for (void* p : r.freed) {
        freed.insert(p);
      }
      const PtrSet created = r.created_set(sc.created);
      for (void* p : sc.stale_ptrs) {
        TORCH_CHECK(freed.contains(p) || (live_set.contains(p) && !created.contains(p)),
                    "slotpool: a stale storage whose memory the restore did not free");
      }
    }
  }
  undo.committed = true;
  phase("checks");
}

}  // namespace slotpool_torch
