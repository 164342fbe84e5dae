/* Host cost of sp_alloc + sp_free through the shared library, as a C program sees it
 * (dlopen: thread-locals resolve through __tls_get_addr, unlike the Rust benches).
 *
 *   cargo build --release -p slotpool-capi
 *   gcc -O2 -o /tmp/pair_dlopen benches/c/pair_dlopen.c -ldl
 *   /tmp/pair_dlopen target/release/libslotpool.so [SIZE]        # simulated device
 *
 * Prints the best of 15 rounds of 10^6 pairs of SIZE bytes (default 1 MiB) on stream 7. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
typedef int (*alloc_t)(int, size_t, uint64_t, void**);
typedef int (*free_t)(void*);
typedef int (*init_t)(const char*, const char*);
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e9+t.tv_nsec;}
int main(int argc, char** argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s LIBSLOTPOOL [SIZE]\n", argv[0]); return 1; }
  void*h=dlopen(argv[1],RTLD_NOW); if(!h){printf("%s\n",dlerror());return 1;}
  init_t in=(init_t)dlsym(h,"sp_init"); alloc_t a=(alloc_t)dlsym(h,"sp_alloc"); free_t f=(free_t)dlsym(h,"sp_free");
  if(in("sim","sim_devices:1")) return 2;
  size_t sz=argc>2?strtoull(argv[2],0,0):(1<<20);
  void*p; for(int i=0;i<100000;i++){a(0,sz,7,&p);f(p);}
  double best=1e18;
  for(int r=0;r<15;r++){ double t0=now(); for(int i=0;i<1000000;i++){a(0,sz,7,&p);f(p);} double dt=(now()-t0)/1e6; if(dt<best)best=dt; }
  printf("%zu: best %.1f ns/pair\n",sz,best); return 0;}
