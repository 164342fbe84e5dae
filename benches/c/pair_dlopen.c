/* Host cost of sp_alloc + sp_free through the shared library, as a C program sees it
 * (dlopen: thread-locals resolve through __tls_get_addr, unlike the Rust benches).
 *
 *   cargo build --release -p slotpool-capi
 *   gcc -O2 -o /tmp/pair_dlopen benches/c/pair_dlopen.c -ldl
 *   /tmp/pair_dlopen target/release/libslotpool.so [SIZE [BACKEND [STREAM]]]
 *
 * BACKEND is "sim" (default, one simulated device) or "cuda"; STREAM defaults to 7 on the
 * simulated device and to 0 (the legacy default stream) on CUDA. Prints the best and the median
 * of 15 rounds of 10^6 pairs of SIZE bytes (default 1 MiB). */
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
  const char*backend=argc>3?argv[3]:"sim";
  int sim=backend[0]=='s';
  if(in(backend,sim?"sim_devices:1":"")) return 2;
  size_t sz=argc>2?strtoull(argv[2],0,0):(1<<20);
  uint64_t st=argc>4?strtoull(argv[4],0,0):(sim?7:0);
  void*p; for(int i=0;i<100000;i++){if(a(0,sz,st,&p)) return 3; f(p);}
  double t[15];
  for(int r=0;r<15;r++){ double t0=now(); for(int i=0;i<1000000;i++){a(0,sz,st,&p);f(p);} t[r]=(now()-t0)/1e6; }
  for(int i=1;i<15;i++) for(int j=i;j>0&&t[j]<t[j-1];j--){double x=t[j];t[j]=t[j-1];t[j-1]=x;}
  printf("{\"backend\": \"%s\", \"size\": %zu, \"best_ns\": %.1f, \"median_ns\": %.1f}\n",backend,sz,t[0],t[7]);
  return 0;}
