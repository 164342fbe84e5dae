// slotpool beneath PyTorch: errors, the allocation path (allocate, raw_alloc, free and the
// deleter), caching, limits, statistics, peers and installation. See slotpool_allocator.h for the
// design decisions and for which file holds which concern.
#include <pybind11/pybind11.h>

#include "slotpool_allocator.h"

#include <c10/core/Allocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <optional>

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
// The allocator

SlotpoolAllocator::SlotpoolAllocator(std::optional<std::string> backend,
                                     std::optional<std::string> conf)
    : backend_(std::move(backend)), conf_(std::move(conf)) {}

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

void SlotpoolAllocator::attachOutOfMemoryObserver(CCA::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lk(observers_mu_);
  oom_observers_.push_back(std::move(observer));
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
