// Host cost of slotpool's setCheckpointPoolState binding (graph_state.cpp) on the simulated
// device, without Python: the patterns of benches/gpu/ckpt_state_bench.py. A private pool of N
// live blocks and N holes, checkpointed; half the live blocks die and as many new blocks of other
// sizes are allocated, each with a storage that owns it; then, timed, either the whole binding
// (`set`: the stale storages lose their deleters, the restore, the checks) or the restore alone
// as the binding calls it (`restore`: sp_checkpoint_restore and the delta's lists). Third,
// graph trees' own pattern (`graph_trees`): half the live blocks die and nothing else is
// allocated; the survivors' bare storages take the allocator's deleter from the binding. Built
// and run by `scripts/torch_host_check.sh --bench [N] [REPEATS]`; under `valgrind
// --tool=callgrind` (BENCH_WRAP) its instruction counts are free of the host's noise.
//
// Prints one line per kind: the median and minimum over the repeats, in microseconds, the
// median page faults taken inside the call, and the median of each of the binding's steps
// (the script builds it with SLOTPOOL_TORCH_PHASES, torch_plugin/csrc/phases.h). Last, the
// binding's reading of N/2 Python ints, through PyLong_AsVoidPtr and through pyint.h.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <sys/resource.h>

#include "../csrc/phases.h"
#include "../csrc/pyint.h"
#include "../csrc/slotpool_allocator.h"

#include <c10/core/StorageImpl.h>

#include "torch_stubs.h"

namespace {

using slotpool_torch::SlotpoolAllocator;

// Allocations on a stream go to the pool while it is routed there. The type's name holds
// CUDAGraph, as PyTorch's capture filters' do: the shim then routes by the stream it names
// without asking CUDA for the current one.
struct FakeCUDAGraphFilter {
  cudaStream_t s;
  bool operator()(cudaStream_t t) const { return t == s; }
};

// Minor page faults of the process so far (a fault inside the timed call is part of its time).
long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

struct Sample {
  double us;
  long faults;
  std::vector<std::pair<std::string, double>> steps;  // the binding's (phases.h), in order
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// What a repeat times: the binding over stale storages, the restore alone as the binding calls
// it, or the binding in graph trees' own pattern (no stale storages; bare storages over the
// surviving blocks take the allocator's deleter).
enum class Kind { Set, Restore, GraphTrees };

const char* name(Kind k) {
  return k == Kind::Set ? "set" : k == Kind::Restore ? "restore" : "graph_trees";
}

// One repeat in a fresh pool: the timed call's microseconds and page faults.
Sample one_repeat(SlotpoolAllocator& a, size_t n, int id, Kind kind) {
  auto* s = reinterpret_cast<cudaStream_t>(7);
  const c10::Device dev(c10::DeviceType::CUDA, 1);
  c10::MempoolId_t pool{static_cast<c10::CaptureId_t>(1000 + id), 0};
  a.createOrIncrefPool(1, pool);
  a.beginAllocateToPool(1, pool, FakeCUDAGraphFilter{s});
  std::vector<void*> live;
  for (size_t i = 0; i < 2 * n; ++i) {
    void* p = a.malloc_impl(1, 512 * (i % 13 + 1), s);
    if (i % 2 == 1) {
      live.push_back(p);
    } else {
      a.free_ptr(p, true);
    }
  }
  auto state = a.getCheckpointState(1, pool);
  std::vector<void*> dead;
  for (size_t i = 0; i < live.size(); i += 2) {
    dead.push_back(live[i]);
    a.free_ptr(live[i], true);
  }
  // The storages, spread over the heap as PyTorch's lie among its tensors and Python objects
  // (a filler allocation between two storages): the new blocks' that own them (stale), or
  // graph trees' bare ones over the survivors.
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> owners;
  std::vector<std::unique_ptr<char[]>> filler;
  std::vector<c10::StorageImpl*> stale, add;
  for (size_t i = 0; i < n / 2; ++i) {
    if (kind == Kind::GraphTrees) {
      void* p = live[2 * i + 1];
      owners.push_back(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), 512, c10::DataPtr(p, dev), nullptr, false));
      add.push_back(owners.back().get());
    } else {
      size_t bytes = 512 * ((7 * i) % 11 + 1) + 256;
      void* p = a.malloc_impl(1, bytes, s);
      owners.push_back(c10::make_intrusive<c10::StorageImpl>(
          c10::StorageImpl::use_byte_size_t(), bytes,
          c10::DataPtr(p, p, &slotpool_torch::slotpool_delete, dev), nullptr, false));
      stale.push_back(owners.back().get());
    }
    filler.emplace_back(new char[448]);
  }
  a.endAllocateToPool(1, pool);

  slotpool_torch::phase("start", true);
  const long f0 = minor_faults();
  auto t0 = std::chrono::steady_clock::now();
  if (kind != Kind::Restore) {
    slotpool_torch::set_checkpoint_pool_state(a, 1, state, stale, add);
  } else {
    slotpool_torch::GraphRestore r;
    a.restore_graph_state(slotpool_torch::graph_checkpoint_state(1, state), r);
    for (auto* st : stale) {  // as the binding: their memory is the restore's now
      (void)st->mutable_data_ptr().compare_exchange_deleter(&slotpool_torch::slotpool_delete,
                                                            &c10::detail::deleteNothing);
    }
  }
  auto t1 = std::chrono::steady_clock::now();
  const long faults = minor_faults() - f0;
  Sample out{std::chrono::duration<double, std::micro>(t1 - t0).count(), faults, {}};
#ifdef SLOTPOOL_TORCH_PHASES
  const auto& st = slotpool_torch::phase_stamps();
  for (size_t k = 1; k < st.size(); ++k) {
    out.steps.emplace_back(st[k].first, st[k].second - st[k - 1].second);
  }
#endif

  // Stale storages lost their deleters (dropping them frees nothing); graph trees' took ours
  // (dropping them frees the survivors).
  owners.clear();
  for (void* p : dead) {
    a.free_ptr(p, true);  // the re-created blocks, as graph trees free them
  }
  for (size_t i = 1; kind != Kind::GraphTrees && i < live.size(); i += 2) {
    a.free_ptr(live[i], true);
  }
  state.reset();
  a.releasePool(1, pool);
  return out;
}

// The binding's first step on n Python ints as graph trees pass them (`storage._cdata`: heap
// addresses, each int its own object): PyLong_AsVoidPtr against the read of pyint.h.
void ints(size_t n, int repeats) {
  if (!Py_IsInitialized()) {
    Py_InitializeEx(0);
  }
  std::vector<std::unique_ptr<char[]>> objects;
  PyObject* list = PyList_New(0);
  for (size_t i = 0; i < n; ++i) {
    objects.emplace_back(new char[256]);
    PyObject* v = PyLong_FromVoidPtr(objects.back().get());
    PyList_Append(list, v);
    Py_DECREF(v);
  }
  std::vector<void*> out(n);
  std::vector<double> general, fast;
  for (int r = 0; r <= repeats; ++r) {
    for (bool quick : {false, true}) {
      auto t0 = std::chrono::steady_clock::now();
      for (size_t i = 0; i < n; ++i) {
        PyObject* o = PyList_GET_ITEM(list, static_cast<Py_ssize_t>(i));
        uintptr_t v = 0;
        out[i] = quick && slotpool_torch::int_as_address(o, &v) ? reinterpret_cast<void*>(v)
                                                                 : PyLong_AsVoidPtr(o);
      }
      auto t1 = std::chrono::steady_clock::now();
      if (out[n - 1] != objects[n - 1].get()) {
        std::fprintf(stderr, "graph_state_bench: an int read wrong\n");
        std::exit(1);
      }
      if (r > 0) {  // the first warms up
        const double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
        (quick ? fast : general).push_back(us);
      }
    }
  }
  std::printf("graph_state_bench ints n=%zu pylong_as_void_ptr_us=%.1f int_as_address_us=%.1f\n",
              n, median(general), median(fast));
  Py_DECREF(list);
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 10000;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 9;
  SlotpoolAllocator a(std::string("sim"), std::string("sim_devices:2"));
  a.init(2);
  int id = 0;
  for (Kind kind : {Kind::Set, Kind::Restore, Kind::GraphTrees}) {
    std::vector<double> us, faults;
    std::vector<Sample> kept;
    for (int r = 0; r <= repeats; ++r) {
      Sample t = one_repeat(a, n, id++, kind);
      if (r > 0) {  // the first warms up
        us.push_back(t.us);
        faults.push_back(static_cast<double>(t.faults));
        kept.push_back(std::move(t));
      }
    }
    std::printf(
        "graph_state_bench %s live_blocks=%zu median_us=%.1f min_us=%.1f page_faults=%.0f "
        "repeats=%d",
        name(kind), n, median(us), *std::min_element(us.begin(), us.end()),
        median(faults), repeats);
    // Each step's median, where the binding stamped them (the same steps every call).
    for (size_t k = 0; k < kept[0].steps.size(); ++k) {
      std::vector<double> v;
      for (const Sample& t : kept) {
        v.push_back(k < t.steps.size() ? t.steps[k].second : 0.0);
      }
      std::printf(" %s=%.1f", kept[0].steps[k].first.c_str(), median(v));
    }
    std::printf("\n");
  }
  ints(n / 2, repeats);
  return 0;
}
