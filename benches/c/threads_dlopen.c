/* Host cost of sp_alloc + sp_free on 1..N threads through the shared library, each thread on its
 * own stream, outside any PyTorch process: alloc_bench's "same" pattern in a plain C program, to
 * tell what a backend adds across threads. It showed that the large-pair slowdown across
 * threads came from shards made in a row by one thread sharing cache lines, not from the
 * backend (docs/design.md, "Shards share no cache line").
 *
 *   cargo build --release -p slotpool-capi
 *   gcc -O2 -pthread -o /tmp/threads_dlopen benches/c/threads_dlopen.c -ldl
 *   /tmp/threads_dlopen target/release/libslotpool.so [SIZE [BACKEND [THREADS [PAIRS]]]]
 *
 * BACKEND is "sim" (default) or "cuda"; on CUDA each thread gets a non-blocking stream from
 * libcudart (dlopen'ed), on the sim stream ids 1..N. Prints, for 1 and for THREADS threads
 * (default 16), the median of 5 runs of PAIRS pairs a thread (default 200,000): ns per pair per
 * thread, and the aggregate ns per pair.
 *
 * A third measurement runs one thread again beside THREADS-1 spinner threads that share no memory:
 * the single-thread cost on a busy host, against which the THREADS-thread cost is compared too.
 *
 * FRESH=1: new streams for every run, each warmed by one pair on the main thread (alloc_bench.py's
 * and the GPU suite's pattern); FRESH=2: the same, each worker warming its own. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*alloc_t)(int, size_t, uint64_t, void**);
typedef int (*free_t)(void*);
typedef int (*init_t)(const char*, const char*);
typedef int (*stream_create_t)(void**, unsigned);
static alloc_t a;
static free_t f;
static size_t size;
static long pairs;
static volatile int go;
static int ready; /* workers started (and warmed, with FRESH=2); read with __atomic */
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
typedef struct { uint64_t stream; int failed; } worker;
static int self_warm;
static void* run(void* arg) {
  worker* w = arg;
  void* p;
  if (self_warm) { /* FRESH=2: the thread warms its own new stream's shard */
    if (a(0, size, w->stream, &p)) { w->failed = 1; return 0; }
    f(p);
  }
  __atomic_fetch_add(&ready, 1, __ATOMIC_SEQ_CST);
  while (!go) {}
  for (long i = 0; i < pairs; i++) {
    if (a(0, size, w->stream, &p)) { w->failed = 1; return 0; }
    f(p);
  }
  return 0;
}
/* A spinner: integer work on its own registers, no memory shared with anyone, until `stop`. */
static volatile int stop;
static void* spin(void* arg) {
  uint64_t x = (uint64_t)(uintptr_t)arg;
  while (!stop) for (int i = 0; i < 1000; i++) x = x * 6364136223846793005ull + 1442695040888963407ull;
  return (void*)(uintptr_t)x;
}
static int cmp(const void* x, const void* y) { double d = *(const double*)x - *(const double*)y; return (d > 0) - (d < 0); }
/* Wall ns per pair per thread, with n threads at once. */
static double once(int n, uint64_t* streams) {
  pthread_t t[256];
  worker w[256];
  go = 0;
  __atomic_store_n(&ready, 0, __ATOMIC_SEQ_CST);
  for (int i = 0; i < n; i++) { w[i].stream = streams[i]; w[i].failed = 0; pthread_create(&t[i], 0, run, &w[i]); }
  while (__atomic_load_n(&ready, __ATOMIC_SEQ_CST) < n) {} /* thread start-up is not timed */
  double t0 = now();
  go = 1;
  for (int i = 0; i < n; i++) pthread_join(t[i], 0);
  double wall = now() - t0;
  for (int i = 0; i < n; i++) if (w[i].failed) { fprintf(stderr, "sp_alloc failed\n"); exit(3); }
  return wall / (double)pairs;
}
int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s LIBSLOTPOOL [SIZE [BACKEND [THREADS [PAIRS]]]]\n", argv[0]); return 1; }
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) { printf("%s\n", dlerror()); return 1; }
  init_t in = (init_t)dlsym(h, "sp_init");
  a = (alloc_t)dlsym(h, "sp_alloc");
  f = (free_t)dlsym(h, "sp_free");
  size = argc > 2 ? strtoull(argv[2], 0, 0) : (64u << 20);
  const char* backend = argc > 3 ? argv[3] : "sim";
  int n = argc > 4 ? atoi(argv[4]) : 16;
  pairs = argc > 5 ? atol(argv[5]) : 200000;
  if (n < 1 || n > 256) return 1;
  int sim = backend[0] == 's';
  if (in(backend, sim ? "sim_devices:1" : "")) return 2;
  uint64_t streams[256];
  for (int i = 0; i < n; i++) streams[i] = (uint64_t)(i + 1);
  stream_create_t sc = 0;
  if (!sim) {
    void* rt = dlopen("libcudart.so", RTLD_NOW);
    sc = rt ? (stream_create_t)dlsym(rt, "cudaStreamCreateWithFlags") : 0;
    if (!sc) { fprintf(stderr, "no libcudart.so\n"); return 4; }
    for (int i = 0; i < n; i++) { void* s; if (sc(&s, 1)) return 5; streams[i] = (uint64_t)(uintptr_t)s; }
  }
  /* FRESH=1: new streams for every run, each warmed by one untimed pair, as alloc_bench.py and
   * the GPU suite make them (every run starts on new shards, beside the idle shards of earlier
   * runs). */
  int fresh = getenv("FRESH") ? atoi(getenv("FRESH")) : 0;
  self_warm = fresh == 2;
  /* Third measurement: one thread again, while THREADS-1 spinners keep the other cores busy
   * (a host that boosts a lone busy core runs the single thread of the first measurement
   * faster than any thread of a busy host; docs/performance.md, "Noise"). */
  int counts[3] = {1, n, 1};
  double per[3];
  for (int c = 0; c < 3; c++) {
    double r[5];
    pthread_t spinners[256];
    int nspin = c == 2 ? n - 1 : 0;
    stop = 0;
    for (int i = 0; i < nspin; i++) pthread_create(&spinners[i], 0, spin, (void*)(uintptr_t)(i + 1));
    once(counts[c], streams); /* warm: every shard grown */
    for (int k = 0; k < 5; k++) {
      if (fresh) {
        if (sim) for (int i = 0; i < n; i++) streams[i] += 1000;
        else for (int i = 0; i < n; i++) { void* s; if (sc(&s, 1)) return 5; streams[i] = (uint64_t)(uintptr_t)s; }
        /* One untimed pair per new stream, as alloc_bench.py warms: its shard grows here. */
        if (fresh == 1)
          for (int i = 0; i < counts[c]; i++) { void* p; if (a(0, size, streams[i], &p)) return 3; f(p); }
      }
      r[k] = once(counts[c], streams);
    }
    stop = 1;
    for (int i = 0; i < nspin; i++) pthread_join(spinners[i], 0);
    qsort(r, 5, sizeof r[0], cmp);
    per[c] = r[2];
  }
  printf("{\"backend\": \"%s\", \"size\": %zu, \"threads\": %d, \"fresh\": %d, \"ns_per_pair_1t\": %.1f, "
         "\"ns_per_pair_per_thread\": %.1f, \"aggregate_ns\": %.1f, \"speedup\": %.2f, "
         "\"ns_per_pair_1t_beside_spinners\": %.1f, \"speedup_vs_1t_beside_spinners\": %.2f}\n",
         backend, size, n, fresh, per[0], per[1], per[1] / n, per[0] * n / per[1], per[2],
         per[2] * n / per[1]);
  return 0;
}
