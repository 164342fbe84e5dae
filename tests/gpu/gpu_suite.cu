// GPU test suite for slotpool through its C ABI on the CUDA backend (run on the H200 by
// benches/gpu/run.sh; needs a GPU, so CI does not build it).
//
//   nvcc -O2 -std=c++17 -cudart shared -I include tests/gpu/gpu_suite.cu -L DIR -lslotpool \
//        -Xlinker -rpath=DIR -o gpu_suite && SLOTPOOL_BACKEND=cuda ./gpu_suite
//
// Each test prints one JSON line {"test": ..., "ok": ..., ...}; the exit code is the number of
// failed tests.
#include <cuda_runtime.h>
#include <slotpool.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

static int failures = 0;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(100);                                                                    \
    }                                                                                    \
  } while (0)

static void report(const char* test, bool ok, const std::string& extra = "") {
  std::printf("{\"test\": \"%s\", \"ok\": %s%s%s}\n", test, ok ? "true" : "false",
              extra.empty() ? "" : ", ", extra.c_str());
  std::fflush(stdout);
  if (!ok) failures++;
}

static std::string sp_err() { return sp_last_error_message() ? sp_last_error_message() : ""; }

__device__ __forceinline__ uint32_t pat(uint64_t seed, uint64_t i) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + i * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 31;
  return (uint32_t)x;
}

__global__ void fill(uint32_t* p, uint64_t n, uint64_t seed) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    p[i] = pat(seed, i);
}

__global__ void verify(const uint32_t* p, uint64_t n, uint64_t seed, unsigned long long* bad) {
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    if (p[i] != pat(seed, i)) atomicAdd(bad, 1ull);
}

// Spin for about `ns` nanoseconds, then read the first word (keeps the allocation in use).
__global__ void spin_then_read(const uint32_t* p, uint64_t ns, unsigned long long* sink) {
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  uint64_t t = t0;
  while (t - t0 < ns) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  atomicAdd(sink, (unsigned long long)p[0]);
}

static uint64_t S(cudaStream_t s) { return (uint64_t)(uintptr_t)s; }

struct Live {
  void* p;
  size_t size;
  uint64_t seed;
  cudaStream_t stream;
};

// 1. Random alloc / fill / verify / free over 4 streams with cross-stream uses (a slow reader on
// another stream, then record_stream): every word of every allocation is checked by a kernel
// before it is freed and at the end. Early reuse would overwrite words a reader still checks.
static void pattern_integrity_strict() {
  std::vector<cudaStream_t> st(4);
  for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long *bad, *sink;
  CK(cudaMalloc(&bad, sizeof *bad));
  CK(cudaMalloc(&sink, sizeof *sink));
  CK(cudaMemset(bad, 0, sizeof *bad));
  std::mt19937_64 rng(7);
  std::vector<Live> live;
  uint64_t seed = 1000;
  bool ok = true;
  for (int i = 0; i < 4000; i++) {
    if (live.size() < 64 && (rng() % 3 != 0 || live.empty())) {
      size_t size = (rng() % 8 == 0) ? (size_t)(1 + rng() % (32 << 20)) : (size_t)(1 + rng() % (2 << 20));
      size = (size + 3) & ~size_t(3);
      cudaStream_t s = st[rng() % st.size()];
      void* p = nullptr;
      if (sp_alloc(0, size, S(s), &p) != SP_OK) { ok = false; break; }
      fill<<<128, 256, 0, s>>>((uint32_t*)p, size / 4, seed);
      live.push_back({p, size, seed++, s});
    } else {
      size_t k = rng() % live.size();
      Live l = live[k];
      live[k] = live.back();
      live.pop_back();
      cudaStream_t o = st[rng() % st.size()];
      if (o != l.stream && rng() % 3 == 0) {
        cudaEvent_t ev;
        CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
        CK(cudaEventRecord(ev, l.stream));
        CK(cudaStreamWaitEvent(o, ev, 0));
        spin_then_read<<<1, 1, 0, o>>>((const uint32_t*)l.p, 50000, sink);
        verify<<<64, 256, 0, o>>>((const uint32_t*)l.p, l.size / 4, l.seed, bad);
        CK(cudaEventDestroy(ev));
        if (sp_record_stream(l.p, S(o)) != SP_OK) ok = false;
      } else {
        verify<<<128, 256, 0, l.stream>>>((const uint32_t*)l.p, l.size / 4, l.seed, bad);
      }
      if (sp_free(l.p) != SP_OK) { ok = false; break; }
    }
  }
  for (auto& l : live) verify<<<128, 256, 0, l.stream>>>((const uint32_t*)l.p, l.size / 4, l.seed, bad);
  CK(cudaDeviceSynchronize());
  for (auto& l : live) sp_free(l.p);
  unsigned long long h = 0;
  CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaFree(bad));
  CK(cudaFree(sink));
  char buf[128];
  std::snprintf(buf, sizeof buf, "\"mismatched_words\": %llu", h);
  report("pattern_integrity", ok && h == 0, buf);
  for (auto& s : st) CK(cudaStreamDestroy(s));
}

// 2. A block used on another stream is not reused while that stream's work runs, and is reused
// once it completed.
static void cross_stream_reuse_after_events() {
  cudaStream_t a, b;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  unsigned long long* sink;
  CK(cudaMalloc(&sink, sizeof *sink));
  void *x = nullptr, *y = nullptr, *z = nullptr;
  bool ok = sp_alloc(0, 1 << 20, S(a), &x) == SP_OK;
  CK(cudaStreamSynchronize(a));
  spin_then_read<<<1, 1, 0, b>>>((const uint32_t*)x, 200000000ull, sink);  // 200 ms
  ok = ok && sp_record_stream(x, S(b)) == SP_OK && sp_free(x) == SP_OK;
  ok = ok && sp_alloc(0, 1 << 20, S(a), &y) == SP_OK;
  bool b_running = cudaStreamQuery(b) == cudaErrorNotReady;
  bool early = (y == x) && b_running;
  CK(cudaStreamSynchronize(b));
  sp_process_events(0);
  ok = ok && sp_alloc(0, 1 << 20, S(a), &z) == SP_OK;
  bool reused_after = (z == x);
  sp_free(y);
  sp_free(z);
  CK(cudaFree(sink));
  char buf[160];
  std::snprintf(buf, sizeof buf, "\"b_was_running\": %s, \"reused_early\": %s, \"reused_after\": %s",
                b_running ? "true" : "false", early ? "true" : "false", reused_after ? "true" : "false");
  report("cross_stream_reuse_after_events", ok && b_running && !early && reused_after, buf);
  CK(cudaStreamDestroy(a));
  CK(cudaStreamDestroy(b));
}

// 3. Capture routing with a real cudaStreamBeginCapture: allocations of the capturing stream go
// to the capture's pool (growing it during the capture), others to the default pool, and the
// capture stays valid.
static void capture_routing() {
  cudaStream_t s, o;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&o, cudaStreamNonBlocking));
  sp_pool_id pool = {0, 4242};
  sp_memory_stats before;
  sp_memory_stats_get(0, &before);
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus cs;
  unsigned long long id = 0;
  CK(cudaStreamGetCaptureInfo(s, &cs, &id));
  bool ok = sp_begin_allocate_to_pool(0, pool, SP_ROUTE_CAPTURE, id) == SP_OK;
  void *p = nullptr, *q = nullptr, *t = nullptr;
  ok = ok && sp_alloc(0, 24 << 20, S(s), &p) == SP_OK;   // grows the pool during capture
  ok = ok && sp_alloc(0, 1 << 20, S(s), &t) == SP_OK;
  ok = ok && sp_alloc(0, 3 << 20, S(o), &q) == SP_OK;    // not capturing: default pool
  fill<<<128, 256, 0, s>>>((uint32_t*)p, (24 << 20) / 4, 99);
  fill<<<16, 256, 0, s>>>((uint32_t*)t, (1 << 20) / 4, 5);
  ok = ok && sp_free(t) == SP_OK;                          // a free during capture
  cudaGraph_t g;
  cudaError_t end = cudaStreamEndCapture(s, &g);
  ok = ok && end == cudaSuccess;
  ok = ok && sp_end_allocate_to_pool(0, pool) == SP_OK;
  sp_memory_stats ps;
  ok = ok && sp_pool_stats_get(0, pool, &ps) == SP_OK;
  bool routed = ps.allocated_bytes.all.current == (24 << 20);
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, s));
  unsigned long long* bad;
  CK(cudaMalloc(&bad, sizeof *bad));
  CK(cudaMemsetAsync(bad, 0, sizeof *bad, s));
  verify<<<128, 256, 0, s>>>((const uint32_t*)p, (24 << 20) / 4, 99, bad);
  unsigned long long h = 1;
  CK(cudaMemcpyAsync(&h, bad, sizeof h, cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaFree(bad));
  sp_free(p);
  sp_free(q);
  uint64_t left = 0;
  sp_pool_release(0, pool, &left);
  sp_empty_cache(0);
  char buf[200];
  std::snprintf(buf, sizeof buf, "\"end_capture\": \"%s\", \"routed\": %s, \"graph_mismatches\": %llu",
                cudaGetErrorString(end), routed ? "true" : "false", h);
  report("capture_routing", ok && routed && h == 0, buf);
  CK(cudaStreamDestroy(s));
  CK(cudaStreamDestroy(o));
}

// 3b. Graph-retained memory: a graph's temporaries stay mapped while its pool is in use, even when
// the pool then allocates more outside the capture (page reclaim) and the cache is emptied;
// replaying the graph afterwards writes and verifies them without a fault.
static void graph_retained_memory() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  sp_pool_id pool = {0, 4343};
  unsigned long long* bad;
  CK(cudaMalloc(&bad, sizeof *bad));
  CK(cudaMemset(bad, 0, sizeof *bad));
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  cudaStreamCaptureStatus cs;
  unsigned long long id = 0;
  CK(cudaStreamGetCaptureInfo(s, &cs, &id));
  bool ok = sp_begin_allocate_to_pool(0, pool, SP_ROUTE_CAPTURE, id) == SP_OK;
  void *t = nullptr, *o = nullptr;
  ok = ok && sp_alloc(0, 8 << 20, S(s), &t) == SP_OK;  // a temporary of the graph
  ok = ok && sp_alloc(0, 4 << 20, S(s), &o) == SP_OK;  // its output
  fill<<<64, 256, 0, s>>>((uint32_t*)t, (8 << 20) / 4, 7);
  verify<<<64, 256, 0, s>>>((const uint32_t*)t, (8 << 20) / 4, 7, bad);
  fill<<<64, 256, 0, s>>>((uint32_t*)o, (4 << 20) / 4, 8);
  ok = ok && sp_free(t) == SP_OK;
  cudaGraph_t g;
  ok = ok && cudaStreamEndCapture(s, &g) == cudaSuccess;
  ok = ok && sp_end_allocate_to_pool(0, pool) == SP_OK;
  uint64_t retained_before = 0;
  sp_memory_stats ps;
  ok = ok && sp_pool_stats_get(0, pool, &ps) == SP_OK;
  retained_before = (uint64_t)ps.reserved_bytes.all.current;
  // Outside the capture, the pool grows past its idle pages (before graph-retained memory existed,
  // this moved the temporary's idle pages here), then every cache is emptied.
  void* big = nullptr;
  ok = ok && sp_pool_alloc(0, pool, 64 << 20, S(s), &big) == SP_OK;
  fill<<<128, 256, 0, s>>>((uint32_t*)big, (64 << 20) / 4, 9);
  CK(cudaStreamSynchronize(s));
  ok = ok && sp_free(big) == SP_OK;
  ok = ok && sp_pool_empty_cache(0, pool) == SP_OK && sp_empty_cache(0) == SP_OK;
  ok = ok && sp_pool_stats_get(0, pool, &ps) == SP_OK;
  uint64_t retained_after = (uint64_t)ps.reserved_bytes.all.current;
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  cudaError_t run = cudaSuccess;
  for (int i = 0; i < 3 && run == cudaSuccess; ++i) {
    run = cudaGraphLaunch(ge, s);
    if (run == cudaSuccess) run = cudaStreamSynchronize(s);
  }
  unsigned long long h = 1;
  if (run == cudaSuccess) CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaFree(bad));
  sp_free(o);
  uint64_t left = 0;
  sp_pool_release(0, pool, &left);
  sp_empty_cache(0);
  char buf[240];
  std::snprintf(buf, sizeof buf,
                "\"replay\": \"%s\", \"mismatches\": %llu, \"pool_reserved_before\": %llu, "
                "\"pool_reserved_after_empty_cache\": %llu",
                cudaGetErrorString(run), h, (unsigned long long)retained_before,
                (unsigned long long)retained_after);
  report("graph_retained_memory",
         ok && run == cudaSuccess && h == 0 && retained_after >= (12ull << 20), buf);
  CK(cudaStreamDestroy(s));
}

// 4. vmm page reuse under load: reserved memory follows live bytes while kernels keep writing.
static void vmm_page_reuse() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  sp_empty_cache(0);
  sp_reset_peak_stats(0);
  std::mt19937_64 rng(3);
  std::vector<void*> live;
  size_t live_bytes = 0, max_live = 0;
  std::vector<size_t> sizes;
  bool ok = true;
  for (int i = 0; i < 400; i++) {
    if (live.size() < 6 || rng() % 2) {
      size_t size = (size_t)(8 + rng() % 120) << 20;
      void* p = nullptr;
      if (sp_alloc(0, size, S(s), &p) != SP_OK) { ok = false; break; }
      fill<<<256, 256, 0, s>>>((uint32_t*)p, size / 4, i);
      live.push_back(p);
      sizes.push_back(size);
      live_bytes += size;
      if (live_bytes > max_live) max_live = live_bytes;
    }
    if (live.size() > 6) {
      size_t k = rng() % live.size();
      sp_free(live[k]);
      live_bytes -= sizes[k];
      live[k] = live.back(); live.pop_back();
      sizes[k] = sizes.back(); sizes.pop_back();
    }
  }
  CK(cudaStreamSynchronize(s));
  sp_memory_stats ms;
  sp_memory_stats_get(0, &ms);
  for (auto p : live) sp_free(p);
  double ratio = (double)ms.reserved_bytes.all.peak / (double)max_live;
  char buf[200];
  std::snprintf(buf, sizeof buf, "\"peak_reserved\": %lld, \"peak_live\": %zu, \"ratio\": %.3f",
                (long long)ms.reserved_bytes.all.peak, max_live, ratio);
  report("vmm_page_reuse", ok && ratio < 1.25, buf);
  CK(cudaStreamDestroy(s));
}

// 5. OOM at a byte limit leaves the state consistent, and memory comes back after frees.
static void oom_at_limit() {
  sp_empty_cache(0);
  uint64_t old_limit = 0, total = 0;
  sp_memory_limit_get(0, &old_limit, &total);
  bool ok = sp_set_memory_limit(0, 256ull << 20) == SP_OK;
  std::vector<void*> v;
  sp_status st = SP_OK;
  for (int i = 0; i < 64; i++) {
    void* p = nullptr;
    st = sp_alloc(0, 30 << 20, 0, &p);
    if (st != SP_OK) break;
    v.push_back(p);
  }
  std::string msg = sp_err();
  sp_memory_stats ms;
  sp_memory_stats_get(0, &ms);
  bool consistent = ms.allocated_bytes.all.current == (int64_t)v.size() * (30 << 20) && ms.num_ooms >= 1;
  for (auto p : v) sp_free(p);
  void* big = nullptr;
  bool back = sp_alloc(0, 200 << 20, 0, &big) == SP_OK;
  if (big) sp_free(big);
  sp_set_memory_limit(0, old_limit);
  sp_empty_cache(0);
  char buf[400];
  std::snprintf(buf, sizeof buf, "\"allocated_before_oom\": %zu, \"status\": %d, \"consistent\": %s, \"after_free\": %s",
                v.size(), (int)st, consistent ? "true" : "false", back ? "true" : "false");
  report("oom_at_limit", ok && st == SP_ERR_OUT_OF_MEMORY && v.size() >= 7 && v.size() <= 8 && consistent && back, buf);
}

// 6. Host cost: alloc + free pairs of 1 MiB, one thread, and 16 threads on 16 streams.
// A spinner: integer work on its own registers, sharing no memory, until `stop`.
static void spin(const std::atomic<bool>& stop, uint64_t x) {
  while (!stop.load(std::memory_order_relaxed))
    for (int i = 0; i < 1000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
  if (x == 42) std::printf(" ");  // keeps the loop from being optimized out
}

// `spinners` threads spin beside the measured ones: one thread beside 15 spinners is the single
// thread of a host whose cores are all busy, as they are in the 16-thread run (the H200 host runs
// a lone busy core up to twice as fast; docs/performance.md, "Noise").
static double pairs_ns(int threads, int iters, size_t size, int spinners = 0) {
  std::atomic<bool> stop{false};
  std::vector<std::thread> spin_threads;
  for (int i = 0; i < spinners; i++) spin_threads.emplace_back(spin, std::cref(stop), uint64_t(i + 1));
  std::vector<cudaStream_t> st(threads);
  for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (auto& s : st) { void* p; sp_alloc(0, size, S(s), &p); sp_free(p); }
  // Every thread is started and waiting before the clock starts: thread creation is not timed.
  std::atomic<int> ready{0}, go{0};
  std::vector<std::thread> th;
  for (int t = 0; t < threads; t++)
    th.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {}
      for (int i = 0; i < iters; i++) { void* p; sp_alloc(0, size, S(st[t]), &p); sp_free(p); }
    });
  while (ready.load() < threads) {}
  auto t0 = std::chrono::steady_clock::now();
  go.store(1, std::memory_order_release);
  for (auto& x : th) x.join();
  auto t1 = std::chrono::steady_clock::now();
  for (auto& s : st) CK(cudaStreamDestroy(s));
  stop.store(true);
  for (auto& x : spin_threads) x.join();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / iters;  // wall ns per pair per thread
}

// The median of five runs: the host's speed drifts between runs.
static double median_pairs_ns(int threads, int iters, size_t size, int spinners = 0) {
  double v[5];
  for (double& x : v) x = pairs_ns(threads, iters, size, spinners);
  std::sort(v, v + 5);
  return v[2];
}

// One thread alone, one thread beside 15 spinners, and 16 threads, each on its own stream: ns per
// pair per thread (medians of five runs), and 16 threads' throughput against each single thread.
struct Scaling {
  double one, busy, sixteen;
  double speedup() const { return 16.0 * one / sixteen; }
  double speedup_busy() const { return 16.0 * busy / sixteen; }
  std::string json() const {
    char buf[300];
    std::snprintf(buf, sizeof buf,
                  "\"ns_per_pair_1t\": %.1f, \"ns_per_pair_1t_beside_spinners\": %.1f, \"ns_per_pair_16t\": %.1f, "
                  "\"aggregate_speedup_16t\": %.2f, \"speedup_vs_1t_beside_spinners\": %.2f",
                  one, busy, sixteen, speedup(), speedup_busy());
    return buf;
  }
};

static Scaling scaling(size_t size, int iters_one, int iters_each) {
  return Scaling{median_pairs_ns(1, iters_one, size), median_pairs_ns(1, iters_one, size, 15),
                 median_pairs_ns(16, iters_each, size)};
}

// The size of PyTorch's 16-thread baseline (docs/performance.md): the targets, one thread
// <= 100 ns a pair and 16 threads >= 8x one thread, against the plain single thread.
static void host_cost() {
  Scaling s = scaling(1 << 20, 2000000, 500000);
  report("host_cost", s.one <= 100.0 && s.speedup() >= 8.0, s.json());
}

// 7. Large pairs (64 MiB): beyond a shard's credit, so each pair spends the shard's lease; before
// leases, every thread wrote one device-wide counter and 16 threads scaled 1.4-2.3x.
static void host_cost_large() {
  Scaling s = scaling(64 << 20, 200000, 50000);
  // What this test guards is contention: a device-wide counter made 16 threads 1.4-2.3x one.
  // It asks for 6x against both single-thread figures. This host runs one thread's 64 MiB pairs
  // in one of two modes, about 2x apart, from run to run, alone or beside spinners alike (on
  // 2026-11-30, 16 threads against one came out 7.09-13.2x for one library), so an 8x bar here
  // fails by the host's draw; the 8x target is asserted at 1 MiB (host_cost).
  report("host_cost_64MiB", s.speedup() >= 6.0 && s.speedup_busy() >= 6.0, s.json());
}

// 8. Peer access (two GPUs): kernels on device 1 read device 0's vmm memory, mapped before and
// after sp_enable_peer_access(0, 1), and find every word; device 1's own memory is filled from
// device 0 the other way round. Skipped with one device.
static void peer_access() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  int can = 0;
  if (n >= 2) CK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (n < 2 || !can) {
    report("peer_access", true, n < 2 ? "\"skipped\": \"one device\"" : "\"skipped\": \"no peer access between 0 and 1\"");
    return;
  }
  const size_t before_sz = 24 << 20, after_sz = 40 << 20, own_sz = 8 << 20;
  CK(cudaSetDevice(0));
  void *before = nullptr, *after = nullptr, *own = nullptr;
  bool ok = sp_alloc(0, before_sz, 0, &before) == SP_OK;
  if (ok) fill<<<256, 256>>>((uint32_t*)before, before_sz / 4, 11);
  sp_status grant = sp_enable_peer_access(0, 1);
  sp_status back = sp_enable_peer_access(1, 0);
  ok = ok && grant == SP_OK && back == SP_OK && sp_alloc(0, after_sz, 0, &after) == SP_OK;
  if (ok) fill<<<256, 256>>>((uint32_t*)after, after_sz / 4, 12);
  CK(cudaDeviceSynchronize());
  CK(cudaSetDevice(1));
  ok = ok && sp_alloc(1, own_sz, 0, &own) == SP_OK;
  unsigned long long* bad = nullptr;
  CK(cudaMalloc(&bad, sizeof *bad));
  CK(cudaMemset(bad, 0, sizeof *bad));
  cudaError_t kerr = cudaSuccess;
  if (ok) {
    verify<<<256, 256>>>((const uint32_t*)before, before_sz / 4, 11, bad);
    verify<<<256, 256>>>((const uint32_t*)after, after_sz / 4, 12, bad);
    kerr = cudaDeviceSynchronize();
  }
  unsigned long long h = 0;
  if (kerr == cudaSuccess) CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
  // Device 0 writes device 1's slotpool memory; device 1 checks it.
  if (ok && kerr == cudaSuccess) {
    CK(cudaSetDevice(0));
    fill<<<256, 256>>>((uint32_t*)own, own_sz / 4, 13);
    kerr = cudaDeviceSynchronize();
    CK(cudaSetDevice(1));
    if (kerr == cudaSuccess) {
      verify<<<256, 256>>>((const uint32_t*)own, own_sz / 4, 13, bad);
      kerr = cudaDeviceSynchronize();
      if (kerr == cudaSuccess) CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
    }
  }
  cudaFree(bad);
  if (own) sp_free(own);
  CK(cudaSetDevice(0));
  if (before) sp_free(before);
  if (after) sp_free(after);
  char buf[300];
  std::snprintf(buf, sizeof buf, "\"grant\": %d, \"grant_back\": %d, \"kernel\": \"%s\", \"mismatched_words\": %llu",
                (int)grant, (int)back, cudaGetErrorString(kerr), h);
  report("peer_access", ok && kerr == cudaSuccess && h == 0, buf);
}

int main() {
  // Physical memory follows live bytes exactly (no slack, 2 MiB pages, not the defaults): the
  // page-reuse and OOM tests below are written for it, and it moves pages the most.
  if (sp_init(getenv("SLOTPOOL_BACKEND") ? getenv("SLOTPOOL_BACKEND") : "cuda",
              "vmm_slack_percent:0,vmm_page_mb:2") != SP_OK) {
    std::printf("{\"test\": \"init\", \"ok\": false, \"error\": \"%s\"}\n", sp_err().c_str());
    return 1;
  }
  const char* name = nullptr;
  sp_backend_name(&name);
  std::printf("{\"test\": \"init\", \"ok\": true, \"backend\": \"%s\"}\n", name ? name : "?");
  CK(cudaFree(0));
  auto invariants = [](const char* after) {
    sp_status st = sp_check_invariants(0);
    std::string extra = std::string("\"after\": \"") + after + "\"";
    if (st != SP_OK) extra += ", \"error\": \"" + sp_err() + "\"";
    report("invariants", st == SP_OK, extra);
  };
  pattern_integrity_strict();
  invariants("pattern_integrity");
  cross_stream_reuse_after_events();
  invariants("cross_stream_reuse_after_events");
  vmm_page_reuse();
  invariants("vmm_page_reuse");
  oom_at_limit();
  invariants("oom_at_limit");
  host_cost();
  host_cost_large();
  invariants("host_cost_64MiB");
  peer_access();
  invariants("peer_access");
  capture_routing();
  invariants("capture_routing");
  graph_retained_memory();
  invariants("graph_retained_memory");
  std::printf("{\"test\": \"summary\", \"failed\": %d}\n", failures);
  return failures;
}
