// Host checks of the shim's C++ conversions, with no GPU: the allocator runs on slotpool's
// simulated device (backend "sim") and is called directly, never installed into PyTorch, so no
// CUDA call is made. Built and run by scripts/torch_host_check.sh against the headers and c10
// libraries of the torch wheel; the GPU API checks (benches/gpu/torch_scenarios.py) cover the rest.
//
// Exit status 0 when every check passes; each failure prints one line.

#include <cstdio>
#include <string>
#include <vector>

#include "../csrc/slotpool_allocator.h"

// Symbols of libtorch_cuda / libtorch_python the shim references but these checks never reach
// (installing the allocator, Python bindings): defined here so that only c10 is needed.
namespace torch::cuda::CUDAPluggableAllocator {
void changeCurrentAllocator(
    const std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator>&) {
  std::fprintf(stderr, "host_check: changeCurrentAllocator called\n");
  std::abort();
}
}  // namespace torch::cuda::CUDAPluggableAllocator

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

void* sp_alloc_or_die(size_t size) {
  void* p = nullptr;
  slotpool_torch::check(sp_alloc(0, size, 7, &p), "sp_alloc");
  return p;
}

}  // namespace

int main() {
  slotpool_torch::SlotpoolAllocator a(std::string("sim"), std::string("sim_devices:2"));
  a.init(2);

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

  // Stop: nothing new; clear_history forgets.
  a.recordHistory(false, nullptr, 0, c10::CachingDeviceAllocator::RecordContext::NEVER, false, {});
  expect(!a.isHistoryEnabled(), "isHistoryEnabled after recordHistory(false)");
  void* r = sp_alloc_or_die(3000);
  slotpool_torch::check(sp_free(r), "sp_free");
  snap = a.snapshot({0, 0}, true);
  expect(count(snap.device_traces[0], Action::ALLOC, p) == 1, "entries stay after stopping");
  expect(count(snap.device_traces[0], Action::ALLOC, r) == (r == p ? 1u : 0u),
         "no entry after stopping");
  a.recordHistory(false, nullptr, 0, c10::CachingDeviceAllocator::RecordContext::NEVER, true, {});
  snap = a.snapshot({0, 0}, true);
  expect(snap.device_traces[0].empty() && snap.device_traces[1].empty(), "clearHistory forgets");

  if (failures == 0) {
    std::printf("host_check: all passed\n");
  }
  return failures == 0 ? 0 : 1;
}
