/* N cached sp_alloc + sp_free pairs of SIZE bytes through the shared library, for an
 * instruction count (benches/c/pair_count.sh runs it under callgrind at N and 2N pairs and
 * reports the difference over N, the cost of one pair with the setup cancelled).
 *
 *   gcc -O2 -o /tmp/pair_count benches/c/pair_count.c -ldl
 *   /tmp/pair_count target/release/libslotpool.so N [SIZE]
 *
 * One simulated device, stream 7, SIZE 4096 by default. One warm-up pair makes the shard and
 * its segment, so every counted pair is a hit in the quick cache. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
typedef int (*alloc_t)(int, size_t, uint64_t, void **);
typedef int (*free_t)(void *);
typedef int (*init_t)(const char *, const char *);
int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s LIBSLOTPOOL N [SIZE]\n", argv[0]);
    return 1;
  }
  void *h = dlopen(argv[1], RTLD_NOW);
  if (!h) {
    fprintf(stderr, "%s\n", dlerror());
    return 1;
  }
  init_t init = (init_t)dlsym(h, "sp_init");
  alloc_t a = (alloc_t)dlsym(h, "sp_alloc");
  free_t f = (free_t)dlsym(h, "sp_free");
  if (!init || !a || !f || init("sim", "sim_devices:1")) return 2;
  long n = strtol(argv[2], 0, 0);
  size_t size = argc > 3 ? strtoull(argv[3], 0, 0) : 4096;
  void *p;
  if (a(0, size, 7, &p) || f(p)) return 3;
  for (long i = 0; i < n; i++) {
    if (a(0, size, 7, &p) || f(p)) return 4;
  }
  return 0;
}
