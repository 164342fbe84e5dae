"""Host-side latency of allocator calls on the GPU machine, slotpool side by side with PyTorch.

PyTorch's allocators are measured as in the baseline figures of benches/traces/README.md;
kind 3 is slotpool through its C ABI (libslotpool.so, dlopen'ed from $SLOTPOOL_LIB, CUDA
backend), measured in the same process and run as the others.

Measures, in one process, ns per (alloc, free) for:
  native  - PyTorch's CUDACachingAllocator via raw_alloc_with_stream/raw_delete
  async   - cudaMallocAsync/cudaFreeAsync on the device's default mem pool (release threshold = max)
  cudamalloc - raw cudaMalloc/cudaFree (uncached; fewer iterations)
Patterns: 'same' (one size repeatedly), 'mixed' (random sizes 512 B..64 MiB, up to 64 live, random frees),
and multithreaded 'same' with T threads (each thread its own stream for async; default stream for native).
Env: KINDS (0,1,3), ALLOC_BENCH_REPS (5), ALLOC_BENCH_ONLY=mixed (the mixed pattern alone, to compare
two builds of libslotpool.so quickly), OUT.
"""
import os, sys, json, time
import torch
from torch.utils.cpp_extension import load_inline

src = r'''
#include <torch/extension.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <chrono>
#include <thread>
#include <vector>
#include <random>
#include <atomic>
#include <dlfcn.h>
#include <cmath>

typedef int (*sp_alloc_t)(int, size_t, uint64_t, void**);
typedef int (*sp_free_t)(void*);
typedef int (*sp_init_t)(const char*, const char*);
static sp_alloc_t sp_alloc_fn = nullptr;
static sp_free_t sp_free_fn = nullptr;

int64_t sp_load(std::string path) {
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!h) throw std::runtime_error(std::string("dlopen: ") + dlerror());
  auto init = (sp_init_t)dlsym(h, "sp_init");
  sp_alloc_fn = (sp_alloc_t)dlsym(h, "sp_alloc");
  sp_free_fn = (sp_free_t)dlsym(h, "sp_free");
  if (!init || !sp_alloc_fn || !sp_free_fn) throw std::runtime_error("missing sp_ symbols");
  return init("cuda", "");
}

using clk = std::chrono::steady_clock;
namespace A = c10::cuda::CUDACachingAllocator;

static void* do_alloc(int kind, size_t sz, cudaStream_t s) {
  void* p = nullptr;
  if (kind == 0) return A::raw_alloc_with_stream(sz, s);
  if (kind == 1) { if (cudaMallocAsync(&p, sz, s) != cudaSuccess) throw std::runtime_error("cudaMallocAsync"); return p; }
  if (kind == 3) { if (sp_alloc_fn(0, sz, (uint64_t)(uintptr_t)s, &p) != 0) throw std::runtime_error("sp_alloc"); return p; }
  if (cudaMalloc(&p, sz) != cudaSuccess) throw std::runtime_error("cudaMalloc");
  return p;
}
static void do_free(int kind, void* p, cudaStream_t s) {
  if (kind == 0) { A::raw_delete(p); return; }
  if (kind == 1) { cudaFreeAsync(p, s); return; }
  if (kind == 3) { sp_free_fn(p); return; }
  cudaFree(p);
}

// A spinner: integer work on its own registers, sharing no memory, until `stop`.
static void spin(const std::atomic<bool>* stop, uint64_t x) {
  while (!stop->load(std::memory_order_relaxed))
    for (int i = 0; i < 1000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
  if (x == 42) printf(" ");
}

// same size alloc+free pairs, T threads; returns ns per pair (wall / (iters*T)). `spinners`
// threads spin beside them: one thread beside 15 spinners is one thread on a host whose cores
// are all busy, as in the 16-thread run (this host runs a lone busy core up to ~1.8x faster).
double bench_same(int kind, int64_t iters, int64_t size, int threads, int spinners) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spin_threads;
  for (int i = 0; i < spinners; i++) spin_threads.emplace_back(spin, &stop, uint64_t(i + 1));
  cudaMemPool_t pool; cudaDeviceGetDefaultMemPool(&pool, 0);
  uint64_t thr = UINT64_MAX; cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &thr);
  std::vector<cudaStream_t> streams(threads);
  for (int t = 0; t < threads; t++) {
    if (kind == 0) streams[t] = c10::cuda::getStreamFromPool(false, 0).stream();
    else cudaStreamCreateWithFlags(&streams[t], cudaStreamNonBlocking);
  }
  // warm
  for (int t = 0; t < threads; t++) { void* p = do_alloc(kind, size, streams[t]); do_free(kind, p, streams[t]); }
  cudaDeviceSynchronize();
  // Every thread is started and waiting before the clock starts: thread creation is not timed.
  std::atomic<int> ready{0}, go{0};
  std::vector<std::thread> th;
  for (int t = 0; t < threads; t++) th.emplace_back([&, t]{
    ready.fetch_add(1);
    while (!go.load(std::memory_order_acquire)) {}
    for (int64_t i = 0; i < iters; i++) { void* p = do_alloc(kind, size, streams[t]); do_free(kind, p, streams[t]); }
  });
  while (ready.load() < threads) {}
  auto t0 = clk::now();
  go.store(1, std::memory_order_release);
  for (auto& x : th) x.join();
  auto t1 = clk::now();
  cudaDeviceSynchronize();
  stop.store(true);
  for (auto& x : spin_threads) x.join();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(iters * threads);
}

// mixed sizes, up to `live` outstanding, single thread; ns per op-pair
double bench_mixed(int kind, int64_t iters, int live, uint64_t seed) {
  cudaStream_t s;
  if (kind == 0) s = c10::cuda::getCurrentCUDAStream(0).stream(); else cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> lg(9.0, 26.0); // 512 B .. 64 MiB log-uniform
  std::vector<void*> ptrs;
  auto one = [&]() {
    if ((int)ptrs.size() >= live || (!ptrs.empty() && (rng() & 1))) {
      size_t j = rng() % ptrs.size(); do_free(kind, ptrs[j], s); ptrs[j] = ptrs.back(); ptrs.pop_back();
    } else {
      size_t sz = (size_t)std::pow(2.0, lg(rng)); ptrs.push_back(do_alloc(kind, sz, s));
    }
  };
  for (int64_t i = 0; i < 20000; i++) one();
  cudaDeviceSynchronize();
  auto t0 = clk::now();
  for (int64_t i = 0; i < iters * 2; i++) one();
  auto t1 = clk::now();
  for (auto p : ptrs) do_free(kind, p, s);
  cudaDeviceSynchronize();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / double(iters);
}
'''
cpp_decl = "double bench_same(int kind, int64_t iters, int64_t size, int threads, int spinners); double bench_mixed(int kind, int64_t iters, int live, uint64_t seed); int64_t sp_load(std::string path);"

t0 = time.time()
m = load_inline(name="alloc_bench", cpp_sources=[cpp_decl], cuda_sources=[src],
                functions=["bench_same", "bench_mixed", "sp_load"], extra_cuda_cflags=["-O3"], verbose=False)
print(f"built in {time.time()-t0:.1f}s", flush=True)
torch.cuda.init(); torch.empty(1, device="cuda")
res = {}
rc = m.sp_load(os.environ["SLOTPOOL_LIB"])
assert rc == 0, f"sp_init failed: {rc}"
names = {0: "native", 1: "async", 2: "cudamalloc", 3: "slotpool"}
REPS = int(os.environ.get("ALLOC_BENCH_REPS", "5"))


def median(vals):
    v = sorted(vals)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
kinds = [int(k) for k in os.environ.get("KINDS", "0,1,3").split(",")]
for kind in kinds:
    # slotpool's pairs are ~30x cheaper: more of them, so that each run lasts as long.
    it = {2: 2000, 3: 2000000}.get(kind, 200000)
    reps = REPS if kind == 3 else 3
    # ALLOC_BENCH_ONLY=mixed: the mixed-size pattern alone (to compare two builds quickly).
    for size in (4096, 1 << 20, 64 << 20) if os.environ.get("ALLOC_BENCH_ONLY") != "mixed" else ():
        for threads in ((1, 4, 16) if kind != 2 else (1,)):
            # The median of `reps` runs (the host's speed drifts between runs).
            vals = [m.bench_same(kind, it // max(1, threads // 4), size, threads, 0) for _ in range(reps)]
            res[f"{names[kind]}/same/{size}/t{threads}"] = median(vals)
            # The fastest run: the cost when the (shared, virtualised) host is undisturbed.
            res[f"{names[kind]}/same/{size}/t{threads}/best"] = min(vals)
            print(names[kind], "same", size, "t", threads, f"{median(vals):.1f} ns/pair", [round(v,1) for v in vals], flush=True)
        if kind != 2:
            # One thread beside 15 spinners: the single-thread baseline on an equally busy host.
            vals = [m.bench_same(kind, it, size, 1, 15) for _ in range(reps)]
            res[f"{names[kind]}/same/{size}/t1_beside_15_spinners"] = median(vals)
            print(names[kind], "same", size, "t 1 beside 15 spinners", f"{median(vals):.1f} ns/pair", [round(v,1) for v in vals], flush=True)
    if kind != 2:
        vals = [m.bench_mixed(kind, 200000, 64, 7) for _ in range(3)]
        res[f"{names[kind]}/mixed64"] = sorted(vals)[1]
        print(names[kind], "mixed64", f"{sorted(vals)[1]:.1f} ns/pair", [round(v,1) for v in vals], flush=True)
# python-level torch.empty for reference
x = None
for sz in (4096, 1 << 20) if os.environ.get("ALLOC_BENCH_ONLY") != "mixed" else ():
    n = 100000
    t = time.perf_counter()
    for _ in range(n):
        x = torch.empty(sz, dtype=torch.uint8, device="cuda"); del x
    res[f"torch.empty/{sz}"] = (time.perf_counter() - t) / n * 1e9
    print("torch.empty", sz, f"{res[f'torch.empty/{sz}']:.1f} ns", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "alloc_bench.json"), "w"), indent=1)
