// slotpool beneath PyTorch: a c10 CUDAAllocator that forwards every call to slotpool's C ABI
// (include/slotpool.h, the only interface this shim uses). The shim keeps no copy of slotpool's
// state: pool options, configuration values, live allocations and snapshots are read back through
// the ABI's typed readers when they are needed.
//
// Built against PyTorch 2.11's exact virtual interface (c10/cuda/CUDACachingAllocator.h). The
// vtable changes between PyTorch versions, so the extension records the torch version it was
// built for and the Python package refuses to load it under any other.
//
// One concern per file (the class is declared here, its methods live where their concern does):
//   allocator.cpp    errors, the allocation path (allocate, raw_*, free), out-of-memory errors
//                    and their observers, caching, limits, statistics, peers, installation
//   conf.cpp         PyTorch's allocator settings, sp_init, configuration values read back
//   routes.cpp       beginAllocateToPool / endAllocateToPool, variant routes
//   pools.cpp        pool lifetime and options, live allocations, checkPoolLiveAllocations
//   orphans.cpp      stale owners after slotpool's own restores
//   checkpoints.cpp  getCheckpointState / setCheckpointPoolState, restores, variant groups
//   graph_state.cpp  torch._C._cuda_setCheckpointPoolState's work on the restore's lists
//   ptr_set.h        the address set of those two (open addressing in a caller's vector)
//   phases.h         graph_state.cpp's steps timed, when built with SLOTPOOL_TORCH_PHASES
//   history.cpp      recordHistory, stacks, trace trackers
//   snapshot.cpp     snapshot() for memory_viz, getExpandableSegmentSizes
//   ipc.cpp          CUDA IPC handles
//   module.cpp       the Python bindings
//   pyint.h          their Python ints read as addresses
//
// Design decisions (see docs/torch.md for the user-facing version):
//
//  * Routing (beginAllocateToPool). PyTorch passes a std::function filter, which a C ABI cannot
//    take. PyTorch 2.11's CUDAGraph::capture_begin calls beginAllocateToPool *before*
//    cudaStreamBeginCapture and its filter reads the capture id lazily, so the capture id does not
//    exist yet when the route begins. The shim therefore keeps PyTorch's filters itself and
//    evaluates them exactly as PyTorch does (oldest route first, the allocation's stream as the
//    argument) whenever a route is active, allocating from the chosen pool with sp_pool_alloc. With
//    no route active an allocation is a plain sp_alloc. slotpool is told about every route too, for
//    its use counts, its "already recording" check and its capture safety: a filter that is a
//    CUDA-graph capture filter (its type name names CUDAGraph, or it rejects the current stream at
//    begin time, as a capture that has not started yet does) is registered as SP_ROUTE_CAPTURE with
//    a capture id that never matches, so slotpool knows a capture is underway (no event queries,
//    no releases) from before cudaStreamBeginCapture to endAllocateToPool, as PyTorch's allocator
//    does; every other filter (use_mem_pool's thread filter, the current-stream and "all" filters)
//    is registered as SP_ROUTE_CURRENT_THREAD.
//
//  * Checkpoints (getCheckpointState / setCheckpointPoolState). The state wraps an sp_checkpoint*.
//    A restore returns PyTorch's native delta: ptrs_freed = every allocation of the pool that was
//    live before the restore, dataptrs_allocd = every allocation live in the checkpoint, as owning
//    DataPtrs with our deleter. slotpool itself leaves allocations that are live in both untouched;
//    the shim reports them in both lists, as PyTorch's allocator does ("a pointer may appear in
//    both"), so that CUDA graph trees' deleter bookkeeping works unchanged. The restore's own delta
//    and the checkpoint's live allocations give both lists; the latter are read once, when the
//    checkpoint is taken (sp_pool_live_allocations), as they are what every restore of it returns
//    the pool to. So a restore takes no snapshot and walks no pool: it costs what changed since
//    the checkpoint, plus one pass over the checkpoint's live allocations to hand them back.
//
//  * Stale owners after slotpool's own restores (slotpool_torch.restore, variant groups). A restore
//    frees allocations that tensors may still reference. Their pointers are remembered as
//    "orphans" (a multiset); a free of an orphaned pointer consumes one orphan entry and frees
//    nothing. The orphan check comes *before* sp_free: the address may already belong to a new
//    allocation (that is the point of variant groups), and freeing it on behalf of the stale tensor
//    would free the new owner's memory. Whichever of the two owners dies last frees the block.
#pragma once

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAMacros.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ptr_set.h"
#include "slotpool.h"

namespace slotpool_torch {

namespace CCA = c10::cuda::CUDACachingAllocator;
using c10::MempoolId_t;

inline sp_pool_id to_sp(MempoolId_t id) {
  return sp_pool_id{static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)};
}
inline MempoolId_t from_sp(sp_pool_id id) {
  return MempoolId_t{id.a, id.b};
}

// A capture id that CUDA never hands out (ids count up from 1): slotpool routes registered with it
// mark a capture as underway without matching any allocation (the shim routes those itself).
constexpr uint64_t kNeverCaptureId = ~uint64_t{0};

// The message of the latest failed slotpool call on this thread, copied.
std::string last_error();
// "SP_ERR_...: <message>" for a failed status, copied at once.
std::string describe(sp_status st);
// Throws c10::Error (TORCH_CHECK) for a failed status; `what` names the call.
void check(sp_status st, const char* what);

// The value in effect of a configuration key (sp_config_get_f64 / sp_config_get_str; "conf": the
// whole configuration string). Throws c10::Error when slotpool refuses the key.
double config_number(const char* key);
std::string config_string(const char* key);

// PyTorch's allocator settings string (PYTORCH_ALLOC_CONF's syntax) as slotpool configuration:
// the keys that slotpool applies the same way (max_split_size_mb, max_non_split_rounding_mb,
// roundup_power2_divisions, garbage_collection_threshold, expandable_segments,
// per_process_memory_fraction), in order. The
// other keys (backend, pinned_*, release_lock_on_cudamalloc, ...) go to `skipped` when given.
std::string torch_conf_for_slotpool(const std::string& torch_conf,
                                    std::vector<std::string>* skipped);

// The settings PyTorch read at start: $PYTORCH_ALLOC_CONF, else $PYTORCH_CUDA_ALLOC_CONF.
std::string torch_conf_from_env();

// One allocation: address and size.
using PtrSize = std::pair<void*, size_t>;

// What one of slotpool's own restores did (slotpool_torch.restore, variant groups).
struct RestoreResult {
  std::vector<PtrSize> freed;    // live before, freed by the restore (now orphans)
  std::vector<PtrSize> created;  // re-created by the restore (freed again at once if asked)
};

struct CheckpointState;

// What a restore of a getCheckpointState state did, as both setCheckpointPoolState and
// set_checkpoint_pool_state (graph_state.cpp) read it. Its lists are in no particular order.
class GraphRestore {
 public:
  std::vector<void*> freed;  // live before, freed by the restore
  std::shared_ptr<CheckpointState> state;  // state->live: what is live in the pool now
  // Re-created by the restore, read from the delta on first use (the usual call of
  // set_checkpoint_pool_state needs only `freed`).
  const std::vector<void*>& created() const;
  // The set of created(), in `slots` (a table the caller keeps).
  PtrSet created_set(std::vector<uintptr_t>& slots) const;
  // Calls f for each survivor: live in the checkpoint and before the restore, untouched by it
  // (state->live less created), lowest address first.
  void for_each_survivor(const std::function<void(void*)>& f) const;
  // Lets go of the state and the delta (the buffers stay for the next restore).
  void reset();

 private:
  friend class SlotpoolAllocator;  // restore_graph_state fills it
  struct DeltaFree {
    void operator()(sp_restore_delta* d) const { (void)sp_delta_free(d); }
  };
  std::unique_ptr<sp_restore_delta, DeltaFree> delta_;  // the restore's own, until reset()
  mutable std::vector<void*> created_;                  // created(), once read
  mutable bool created_read_ = false;
};

// getCheckpointState's AllocatorState: owns one sp_checkpoint.
struct CheckpointState : public CCA::AllocatorState {
  CheckpointState(int device, sp_pool_id pool, sp_checkpoint* cp, std::vector<void*> live)
      : device(device), pool(pool), cp(cp), live(std::move(live)) {}
  ~CheckpointState() override;
  CheckpointState(const CheckpointState&) = delete;
  CheckpointState& operator=(const CheckpointState&) = delete;

  int device;
  sp_pool_id pool;
  sp_checkpoint* cp;
  // The pool's live allocations when the checkpoint was taken, lowest address first: what a
  // restore of it (with no keep set) leaves live, fixed for the checkpoint's life.
  std::vector<void*> live;
  // The same addresses as a PtrSet's table (ptr_set.h), built once with the checkpoint: graph
  // trees restore it at every branch switch and ask of thousands of storages whether their
  // memory is live in it.
  std::vector<uintptr_t> live_set;
};

// A variant group of slotpool (sp_variant_group_*), owned.
struct VariantGroup {
  VariantGroup(int device, sp_pool_id pool, size_t count, sp_variant_group* g)
      : device(device), pool(pool), count(count), g(g) {}
  ~VariantGroup();
  VariantGroup(const VariantGroup&) = delete;
  VariantGroup& operator=(const VariantGroup&) = delete;

  // Begin variant k: the pool goes back to the group's checkpoint; see RestoreResult.
  RestoreResult begin(size_t k, bool free_created);
  void end();
  void close();

  int device;
  sp_pool_id pool;
  size_t count;
  sp_variant_group* g;
  std::optional<size_t> active;
  std::mutex mu;
};

// One route the shim evaluates (beginAllocateToPool's filter).
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
  bool capture;      // registered with slotpool as a capture route
  std::string kind;  // "capture" | "thread/stream/all" (for diagnostics)
};

class SlotpoolAllocator final : public CCA::CUDAAllocator {
 public:
  SlotpoolAllocator(std::optional<std::string> backend, std::optional<std::string> conf);
  ~SlotpoolAllocator() override = default;

  // ---- c10::Allocator ----
  c10::DataPtr allocate(size_t nbytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // ---- c10::DeviceAllocator ----
  bool initialized() override;
  void emptyCache(MempoolId_t mempool_id = {0, 0}) override;
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;

  // ---- CUDAAllocator ----
  void* raw_alloc(size_t nbytes) override;
  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<CCA::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override;
  void enable(bool value) override;
  bool isEnabled() const override;
  void cacheInfo(c10::DeviceIndex device, size_t* largestBlock) override;
  void* getBaseAllocation(void* ptr, size_t* size) override;
  using CCA::CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override;
  CCA::SnapshotInfo snapshot(MempoolId_t mempool_id = {0, 0}, bool include_traces = true) override;
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CCA::CUDAAllocator> allocator = nullptr) override;
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;
  CCA::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override;
  void recordHistory(bool enabled, CCA::CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, CCA::RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override;
  void attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(CCA::AllocatorTraceTracker tracker) override;
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice, size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  std::shared_ptr<CCA::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override;
  CCA::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<CCA::AllocatorState> pps) override;
  std::string name() override;

  // ---- used by the Python bindings ----
  // Initialises slotpool (sp_init with the backend and conf given at install) unless it is.
  void ensure_initialized();
  // Frees ptr (the deleter's path). Orphans are consumed first; throw_on_error: raw_delete's
  // semantics (throw), else a warning (deleters must not throw).
  void free_ptr(void* ptr, bool throw_on_error);
  // The allocation behind allocate / raw_alloc, on a given device and stream.
  void* malloc_impl(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream);
  // Record restore-freed pointers as orphans; free re-created ones if asked.
  RestoreResult absorb_delta(int device, sp_pool_id pool, sp_restore_delta* delta,
                             bool free_created);
  // setCheckpointPoolState's restore (of a state from graph_checkpoint_state), before PyTorch's
  // delta is built from it; into `out`, whose lists keep their capacity (a caller that restores
  // often keeps one, so that thousands of pointers cost no allocation).
  void restore_graph_state(std::shared_ptr<CheckpointState> state, GraphRestore& out);
  // slotpool_torch.restore: slotpool's own semantics (survivors untouched).
  RestoreResult restore(int device, sp_pool_id pool, const CheckpointState& cp,
                        const std::vector<void*>& keep_live, bool free_created);
  // slotpool_torch.checkpoint (also getCheckpointState's core).
  std::shared_ptr<CheckpointState> take_checkpoint(int device, sp_pool_id pool);
  size_t orphan_count();
  // sp_mark_reusable, and the pointer becomes an orphan (its owner's later free is swallowed).
  uint64_t mark_reusable(void* ptr);
  std::vector<std::pair<MempoolId_t, std::string>> routes(int device);
  // The variant block's thread route (see DeviceRoutes::variant).
  void begin_variant_route(int device, MempoolId_t pool);
  void end_variant_route(int device);
  // Reads pool's options (sp_pool_options_get), lets `change` edit them and sets them
  // (sp_pool_set_options); one such update at a time, so that none is lost. Returns the first
  // failed status (the message in sp_last_error_message), or SP_OK.
  sp_status update_pool_options(int device, sp_pool_id pool,
                                const std::function<void(sp_pool_options&)>& change);
  // The live allocations of pool on device, lowest address first (sp_pool_live_allocations).
  std::vector<sp_allocation> pool_live_allocations(int device, sp_pool_id pool);
  int device_count() const { return device_count_.load(); }

 private:
  [[noreturn]] void throw_oom(c10::DeviceIndex device, size_t nbytes, const std::string& msg);
  sp_pool_id route_for(c10::DeviceIndex device, cudaStream_t stream);
  bool consume_orphan(void* ptr);
  void check_device(c10::DeviceIndex device) const;
  void append_traces(const sp_snapshot* snap, CCA::SnapshotInfo& info);

  std::optional<std::string> backend_;
  std::optional<std::string> conf_;
  std::atomic<bool> initialized_{false};
  std::atomic<bool> sp_ready_{false};
  std::mutex init_mu_;
  std::atomic<int> device_count_{0};
  std::atomic<bool> enabled_{true};
  std::atomic<bool> history_enabled_{false};

  // Stacks for the memory history (recordHistory's context_recorder). slotpool records the trace
  // entries; the shim gathers the stacks, as PyTorch's allocator does, and snapshot() joins them:
  // a live block's stack by its address, a trace entry's by (device, action, address), counting
  // from the newest, because both records drop their oldest entries first.
  void note_alloc(c10::DeviceIndex device, void* p);
  void note_free(void* p);
  std::shared_ptr<c10::GatheredContext> gather(CCA::RecordContext at_least);
  struct TracedStack {
    int device;
    CCA::TraceEntry::Action action;
    uint64_t addr;
    std::shared_ptr<c10::GatheredContext> ctx;
  };
  void trim_trace_stacks_locked(std::vector<TracedStack>& dropped);
  // What recordHistory asked: 0 (NEVER) while no stacks are gathered, else a RecordContext.
  std::atomic<int> gather_when_{0};
  // block_stacks_.size(), read without the lock: while stacks are kept, allocations and frees
  // keep them current even after recording stopped.
  std::atomic<size_t> n_block_stacks_{0};
  bool history_hooks() const {
    return gather_when_.load(std::memory_order_relaxed) != 0 ||
           n_block_stacks_.load(std::memory_order_relaxed) != 0;
  }
  // Never held while calling the recorder or destroying a stack: both may take the GIL, and
  // snapshot() takes this lock while its caller holds the GIL.
  std::mutex history_mu_;
  CCA::CreateContextFn history_recorder_ = nullptr;
  size_t history_max_ = 0;
  std::vector<std::string> history_skip_;  // recordHistory's skip_actions, applied by snapshot()
  // Live blocks' stacks by address (CUDA addresses are unique across devices): (device, stack).
  std::unordered_map<uint64_t, std::pair<int, std::shared_ptr<c10::GatheredContext>>> block_stacks_;
  std::deque<TracedStack> trace_stacks_;  // oldest first, at most history_max_

  struct DeviceRoutes {
    std::shared_mutex mu;
    std::vector<Route> list;        // PyTorch's captures_underway: evaluated oldest first
    // A variant block's route (slotpool_torch.VariantGroup.variant): every allocation of one
    // thread that no route in `list` takes goes to the group's pool. Not in `list`, because the
    // captures inside the block record to that same pool.
    std::optional<std::pair<std::thread::id, MempoolId_t>> variant;
    std::atomic<int> active{0};     // list.size() + (variant ? 1 : 0), read without the lock
  };
  std::array<DeviceRoutes, C10_COMPILE_TIME_MAX_GPUS> routes_;

  // Stale owners after a restore (see "Stale owners" above). An orphan of a restore pins its pool
  // (one use, taken by the first orphan, given back by the last): the pool's memory under it
  // stays mapped while a tensor still points there, as a live block would keep it.
  struct Orphan {
    size_t count = 0;
    bool pinned = false;  // counted in pinned_pools_ (restores; mark_reusable does not pin)
    int device = 0;
    sp_pool_id pool{0, 0};
  };
  void unpin_locked(const Orphan& o);
  std::mutex orphan_mu_;
  std::unordered_map<void*, Orphan> orphans_;
  std::map<std::tuple<int, uint64_t, uint64_t>, size_t> pinned_pools_;
  std::atomic<size_t> n_orphans_{0};

  std::mutex options_mu_;  // one update_pool_options at a time

  std::mutex observers_mu_;
  std::vector<CCA::OutOfMemoryObserver> oom_observers_;

  // attachAllocatorTraceTracker: called with every slotpool event (sp_set_trace_callback) from
  // the first attach on. Replaced whole on attach, so that an event copies one pointer; the
  // mutex is never held while calling slotpool (the callback runs under slotpool's locks).
  std::mutex trackers_mu_;
  std::shared_ptr<const std::vector<CCA::AllocatorTraceTracker>> trace_trackers_;
  static void on_trace_event(const sp_trace_event* event, void* self);

  // CUDA IPC handles opened here (getIpcDevPtr), by handle: one open per handle while in use.
  std::mutex ipc_mu_;
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_opened_;
};

// A getCheckpointState state as slotpool's, checked to be one, of `device`, not freed.
std::shared_ptr<CheckpointState> graph_checkpoint_state(
    c10::DeviceIndex device, const std::shared_ptr<CCA::AllocatorState>& pps);

// torch._C._cuda_setCheckpointPoolState's work, with its contract, on slotpool's restore
// (graph_state.cpp): stale storages lose their deleters, storages_to_add_deleters_to take them.
void set_checkpoint_pool_state(SlotpoolAllocator& a, c10::DeviceIndex device,
                               const std::shared_ptr<CCA::AllocatorState>& state,
                               const std::vector<c10::StorageImpl*>& stale_storages,
                               const std::vector<c10::StorageImpl*>& storages_to_add_deleters_to);

// The deleter of every DataPtr the allocator hands out (raw_deleter()).
void slotpool_delete(void* ptr);

// The installed allocator, or nullptr.
SlotpoolAllocator* instance();
std::shared_ptr<SlotpoolAllocator> instance_shared();

// Creates the allocator and installs it as PyTorch's CUDA allocator (changeCurrentAllocator and
// c10::SetAllocator(kCUDA, ..., 255)). Must run before CUDA is initialised. Idempotent.
std::shared_ptr<SlotpoolAllocator> install(std::optional<std::string> backend,
                                           std::optional<std::string> conf);

// True if c10::GetAllocator(kCUDA) is ours (the probe found changeCurrentAllocator alone does not
// update that registry).
bool registry_is_ours();

// The torch version the extension was compiled against (SLOTPOOL_TORCH_VERSION_STR).
const char* built_for_torch();

}  // namespace slotpool_torch
