/* Host cost of alloc_bench's mixed pattern through the shared library, as a C program sees it:
 * sizes log-uniform from 512 B to 64 MiB, up to 64 live, each step a free (half the time, or when
 * 64 are live) or an alloc. Configuration from SLOTPOOL_CONF, over the library's defaults.
 *
 *   cargo build --release -p slotpool-capi
 *   gcc -O2 -o /tmp/mixed_dlopen benches/c/mixed_dlopen.c -ldl -lm
 *   SLOTPOOL_CONF=... /tmp/mixed_dlopen target/release/libslotpool.so [BACKEND [PAIRS]]
 *
 * BACKEND is "sim" (default) or "cuda". Prints the best and the median of 5 rounds of PAIRS
 * (default 200,000) alloc + free pairs, and the device's peak reserved bytes. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*alloc_t)(int, size_t, uint64_t, void**);
typedef int (*free_t)(void*);
typedef int (*init_t)(const char*, const char*);
typedef int (*peaks_t)(int, uint64_t*, uint64_t*);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e9 + t.tv_nsec; }
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
static void* live[64];
static int n_live = 0;
static alloc_t a;
static free_t f;
static int step(void) {
  if (n_live >= 64 || (n_live > 0 && (next() & 1))) {
    int i = (int)(next() % (uint64_t)n_live);
    if (f(live[i])) return 1;
    live[i] = live[--n_live];
  } else {
    double e = 9.0 + 17.0 * ((double)(next() >> 11) / 9007199254740992.0);
    if (a(0, (size_t)pow(2.0, e), 0, &live[n_live])) return 1;
    n_live++;
  }
  return 0;
}
int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s LIBSLOTPOOL [BACKEND [PAIRS]]\n", argv[0]); return 1; }
  void* h = dlopen(argv[1], RTLD_NOW);
  if (!h) { printf("%s\n", dlerror()); return 1; }
  init_t in = (init_t)dlsym(h, "sp_init");
  a = (alloc_t)dlsym(h, "sp_alloc");
  f = (free_t)dlsym(h, "sp_free");
  peaks_t pk = (peaks_t)dlsym(h, "sp_memory_peaks");
  const char* backend = argc > 2 ? argv[2] : "sim";
  long pairs = argc > 3 ? atol(argv[3]) : 200000;
  if (in(backend, "")) return 2;
  for (int i = 0; i < 20000; i++) if (step()) return 3;
  double t[5];
  for (int r = 0; r < 5; r++) {
    double t0 = now();
    for (long i = 0; i < 2 * pairs; i++) if (step()) return 3;
    t[r] = (now() - t0) / (double)pairs;
  }
  for (int i = 1; i < 5; i++) for (int j = i; j > 0 && t[j] < t[j - 1]; j--) { double x = t[j]; t[j] = t[j - 1]; t[j - 1] = x; }
  uint64_t alloc_peak = 0, reserved_peak = 0;
  pk(0, &alloc_peak, &reserved_peak);
  const char* conf = getenv("SLOTPOOL_CONF");
  printf("{\"backend\": \"%s\", \"conf\": \"%s\", \"best_ns\": %.1f, \"median_ns\": %.1f, \"peak_reserved\": %llu, \"peak_allocated\": %llu}\n",
         backend, conf ? conf : "", t[0], t[2], (unsigned long long)reserved_peak, (unsigned long long)alloc_peak);
  return 0;
}
