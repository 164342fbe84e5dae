// What a pause and a resume cost at the driver, per page against per physical run, and what the
// backup's copies and pinned buffer cost. Answers the design questions of slotpool's pause path
// (crates/slotpool-core/src/phys_run.rs, docs/performance.md "Pause / resume"):
//
//   * per page of VMM_PAGE_MB: one cuMemCreate + cuMemMap each, one cuMemSetAccess for the range
//     (a resume before runs), against one cuMemCreate + cuMemMap + cuMemSetAccess per run of
//     2 GiB (slotpool's RUN_MAX_BYTES) and per run of the whole size;
//   * unmap: per page, and one cuMemUnmap over a range of several page mappings (does the driver
//     take it? if it refuses, are the pages still mapped?); cuMemRelease per page and per run;
//   * cuMemMap at a nonzero offset into a run, and cuMemUnmap of part of a run's mapping;
//   * runs of 8 GiB; a pause that releases every handle first and then unmaps the range once;
//     a pause spread over 2, 4 or 8 threads (is the driver's release serialised?);
//   * what cuMemGetInfo costs;
//   * copy bandwidth device <-> pinned host: one call of the whole size, 256 MiB chunks on one
//     stream, and on two streams; the cost of pinning the buffer with cuMemHostAlloc against
//     mmap + MADV_HUGEPAGE + cuMemHostRegister.
//
// One JSON line per size, then a short table last.
//
//   nvcc -O2 -std=c++17 benches/gpu/vmm_runs.cu -lcuda -o /tmp/vmm_runs && /tmp/vmm_runs
//   env: VMM_RUNS_GB (default "1,10,40"), VMM_PAGE_MB (default 4), VMM_RUNS_PIN (default 1: time
//   the pinning methods; 0 skips them, they take about 0.4 s per GB each)
#include <cuda.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                \
  do {                                                                       \
    CUresult r_ = (x);                                                       \
    if (r_ != CUDA_SUCCESS) {                                                \
      const char* s_;                                                        \
      cuGetErrorString(r_, &s_);                                             \
      printf("FAIL %s -> %s (line %d)\n", #x, s_, __LINE__);                 \
      exit(1);                                                               \
    }                                                                        \
  } while (0)

using clk = std::chrono::steady_clock;
static double ms_since(clk::time_point a) {
  return std::chrono::duration<double, std::milli>(clk::now() - a).count();
}
static const char* err_name(CUresult r) {
  const char* s = "?";
  cuGetErrorName(r, &s);
  return s;
}

static CUmemAllocationProp g_prop;
static CUmemAccessDesc g_acc;

struct Mapped {
  double create_ms = 0, map_ms = 0, access_ms = 0;
  std::vector<CUmemGenericAllocationHandle> h;
  std::vector<size_t> len;
};

// Map [va, va + total) with allocations of `chunk` bytes (the last may be shorter); one
// cuMemSetAccess over the whole range, as slotpool does for a run of pages.
static Mapped map_chunks(CUdeviceptr va, size_t total, size_t chunk) {
  Mapped m;
  size_t n = (total + chunk - 1) / chunk;
  m.h.resize(n);
  m.len.resize(n);
  auto t = clk::now();
  for (size_t i = 0; i < n; i++) {
    m.len[i] = std::min(chunk, total - i * chunk);
    CK(cuMemCreate(&m.h[i], m.len[i], &g_prop, 0));
  }
  m.create_ms = ms_since(t);
  t = clk::now();
  for (size_t i = 0; i < n; i++) CK(cuMemMap(va + i * chunk, m.len[i], 0, m.h[i], 0));
  m.map_ms = ms_since(t);
  t = clk::now();
  CK(cuMemSetAccess(va, total, &g_acc, 1));
  m.access_ms = ms_since(t);
  return m;
}

// Unmap each mapping, then release each handle: (unmap ms, release ms).
static std::pair<double, double> unmap_each(CUdeviceptr va, Mapped& m) {
  auto t = clk::now();
  size_t off = 0;
  for (size_t i = 0; i < m.h.size(); i++) {
    CK(cuMemUnmap(va + off, m.len[i]));
    off += m.len[i];
  }
  double u = ms_since(t);
  t = clk::now();
  for (auto h : m.h) CK(cuMemRelease(h));
  return {u, ms_since(t)};
}

// A pause in other orders and on several threads, for runs of `chunk` bytes over [va, va + total):
// "order": every handle released while still mapped, then one cuMemUnmap over the range (the
// release takes effect at the unmap); "tN": N threads, each unmapping and releasing its share of
// the runs. Returns the pause's wall time in ms for each variant, in the order of `threads`.
struct PauseWays {
  double release_then_unmap_ms = -1;
  std::vector<std::pair<int, double>> threads;
};
static PauseWays pause_ways(CUcontext ctx, CUdeviceptr va, size_t total, size_t chunk,
                            const std::vector<int>& threads) {
  PauseWays out;
  {
    Mapped m = map_chunks(va, total, chunk);
    auto t = clk::now();
    for (auto h : m.h) CK(cuMemRelease(h));
    CUresult r = cuMemUnmap(va, total);
    out.release_then_unmap_ms = r == CUDA_SUCCESS ? ms_since(t) : -2;
    if (r != CUDA_SUCCESS) {
      size_t off = 0;
      for (size_t i = 0; i < m.h.size(); i++) {
        cuMemUnmap(va + off, m.len[i]);
        off += m.len[i];
      }
    }
  }
  for (int n : threads) {
    Mapped m = map_chunks(va, total, chunk);
    std::vector<size_t> offs(m.h.size());
    for (size_t i = 1; i < m.h.size(); i++) offs[i] = offs[i - 1] + m.len[i - 1];
    auto t = clk::now();
    std::vector<std::thread> ts;
    for (int k = 0; k < n; k++) {
      ts.emplace_back([&, k] {
        cuCtxSetCurrent(ctx);
        for (size_t i = k; i < m.h.size(); i += n) {
          CK(cuMemUnmap(va + offs[i], m.len[i]));
          CK(cuMemRelease(m.h[i]));
        }
      });
    }
    for (auto& th : ts) th.join();
    out.threads.push_back({n, ms_since(t)});
  }
  return out;
}

static std::string ways_json(const char* name, const PauseWays& w) {
  char buf[512];
  int at = snprintf(buf, sizeof buf, "\"%s_release_then_unmap_ms\": %.3f", name,
                    w.release_then_unmap_ms);
  for (auto& [n, ms] : w.threads)
    at += snprintf(buf + at, sizeof buf - at, ", \"%s_pause_%d_threads_ms\": %.3f", name, n, ms);
  return buf;
}

struct Row {
  double gb;
  Mapped page;
  double page_unmap = 0, page_release = 0;
  std::string span;  // one cuMemUnmap over the page mappings: "ok", or the error and what stayed
  double span_ms = -1, span_release = 0;
  Mapped run2g, run8g, whole;
  double run8g_unmap = 0, run8g_release = 0;
  std::string ways;  // pause_ways over pages, 2 GiB runs and the whole size, as JSON fields
  double run2g_unmap = 0, run2g_release = 0, whole_unmap = 0, whole_release = 0;
  double dtoh_gbs = 0, htod_gbs = 0, dtoh_chunk_gbs = 0, htod_chunk_gbs = 0, dtoh_2s_gbs = 0,
         htod_2s_gbs = 0;
  double pin_alloc_ms = -1, pin_register_ms = -1;
};

static double gbs(double bytes, double ms) { return bytes / 1e9 / (ms / 1e3); }

static void copies(Row& row, CUdeviceptr dev, size_t bytes, void* host) {
  const size_t CH = 256ull << 20;
  CUstream s[2];
  CK(cuStreamCreate(&s[0], CU_STREAM_NON_BLOCKING));
  CK(cuStreamCreate(&s[1], CU_STREAM_NON_BLOCKING));
  // Warm-up: one chunk each way.
  CK(cuMemcpyDtoH(host, dev, std::min(CH, bytes)));
  CK(cuMemcpyHtoD(dev, host, std::min(CH, bytes)));
  auto t = clk::now();
  CK(cuMemcpyDtoH(host, dev, bytes));
  row.dtoh_gbs = gbs(bytes, ms_since(t));
  t = clk::now();
  CK(cuMemcpyHtoD(dev, host, bytes));
  CK(cuCtxSynchronize());
  row.htod_gbs = gbs(bytes, ms_since(t));
  for (int streams = 1; streams <= 2; streams++) {
    for (int dir = 0; dir < 2; dir++) {
      t = clk::now();
      for (size_t off = 0, i = 0; off < bytes; off += CH, i++) {
        size_t n = std::min(CH, bytes - off);
        CUstream st = s[i % streams];
        if (dir == 0)
          CK(cuMemcpyDtoHAsync((char*)host + off, dev + off, n, st));
        else
          CK(cuMemcpyHtoDAsync(dev + off, (char*)host + off, n, st));
      }
      CK(cuCtxSynchronize());
      double r = gbs(bytes, ms_since(t));
      if (streams == 1) (dir == 0 ? row.dtoh_chunk_gbs : row.htod_chunk_gbs) = r;
      else (dir == 0 ? row.dtoh_2s_gbs : row.htod_2s_gbs) = r;
    }
  }
  cuStreamDestroy(s[0]);
  cuStreamDestroy(s[1]);
}

int main() {
  CK(cuInit(0));
  CUdevice d;
  CK(cuDeviceGet(&d, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, d));
  CK(cuCtxSetCurrent(ctx));
  memset(&g_prop, 0, sizeof g_prop);
  g_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  g_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  g_prop.location.id = 0;
  memset(&g_acc, 0, sizeof g_acc);
  g_acc.location = g_prop.location;
  g_acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t gran = 0;
  CK(cuMemGetAllocationGranularity(&gran, &g_prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const size_t PAGE = (size_t)(getenv("VMM_PAGE_MB") ? atoi(getenv("VMM_PAGE_MB")) : 4) << 20;
  const bool pin = !getenv("VMM_RUNS_PIN") || atoi(getenv("VMM_RUNS_PIN")) != 0;
  std::vector<double> sizes;
  {
    std::string s = getenv("VMM_RUNS_GB") ? getenv("VMM_RUNS_GB") : "1,10,40";
    size_t i = 0;
    while (i < s.size()) {
      size_t j = s.find(',', i);
      if (j == std::string::npos) j = s.size();
      sizes.push_back(atof(s.substr(i, j - i).c_str()));
      i = j + 1;
    }
  }
  int drv = 0;
  cuDriverGetVersion(&drv);
  char name[256] = {0};
  cuDeviceGetName(name, sizeof name, d);
  printf("{\"probe\": \"vmm_runs\", \"device\": \"%s\", \"driver\": %d, \"granularity\": %zu, "
         "\"page\": %zu}\n", name, drv, gran, PAGE);

  // What cuMemGetInfo costs (an allocator that asks it before growing pays this each time).
  {
    std::vector<double> us;
    for (int i = 0; i < 21; i++) {
      size_t f = 0, t = 0;
      auto t0 = clk::now();
      CK(cuMemGetInfo(&f, &t));
      us.push_back(ms_since(t0) * 1e3);
    }
    std::sort(us.begin(), us.end());
    printf("{\"probe\": \"vmm_runs\", \"mem_get_info_us_median\": %.1f, \"max\": %.1f}\n",
           us[us.size() / 2], us.back());
  }

  // Offsets and partial unmaps, on a run of 4 pages.
  {
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, 8 * PAGE, 0, 0, 0));
    CUmemGenericAllocationHandle h;
    CK(cuMemCreate(&h, 4 * PAGE, &g_prop, 0));
    CUresult off = cuMemMap(va, 2 * PAGE, 2 * PAGE, h, 0);
    if (off == CUDA_SUCCESS) cuMemUnmap(va, 2 * PAGE);
    CK(cuMemMap(va + 4 * PAGE, 4 * PAGE, 0, h, 0));
    CUresult part = cuMemUnmap(va + 4 * PAGE, 2 * PAGE);
    if (part != CUDA_SUCCESS) CK(cuMemUnmap(va + 4 * PAGE, 4 * PAGE));
    CK(cuMemRelease(h));
    CK(cuMemAddressFree(va, 8 * PAGE));
    printf("{\"probe\": \"vmm_runs\", \"map_at_offset\": \"%s\", \"unmap_part_of_run\": \"%s\"}\n",
           err_name(off), err_name(part));
  }

  std::vector<Row> rows;
  for (double gb : sizes) {
    Row row;
    row.gb = gb;
    size_t total = ((size_t)(gb * 1e9) + PAGE - 1) / PAGE * PAGE;
    CUdeviceptr va;
    CK(cuMemAddressReserve(&va, total, PAGE, 0, 0));
    // Page by page, unmapped page by page.
    row.page = map_chunks(va, total, PAGE);
    auto ur = unmap_each(va, row.page);
    row.page_unmap = ur.first;
    row.page_release = ur.second;
    // Page by page, unmapped with one call over the range.
    {
      Mapped m = map_chunks(va, total, PAGE);
      auto t = clk::now();
      CUresult r = cuMemUnmap(va, total);
      double span = ms_since(t);
      if (r == CUDA_SUCCESS) {
        row.span = "ok";
        row.span_ms = span;
        t = clk::now();
        for (auto h : m.h) CK(cuMemRelease(h));
        row.span_release = ms_since(t);
      } else {
        // Still mapped? Unmapping the first page alone tells.
        CUresult first = cuMemUnmap(va, PAGE);
        row.span = std::string(err_name(r)) +
                   (first == CUDA_SUCCESS ? ", pages still mapped" : ", pages state unknown");
        for (size_t i = (first == CUDA_SUCCESS ? 1 : 0); i < m.h.size(); i++)
          cuMemUnmap(va + i * PAGE, PAGE);
        for (auto h : m.h) cuMemRelease(h);
      }
    }
    // Runs of 2 GiB, and one run of the whole size.
    row.run2g = map_chunks(va, total, std::min(total, (size_t)2 << 30));
    ur = unmap_each(va, row.run2g);
    row.run2g_unmap = ur.first;
    row.run2g_release = ur.second;
    if (total > ((size_t)8 << 30)) {
      row.run8g = map_chunks(va, total, (size_t)8 << 30);
      ur = unmap_each(va, row.run8g);
      row.run8g_unmap = ur.first;
      row.run8g_release = ur.second;
    }
    row.ways = ways_json("pages", pause_ways(ctx, va, total, PAGE, {4})) + ", " +
               ways_json("run2g", pause_ways(ctx, va, total, std::min(total, (size_t)2 << 30),
                                             {2, 4, 8})) +
               ", " + ways_json("whole", pause_ways(ctx, va, total, total, {}));
    row.whole = map_chunks(va, total, total);
    // The copies run on the whole run while it is mapped.
    void* host = nullptr;
    auto t = clk::now();
    CK(cuMemHostAlloc(&host, total, CU_MEMHOSTALLOC_PORTABLE));
    double alloc_ms = ms_since(t);
    if (pin) row.pin_alloc_ms = alloc_ms;
    copies(row, va, total, host);
    CK(cuMemFreeHost(host));
    ur = unmap_each(va, row.whole);
    row.whole_unmap = ur.first;
    row.whole_release = ur.second;
    CK(cuMemAddressFree(va, total));
    if (pin) {
      t = clk::now();
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p != MAP_FAILED) {
        madvise(p, total, MADV_HUGEPAGE);
        CUresult r = cuMemHostRegister(p, total, CU_MEMHOSTREGISTER_PORTABLE);
        if (r == CUDA_SUCCESS) {
          row.pin_register_ms = ms_since(t);
          cuMemHostUnregister(p);
        }
        munmap(p, total);
      }
    }
    printf("{\"probe\": \"vmm_runs\", \"gb\": %g, \"pages\": %zu, "
           "\"page_create_ms\": %.2f, \"page_map_ms\": %.2f, \"page_access_ms\": %.2f, "
           "\"page_unmap_ms\": %.2f, \"page_release_ms\": %.2f, "
           "\"span_unmap\": \"%s\", \"span_unmap_ms\": %.3f, \"span_release_ms\": %.2f, "
           "\"runs_2g\": %zu, \"run2g_create_ms\": %.3f, \"run2g_map_ms\": %.3f, "
           "\"run2g_access_ms\": %.3f, \"run2g_unmap_ms\": %.3f, \"run2g_release_ms\": %.3f, "
           "\"runs_8g\": %zu, \"run8g_create_ms\": %.3f, \"run8g_map_ms\": %.3f, "
           "\"run8g_access_ms\": %.3f, \"run8g_unmap_ms\": %.3f, \"run8g_release_ms\": %.3f, %s, "
           "\"whole_create_ms\": %.3f, \"whole_map_ms\": %.3f, \"whole_access_ms\": %.3f, "
           "\"whole_unmap_ms\": %.3f, \"whole_release_ms\": %.3f, "
           "\"dtoh_gbs\": %.2f, \"htod_gbs\": %.2f, \"dtoh_chunked_gbs\": %.2f, "
           "\"htod_chunked_gbs\": %.2f, \"dtoh_2streams_gbs\": %.2f, \"htod_2streams_gbs\": %.2f, "
           "\"pin_hostalloc_ms\": %.0f, \"pin_mmap_thp_register_ms\": %.0f}\n",
           gb, row.page.h.size(), row.page.create_ms, row.page.map_ms, row.page.access_ms,
           row.page_unmap, row.page_release, row.span.c_str(), row.span_ms, row.span_release,
           row.run2g.h.size(), row.run2g.create_ms, row.run2g.map_ms, row.run2g.access_ms,
           row.run2g_unmap, row.run2g_release, row.run8g.h.size(), row.run8g.create_ms,
           row.run8g.map_ms, row.run8g.access_ms, row.run8g_unmap, row.run8g_release,
           row.ways.c_str(), row.whole.create_ms, row.whole.map_ms,
           row.whole.access_ms, row.whole_unmap, row.whole_release, row.dtoh_gbs, row.htod_gbs,
           row.dtoh_chunk_gbs, row.htod_chunk_gbs, row.dtoh_2s_gbs, row.htod_2s_gbs,
           row.pin_alloc_ms, row.pin_register_ms);
    fflush(stdout);
    rows.push_back(row);
  }

  printf("\nvmm_runs: %s, driver %d, pages of %zu MiB (ms; resume = create + map + access, "
         "pause = unmap + release)\n", name, drv, PAGE >> 20);
  printf("%6s | %-17s %-17s | %-28s | %-15s %-15s | %-13s | %-22s\n", "GB", "pages: resume",
         "pause", "one unmap over pages", "2 GiB runs: res", "pause", "one run: res",
         "copy GB/s d2h/h2d, 2 str");
  for (auto& r : rows) {
    char span[64];
    if (r.span == "ok")
      snprintf(span, sizeof span, "ok %.2f + rel %.1f", r.span_ms, r.span_release);
    else
      snprintf(span, sizeof span, "%.27s", r.span.c_str());
    printf("%6g | %8.1f (%5zu) %8.1f+%-8.1f | %-28s | %15.2f %6.2f+%-8.2f | %13.2f | %5.1f/%5.1f, %5.1f/%5.1f\n",
           r.gb, r.page.create_ms + r.page.map_ms + r.page.access_ms, r.page.h.size(),
           r.page_unmap, r.page_release, span,
           r.run2g.create_ms + r.run2g.map_ms + r.run2g.access_ms, r.run2g_unmap,
           r.run2g_release, r.whole.create_ms + r.whole.map_ms + r.whole.access_ms, r.dtoh_gbs,
           r.htod_gbs, r.dtoh_2s_gbs, r.htod_2s_gbs);
  }
  if (pin) {
    printf("pinning the backup buffer (ms): ");
    for (auto& r : rows)
      printf("%g GB: cuMemHostAlloc %.0f, mmap+THP+cuMemHostRegister %.0f; ", r.gb,
             r.pin_alloc_ms, r.pin_register_ms);
    printf("\n");
  }
  return 0;
}
