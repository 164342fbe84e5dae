// Host checks of the shim's C++ conversions, with no GPU: the allocator runs on slotpool's
// simulated device (backend "sim") and is called directly, never installed into PyTorch, so no
// CUDA call is made. Built and run by scripts/torch_host_check.sh against the headers and c10
// libraries of the torch wheel; the GPU API checks (benches/gpu/torch_scenarios.py) cover the rest.
//
// Exit status 0 when every check passes; each failure prints one line.

#include <algorithm>
#include <functional>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>
#include <memory>
#include <mutex>
#include <tuple>
#include <atomic>
#include <set>
#include <unordered_set>
#include <string>
#include <vector>

#include "../csrc/pyint.h"
#include "../csrc/slotpool_allocator.h"

#include <c10/core/StorageImpl.h>

#include "torch_stubs.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    std::printf("FAIL: %s\n", what.c_str());
    ++failures;
  }
}

using Action = c10::CachingDeviceAllocator::TraceEntry::Action;

size_t count(const std::vector<c10::CachingDeviceAllocator::TraceEntry>& trace, Action a,
             void* addr) {
  size_t n = 0;
  for (const auto& e : trace) {
    n += e.action_ == a && e.addr_ == reinterpret_cast<size_t>(addr);
  }
  return n;
}

// A stand-in for PyTorch's CapturedTraceback: numbered in the order the recorder made them.
struct FakeStack : c10::GatheredContext {
  explicit FakeStack(int id) : id(id) {}
  int id;
};

std::atomic<int> stacks_made{0};

std::shared_ptr<c10::GatheredContext> fake_recorder() {
  return std::make_shared<FakeStack>(++stacks_made);
}

std::shared_ptr<c10::GatheredContext> failing_recorder() {
  throw std::runtime_error("no stack today");
}

int stack_id(const std::shared_ptr<c10::GatheredContext>& c) {
  auto* f = dynamic_cast<FakeStack*>(c.get());
  return f != nullptr ? f->id : 0;
}

// The stack of the k-th entry (oldest first) of `action` at `addr`, 0 if none, -1 if no entry.
int entry_stack(const std::vector<c10::CachingDeviceAllocator::TraceEntry>& trace, Action a,
                void* addr, size_t k) {
  for (const auto& e : trace) {
    if (e.action_ == a && e.addr_ == reinterpret_cast<size_t>(addr) && k-- == 0) {
      return stack_id(e.context_);
    }
  }
  return -1;
}

// The stack of the allocated block at `addr` in a snapshot, 0 if none, -1 if no such block.
int block_stack(const c10::cuda::CUDACachingAllocator::SnapshotInfo& s, void* addr) {
  for (const auto& seg : s.segments) {
    size_t a = seg.address;
    for (const auto& b : seg.blocks) {
      if (a == reinterpret_cast<size_t>(addr) && b.allocated) {
        return stack_id(b.context_when_allocated);
      }
      a += b.size;
    }
  }
  return -1;
}

// A filter std::function whose target type names CUDAGraph, as PyTorch's capture filters do:
// the shim registers it as a capture route without asking CUDA for the current stream.
struct FakeCUDAGraphFilter {
  cudaStream_t capturing;
  bool operator()(cudaStream_t s) const { return s == capturing; }
};

// Which pool slotpool says the block at `p` belongs to, from the snapshot's segments.
c10::MempoolId_t pool_of(slotpool_torch::SlotpoolAllocator& a, void* p) {
  auto snap = a.snapshot({0, 0}, false);
  for (const auto& seg : snap.segments) {
    if (reinterpret_cast<size_t>(p) >= seg.address &&
        reinterpret_cast<size_t>(p) < seg.address + seg.total_size) {
      return seg.owner_private_pool_id;
    }
  }
  return {~0ULL, ~0ULL};
}

// The message of what f throws (c10::Error), or "" when it returns.
std::string thrown(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

void check_stats_routes_and_checkpoints(slotpool_torch::SlotpoolAllocator& a) {
  using c10::CachingDeviceAllocator::StatType;
  const auto all = static_cast<size_t>(StatType::AGGREGATE);
  const auto small = static_cast<size_t>(StatType::SMALL_POOL);
  const auto large = static_cast<size_t>(StatType::LARGE_POOL);
  auto* s1 = reinterpret_cast<cudaStream_t>(11);
  auto* s2 = reinterpret_cast<cudaStream_t>(12);

  // getDeviceStats: PyTorch's fields from slotpool's, pool by pool.
  a.emptyCache({0, 0});
  a.resetPeakStats(1);
  auto before = a.getDeviceStats(1);
  void* sm = a.malloc_impl(1, 1000, s1);      // small pool, 1024 bytes
  void* lg = a.malloc_impl(1, 3 << 20, s1);   // large pool
  auto d = a.getDeviceStats(1);
  expect(d.allocation[all].current == before.allocation[all].current + 2, "stats: allocation");
  expect(d.allocated_bytes[small].current == before.allocated_bytes[small].current + 1024,
         "stats: small pool bytes");
  expect(d.allocated_bytes[large].current == before.allocated_bytes[large].current + (3 << 20),
         "stats: large pool bytes");
  expect(d.requested_bytes[all].current ==
             before.requested_bytes[all].current + 1000 + (3 << 20),
         "stats: requested bytes");
  expect(d.allocated_bytes[all].peak >= d.allocated_bytes[all].current, "stats: peak");
  expect(d.reserved_bytes[all].current >= d.allocated_bytes[all].current, "stats: reserved");
  a.free_ptr(lg, true);
  d = a.getDeviceStats(1);
  expect(d.allocated_bytes[large].freed >= (3 << 20), "stats: freed total");
  expect(d.allocated_bytes[all].peak - d.allocated_bytes[all].current == (3 << 20),
         "stats: the peak stays after a free");
  a.free_ptr(sm, true);

  // A capture route: allocations of the capturing stream go to the pool, others do not.
  c10::MempoolId_t pool{7, 0};
  a.createOrIncrefPool(1, pool);
  a.beginAllocateToPool(1, pool, FakeCUDAGraphFilter{s1});
  void* in_pool = a.malloc_impl(1, 5 << 20, s1);
  void* outside = a.malloc_impl(1, 5 << 20, s2);
  a.endAllocateToPool(1, pool);
  void* after = a.malloc_impl(1, 5 << 20, s1);
  expect(pool_of(a, in_pool) == pool, "route: the capturing stream's allocation is in the pool");
  expect(pool_of(a, outside) == c10::MempoolId_t{0, 0}, "route: another stream's is not");
  expect(pool_of(a, after) == c10::MempoolId_t{0, 0}, "route: none after endAllocateToPool");
  expect(a.checkPoolLiveAllocations(1, pool, {in_pool}), "checkPoolLiveAllocations: exact set");
  expect(!a.checkPoolLiveAllocations(1, pool, {}), "checkPoolLiveAllocations: a missing one");
  a.free_ptr(outside, true);
  a.free_ptr(after, true);

  // getCheckpointState / setCheckpointPoolState, PyTorch's contract: every allocation live
  // before the restore is in ptrs_freed, every allocation of the checkpoint in dataptrs_allocd.
  auto cp = a.getCheckpointState(1, pool);
  a.free_ptr(in_pool, true);
  a.beginAllocateToPool(1, pool, FakeCUDAGraphFilter{s1});
  void* other = a.malloc_impl(1, 9 << 20, s1);
  a.endAllocateToPool(1, pool);
  {
    auto delta = a.setCheckpointPoolState(1, cp);
    auto has = [](const std::vector<void*>& v, void* p) {
      return std::find(v.begin(), v.end(), p) != v.end();
    };
    expect(has(delta.ptrs_freed, other), "restore: the allocation made since is freed");
    expect(delta.dataptrs_allocd.size() == 1 && delta.dataptrs_allocd[0].get() == in_pool,
           "restore: the checkpoint's allocation is handed back");
    expect(a.checkPoolLiveAllocations(1, pool, {in_pool}), "restore: the pool holds it again");
  }  // the handed-back DataPtr frees it here, with the shim's deleter
  expect(a.checkPoolLiveAllocations(1, pool, {}), "the DataPtr's deleter freed it");
  a.releasePool(1, pool);

  // Half changed, as CUDA graph trees meet it at a branch switch: of four allocations in the
  // checkpoint two die since, and two new ones are made. ptrs_freed: the new ones and the
  // survivors (live before); dataptrs_allocd: the survivors and the re-created (the checkpoint's).
  c10::MempoolId_t half{8, 0};
  a.createOrIncrefPool(1, half);
  a.beginAllocateToPool(1, half, FakeCUDAGraphFilter{s1});
  std::vector<void*> in_cp;
  for (size_t i = 0; i < 4; ++i) {
    in_cp.push_back(a.malloc_impl(1, (i + 1) << 20, s1));
  }
  a.endAllocateToPool(1, half);
  auto cp_half = a.getCheckpointState(1, half);
  a.free_ptr(in_cp[0], true);
  a.free_ptr(in_cp[2], true);
  a.beginAllocateToPool(1, half, FakeCUDAGraphFilter{s1});
  void* new1 = a.malloc_impl(1, 7 << 20, s1);
  void* new2 = a.malloc_impl(1, 9 << 20, s1);
  a.endAllocateToPool(1, half);
  {
    auto delta = a.setCheckpointPoolState(1, cp_half);
    std::vector<void*> freed = delta.ptrs_freed;
    std::vector<void*> allocd;
    for (const auto& d : delta.dataptrs_allocd) {
      allocd.push_back(d.get());
      expect(d.get_deleter() == &slotpool_torch::slotpool_delete, "restore: our deleter");
    }
    std::sort(freed.begin(), freed.end());
    std::sort(allocd.begin(), allocd.end());
    std::vector<void*> want_freed{new1, new2, in_cp[1], in_cp[3]};
    std::vector<void*> want_allocd = in_cp;
    std::sort(want_freed.begin(), want_freed.end());
    std::sort(want_allocd.begin(), want_allocd.end());
    expect(freed == want_freed, "half changed: ptrs_freed = the new ones and the survivors");
    expect(allocd == want_allocd, "half changed: dataptrs_allocd = every allocation of the checkpoint");
    expect(a.checkPoolLiveAllocations(1, half, {in_cp.begin(), in_cp.end()}),
           "half changed: the pool holds the checkpoint's allocations");
    // slotpool_torch.restore of another pool with this checkpoint: refused, nothing changes.
    auto* state = dynamic_cast<slotpool_torch::CheckpointState*>(cp_half.get());
    std::string msg =
        thrown([&] { a.restore(1, slotpool_torch::to_sp(pool), *state, {}, true); });
    expect(msg.find("cannot restore pool") != std::string::npos,
           "a checkpoint restores only its own pool: " + msg);
    expect(a.checkPoolLiveAllocations(1, half, {in_cp.begin(), in_cp.end()}),
           "the refused restore changed nothing");
    for (auto& d : delta.dataptrs_allocd) {
      d.release_context();  // the four are this test's to free again
    }
  }
  // The same checkpoint again, after other changes (graph trees return to a node many times).
  a.free_ptr(in_cp[1], true);
  a.beginAllocateToPool(1, half, FakeCUDAGraphFilter{s1});
  void* new3 = a.malloc_impl(1, 5 << 20, s1);
  a.endAllocateToPool(1, half);
  {
    auto delta = a.setCheckpointPoolState(1, cp_half);
    std::vector<void*> freed = delta.ptrs_freed;
    std::vector<void*> allocd;
    for (const auto& d : delta.dataptrs_allocd) {
      allocd.push_back(d.get());
    }
    std::sort(freed.begin(), freed.end());
    std::sort(allocd.begin(), allocd.end());
    std::vector<void*> want_freed{new3, in_cp[0], in_cp[2], in_cp[3]};
    std::vector<void*> want_allocd = in_cp;
    std::sort(want_freed.begin(), want_freed.end());
    std::sort(want_allocd.begin(), want_allocd.end());
    expect(freed == want_freed, "a second restore: ptrs_freed = what is live before it");
    expect(allocd == want_allocd, "a second restore: dataptrs_allocd = the checkpoint's again");
  }  // the DataPtrs free all four
  expect(a.checkPoolLiveAllocations(1, half, {}), "half changed: the DataPtrs freed the pool");
  cp_half.reset();
  a.releasePool(1, half);
}

// n bytes from `pool` on device 1, as a capture on stream s allocates them.
void* capture_alloc(slotpool_torch::SlotpoolAllocator& a, c10::MempoolId_t pool, cudaStream_t s,
                    size_t n) {
  a.beginAllocateToPool(1, pool, FakeCUDAGraphFilter{s});
  void* p = a.malloc_impl(1, n, s);
  a.endAllocateToPool(1, pool);
  return p;
}

// set_checkpoint_pool_state (what torch._C._cuda_setCheckpointPoolState becomes under slotpool),
// on storages made here: stale storages lose the deleter, storages without one take it, and what
// can be refused before the restore changes nothing.
void check_graph_state(slotpool_torch::SlotpoolAllocator& a) {
  using slotpool_torch::set_checkpoint_pool_state;
  using slotpool_torch::slotpool_delete;
  auto* s1 = reinterpret_cast<cudaStream_t>(11);
  const c10::Device dev(c10::DeviceType::CUDA, 1);
  auto owned = [&](void* p, size_t n) {  // a storage that owns p, as allocate() makes it
    return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), n,
                                                 c10::DataPtr(p, p, &slotpool_delete, dev),
                                                 nullptr, false);
  };
  auto bare = [&](void* p, size_t n) {  // graph trees' storage over a block: no deleter
    return c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(), n,
                                                 c10::DataPtr(p, dev), nullptr, false);
  };
  c10::MempoolId_t pool{9, 0};
  a.createOrIncrefPool(1, pool);
  auto alloc = [&](size_t n) { return capture_alloc(a, pool, s1, n); };
  std::vector<void*> in_cp;
  for (size_t i = 0; i < 4; ++i) {
    in_cp.push_back(alloc((i + 1) << 20));
  }
  auto cp = a.getCheckpointState(1, pool);
  a.free_ptr(in_cp[0], true);
  a.free_ptr(in_cp[2], true);
  void* n1 = alloc(7 << 20);
  void* n2 = alloc(9 << 20);
  auto st1 = owned(n1, 7 << 20);
  auto st2 = owned(n2, 9 << 20);
  const std::set<void*> cp_live(in_cp.begin(), in_cp.end());

  // Refused before the restore: a stale storage with another deleter; a storage that already
  // has a deleter context; a state that is not slotpool's.
  auto foreign = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 16,
      c10::DataPtr(n2, n2, &c10::detail::deleteNothing, dev), nullptr, false);
  std::string msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st1.get(), foreign.get()}, {}); });
  expect(msg.find("deleter") != std::string::npos, "a foreign deleter is refused: " + msg);
  auto with_ctx = owned(in_cp[1], 2 << 20);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st1.get(), st2.get()}, {with_ctx.get()}); });
  expect(msg.find("Not expecting deleter") != std::string::npos,
         "a storage with a deleter context is refused: " + msg);
  (void)with_ctx->mutable_data_ptr().release_context();  // not its memory to free
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, nullptr, {st1.get()}, {}); });
  expect(msg.find("getCheckpointState") != std::string::npos, "a null state is refused: " + msg);
  // A null storage among those to add a deleter to, after one that would take it: refused, and
  // neither the stale storage nor the bare one is left changed.
  auto bare1 = bare(in_cp[1], 2 << 20);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st1.get()}, {nullptr, bare1.get()}); });
  expect(msg.find("null storage") != std::string::npos, "a null storage is refused: " + msg);
  expect(st1->data_ptr().get_deleter() == &slotpool_delete &&
             bare1->data_ptr().get_context() == nullptr,
         "a refused call leaves the stale and the bare storage as they were");
  expect(a.checkPoolLiveAllocations(1, pool, {in_cp[1], in_cp[3], n1, n2}),
         "the refused calls changed nothing");
  expect(st1->data_ptr().get_deleter() == &slotpool_delete, "the refused calls kept the deleters");

  // Refused before the restore too: a foreign deleteNothing after a storage given twice (the
  // set that tells them apart is built at the second st1, and still holds what came after it).
  msg = thrown([&] {
    set_checkpoint_pool_state(a, 1, cp, {st1.get(), st1.get(), st2.get(), foreign.get()}, {});
  });
  expect(msg.find("deleter") != std::string::npos, "a foreign deleter after a repeat: " + msg);
  expect(st1->data_ptr().get_deleter() == &slotpool_delete &&
             st2->data_ptr().get_deleter() == &slotpool_delete,
         "that refused call gave the stale storages their deleter back");

  // The branch switch: the new blocks' storages are stale (one given twice), the re-created
  // in_cp[0] takes a deleter through a bare storage: the last one over it (given twice), not
  // the one before it over the same block.
  auto over0 = bare(in_cp[0], 1 << 20);
  auto over0_before = bare(in_cp[0], 1 << 20);
  msg = thrown([&] {
    set_checkpoint_pool_state(a, 1, cp, {st1.get(), st2.get(), st1.get()},
                              {over0_before.get(), over0.get(), over0.get()});
  });
  expect(msg.empty(), "the branch switch: " + msg);
  expect(over0_before->data_ptr().get_deleter() != &slotpool_delete &&
             over0_before->data_ptr().get_context() == nullptr,
         "only the last storage over a block takes the deleter");
  over0_before.reset();
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "the pool holds the checkpoint's allocations");
  expect(st1->data_ptr().get_deleter() == &c10::detail::deleteNothing &&
             st2->data_ptr().get_deleter() == &c10::detail::deleteNothing,
         "the stale storages lost their deleter");
  expect(over0->data_ptr().get_deleter() == &slotpool_delete, "the bare storage took ours");
  st1.reset();
  st2.reset();  // free nothing
  over0.reset();  // frees in_cp[0]
  expect(a.checkPoolLiveAllocations(1, pool, {in_cp[1], in_cp[2], in_cp[3]}),
         "dropping the storages freed only the one that took the deleter");

  // A block freed for good without its stale storage: refused (after the restore, as PyTorch),
  // and every storage the call changed gets its deleter back: the stale one ours, the bare one
  // none.
  void* n3 = alloc(5 << 20);
  void* n4 = alloc(3 << 20);
  auto st4 = owned(n4, 3 << 20);
  auto over1 = bare(in_cp[1], 2 << 20);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st4.get()}, {over1.get()}); });
  expect(msg.find("stale tensors") != std::string::npos, "a missing stale storage: " + msg);
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "the restore before the refusal returned the pool to the checkpoint");
  expect(st4->data_ptr().get_deleter() == &slotpool_delete,
         "the refused call gave the stale storage its deleter back");
  expect(over1->data_ptr().get_deleter() != &slotpool_delete &&
             over1->data_ptr().get_context() == nullptr,
         "the refused call took the deleter it gave back");
  (void)st4->mutable_data_ptr().release_context();  // the restore freed its block
  st4.reset();
  over1.reset();  // frees nothing
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "dropping the storages of the refused call freed nothing");

  // A survivor's storage among the stale ones is taken: PyTorch lists survivors as freed.
  void* n5 = alloc(4 << 20);
  auto st5 = owned(n5, 4 << 20);
  auto surv = owned(in_cp[3], 4 << 20);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st5.get(), surv.get()}, {}); });
  expect(msg.empty(), "a survivor's stale storage: " + msg);
  expect(st5->data_ptr().get_deleter() == &c10::detail::deleteNothing &&
             surv->data_ptr().get_deleter() == &c10::detail::deleteNothing,
         "the new block's and the survivor's stale storages lost their deleter");
  st5.reset();
  surv.reset();  // free nothing
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "the survivor's stale storage freed nothing");
  // A stale storage over memory the restore did not free (inside a live block): refused after
  // the restore, and both stale storages get their deleter back.
  void* n6 = alloc(6 << 20);
  auto st6 = owned(n6, 6 << 20);
  auto inside = owned(static_cast<char*>(in_cp[1]) + 512, 512);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {st6.get(), inside.get()}, {}); });
  expect(msg.find("did not free") != std::string::npos, "memory not freed: " + msg);
  expect(st6->data_ptr().get_deleter() == &slotpool_delete &&
             inside->data_ptr().get_deleter() == &slotpool_delete,
         "the refused call gave both stale storages their deleter back");
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "the restore before that refusal returned the pool to the checkpoint");
  (void)st6->mutable_data_ptr().release_context();  // the restore freed its block
  st6.reset();
  // As many stale storages as freed blocks, but not the same pointers (the freed block's
  // storage is not passed; one over memory still live is): refused all the same.
  void* n7 = alloc(2 << 20);
  msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {inside.get()}, {}); });
  expect(msg.find("did not free") != std::string::npos,
         "as many stale storages as freed blocks, not theirs: " + msg);
  expect(inside->data_ptr().get_deleter() == &slotpool_delete,
         "that refused call gave the stale storage its deleter back");
  expect(a.checkPoolLiveAllocations(1, pool, {cp_live.begin(), cp_live.end()}),
         "the restore before that refusal freed n7");
  (void)n7;
  (void)inside->mutable_data_ptr().release_context();  // not an allocation
  inside.reset();
  (void)n3;
  for (void* p : in_cp) {
    a.free_ptr(p, true);
  }
  cp.reset();
  a.releasePool(1, pool);
}

// Branch switches over and over, of hundreds of blocks and of a few, on one thread: the binding's
// buffers, the C ABI's reused delta lists and the checkpoint's live set serve call after call,
// and each call leaves exactly the checkpoint's allocations live. Both of PyTorch's patterns:
// stale storages (the new blocks'), and bare storages that take the deleter of a re-created or
// surviving block.
void check_graph_state_repeated(slotpool_torch::SlotpoolAllocator& a) {
  using slotpool_torch::set_checkpoint_pool_state;
  using slotpool_torch::slotpool_delete;
  auto* s1 = reinterpret_cast<cudaStream_t>(12);
  const c10::Device dev(c10::DeviceType::CUDA, 1);
  c10::MempoolId_t pool{10, 0};
  a.createOrIncrefPool(1, pool);
  auto alloc = [&](size_t n) { return capture_alloc(a, pool, s1, n); };
  std::vector<void*> cp_live;
  for (size_t i = 0; i < 800; ++i) {
    void* p = alloc(512 * (i % 13 + 1));
    if (i % 2 == 1) {
      cp_live.push_back(p);
    } else {
      a.free_ptr(p, true);
    }
  }
  auto cp = a.getCheckpointState(1, pool);
  const std::unordered_set<void*> want(cp_live.begin(), cp_live.end());
  for (size_t round = 0; round < 6; ++round) {
    // Rounds alternate between many changes and few: every other (or every 50th) block dies.
    const size_t step = round % 2 == 0 ? 2 : 50;
    std::vector<void*> dead;
    for (size_t i = round % step; i < cp_live.size(); i += step) {
      dead.push_back(cp_live[i]);
      a.free_ptr(cp_live[i], true);
    }
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> fresh;
    std::vector<c10::StorageImpl*> stale;
    for (size_t i = 0; i < dead.size(); ++i) {
      size_t n = 512 * ((7 * i + round) % 11 + 1) + 256;
      void* p = alloc(n);
      fresh.push_back(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), n, c10::DataPtr(p, p, &slotpool_delete, dev),
          nullptr, false));
      stale.push_back(fresh.back().get());
    }
    // Odd rounds hand deleters to bare storages over the blocks the restore re-creates.
    std::vector<c10::intrusive_ptr<c10::StorageImpl>> bare;
    std::vector<c10::StorageImpl*> add;
    if (round % 2 == 1) {
      for (void* p : dead) {
        bare.push_back(c10::make_intrusive<c10::StorageImpl>(
            c10::StorageImpl::use_byte_size_t(), 512, c10::DataPtr(p, dev), nullptr, false));
        add.push_back(bare.back().get());
      }
    }
    std::string msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, stale, add); });
    expect(msg.empty(), "branch switch " + std::to_string(round) + ": " + msg);
    expect(a.checkPoolLiveAllocations(1, pool, want),
           "branch switch " + std::to_string(round) + " leaves the checkpoint's allocations");
    bool swapped = true;
    for (c10::StorageImpl* st : stale) {
      swapped = swapped && st->data_ptr().get_deleter() == &c10::detail::deleteNothing;
    }
    expect(swapped, "every stale storage lost its deleter, round " + std::to_string(round));
    fresh.clear();  // frees nothing
    if (round % 2 == 1) {
      bare.clear();  // they own the re-created blocks: dropping them frees those
    } else {
      for (void* p : dead) {
        a.free_ptr(p, true);  // as graph trees free the re-created blocks
      }
    }
    // The re-created blocks are gone again: a switch with nothing else changed brings them back.
    msg = thrown([&] { set_checkpoint_pool_state(a, 1, cp, {}, {}); });
    expect(msg.empty(), "switch back " + std::to_string(round) + ": " + msg);
    expect(a.checkPoolLiveAllocations(1, pool, want),
           "switch back " + std::to_string(round) + " leaves the checkpoint's allocations");
  }
  for (void* p : cp_live) {
    a.free_ptr(p, true);
  }
  cp.reset();
  a.releasePool(1, pool);
}

// setUseOnOOM / setNoSplit change one option and keep the others the pool has (here a byte
// limit given at creation, which the shim never saw).
void check_pool_options(slotpool_torch::SlotpoolAllocator& a) {
  sp_pool_options o{};
  o.limit_bytes = 64u << 20;
  sp_pool_id id{};
  slotpool_torch::check(sp_pool_named(0, "host_check.options", &o, &id), "sp_pool_named");
  c10::MempoolId_t pool = slotpool_torch::from_sp(id);
  a.setNoSplit(0, pool);
  a.setUseOnOOM(0, pool, true);
  sp_pool_options now{};
  slotpool_torch::check(sp_pool_options_get(0, id, &now), "sp_pool_options_get");
  expect(now.no_split == 1 && now.use_on_oom == 1 && now.limit_bytes == (64u << 20),
         "setNoSplit and setUseOnOOM keep the pool's byte limit");
  a.setUseOnOOM(0, pool, false);
  slotpool_torch::check(sp_pool_options_get(0, id, &now), "sp_pool_options_get");
  expect(now.no_split == 1 && now.use_on_oom == 0 && now.limit_bytes == (64u << 20),
         "setUseOnOOM(false) changes use_on_oom alone");
  std::string msg = thrown([&] { a.setNoSplit(0, c10::MempoolId_t{12345, 0}); });
  expect(msg.empty(), "setNoSplit on an unknown pool warns and does not throw: " + msg);
  slotpool_torch::check(sp_pool_release(0, id, nullptr), "sp_pool_release");
}

// getExpandableSegmentSizes: slotpool's vmm segments by (stream, size class).
void check_expandable_sizes(slotpool_torch::SlotpoolAllocator& a) {
  auto* stream = reinterpret_cast<cudaStream_t>(31);
  void* big = a.malloc_impl(0, 40u << 20, stream);
  size_t total = 0;
  for (const auto& s : a.getExpandableSegmentSizes(0)) {
    if (s.stream == stream && !s.is_small_pool) {
      total += s.total_size;
    }
  }
  expect(total >= (40u << 20), "getExpandableSegmentSizes counts the stream's vmm segment");
  a.free_ptr(big, true);
}

void* sp_alloc_or_die(size_t size) {
  void* p = nullptr;
  slotpool_torch::check(sp_alloc(0, size, 7, &p), "sp_alloc");
  return p;
}

}  // namespace

// The CUDA IPC paths that fail before any CUDA call: sharing vmm memory on the simulated device,
// and malformed handles. (Sharing and opening real memory needs a GPU: torch_scenarios.py.)

void check_ipc_refusals(slotpool_torch::SlotpoolAllocator& a) {
  void* big = sp_alloc_or_die(40u << 20);  // beyond the default 16 MiB pages' small blocks: vmm
  auto msg = thrown([&] { a.shareIpcHandle(big); });
  expect(msg.find("simulated") != std::string::npos,
         "the simulated device refuses to share vmm memory: " + msg);
  slotpool_torch::check(sp_free(big), "sp_free");
  // getBaseAllocation: a classic block's segment (2 MiB), a vmm block itself.
  void* small = sp_alloc_or_die(100u << 10);
  size_t bytes = 0;
  void* base = a.getBaseAllocation(small, &bytes);
  expect(base <= small && static_cast<char*>(small) < static_cast<char*>(base) + bytes &&
             bytes == (2u << 20),
         "getBaseAllocation of a classic block is its 2 MiB segment");
  slotpool_torch::check(sp_free(small), "sp_free");
  void* big2 = sp_alloc_or_die(40u << 20);
  expect(a.getBaseAllocation(big2, &bytes) == big2 && bytes == (40u << 20),
         "getBaseAllocation of a vmm block is the block");
  slotpool_torch::check(sp_free(big2), "sp_free");
  std::string truncated("\x02" "e" "0123456789", 12);
  msg = thrown([&] { a.getIpcDevPtr(truncated); });
  expect(msg.find("truncated") != std::string::npos, "a truncated 'e' handle is refused: " + msg);
  // A header announcing two descriptors, followed by one.
  std::string wrong("\x02" "e", 2);
  const int32_t pid_pad[2] = {1, 0};
  const uint64_t size_count[2] = {16u << 20, 2};
  const int32_t fd = 3;
  wrong.append(reinterpret_cast<const char*>(pid_pad), sizeof pid_pad);
  wrong.append(reinterpret_cast<const char*>(size_count), sizeof size_count);
  wrong.append(reinterpret_cast<const char*>(&fd), sizeof fd);
  msg = thrown([&] { a.getIpcDevPtr(wrong); });
  expect(msg.find("wrong size") != std::string::npos, "an 'e' handle of the wrong size: " + msg);
  msg = thrown([&] { a.getIpcDevPtr(std::string("\x01" "c", 2)); });
  expect(msg.find("unknown format") != std::string::npos, "an old version is refused: " + msg);
  msg = thrown([&] { a.getIpcDevPtr(std::string("\x02" "c" "short", 7)); });
  expect(msg.find("unknown type or size") != std::string::npos, "a short handle is refused: " + msg);
}

// Python ints read as addresses (pyint.h): the fast path agrees with PyLong_AsVoidPtr on every
// int it takes, and leaves the rest (negative, over 60 bits, not an exact int) to it.
void check_int_as_address() {
  if (!Py_IsInitialized()) {
    Py_InitializeEx(0);
  }
  const bool known = PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000;
  for (unsigned long long v : {0ULL, 1ULL, 511ULL, (1ULL << 30) - 1, 1ULL << 30, (1ULL << 30) + 5,
                               0x7f3a5c001230ULL, 0x7fffffffffffULL, (1ULL << 60) - 1}) {
    PyObject* o = PyLong_FromUnsignedLongLong(v);
    uintptr_t got = ~uintptr_t{0};
    const bool fast = slotpool_torch::int_as_address(o, &got);
    expect(fast == known, "an address-sized int takes the fast path: " + std::to_string(v));
    expect(!fast || (got == v && reinterpret_cast<uintptr_t>(PyLong_AsVoidPtr(o)) == v),
           "the fast path reads " + std::to_string(v) + " as PyLong_AsVoidPtr does");
    Py_DECREF(o);
  }
  uintptr_t got = 0;
  std::vector<PyObject*> general = {PyLong_FromUnsignedLongLong(1ULL << 60),
                                    PyLong_FromUnsignedLongLong(~0ULL), PyLong_FromLong(-1),
                                    PyLong_FromLong(-4096), PyBool_FromLong(1),
                                    PyFloat_FromDouble(4096.0)};
  for (PyObject* o : general) {
    expect(!slotpool_torch::int_as_address(o, &got), "an int past 60 bits, a negative one, a bool "
                                                     "or a float takes the general path");
    Py_DECREF(o);
  }
}

// PyTorch's allocator settings: the keys slotpool applies the same way pass, in order (lists
// whole); the rest is named as skipped.
void check_torch_conf() {
  std::vector<std::string> skipped;
  std::string c = slotpool_torch::torch_conf_for_slotpool(
      " max_split_size_mb:128, pinned_use_cuda_host_register:True,"
      "roundup_power2_divisions:[256:1,512:2,>:4],backend:native,"
      "garbage_collection_threshold:0.6,expandable_segments:False,per_process_memory_fraction:0.5",
      &skipped);
  expect(c == "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],"
              "garbage_collection_threshold:0.6,expandable_segments:False,"
              "per_process_memory_fraction:0.5",
         "torch conf translated: " + c);
  expect(skipped == std::vector<std::string>{"pinned_use_cuda_host_register", "backend"},
         "torch conf skipped keys");
  skipped.clear();
  expect(slotpool_torch::torch_conf_for_slotpool("", &skipped).empty() && skipped.empty(),
         "empty torch conf");
}

// attachAllocatorTraceTracker: every tracker sees each event as it happens, as PyTorch's TraceEntry.
void check_trace_trackers(slotpool_torch::SlotpoolAllocator& a) {
  // The trackers stay attached for the rest of the checks: they own what they write.
  using Seen = std::vector<std::tuple<Action, size_t, size_t>>;
  auto seen = std::make_shared<Seen>();
  auto mu = std::make_shared<std::mutex>();
  auto other = std::make_shared<std::atomic<int>>(0);
  a.attachAllocatorTraceTracker([=](const c10::CachingDeviceAllocator::TraceEntry& te) {
    if (te.device_ == 1) {
      std::lock_guard<std::mutex> lk(*mu);
      seen->emplace_back(te.action_, te.addr_, te.size_);
    }
  });
  a.attachAllocatorTraceTracker(
      [=](const c10::CachingDeviceAllocator::TraceEntry&) { other->fetch_add(1); });
  int before = other->load();
  void* p = nullptr;
  slotpool_torch::check(sp_alloc(1, 5000, 0, &p), "sp_alloc");
  slotpool_torch::check(sp_free(p), "sp_free");
  std::lock_guard<std::mutex> lk(*mu);
  std::vector<std::pair<Action, size_t>> got;
  for (const auto& [action, addr, size] : *seen) {
    if (addr == reinterpret_cast<size_t>(p) && size == 5000) {
      got.emplace_back(action, size);
    }
  }
  std::vector<std::pair<Action, size_t>> want = {
      {Action::ALLOC, 5000}, {Action::FREE_REQUESTED, 5000}, {Action::FREE_COMPLETED, 5000}};
  expect(got == want, "trace tracker: alloc, free_requested, free_completed of 5000 B");
  expect(other->load() - before >= 3, "a second tracker sees the events too");
}

int main() {
  check_int_as_address();
  check_torch_conf();
  // Applied at sp_init, beneath $SLOTPOOL_CONF and the allocator's own conf.
  setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128,garbage_collection_threshold:0.6", 1);
  slotpool_torch::SlotpoolAllocator a(std::string("sim"), std::string("sim_devices:2"));
  a.init(2);
  {
    sp_memory_stats st{};
    slotpool_torch::check(sp_memory_stats_get(0, &st), "sp_memory_stats_get");
    expect(st.max_split_size == 128LL << 20, "PYTORCH_ALLOC_CONF's max_split_size_mb applied");
    auto info = a.snapshot({0, 0}, false);
    expect(info.config_metadata.garbage_collection_threshold == 0.6,
           "config_metadata.garbage_collection_threshold");
    expect(info.config_metadata.last_allocator_settings.find("max_split_size_mb:128") !=
               std::string::npos,
           "last_allocator_settings names what was applied: " +
               info.config_metadata.last_allocator_settings);
    expect(info.config_metadata.last_allocator_settings.rfind("growth:", 0) == 0 &&
               info.config_metadata.last_allocator_settings.find("vmm_slack_percent:") !=
                   std::string::npos,
           "last_allocator_settings is the whole configuration in effect: " +
               info.config_metadata.last_allocator_settings);
  }

  // Nothing recorded before recordHistory.
  void* before = sp_alloc_or_die(4096);
  slotpool_torch::check(sp_free(before), "sp_free");
  auto snap = a.snapshot({0, 0}, true);
  expect(snap.device_traces.size() == 2, "one trace list per device");
  expect(count(snap.device_traces[0], Action::ALLOC, before) == 0, "no history before recording");

  // _record_memory_history(max_entries=100): alloc and free show up, in order, with sizes.
  a.recordHistory(true, nullptr, 100, c10::CachingDeviceAllocator::RecordContext::NEVER, false,
                  {});
  expect(a.isHistoryEnabled(), "isHistoryEnabled after recordHistory(true)");
  void* p = sp_alloc_or_die(3000);
  slotpool_torch::check(sp_free(p), "sp_free");
  snap = a.snapshot({0, 0}, true);
  const auto& t = snap.device_traces[0];
  expect(count(t, Action::ALLOC, p) == 1, "alloc recorded");
  expect(count(t, Action::FREE_REQUESTED, p) == 1, "free_requested recorded");
  expect(count(t, Action::FREE_COMPLETED, p) == 1, "free_completed recorded");
  size_t ia = t.size(), ifr = t.size();
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i].addr_ == reinterpret_cast<size_t>(p) && t[i].action_ == Action::ALLOC) {
      ia = i;
      expect(t[i].size_ == 3000, "alloc size is the requested size");
      expect(t[i].stream_ == reinterpret_cast<void*>(7), "alloc stream");
      expect(t[i].device_ == 0, "alloc device");
      expect(t[i].time_.t_ > 1700000000LL * 1000000LL, "time_.t_ holds microseconds since 1970");
    }
    if (t[i].addr_ == reinterpret_cast<size_t>(p) && t[i].action_ == Action::FREE_REQUESTED) {
      ifr = i;
    }
  }
  expect(ia < ifr && ifr < t.size(), "alloc before free_requested");
  expect(a.snapshot({0, 0}, false).device_traces[0].empty(), "include_traces=false: no entries");

  // skip_actions are left out of the snapshot.
  a.recordHistory(true, nullptr, 100, c10::CachingDeviceAllocator::RecordContext::NEVER, false,
                  {"free_requested"});
  snap = a.snapshot({0, 0}, true);
  expect(count(snap.device_traces[0], Action::ALLOC, p) == 1, "skip keeps alloc");
  expect(count(snap.device_traces[0], Action::FREE_REQUESTED, p) == 0, "skip drops free_requested");

  // Device 1 was first used after recordHistory: it records too.
  void* q = nullptr;
  slotpool_torch::check(sp_alloc(1, 5000, 0, &q), "sp_alloc device 1");
  snap = a.snapshot({0, 0}, true);
  expect(count(snap.device_traces[1], Action::ALLOC, q) == 1, "device used later records");
  slotpool_torch::check(sp_free(q), "sp_free device 1");

  // clear_history forgets what was recorded, and recording goes on.
  a.recordHistory(true, nullptr, 100, c10::CachingDeviceAllocator::RecordContext::NEVER, true, {});
  snap = a.snapshot({0, 0}, true);
  expect(snap.device_traces[0].empty() && snap.device_traces[1].empty(), "clearHistory forgets");
  void* r = sp_alloc_or_die(3000);
  slotpool_torch::check(sp_free(r), "sp_free");
  expect(count(a.snapshot({0, 0}, true).device_traces[0], Action::ALLOC, r) == 1,
         "recording goes on after clearHistory");
  // Stopping forgets the trace too, as PyTorch's allocator does, and records nothing more.
  a.recordHistory(false, nullptr, 0, c10::CachingDeviceAllocator::RecordContext::NEVER, false, {});
  expect(!a.isHistoryEnabled(), "isHistoryEnabled after recordHistory(false)");
  void* r2 = sp_alloc_or_die(3000);
  slotpool_torch::check(sp_free(r2), "sp_free");
  snap = a.snapshot({0, 0}, true);
  expect(snap.device_traces[0].empty() && snap.device_traces[1].empty(),
         "stopping forgets the trace and records nothing");

  // Stacks (context_recorder), at PyTorch's levels. ALL: blocks, allocs and frees.
  using RC = c10::CachingDeviceAllocator::RecordContext;
  a.recordHistory(true, &fake_recorder, 100, RC::ALL, true, {});
  auto* stream = reinterpret_cast<cudaStream_t>(7);
  void* s1 = a.malloc_impl(0, 6000, stream);
  snap = a.snapshot({0, 0}, true);
  int alloc1 = entry_stack(snap.device_traces[0], Action::ALLOC, s1, 0);
  expect(alloc1 > 0, "ALL: the alloc entry has a stack");
  expect(block_stack(snap, s1) == alloc1, "ALL: the live block has the alloc's stack");
  a.free_ptr(s1, true);
  void* s2 = a.malloc_impl(0, 6000, stream);  // the cached block again
  expect(s2 == s1, "the quick cache hands the same block back");
  snap = a.snapshot({0, 0}, true);
  int free1 = entry_stack(snap.device_traces[0], Action::FREE_REQUESTED, s1, 0);
  int alloc2 = entry_stack(snap.device_traces[0], Action::ALLOC, s1, 1);
  expect(free1 > alloc1 && alloc2 > free1, "ALL: free and second alloc have their own stacks");
  expect(entry_stack(snap.device_traces[0], Action::ALLOC, s1, 0) == alloc1,
         "the first alloc keeps its stack");
  expect(block_stack(snap, s1) == alloc2, "the block has the newest alloc's stack");

  // STATE: live blocks only; trace entries have none.
  a.recordHistory(true, &fake_recorder, 100, RC::STATE, true, {});
  void* s3 = a.malloc_impl(0, 9000, stream);
  snap = a.snapshot({0, 0}, true);
  expect(block_stack(snap, s3) > alloc2, "STATE: the block has a stack");
  expect(entry_stack(snap.device_traces[0], Action::ALLOC, s3, 0) == 0,
         "STATE: the alloc entry has none");

  // A recorder that throws costs the stack, not the allocation or the free.
  a.recordHistory(true, &failing_recorder, 100, RC::ALL, false, {});
  void* f1 = nullptr;
  try {
    f1 = a.malloc_impl(0, 7000, stream);
    a.free_ptr(f1, true);
  } catch (const std::exception& e) {
    expect(false, std::string("a failing recorder broke an allocation: ") + e.what());
  }
  snap = a.snapshot({0, 0}, true);
  expect(f1 != nullptr && entry_stack(snap.device_traces[0], Action::ALLOC, f1, 0) == 0,
         "a failing recorder: the entry is recorded without a stack");

  // Recording stopped: the stacks of live blocks stay until they are freed.
  a.recordHistory(false, nullptr, 0, RC::NEVER, false, {});
  snap = a.snapshot({0, 0}, false);
  expect(block_stack(snap, s3) > 0, "a live block keeps its stack after recording stopped");
  a.free_ptr(s3, true);
  a.free_ptr(s2, true);
  void* s4 = a.malloc_impl(0, 9000, stream);
  snap = a.snapshot({0, 0}, false);
  expect(s4 != s3 || block_stack(snap, s4) == 0, "a block allocated after stopping has none");
  a.free_ptr(s4, true);

  check_stats_routes_and_checkpoints(a);
  check_graph_state(a);
  check_graph_state_repeated(a);
  check_pool_options(a);
  check_expandable_sizes(a);

  // Threads allocating and freeing while stacks are gathered and snapshots taken: no deadlock, no
  // lost block, every live block's stack in the snapshot.
  a.recordHistory(true, &fake_recorder, 4096, RC::ALL, true, {});
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&a, t] {
        auto* st = reinterpret_cast<cudaStream_t>(100 + t);
        std::vector<void*> live;
        for (int i = 0; i < 2000; ++i) {
          if (live.size() < 8 && (i % 3 != 2 || live.empty())) {
            live.push_back(a.malloc_impl(0, 512 * (1 + (i * 7 + t) % 40), st));
          } else {
            a.free_ptr(live[i % live.size()], true);
            live.erase(live.begin() + static_cast<long>(i % live.size()));
          }
        }
        for (void* p : live) {
          a.free_ptr(p, true);
        }
      });
    }
    for (int i = 0; i < 20; ++i) {
      auto snap = a.snapshot({0, 0}, true);
      (void)snap;
    }
    for (auto& th : threads) {
      th.join();
    }
  }
  void* last = a.malloc_impl(0, 4096, stream);
  snap = a.snapshot({0, 0}, true);
  expect(block_stack(snap, last) > 0, "after the threads: a new block has its stack");
  expect(snap.device_traces[0].size() <= 4096, "the ring keeps at most max_entries");
  a.free_ptr(last, true);
  a.recordHistory(false, nullptr, 0, RC::NEVER, true, {});

  check_ipc_refusals(a);
  check_trace_trackers(a);

  if (failures == 0) {
    std::printf("host_check: all passed\n");
  }
  return failures == 0 ? 0 : 1;
}
