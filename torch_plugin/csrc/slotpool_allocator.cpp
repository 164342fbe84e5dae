// slotpool beneath PyTorch: implementation. See slotpool_allocator.h for the design decisions.
#include <pybind11/pybind11.h>
#include <optional>
#include "slotpool_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <sstream>
#include <string_view>
#include <tuple>
#include <typeinfo>
#include <unordered_set>

#include "json_lite.h"

#define SLOTPOOL_STR2(x) #x
#define SLOTPOOL_STR(x) SLOTPOOL_STR2(x)

namespace slotpool_torch {

namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingAllocator::Stat;
using c10::CachingAllocator::StatArray;
using c10::CachingAllocator::StatType;

std::atomic<SlotpoolAllocator*> g_instance{nullptr};
std::shared_ptr<SlotpoolAllocator> g_owner;
std::mutex g_install_mu;

std::string format_size(uint64_t size) {
  char buf[64];
  if (size <= 1024) {
    std::snprintf(buf, sizeof(buf), "%" PRIu64 " bytes", size);
  } else if (size <= 1048576) {
    std::snprintf(buf, sizeof(buf), "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return buf;
}

void map_stat(const sp_stat& s, Stat& d) {
  d.current = s.current;
  d.peak = s.peak;
  d.allocated = s.allocated;
  d.freed = s.freed;
}

void map_array(const sp_stat_array& s, StatArray& d) {
  map_stat(s.all, d[static_cast<size_t>(StatType::AGGREGATE)]);
  map_stat(s.small_pool, d[static_cast<size_t>(StatType::SMALL_POOL)]);
  map_stat(s.large_pool, d[static_cast<size_t>(StatType::LARGE_POOL)]);
}

// Owns a delta from sp_checkpoint_restore / sp_variant_begin.
struct DeltaGuard {
  sp_restore_delta* d = nullptr;
  ~DeltaGuard() {
    if (d != nullptr) {
      sp_delta_free(d);
    }
  }
};

std::vector<PtrSize> delta_list(const sp_restore_delta* d, bool freed) {
  std::vector<PtrSize> out;
  if (d == nullptr) {
    return out;
  }
  size_t n = freed ? sp_delta_freed_count(d) : sp_delta_created_count(d);
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    void* p = nullptr;
    size_t size = 0;
    sp_status st = freed ? sp_delta_freed(d, i, &p, &size) : sp_delta_created(d, i, &p, &size);
    check(st, freed ? "sp_delta_freed" : "sp_delta_created");
    out.emplace_back(p, size);
  }
  return out;
}

// slotpool's snapshot JSON for device (-1: every device), parsed.
json::Value snapshot_json(int device) {
  char* text = nullptr;
  size_t len = 0;
  check(sp_snapshot_json(device, &text, &len), "sp_snapshot_json");
  std::unique_ptr<char, sp_status (*)(char*)> owned(text, &sp_string_free);
  if (text == nullptr) {
    return json::Value{};
  }
  try {
    return json::parse(text, len);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "slotpool: cannot read the snapshot: ", e.what());
  }
}

bool same_pool(const json::Value& seg, sp_pool_id pool) {
  const json::Value* id = seg.get("segment_pool_id");
  if (id == nullptr || id->type != json::Value::Type::Array || id->arr.size() != 2) {
    return pool.a == 0 && pool.b == 0;
  }
  return id->arr[0].as_u64() == pool.a && id->arr[1].as_u64() == pool.b;
}

bool current_stream_capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return true;  // unknown: assume the worst
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Errors

std::string last_error() {
  const char* m = sp_last_error_message();
  return m != nullptr ? std::string(m) : std::string();
}

std::string describe(sp_status st) {
  std::string msg = last_error();
  std::string out = sp_status_name(st);  // the library names its codes
  if (!msg.empty()) {
    out += ": ";
    out += msg;
  }
  return out;
}

void check(sp_status st, const char* what) {
  if (st != SP_OK) {
    std::string msg = describe(st);
    TORCH_CHECK(false, "slotpool: ", what, " failed: ", msg);
  }
}

const char* built_for_torch() {
#ifdef SLOTPOOL_TORCH_VERSION_STR
  return SLOTPOOL_STR(SLOTPOOL_TORCH_VERSION_STR);
#else
  return SLOTPOOL_STR(TORCH_VERSION_MAJOR) "." SLOTPOOL_STR(TORCH_VERSION_MINOR) "." SLOTPOOL_STR(
      TORCH_VERSION_PATCH);
#endif
}

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
  check(sp_variant_begin(g, k, &delta.d), "sp_variant_begin");
  active = k;
  return a->absorb_delta(device, pool, delta.d, free_created);
}

void VariantGroup::end() {
  std::lock_guard<std::mutex> lk(mu);
  TORCH_CHECK(g != nullptr, "slotpool: the variant group is closed");
  check(sp_variant_end(g), "sp_variant_end");
  active.reset();
}

// ------------------------------------------------------------------------------------------------
// PyTorch's allocator settings

std::string torch_conf_from_env() {
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      return v;
    }
  }
  return "";
}

namespace {
// Configuration strings after one another, comma-separated, empty ones left out.
std::string join_conf(std::initializer_list<std::string> parts) {
  std::string out;
  for (const std::string& p : parts) {
    if (!p.empty()) {
      out += (out.empty() ? "" : ",") + p;
    }
  }
  return out;
}
}  // namespace

std::string torch_conf_for_slotpool(const std::string& torch_conf,
                                    std::vector<std::string>* skipped) {
  static const char* const kSame[] = {"max_split_size_mb",        "max_non_split_rounding_mb",
                                      "roundup_power2_divisions", "garbage_collection_threshold",
                                      "expandable_segments",      "per_process_memory_fraction"};
  std::string out;
  std::string part;
  int depth = 0;
  auto flush = [&]() {
    size_t b = part.find_first_not_of(" \t");
    size_t e = part.find_last_not_of(" \t");
    std::string item = b == std::string::npos ? "" : part.substr(b, e - b + 1);
    part.clear();
    if (item.empty()) {
      return;
    }
    size_t colon = item.find(':');
    std::string key = item.substr(0, colon);
    key.erase(key.find_last_not_of(" \t") + 1);
    if (std::find(std::begin(kSame), std::end(kSame), key) != std::end(kSame) &&
        colon != std::string::npos) {
      out = join_conf({out, item});
    } else if (skipped != nullptr) {
      skipped->push_back(key);
    }
  };
  for (char c : torch_conf) {
    depth += c == '[' ? 1 : c == ']' ? -1 : 0;
    if (c == ',' && depth <= 0) {
      flush();
    } else {
      part += c;
    }
  }
  flush();
  return out;
}

// ------------------------------------------------------------------------------------------------
// The allocator

SlotpoolAllocator::SlotpoolAllocator(std::optional<std::string> backend,
                                     std::optional<std::string> conf)
    : backend_(std::move(backend)), conf_(std::move(conf)) {}

void SlotpoolAllocator::ensure_initialized() {
  if (sp_ready_.load(std::memory_order_acquire)) {
    return;
  }
  std::lock_guard<std::mutex> lk(init_mu_);
  if (sp_ready_.load(std::memory_order_relaxed)) {
    return;
  }
  int is_init = 0;
  check(sp_is_initialized(&is_init), "sp_is_initialized");
  if (is_init == 0) {
    // PyTorch's own settings first, then $SLOTPOOL_CONF, then install(conf=): the library applies
    // its `conf` over $SLOTPOOL_CONF, so the variable is repeated after PyTorch's keys.
    std::vector<std::string> skipped;
    std::string from_torch = torch_conf_for_slotpool(torch_conf_from_env(), &skipped);
    const char* env = std::getenv("SLOTPOOL_CONF");
    std::string env_conf = env != nullptr ? env : "";
    std::string full = join_conf({from_torch, env_conf, conf_.value_or("")});
    const char* backend = backend_ ? backend_->c_str() : nullptr;
    sp_status st = sp_init(backend, full.c_str());
    if (st == SP_ERR_CONFIG && !from_torch.empty()) {
      // A value PyTorch accepts that slotpool refuses: run without PyTorch's keys, and say so.
      std::string why = describe(st);
      st = sp_init(backend, conf_ ? conf_->c_str() : nullptr);
      if (st == SP_OK) {
        TORCH_WARN("slotpool: PyTorch's allocator settings (", from_torch,
                   ") were not applied: ", why);
        full = join_conf({env_conf, conf_.value_or("")});
      }
    }
    if (st != SP_OK && st != SP_ERR_INVALID_STATE) {  // INVALID_STATE: initialised meanwhile
      std::string msg = describe(st);
      TORCH_CHECK(false, "slotpool: sp_init(backend=", backend_.value_or("<env>"),
                  ", conf=", full, ") failed: ", msg);
    }
    applied_conf_ = full;
    if (!skipped.empty()) {
      std::string names;
      for (const auto& k : skipped) {
        names += (names.empty() ? "" : ", ") + k;
      }
      // pinned_* keys still reach PyTorch's pinned host allocator, which slotpool leaves alone.
      TORCH_WARN_ONCE("slotpool: PyTorch allocator settings with no slotpool meaning left to "
                      "PyTorch: ", names);
    }
  }
  const char* bname = nullptr;
  if (sp_backend_name(&bname) == SP_OK && bname != nullptr && std::string(bname) != "cuda") {
    TORCH_WARN("slotpool: backend is '", bname,
               "', not 'cuda': PyTorch kernels cannot use its memory. Set SLOTPOOL_BACKEND=cuda "
               "or install(backend='cuda').");
  }
  sp_ready_.store(true, std::memory_order_release);
}

void SlotpoolAllocator::check_device(c10::DeviceIndex device) const {
  TORCH_CHECK(device >= 0 && device < static_cast<c10::DeviceIndex>(C10_COMPILE_TIME_MAX_GPUS),
              "slotpool: invalid device ", static_cast<int>(device));
}

void SlotpoolAllocator::init(int device_count) {
  device_count_.store(device_count);
  ensure_initialized();
  initialized_.store(true, std::memory_order_release);
}

bool SlotpoolAllocator::initialized() {
  return initialized_.load(std::memory_order_acquire);
}

// ---- allocation ----

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

void* SlotpoolAllocator::malloc_impl(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream) {
  check_device(device);
  void* p = nullptr;
  sp_status st;
  if (C10_UNLIKELY(routes_[device].active.load(std::memory_order_acquire) > 0)) {
    sp_pool_id pool = route_for(device, stream);
    st = sp_pool_alloc(device, pool, nbytes, reinterpret_cast<uint64_t>(stream), &p);
  } else {
    st = sp_alloc(device, nbytes, reinterpret_cast<uint64_t>(stream), &p);
  }
  if (C10_LIKELY(st == SP_OK)) {
    if (C10_UNLIKELY(history_hooks())) {
      note_alloc(device, p);
    }
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
      sp_memory_stats s{};
      if (sp_memory_stats_get(device, &s) == SP_OK) {
        size_t rounded = nbytes;
        void* base = nullptr;
        size_t requested = 0;
        int dev = 0;
        (void)sp_allocation_info(p, &base, &rounded, &requested, &dev);
        c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(rounded),
                                         static_cast<size_t>(s.allocated_bytes.all.current),
                                         static_cast<size_t>(s.reserved_bytes.all.current),
                                         c10::Device(c10::DeviceType::CUDA, device));
      }
    }
    return p;
  }
  std::string msg = describe(st);
  // slotpool refuses sizes above 2^56 as invalid; PyTorch reports any unsatisfiable size as OOM.
  if (st == SP_ERR_OUT_OF_MEMORY ||
      (st == SP_ERR_INVALID_ARGUMENT && static_cast<uint64_t>(nbytes) > (uint64_t{1} << 56))) {
    throw_oom(device, nbytes, msg);
  }
  TORCH_CHECK(false, "slotpool: allocating ", format_size(nbytes), " on device ",
              static_cast<int>(device), " failed: ", msg);
}

void SlotpoolAllocator::throw_oom(c10::DeviceIndex device, size_t nbytes, const std::string& msg) {
  size_t device_free = 0;
  size_t device_total = 0;
  {
    // cudaMemGetInfo is not a stream operation, but stay clear of a global-mode capture's rules.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    bool swapped = cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
    c10::DeviceIndex prev = -1;
    if (c10::cuda::GetDevice(&prev) == cudaSuccess && prev != device) {
      (void)c10::cuda::SetDevice(device);
    }
    if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
      (void)cudaGetLastError();
    }
    if (prev >= 0 && prev != device) {
      (void)c10::cuda::SetDevice(prev);
    }
    if (swapped) {
      (void)cudaThreadExchangeStreamCaptureMode(&mode);
    }
  }
  uint64_t limit = 0;
  uint64_t total = 0;
  size_t allowed = device_total;
  if (sp_memory_limit_get(device, &limit, &total) == SP_OK && limit != 0 && limit < total) {
    allowed = static_cast<size_t>(limit);
  }
  sp_memory_stats s{};
  bool have_stats = sp_memory_stats_get(device, &s) == SP_OK;
  if (have_stats && C10_UNLIKELY(c10::memoryProfilingEnabled())) {
    c10::reportOutOfMemoryToProfiler(static_cast<int64_t>(nbytes),
                                     static_cast<size_t>(s.allocated_bytes.all.current),
                                     static_cast<size_t>(s.reserved_bytes.all.current),
                                     c10::Device(c10::DeviceType::CUDA, device));
  }
  {
    // Observers registered from Python capture Python objects: copying and destroying them
    // touches reference counts, so hold the GIL for the whole block (re-entrant if this thread
    // already holds it).
    std::optional<pybind11::gil_scoped_acquire> gil;
    if (Py_IsInitialized()) gil.emplace();
    std::vector<CCA::OutOfMemoryObserver> observers;
    {
      std::lock_guard<std::mutex> lk(observers_mu_);
      observers = oom_observers_;
    }
    for (auto& obs : observers) {
      try {
        obs(device, nbytes, allowed, device_free);
      } catch (const std::exception& e) {
        TORCH_WARN("slotpool: an out-of-memory observer failed: ", e.what());
      } catch (...) {
        TORCH_WARN("slotpool: an out-of-memory observer failed");
      }
    }
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ",
                   format_size(nbytes), ". GPU ", static_cast<int>(device),
                   " has a total capacity of ", format_size(device_total), " of which ",
                   format_size(device_free), " is free. slotpool: ", msg);
}

c10::DataPtr SlotpoolAllocator::allocate(size_t nbytes) {
  c10::DeviceIndex device = c10::cuda::current_device();
  void* p = nullptr;
  if (nbytes != 0) {
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
    p = malloc_impl(device, nbytes, stream);
  }
  // Size 0: a null pointer with our deleter, as PyTorch's allocator does (the deleter never runs
  // for a null context).
  return {p, p, &slotpool_delete, c10::Device(c10::DeviceType::CUDA, device)};
}

c10::DeleterFnPtr SlotpoolAllocator::raw_deleter() const {
  return &slotpool_delete;
}

void SlotpoolAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

void* SlotpoolAllocator::raw_alloc(size_t nbytes) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = c10::cuda::current_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  return malloc_impl(device, nbytes, stream);
}

void* SlotpoolAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) {
    return nullptr;
  }
  c10::DeviceIndex device = c10::cuda::current_device();
  return malloc_impl(device, nbytes, stream);
}

void SlotpoolAllocator::raw_delete(void* ptr) {
  free_ptr(ptr, /*throw_on_error=*/true);
}

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

void SlotpoolAllocator::free_ptr(void* ptr, bool throw_on_error) {
  if (ptr == nullptr) {
    return;
  }
  // A pointer a restore freed while a tensor still held it: this free is the stale owner's (or
  // the new owner's, if the address was handed out again; then the other one frees it later).
  if (C10_UNLIKELY(n_orphans_.load(std::memory_order_acquire) > 0) && consume_orphan(ptr)) {
    return;
  }
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
    void* base = nullptr;
    size_t size = 0;
    size_t requested = 0;
    int dev = 0;
    if (sp_allocation_info(ptr, &base, &size, &requested, &dev) == SP_OK) {
      sp_memory_stats s{};
      if (sp_memory_stats_get(dev, &s) == SP_OK) {
        c10::reportMemoryUsageToProfiler(
            ptr, -static_cast<int64_t>(size),
            static_cast<size_t>(s.allocated_bytes.all.current) - size,
            static_cast<size_t>(s.reserved_bytes.all.current),
            c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(dev)));
      }
    }
  }
  if (C10_UNLIKELY(history_hooks())) {
    note_free(ptr);
  }
  sp_status st = sp_free(ptr);
  if (C10_LIKELY(st == SP_OK)) {
    return;
  }
  std::string msg = describe(st);
  if (throw_on_error) {
    TORCH_CHECK(false, "slotpool: freeing ", ptr, " failed: ", msg);
  }
  TORCH_WARN("slotpool: freeing ", ptr, " failed: ", msg);
}

void slotpool_delete(void* ptr) {
  SlotpoolAllocator* a = g_instance.load(std::memory_order_acquire);
  if (a != nullptr) {
    a->free_ptr(ptr, /*throw_on_error=*/false);
  } else if (ptr != nullptr) {
    (void)sp_free(ptr);
  }
}

// ---- caching, limits, statistics ----

void SlotpoolAllocator::emptyCache(MempoolId_t mempool_id) {
  ensure_initialized();
  // Called from ~MemPool: report, never throw.
  if (mempool_id.first == 0 && mempool_id.second == 0) {
    sp_status st = sp_empty_cache(-1);
    if (st != SP_OK) {
      TORCH_WARN("slotpool: empty_cache failed: ", describe(st));
    }
    return;
  }
  int n = std::max(device_count_.load(), 1);
  for (int d = 0; d < n; ++d) {
    sp_status st = sp_pool_empty_cache(d, to_sp(mempool_id));
    if (st != SP_OK && st != SP_ERR_UNKNOWN_POOL) {
      TORCH_WARN("slotpool: emptying pool (", mempool_id.first, ", ", mempool_id.second,
                 ") on device ", d, " failed: ", describe(st));
    }
  }
}

double SlotpoolAllocator::getMemoryFraction(c10::DeviceIndex device) {
  ensure_initialized();
  uint64_t limit = 0;
  uint64_t total = 0;
  check(sp_memory_limit_get(device, &limit, &total), "sp_memory_limit_get");
  if (limit == 0 || total == 0 || limit >= total) {
    return 1.0;
  }
  return static_cast<double>(limit) / static_cast<double>(total);
}

void SlotpoolAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  ensure_initialized();
  check(sp_set_memory_fraction(device, fraction), "sp_set_memory_fraction");
}

std::vector<CCA::StreamSegmentSize> SlotpoolAllocator::getExpandableSegmentSizes(
    c10::DeviceIndex device) {
  ensure_initialized();
  // slotpool's vmm segments play the part of expandable segments: their sizes per (stream, pool
  // size class), from the snapshot.
  std::map<std::pair<uint64_t, bool>, size_t> sizes;
  json::Value snap = snapshot_json(device);
  if (const json::Value* segs = snap.get("segments")) {
    for (const auto& seg : segs->arr) {
      if (!seg.boolean("is_expandable")) {
        continue;
      }
      bool small = seg.str("segment_type") == "small";
      sizes[{seg.u64("stream"), small}] += static_cast<size_t>(seg.u64("total_size"));
    }
  }
  std::vector<CCA::StreamSegmentSize> out;
  for (const auto& [key, size] : sizes) {
    out.emplace_back(reinterpret_cast<cudaStream_t>(key.first), key.second, size);
  }
  return out;
}

void SlotpoolAllocator::enable(bool value) {
  if (!value) {
    TORCH_WARN_ONCE(
        "slotpool: caching cannot be turned off (caching_allocator_enable(False) / "
        "PYTORCH_NO_CUDA_MEMORY_CACHING); slotpool keeps caching. Use torch.cuda.empty_cache() "
        "or a memory limit instead.");
  }
  enabled_.store(value);
}

bool SlotpoolAllocator::isEnabled() const {
  // Caching stays on whatever enable() was told (see enable()).
  return true;
}

void SlotpoolAllocator::cacheInfo(c10::DeviceIndex device, size_t* largestBlock) {
  ensure_initialized();
  TORCH_CHECK(largestBlock != nullptr, "slotpool: cacheInfo needs an out pointer");
  if (*largestBlock == 0) {
    // PyTorch's allocator starts from the device's free memory when asked with 0 (cuDNN's
    // benchmark sizes its workspace from this).
    size_t free_b = 0;
    size_t total_b = 0;
    c10::cuda::CUDAGuard guard(device);
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      *largestBlock = free_b;
    } else {
      (void)cudaGetLastError();
    }
  }
  size_t cached = 0;
  check(sp_largest_free_block(device, &cached), "sp_largest_free_block");
  *largestBlock = std::max(*largestBlock, cached);
}

// The cudaMalloc allocation behind ptr, as PyTorch answers: a classic segment's base and size. A
// vmm reservation is no such allocation (PyTorch refuses expandable blocks here): the block itself.
void* SlotpoolAllocator::getBaseAllocation(void* ptr, size_t* size) {
  void* base = nullptr;
  size_t bytes = 0;
  int vmm = 0;
  check(sp_segment_info(ptr, &base, &bytes, &vmm), "sp_segment_info");
  if (vmm != 0) {
    size_t requested = 0;
    int dev = 0;
    check(sp_allocation_info(ptr, &base, &bytes, &requested, &dev), "sp_allocation_info");
  }
  if (size != nullptr) {
    *size = bytes;
  }
  return base;
}

void SlotpoolAllocator::recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) {
  // Like PyTorch's allocator: memory that is not ours (another deleter: IPC, arenas, from_blob) is
  // ignored; so is the null pointer of an empty tensor.
  if (ptr.get() == nullptr || ptr.get_deleter() != &slotpool_delete) {
    return;
  }
  sp_status st = sp_record_stream(ptr.get(), reinterpret_cast<uint64_t>(stream.stream()));
  if (st == SP_OK) {
    return;
  }
  std::string msg = describe(st);
  if (st == SP_ERR_UNKNOWN_POINTER && n_orphans_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lk(orphan_mu_);
    if (orphans_.count(ptr.get()) != 0) {
      return;  // a stale tensor whose allocation a restore freed: nothing left to protect
    }
  }
  TORCH_CHECK(false, "slotpool: sp_record_stream failed: ", msg);
}

DeviceStats SlotpoolAllocator::getDeviceStats(c10::DeviceIndex device) {
  ensure_initialized();
  sp_memory_stats s{};
  check(sp_memory_stats_get(device, &s), "sp_memory_stats_get");
  DeviceStats d;
  map_array(s.allocation, d.allocation);
  map_array(s.segment, d.segment);
  map_array(s.active, d.active);
  map_array(s.inactive_split, d.inactive_split);
  map_array(s.allocated_bytes, d.allocated_bytes);
  map_array(s.reserved_bytes, d.reserved_bytes);
  map_array(s.active_bytes, d.active_bytes);
  map_array(s.inactive_split_bytes, d.inactive_split_bytes);
  map_array(s.requested_bytes, d.requested_bytes);
  d.num_alloc_retries = s.num_alloc_retries;
  d.num_ooms = s.num_ooms;
  map_stat(s.oversize_allocations, d.oversize_allocations);
  map_stat(s.oversize_segments, d.oversize_segments);
  d.num_sync_all_streams = s.num_sync_all_streams;
  d.num_device_alloc = s.num_device_alloc;
  d.num_device_free = s.num_device_free;
  d.max_split_size = s.max_split_size;  // -1 when unlimited, as PyTorch's SIZE_MAX reads
  return d;
}

void SlotpoolAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  ensure_initialized();
  check(sp_reset_accumulated_stats(device), "sp_reset_accumulated_stats");
}

void SlotpoolAllocator::resetPeakStats(c10::DeviceIndex device) {
  ensure_initialized();
  check(sp_reset_peak_stats(device), "sp_reset_peak_stats");
}

// ---- snapshot ----

// PyTorch 2.11's trace actions (parseTraceEntryAction throws on any other).
constexpr std::string_view kTraceActions[] = {
    "alloc",       "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap",  "snapshot",       "oom"};

// The recorded history (sp_record_history) as PyTorch's trace entries, less recordHistory's
// skip_actions, with the stacks the shim gathered. PyTorch's Python side reads time_.t_ as
// microseconds (its own allocator converts its approximate clock before returning); slotpool
// records microseconds already.
void SlotpoolAllocator::append_traces(const json::Value& snap, CCA::SnapshotInfo& info) {
  const json::Value* traces = snap.get("device_traces");
  if (traces == nullptr || traces->type != json::Value::Type::Array) {
    return;
  }
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
  if (info.device_traces.size() < traces->arr.size()) {
    info.device_traces.resize(traces->arr.size());
  }
  for (size_t device = 0; device < traces->arr.size(); ++device) {
    auto& out = info.device_traces[device];
    const auto& entries = traces->arr[device].arr;
    // Newest first, so that the k-th newest entry of a key gets the k-th newest stack.
    std::vector<CCA::TraceEntry> rev;
    std::map<std::tuple<int, int, uint64_t>, size_t> seen;
    for (auto e = entries.rbegin(); e != entries.rend(); ++e) {
      std::string action = e->str("action");
      if (std::find(std::begin(kTraceActions), std::end(kTraceActions), action) ==
          std::end(kTraceActions)) {
        continue;  // an action this PyTorch does not know
      }
      auto a = c10::CachingDeviceAllocator::parseTraceEntryAction(action);
      uint64_t addr = e->u64("addr");
      std::shared_ptr<c10::GatheredContext> ctx;
      std::tuple<int, int, uint64_t> key{static_cast<int>(device), static_cast<int>(a), addr};
      if (auto it = stacks.find(key); it != stacks.end()) {
        size_t k = seen[key]++;
        if (k < it->second.size()) {
          ctx = it->second[it->second.size() - 1 - k];
        }
      }
      if (std::find(skip.begin(), skip.end(), action) != skip.end()) {
        continue;
      }
      rev.emplace_back(a, static_cast<c10::DeviceIndex>(device), static_cast<size_t>(addr),
                       static_cast<size_t>(e->u64("size")),
                       reinterpret_cast<void*>(e->u64("stream")), MempoolId_t{0, 0},
                       c10::approx_time_t{0}, std::move(ctx));
      rev.back().time_.t_ = static_cast<time_t>(e->u64("time_us"));
    }
    out.insert(out.end(), std::make_move_iterator(rev.rbegin()), std::make_move_iterator(rev.rend()));
  }
}

CCA::SnapshotInfo SlotpoolAllocator::snapshot(MempoolId_t mempool_id, bool include_traces) {
  ensure_initialized();
  CCA::SnapshotInfo info;
  json::Value snap = snapshot_json(-1);
  decltype(block_stacks_) stacks;
  {
    std::lock_guard<std::mutex> lk(history_mu_);
    stacks = block_stacks_;
  }
  bool filter = mempool_id.first != 0 || mempool_id.second != 0;
  sp_pool_id want = to_sp(mempool_id);
  int max_device = std::max(device_count_.load(), 1) - 1;
  if (const json::Value* segs = snap.get("segments")) {
    for (const auto& seg : segs->arr) {
      if (filter && !same_pool(seg, want)) {
        continue;
      }
      int device = static_cast<int>(seg.i64("device"));
      max_device = std::max(max_device, device);
      c10::CachingDeviceAllocator::SegmentInfo proto;
      proto.device = static_cast<c10::DeviceIndex>(device);
      proto.stream = reinterpret_cast<void*>(seg.u64("stream"));
      proto.is_large = seg.str("segment_type") != "small";
      proto.is_expandable = seg.boolean("is_expandable");
      if (const json::Value* id = seg.get("segment_pool_id");
          id != nullptr && id->type == json::Value::Type::Array && id->arr.size() == 2) {
        proto.owner_private_pool_id = MempoolId_t{id->arr[0].as_u64(), id->arr[1].as_u64()};
      }
      // PyTorch computes block addresses as segment address + sizes of the blocks before; a
      // gap (an unmapped range of a vmm segment) starts a new segment, as PyTorch reports each
      // mapped range of an expandable segment on its own.
      const json::Value* blocks = seg.get("blocks");
      uint64_t seg_addr = seg.u64("address");
      auto start = [&](uint64_t addr) {
        info.segments.push_back(proto);
        info.segments.back().address = static_cast<size_t>(addr);
      };
      if (blocks == nullptr || blocks->arr.empty()) {
        start(seg_addr);
        info.segments.back().total_size = static_cast<size_t>(seg.u64("total_size"));
        continue;
      }
      uint64_t next = 0;
      bool open = false;
      for (const auto& b : blocks->arr) {
        uint64_t addr = b.get("address") != nullptr ? b.u64("address") : (open ? next : seg_addr);
        if (!open || addr != next) {
          start(addr);
          open = true;
        }
        auto& cur = info.segments.back();
        c10::CachingDeviceAllocator::BlockInfo bi;
        bi.size = static_cast<size_t>(b.u64("size"));
        bi.requested_size = static_cast<size_t>(b.u64("requested_size"));
        std::string state = b.str("state");
        bi.allocated = state == "active_allocated";
        bi.active = state != "inactive";
        if (bi.allocated && !stacks.empty()) {
          if (auto it = stacks.find(addr); it != stacks.end()) {
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
        next = addr + b.u64("size");
      }
    }
  }
  std::sort(info.segments.begin(), info.segments.end(),
            [](const auto& x, const auto& y) { return x.address < y.address; });
  info.device_traces.resize(static_cast<size_t>(max_device + 1));
  if (include_traces) {
    append_traces(snap, info);
  }
  CCA::AllocatorConfigInfo& cfg = info.config_metadata;
  // The last garbage_collection_threshold that sp_init was given (0: off).
  cfg.garbage_collection_threshold = 0.0;
  for (size_t at = applied_conf_.find("garbage_collection_threshold:");
       at != std::string::npos;
       at = applied_conf_.find("garbage_collection_threshold:", at + 1)) {
    cfg.garbage_collection_threshold =
        std::strtod(applied_conf_.c_str() + at + std::strlen("garbage_collection_threshold:"),
                    nullptr);
  }
  sp_memory_stats s{};
  cfg.max_split_size = sp_memory_stats_get(0, &s) == SP_OK && s.max_split_size >= 0
                           ? static_cast<size_t>(s.max_split_size)
                           : SIZE_MAX;
  cfg.pinned_num_register_threads = 1;
  // The configuration in effect, as slotpool reads it ("growth:vmm,...,vmm_page_mb:16"):
  // PyTorch's snapshot shows it as allocator_settings["PYTORCH_CUDA_ALLOC_CONF"].
  std::string effective;
  if (const json::Value* settings = snap.get("allocator_settings")) {
    effective = settings->str("conf");
  }
  cfg.expandable_segments =
      effective.empty() ? std::any_of(info.segments.begin(), info.segments.end(),
                                      [](const auto& x) { return x.is_expandable; })
                        : effective.rfind("growth:vmm", 0) == 0;
  cfg.release_lock_on_malloc = false;
  cfg.pinned_use_host_register = false;
  cfg.graph_capture_record_stream_reuse = false;
  cfg.last_allocator_settings = effective.empty() ? applied_conf_ : effective;
  return info;
}

std::vector<void*> SlotpoolAllocator::pool_live_allocations(int device, sp_pool_id pool) {
  std::vector<void*> out;
  json::Value snap = snapshot_json(device);
  const json::Value* segs = snap.get("segments");
  if (segs == nullptr) {
    return out;
  }
  for (const auto& seg : segs->arr) {
    if (!same_pool(seg, pool)) {
      continue;
    }
    const json::Value* blocks = seg.get("blocks");
    if (blocks == nullptr) {
      continue;
    }
    uint64_t addr = seg.u64("address");
    for (const auto& b : blocks->arr) {
      if (b.get("address") != nullptr) {
        addr = b.u64("address");
      }
      if (b.str("state") == "active_allocated") {
        out.push_back(reinterpret_cast<void*>(addr));
      }
      addr += b.u64("size");
    }
  }
  return out;
}

// ---- pools and routes ----

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

void SlotpoolAllocator::releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  // Called from CUDAGraph::reset (a destructor) and ~MemPool: report, never throw.
  sp_status st = sp_pool_release(device, to_sp(mempool_id), nullptr);
  if (st != SP_OK) {
    TORCH_WARN("slotpool: releasing pool (", mempool_id.first, ", ", mempool_id.second,
               ") on device ", static_cast<int>(device), " failed: ", describe(st));
  }
}

int SlotpoolAllocator::getPoolUseCount(c10::DeviceIndex device, MempoolId_t mempool_id) {
  ensure_initialized();
  uint64_t n = 0;
  sp_status st = sp_pool_use_count(device, to_sp(mempool_id), &n);
  if (st == SP_ERR_UNKNOWN_POOL) {
    return 0;
  }
  check(st, "sp_pool_use_count");
  return static_cast<int>(n);
}

void SlotpoolAllocator::createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                                           std::shared_ptr<CCA::CUDAAllocator> allocator) {
  ensure_initialized();
  if (allocator != nullptr && allocator.get() != this) {
    TORCH_WARN_ONCE(
        "slotpool: MemPool(allocator=...) is not supported; the pool's memory comes from "
        "slotpool and the given allocator is ignored.");
  }
  check(sp_pool_create_or_incref(device, to_sp(mempool_id), nullptr, nullptr),
        "sp_pool_create_or_incref");
}

sp_pool_options& SlotpoolAllocator::pool_options_locked(int device, sp_pool_id pool) {
  return pool_options_[std::make_tuple(device, pool.a, pool.b)];  // zero-initialised if new
}

void SlotpoolAllocator::setUseOnOOM(c10::DeviceIndex device, MempoolId_t mempool_id,
                                    bool use_on_oom) {
  // ~MemPool calls this: report, never throw (a throw there aborts the process).
  std::lock_guard<std::mutex> lk(options_mu_);
  sp_pool_options& o = pool_options_locked(device, to_sp(mempool_id));
  o.use_on_oom = use_on_oom ? 1 : 0;
  sp_status st = sp_pool_set_options(device, to_sp(mempool_id), &o);
  if (st != SP_OK) {
    TORCH_WARN("slotpool: setUseOnOOM on pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", describe(st));
  }
}

void SlotpoolAllocator::setNoSplit(c10::DeviceIndex device, MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lk(options_mu_);
  sp_pool_options& o = pool_options_locked(device, to_sp(mempool_id));
  o.no_split = 1;
  sp_status st = sp_pool_set_options(device, to_sp(mempool_id), &o);
  if (st != SP_OK) {
    TORCH_WARN("slotpool: setNoSplit on pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", describe(st));
  }
}

bool SlotpoolAllocator::checkPoolLiveAllocations(
    c10::DeviceIndex device, MempoolId_t mempool_id,
    const std::unordered_set<void*>& expected_live_allocations) {
  ensure_initialized();
  std::vector<void*> ptrs(expected_live_allocations.begin(), expected_live_allocations.end());
  void* none[1] = {nullptr};  // a valid array pointer even when the set is empty
  sp_status st = sp_pool_verify_live(device, to_sp(mempool_id), ptrs.empty() ? none : ptrs.data(),
                                     ptrs.size());
  if (st == SP_OK) {
    return true;
  }
  if (st == SP_ERR_INVALID_STATE) {
    return false;
  }
  if (st == SP_ERR_UNKNOWN_POOL) {
    return ptrs.empty();
  }
  check(st, "sp_pool_verify_live");
  return false;
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
  return std::make_shared<CheckpointState>(device, pool, cp);
}

std::shared_ptr<CCA::AllocatorState> SlotpoolAllocator::getCheckpointState(c10::DeviceIndex device,
                                                                          MempoolId_t id) {
  return take_checkpoint(device, to_sp(id));
}

CCA::CheckpointDelta SlotpoolAllocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<CCA::AllocatorState> pps) {
  ensure_initialized();
  auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
  TORCH_CHECK(state != nullptr,
              "slotpool: setCheckpointPoolState needs a state from slotpool's getCheckpointState");
  TORCH_CHECK(state->device == device, "slotpool: checkpoint of device ", state->device,
              " restored on device ", static_cast<int>(device));
  TORCH_CHECK(state->cp != nullptr, "slotpool: checkpoint already freed");
  (void)sp_process_events(device);
  DeltaGuard delta;
  void* none[1] = {nullptr};  // keep nothing (PyTorch's restore has no keep set)
  check(sp_checkpoint_restore(device, state->pool, state->cp, none, 0, &delta.d),
        "sp_checkpoint_restore");
  std::vector<PtrSize> freed = delta_list(delta.d, true);
  std::vector<PtrSize> created = delta_list(delta.d, false);
  // PyTorch's contract: every allocation live before is "freed", every allocation of the
  // checkpoint is "allocated" (survivors, live in both, appear in both lists).
  std::vector<void*> live_after = pool_live_allocations(device, state->pool);
  std::unordered_set<void*> created_set;
  for (const auto& c : created) {
    created_set.insert(c.first);
  }
  CCA::CheckpointDelta out;
  out.ptrs_freed.reserve(freed.size() + live_after.size());
  for (const auto& f : freed) {
    out.ptrs_freed.push_back(f.first);
  }
  for (void* p : live_after) {
    if (created_set.count(p) == 0) {
      out.ptrs_freed.push_back(p);
    }
  }
  out.dataptrs_allocd.reserve(live_after.size());
  for (void* p : live_after) {
    out.dataptrs_allocd.emplace_back(p, p, &slotpool_delete,
                                     c10::Device(c10::DeviceType::CUDA, device));
  }
  return out;
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

RestoreResult SlotpoolAllocator::restore(int device, sp_pool_id pool, const CheckpointState& cp,
                                         const std::vector<void*>& keep_live, bool free_created) {
  ensure_initialized();
  TORCH_CHECK(cp.cp != nullptr, "slotpool: checkpoint already freed");
  TORCH_CHECK(cp.device == device, "slotpool: checkpoint of device ", cp.device,
              " restored on device ", device);
  (void)sp_process_events(device);
  DeltaGuard delta;
  void* none[1] = {nullptr};
  check(sp_checkpoint_restore(device, pool, cp.cp, keep_live.empty() ? none : keep_live.data(),
                              keep_live.size(), &delta.d),
        "sp_checkpoint_restore");
  return absorb_delta(device, pool, delta.d, free_created);
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

// ---- history, observers, IPC, peers ----

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

void SlotpoolAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lk(observers_mu_);
  oom_observers_.push_back(std::move(observer));
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
  using Action = CCA::TraceEntry::Action;
  static constexpr Action kActions[] = {
      Action::ALLOC,         Action::FREE_REQUESTED, Action::FREE_COMPLETED,
      Action::SEGMENT_ALLOC, Action::SEGMENT_FREE,   Action::SEGMENT_MAP,
      Action::SEGMENT_UNMAP, Action::OOM};
  if (e == nullptr || e->action < 0 || e->action >= static_cast<int>(std::size(kActions))) {
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
    CCA::TraceEntry te(kActions[e->action], static_cast<c10::DeviceIndex>(e->device),
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

// CUDA IPC (torch.multiprocessing) in PyTorch's handle format, version 2: a version byte, then
//  - 'c' and the cudaIpcMemHandle_t of a cudaMalloc'd segment's base (slotpool's classic
//    segments are such allocations);
//  - 'e' and the pages of an expandable segment, which is what slotpool's vmm reservations are:
//    a header {pid_t pid; (4 bytes of padding); size_t page_size; size_t count} and `count` ints,
//    the sender's POSIX file descriptors of the physical pages that cover the block, in address
//    order (the layout PyTorch 2.11 writes, benches/gpu/ipc_probe.py on the H200). The receiver
//    duplicates them with pidfd_getfd and maps them in order.
// The block's offset (into its segment, or into its first page) travels beside the handle. Both
// kinds are opened here whichever allocator sent them, and slotpool's handles by PyTorch's own.
namespace {
constexpr char kIpcHandleVersion = 2;
constexpr char kIpcCudaMalloc = 'c';
constexpr char kIpcExpandable = 'e';

struct IpcPagesHeader {
  int32_t pid;
  int32_t padding;
  uint64_t page_size;
  uint64_t count;
};
static_assert(sizeof(IpcPagesHeader) == 24, "PyTorch's expandable-segment share header");
}  // namespace

CCA::ShareableHandle SlotpoolAllocator::shareIpcHandle(void* ptr) {
  void* base = nullptr;
  size_t size = 0;
  int vmm = 0;
  check(sp_segment_info(ptr, &base, &size, &vmm), "sp_segment_info");
  std::string bytes;
  bytes.push_back(kIpcHandleVersion);
  if (vmm == 0) {
    cudaIpcMemHandle_t handle;
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
    bytes.push_back(kIpcCudaMalloc);
    bytes.append(reinterpret_cast<const char*>(&handle), sizeof handle);
    return CCA::ShareableHandle{static_cast<char*>(ptr) - static_cast<char*>(base),
                                std::move(bytes)};
  }
  size_t count = 0, page_size = 0, offset = 0;
  // A first call with no room only reports how many pages cover the block.
  (void)sp_ipc_export(ptr, nullptr, 0, &count, &page_size, &offset);
  TORCH_CHECK(count > 0, "slotpool: sp_ipc_export: ", sp_last_error_message());
  std::vector<int> fds(count, -1);
  check(sp_ipc_export(ptr, fds.data(), fds.size(), &count, &page_size, &offset),
        "sp_ipc_export");
  IpcPagesHeader header{static_cast<int32_t>(getpid()), 0, page_size, count};
  bytes.push_back(kIpcExpandable);
  bytes.append(reinterpret_cast<const char*>(&header), sizeof header);
  bytes.append(reinterpret_cast<const char*>(fds.data()), fds.size() * sizeof(int));
  return CCA::ShareableHandle{static_cast<ptrdiff_t>(offset), std::move(bytes)};
}

std::shared_ptr<void> SlotpoolAllocator::getIpcDevPtr(std::string handle) {
  TORCH_CHECK(handle.size() >= 2 && handle[0] == kIpcHandleVersion,
              "slotpool: a CUDA IPC handle of an unknown format (not PyTorch's version ",
              static_cast<int>(kIpcHandleVersion), ")");
  const bool pages = handle[1] == kIpcExpandable;
  IpcPagesHeader header{};
  if (pages) {
    TORCH_CHECK(handle.size() >= 2 + sizeof header, "slotpool: a truncated 'e' IPC handle");
    std::memcpy(&header, handle.data() + 2, sizeof header);
    TORCH_CHECK(header.count > 0 && header.count <= (1u << 20) &&
                    handle.size() == 2 + sizeof header + header.count * sizeof(int),
                "slotpool: an 'e' IPC handle of the wrong size");
  } else {
    TORCH_CHECK(handle[1] == kIpcCudaMalloc && handle.size() == 2 + sizeof(cudaIpcMemHandle_t),
                "slotpool: a CUDA IPC handle of an unknown type or size");
  }
  std::lock_guard<std::mutex> lock(ipc_mu_);
  auto it = ipc_opened_.find(handle);
  if (it != ipc_opened_.end()) {
    if (auto open = it->second.lock()) {
      return open;
    }
  }
  c10::DeviceIndex device = 0;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* dev_ptr = nullptr;
  if (pages) {
    ensure_initialized();
    std::vector<int> fds(header.count);
    std::memcpy(fds.data(), handle.data() + 2 + sizeof header, fds.size() * sizeof(int));
    check(sp_ipc_open(device, header.pid, fds.data(), fds.size(), header.page_size, &dev_ptr),
          "sp_ipc_open");
  } else {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + 2, sizeof h);
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&dev_ptr, h, cudaIpcMemLazyEnablePeerAccess));
  }
  // Closed on the device that opened it, once the last storage using it is gone.
  std::shared_ptr<void> open(dev_ptr, [this, handle, device, pages](void* p) {
    c10::cuda::CUDAGuard guard(device);
    std::lock_guard<std::mutex> lock(ipc_mu_);
    if (pages) {
      if (sp_ipc_close(device, p) != SP_OK) {
        TORCH_WARN("slotpool: sp_ipc_close: ", sp_last_error_message());
      }
    } else {
      C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(p));
    }
    auto entry = ipc_opened_.find(handle);
    if (entry != ipc_opened_.end() && entry->second.expired()) {
      ipc_opened_.erase(entry);
    }
  });
  ipc_opened_[handle] = open;
  return open;
}

// `dev` may now read and write `dev_to_access`'s memory: cudaMalloc memory (slotpool's classic
// segments) through the runtime's peer access, slotpool's vmm pages through their access lists,
// as PyTorch does for its expandable segments.
void SlotpoolAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  c10::cuda::CUDAGuard guard(dev);
  cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
  if (err == cudaErrorPeerAccessAlreadyEnabled) {
    (void)cudaGetLastError();
  } else {
    C10_CUDA_CHECK(err);
  }
  ensure_initialized();
  check(sp_enable_peer_access(dev_to_access, dev), "sp_enable_peer_access");
}

cudaError_t SlotpoolAllocator::memcpyAsync(void* dst, int dstDevice, const void* src,
                                           int srcDevice, size_t count, cudaStream_t stream,
                                           bool p2p_enabled) {
  (void)p2p_enabled;
  // Copies between devices take the peer path, which works for every kind of memory, whether or
  // not enablePeerAccess opened it.
  if (dstDevice == srcDevice) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

std::string SlotpoolAllocator::name() {
  return "slotpool";
}

// ------------------------------------------------------------------------------------------------
// Installation

SlotpoolAllocator* instance() {
  return g_instance.load(std::memory_order_acquire);
}

std::shared_ptr<SlotpoolAllocator> instance_shared() {
  std::lock_guard<std::mutex> lk(g_install_mu);
  return g_owner;
}

std::shared_ptr<SlotpoolAllocator> install(std::optional<std::string> backend,
                                           std::optional<std::string> conf) {
  std::lock_guard<std::mutex> lk(g_install_mu);
  if (g_owner) {
    return g_owner;
  }
  auto a = std::make_shared<SlotpoolAllocator>(std::move(backend), std::move(conf));
  try {
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false,
                "slotpool_torch.install() must run before CUDA is initialised (before the first "
                "CUDA tensor or torch.cuda.init()); PyTorch said: ",
                e.what_without_backtrace());
  }
  // changeCurrentAllocator alone leaves c10's allocator registry on the native allocator (measured
  // on PyTorch 2.11); code reaching the allocator through c10::GetAllocator(kCUDA) needs this.
  c10::SetAllocator(c10::DeviceType::CUDA, a.get(), 255);
  g_owner = a;
  g_instance.store(a.get(), std::memory_order_release);
  return a;
}

bool registry_is_ours() {
  SlotpoolAllocator* a = instance();
  return a != nullptr && c10::GetAllocator(c10::DeviceType::CUDA) == static_cast<c10::Allocator*>(a);
}

}  // namespace slotpool_torch
