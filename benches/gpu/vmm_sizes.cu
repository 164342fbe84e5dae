// What vmm growth costs per byte as the physical chunk grows, and whether growth waits for the
// GPU. Answers two design questions of slotpool's vmm mode: would mapping larger chunks than the
// 2 MiB granularity cut growth cost, and does cuMemSetAccess stall behind running kernels?
//
//   nvcc -O2 -std=c++17 benches/gpu/vmm_sizes.cu -lcuda -o vmm_sizes && ./vmm_sizes
#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include <unistd.h>
#include <cstdlib>
#define CK(x)                                                                         \
  do {                                                                                \
    CUresult r = (x);                                                                 \
    if (r != CUDA_SUCCESS) {                                                          \
      const char* s;                                                                  \
      cuGetErrorString(r, &s);                                                        \
      printf("FAIL %s -> %s (line %d)\n", #x, s, __LINE__);                           \
      return 1;                                                                       \
    }                                                                                 \
  } while (0)
using clk = std::chrono::steady_clock;
static double us(clk::time_point a, clk::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}
static double med(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
__global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

int main() {
  cudaFree(0);
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  // VMM_SHAREABLE=1: pages exportable as POSIX file descriptors, as slotpool makes them where the
  // device supports it (CUDA IPC of vmm memory); the export of each page is timed too.
  const bool shareable = getenv("VMM_SHAREABLE") && atoi(getenv("VMM_SHAREABLE")) == 1;
  if (shareable) prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemAccessDesc acc = {};
  acc.location = prop.location;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const size_t G = 2 << 20;
  const size_t TOTAL = 2ull << 30;  // 2 GiB per chunk size
  CUdeviceptr va;
  CK(cuMemAddressReserve(&va, TOTAL * 2, 0, 0, 0));
  printf("{\"probe\": \"vmm_sizes\", \"shareable\": %d, \"rows\": [\n", (int)shareable);
  const size_t mibs[] = {2, 4, 8, 16, 20, 32, 64, 128};
  for (size_t k = 0; k < sizeof(mibs) / sizeof(mibs[0]); k++) {
    size_t chunk = mibs[k] << 20;
    size_t n = TOTAL / chunk;
    std::vector<CUmemGenericAllocationHandle> h(n);
    std::vector<double> tc, tm, ts, tu, te;
    auto start = clk::now();
    for (size_t i = 0; i < n; i++) {
      auto a = clk::now();
      CK(cuMemCreate(&h[i], chunk, &prop, 0));
      auto b = clk::now();
      CK(cuMemMap(va + i * chunk, chunk, 0, h[i], 0));
      auto c = clk::now();
      CK(cuMemSetAccess(va + i * chunk, chunk, &acc, 1));
      auto d = clk::now();
      tc.push_back(us(a, b));
      tm.push_back(us(b, c));
      ts.push_back(us(c, d));
    }
    auto end = clk::now();
    for (size_t i = 0; shareable && i < n; i++) {
      int fd = -1;
      auto a = clk::now();
      CK(cuMemExportToShareableHandle(&fd, h[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
      te.push_back(us(a, clk::now()));
      close(fd);
    }
    if (te.empty()) te.push_back(0);
    for (size_t i = 0; i < n; i++) {
      auto a = clk::now();
      CK(cuMemUnmap(va + i * chunk, chunk));
      CK(cuMemRelease(h[i]));
      tu.push_back(us(a, clk::now()));
    }
    printf("  {\"chunk_mib\": %zu, \"create_us\": %.1f, \"map_us\": %.1f, \"set_access_us\": %.1f, "
           "\"unmap_release_us\": %.1f, \"grow_us_per_2mib\": %.2f, \"export_us\": %.1f}%s\n",
           mibs[k], med(tc), med(tm), med(ts), med(tu), us(start, end) / (TOTAL / G), med(te),
           k + 1 < sizeof(mibs) / sizeof(mibs[0]) ? "," : "");
  }
  printf("]}\n");
  // Growth while a kernel runs: does any call wait for the GPU?
  int clock_khz = 0;
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  long long cycles = (long long)clock_khz * 200;  // ~200 ms
  CUmemGenericAllocationHandle h;
  CK(cuMemCreate(&h, G, &prop, 0));
  auto k0 = clk::now();
  spin<<<1, 1, 0, s>>>(cycles);
  auto a = clk::now();
  CK(cuMemMap(va, G, 0, h, 0));
  auto b = clk::now();
  CK(cuMemSetAccess(va, G, &acc, 1));
  auto c = clk::now();
  CK(cuMemUnmap(va, G));
  auto d = clk::now();
  cudaStreamSynchronize(s);
  auto e = clk::now();
  printf("{\"probe\": \"growth_during_kernel\", \"kernel_ms\": %.1f, \"map_us\": %.1f, "
         "\"set_access_us\": %.1f, \"unmap_us\": %.1f}\n",
         us(k0, e) / 1e3, us(a, b), us(b, c), us(c, d));
  CK(cuMemRelease(h));
  CK(cuMemAddressFree(va, TOTAL * 2));
  return 0;
}
