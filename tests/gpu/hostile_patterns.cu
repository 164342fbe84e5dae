// Hostile-use pattern run on the CUDA backend, through the C ABI: random sequences of allocations,
// frees, cross-thread frees, checkpoint / restore, empty_cache and memory pressure, with every
// allocation filled with its own 32-bit pattern (cuMemsetD32Async) and read back on the GPU
// before it is freed, after every restore and after every empty_cache.
//
//   nvcc -O2 -std=c++17 -cudart shared -I include tests/gpu/hostile_patterns.cu -L DIR
//        -lslotpool -lcuda -Xlinker -rpath=DIR -o hostile_patterns   (one command)
//   ./hostile_patterns CONF [THREADS=8] [OPS_PER_THREAD=20000] [LIMIT_MB=1536]
//
// CONF is the configuration string given to sp_init (e.g. "growth:vmm,vmm_page_mb:2" or
// "growth:classic"). Each thread works on its own stream and its own pool, and on the default
// pool; a thread hands some of its allocations to another thread, which reads them back and
// frees them on its own stream (sp_record_stream). One JSON line is printed at the end; the exit
// code is non-zero when a word was wrong, an unexpected call failed, or the allocator's state
// did not come back to empty.
#include <cuda.h>
#include <cuda_runtime.h>
#include <slotpool.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(100);                                                                         \
    }                                                                                         \
  } while (0)

// Counts the words of p[0..n) that differ from v.
__global__ void count_wrong(const uint32_t* p, uint64_t n, uint32_t v, unsigned long long* bad) {
  unsigned long long local = 0;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
       i += (uint64_t)gridDim.x * blockDim.x)
    local += p[i] != v;
  if (local) atomicAdd(bad, local);
}

struct Live {
  void* p;
  size_t size;
  uint32_t value;
  bool pooled;
};

struct Handoff {
  void* p;
  size_t size;
  uint32_t value;
};

static std::mutex handoff_mu;
static std::deque<Handoff> handoffs;

static std::atomic<uint64_t> n_alloc{0}, n_free{0}, n_handoff{0}, n_restore{0}, n_empty{0},
    n_oom{0}, n_api_errors{0}, n_verified_bytes{0}, n_corrupt_words{0}, n_ops{0};
static std::mutex err_mu;
static std::string first_error;

static void api_error(const char* what, sp_status st) {
  n_api_errors++;
  std::lock_guard<std::mutex> g(err_mu);
  if (first_error.empty()) {
    first_error = std::string(what) + " -> " + std::to_string((int)st) + ": " +
                  (sp_last_error_message() ? sp_last_error_message() : "");
    std::fprintf(stderr, "first unexpected error: %s\n", first_error.c_str());
  }
}

struct Worker {
  int t;
  cudaStream_t s;
  sp_pool_id pool;
  unsigned long long* bad;  // device counter of wrong words (plain cudaMalloc)
  std::mt19937_64 rng;
  std::vector<Live> live;
  uint32_t next_value;

  uint64_t S() const { return (uint64_t)(uintptr_t)s; }

  size_t pick_size() {
    uint64_t r = rng() % 100;
    size_t lo, hi;
    if (r < 70) lo = 512, hi = 256 << 10;
    else if (r < 95) lo = 256 << 10, hi = 8 << 20;
    else lo = 8 << 20, hi = 64 << 20;
    size_t sz = lo + rng() % (hi - lo);
    return sz & ~(size_t)3;
  }

  uint32_t fresh_value() { return (uint32_t)(t * 0x9E3779B9u) ^ (next_value++ * 0x85EBCA6Bu) ^ 1u; }

  void fill(void* p, size_t size, uint32_t v) {
    if (cuMemsetD32Async((CUdeviceptr)(uintptr_t)p, v, size / 4, (CUstream)s) != CUDA_SUCCESS) {
      std::fprintf(stderr, "cuMemsetD32Async failed\n");
      std::exit(101);
    }
  }

  // Enqueues a read-back of p on stream `on`; wrong words land in this worker's counter.
  void verify(void* p, size_t size, uint32_t v, cudaStream_t on) {
    uint64_t n = size / 4;
    unsigned blocks = (unsigned)std::min<uint64_t>(1024, (n + 255) / 256);
    count_wrong<<<blocks ? blocks : 1, 256, 0, on>>>((const uint32_t*)p, n, v, bad);
    n_verified_bytes += size;
  }

  void verify_all() {
    for (auto& l : live) verify(l.p, l.size, l.value, s);
  }

  bool alloc_one(bool pooled, Live* out) {
    size_t sz = pick_size();
    void* p = nullptr;
    sp_status st = pooled ? sp_pool_alloc(0, pool, sz, S(), &p) : sp_alloc(0, sz, S(), &p);
    if (st == SP_ERR_OUT_OF_MEMORY) {
      n_oom++;
      return false;
    }
    if (st != SP_OK) {
      api_error(pooled ? "sp_pool_alloc" : "sp_alloc", st);
      return false;
    }
    uint32_t v = fresh_value();
    fill(p, sz, v);
    *out = Live{p, sz, v, pooled};
    n_alloc++;
    return true;
  }

  void free_at(size_t i) {
    Live l = live[i];
    live[i] = live.back();
    live.pop_back();
    verify(l.p, l.size, l.value, s);
    sp_status st = sp_free(l.p);
    if (st != SP_OK) api_error("sp_free", st);
    n_free++;
  }

  // Checkpoint the pool, allocate and free in it, free one allocation the checkpoint holds, and
  // restore: what was made since is freed, the freed one is re-created at its address, and every
  // other allocation keeps its bytes.
  void checkpoint_cycle() {
    sp_checkpoint* cp = nullptr;
    sp_status st = sp_checkpoint_take(0, pool, &cp);
    if (st != SP_OK) {
      api_error("sp_checkpoint_take", st);
      return;
    }
    std::vector<Live> held;  // pool allocations the checkpoint holds, still live
    std::vector<Live> rest;
    for (auto& l : live) (l.pooled ? held : rest).push_back(l);
    Live gone{};
    bool freed_held = false;
    if (!held.empty() && rng() % 2) {
      size_t k = rng() % held.size();
      gone = held[k];
      held[k] = held.back();
      held.pop_back();
      verify(gone.p, gone.size, gone.value, s);
      if ((st = sp_free(gone.p)) != SP_OK) api_error("sp_free (checkpointed)", st);
      freed_held = true;
    }
    std::vector<Live> fresh;  // made since the checkpoint: the restore frees them
    size_t n_new = 1 + rng() % 8;
    for (size_t i = 0; i < n_new; i++) {
      Live l;
      if (alloc_one(true, &l)) fresh.push_back(l);
    }
    std::vector<void*> keep;
    for (auto& l : held) keep.push_back(l.p);
    sp_restore_delta* d = nullptr;
    st = sp_checkpoint_restore(cp, keep.data(), keep.size(), &d);
    live = rest;
    for (auto& l : held) live.push_back(l);
    if (st != SP_OK) {
      // Refused: nothing changed, so what was made since is still live and ours.
      api_error("sp_checkpoint_restore", st);
      for (auto& l : fresh) live.push_back(l);
      sp_checkpoint_free(cp);
      return;
    }
    n_restore++;
    // The contract: the checkpoint's allocations are live again (the freed one re-created at its
    // address, its contents undefined) and everything made since is gone, whatever the delta says.
    if (freed_held) {
      gone.value = fresh_value();
      fill(gone.p, gone.size, gone.value);
      live.push_back(gone);
    }
    size_t freed = sp_delta_freed_count(d), created = sp_delta_created_count(d);
    if (freed != fresh.size() || created != (freed_held ? 1u : 0u)) {
      char m[160];
      std::snprintf(m, sizeof m, "restore delta counts: freed %zu of %zu made, created %zu of %d", freed,
                    fresh.size(), created, freed_held ? 1 : 0);
      api_error(m, SP_OK);
    }
    if (freed_held && created == 1) {
      void* p = nullptr;
      size_t sz = 0;
      if (sp_delta_created(d, 0, &p, &sz) != SP_OK || p != gone.p) api_error("re-created address", SP_OK);
    }
    sp_delta_free(d);
    sp_checkpoint_free(cp);
    verify_all();
  }

  void drain_handoffs(size_t max) {
    for (size_t i = 0; i < max; i++) {
      Handoff h;
      {
        std::lock_guard<std::mutex> g(handoff_mu);
        if (handoffs.empty()) return;
        h = handoffs.front();
        handoffs.pop_front();
      }
      verify(h.p, h.size, h.value, s);
      sp_status st = sp_record_stream(h.p, S());
      if (st != SP_OK) api_error("sp_record_stream", st);
      if ((st = sp_free(h.p)) != SP_OK) api_error("sp_free (handed over)", st);
      n_free++;
    }
  }

  void step() {
    uint64_t r = rng() % 1000;
    if (r < 400 && live.size() < 48) {
      Live l;
      if (alloc_one(rng() % 3 == 0, &l)) live.push_back(l);
    } else if (r < 750) {
      if (!live.empty()) free_at(rng() % live.size());
    } else if (r < 800) {
      // Hand a default-pool allocation to whichever thread drains next.
      for (size_t i = 0; i < live.size(); i++) {
        if (live[i].pooled) continue;
        Live l = live[i];
        live[i] = live.back();
        live.pop_back();
        CK(cudaStreamSynchronize(s));  // the fill is done before another stream reads it
        std::lock_guard<std::mutex> g(handoff_mu);
        handoffs.push_back(Handoff{l.p, l.size, l.value});
        n_handoff++;
        break;
      }
    } else if (r < 850) {
      drain_handoffs(4);
    } else if (r < 880) {
      checkpoint_cycle();
    } else if (r < 890) {
      sp_status st = (rng() % 2) ? sp_empty_cache(0) : sp_pool_empty_cache(0, pool);
      if (st != SP_OK) api_error("empty_cache", st);
      n_empty++;
      verify_all();
    } else {
      verify_all();
    }
    n_ops++;
  }

  unsigned long long read_bad() {
    unsigned long long h = 0;
    CK(cudaStreamSynchronize(s));
    CK(cudaMemcpy(&h, bad, sizeof h, cudaMemcpyDeviceToHost));
    return h;
  }
};

int main(int argc, char** argv) {
  const char* conf = argc > 1 ? argv[1] : "";
  int threads = argc > 2 ? std::atoi(argv[2]) : 8;
  long ops = argc > 3 ? std::atol(argv[3]) : 20000;
  uint64_t limit_mb = argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 1536;
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  if (sp_init("cuda", conf) != SP_OK) {
    std::printf("{\"test\": \"hostile_patterns\", \"ok\": false, \"error\": \"init: %s\"}\n",
                sp_last_error_message());
    return 1;
  }
  if (limit_mb && sp_set_memory_limit(0, limit_mb << 20) != SP_OK) api_error("sp_set_memory_limit", SP_OK);

  std::vector<Worker> w(threads);
  for (int t = 0; t < threads; t++) {
    w[t].t = t;
    w[t].rng.seed(0x5eed0000ull + t);
    w[t].next_value = 1;
    CK(cudaStreamCreateWithFlags(&w[t].s, cudaStreamNonBlocking));
    CK(cudaMalloc(&w[t].bad, sizeof(unsigned long long)));
    CK(cudaMemset(w[t].bad, 0, sizeof(unsigned long long)));
    w[t].pool = sp_pool_id{0, 1000 + (uint64_t)t};
    sp_status st = sp_pool_create_or_incref(0, w[t].pool, nullptr, nullptr);
    if (st != SP_OK) api_error("sp_pool_create_or_incref", st);
  }

  std::vector<std::thread> th;
  for (int t = 0; t < threads; t++)
    th.emplace_back([&, t] {
      Worker& me = w[t];
      CK(cudaSetDevice(0));  // the driver calls (cuMemsetD32Async) need the context current
      for (long i = 0; i < ops; i++) me.step();
    });
  for (auto& x : th) x.join();

  // Everything left: read back and free, handed-over allocations included.
  for (auto& me : w) {
    me.drain_handoffs(SIZE_MAX);
    while (!me.live.empty()) me.free_at(me.live.size() - 1);
  }
  unsigned long long bad = 0;
  for (auto& me : w) bad += me.read_bad();
  n_corrupt_words += bad;
  CK(cudaDeviceSynchronize());

  sp_status inv = sp_check_invariants(0);
  std::string inv_msg = inv == SP_OK ? "" : sp_last_error_message();
  for (auto& me : w) {
    uint64_t left = 0;
    sp_status st = sp_pool_release(0, me.pool, &left);
    if (st != SP_OK) api_error("sp_pool_release", st);
  }
  sp_status st = sp_empty_cache(0);
  if (st != SP_OK) api_error("sp_empty_cache (final)", st);
  sp_memory_stats ms;
  std::memset(&ms, 0, sizeof ms);
  if (sp_memory_stats_get(0, &ms) != SP_OK) api_error("sp_memory_stats_get", SP_OK);
  sp_status inv2 = sp_check_invariants(0);
  if (inv2 != SP_OK && inv_msg.empty()) inv_msg = sp_last_error_message();

  bool ok = n_corrupt_words == 0 && n_api_errors == 0 && inv == SP_OK && inv2 == SP_OK &&
            ms.allocated_bytes.all.current == 0 && ms.reserved_bytes.all.current == 0;
  std::printf(
      "{\"test\": \"hostile_patterns\", \"conf\": \"%s\", \"threads\": %d, \"ops\": %llu, "
      "\"allocs\": %llu, \"frees\": %llu, \"handoffs\": %llu, \"restores\": %llu, "
      "\"empty_cache\": %llu, \"ooms\": %llu, \"verified_bytes\": %llu, \"corrupt_words\": %llu, "
      "\"api_errors\": %llu, \"invariants\": %s, \"allocated_after\": %lld, "
      "\"reserved_after\": %lld, \"ok\": %s%s%s%s}\n",
      conf, threads, (unsigned long long)n_ops.load(), (unsigned long long)n_alloc.load(),
      (unsigned long long)n_free.load(), (unsigned long long)n_handoff.load(),
      (unsigned long long)n_restore.load(), (unsigned long long)n_empty.load(),
      (unsigned long long)n_oom.load(), (unsigned long long)n_verified_bytes.load(),
      (unsigned long long)n_corrupt_words.load(), (unsigned long long)n_api_errors.load(),
      inv == SP_OK && inv2 == SP_OK ? "true" : "false", (long long)ms.allocated_bytes.all.current,
      (long long)ms.reserved_bytes.all.current, ok ? "true" : "false",
      first_error.empty() && inv_msg.empty() ? "" : ", \"error\": \"",
      first_error.empty() ? inv_msg.c_str() : first_error.c_str(),
      first_error.empty() && inv_msg.empty() ? "" : "\"");
  return ok ? 0 : 1;
}
