// preload_loop.cu - allocation speed of a plain CUDA program, with and without slotpool's
// LD_PRELOAD library.
//
// Allocates and frees in a loop (default: 4 KiB, 1 MiB and 64 MiB, 20000 pairs each) through
// cudaMalloc/cudaFree and through cudaMallocAsync/cudaFreeAsync, touches the allocation with a
// trivial kernel every --touch-every iterations (and checks the value back on the host, so that a
// pointer that is not real device memory fails loudly), and prints one JSON line per (api, size)
// with the host time per allocate+free pair. Running it with and without LD_PRELOAD gives the
// speed-up:
//
//   nvcc -O2 -std=c++17 -cudart shared -arch=sm_90 -o preload_loop benches/gpu/preload_loop.cu
//   ./preload_loop > real.jsonl
//   LD_PRELOAD=$PWD/target/release/libslotpool_preload.so SLOTPOOL_LOG=info ./preload_loop > sp.jsonl
//
// -cudart shared is required: nvcc links the runtime statically by default, and a static runtime
// cannot be interposed (the program then silently measures the real allocator twice; the
// "slotpool" field of the output says which one ran).
//
// Options: --iters N (20000), --warmup N (200), --touch-every N (100; 0 = never),
//          --sizes a,b,c in bytes (4096,1048576,67108864), --api sync|async|both (both).
//
// Timing: only the allocate and free calls are timed (std::chrono::steady_clock around each),
// never the kernel or the synchronisation after it; the device is idle at every timed free, so a
// real cudaFree's implicit synchronisation costs nothing extra here. Warm-up pairs are not counted.
// The clock reads are in those figures (four a pair); `ns_per_pair_batch` times the same pairs
// again as one batch, without touching, which leaves them out.

#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CHECK(call)                                                                              \
    do {                                                                                         \
        cudaError_t err_ = (call);                                                               \
        if (err_ != cudaSuccess) {                                                               \
            std::fprintf(stderr, "%s:%d: %s failed: %s (%d)\n", __FILE__, __LINE__, #call,       \
                         cudaGetErrorString(err_), static_cast<int>(err_));                      \
            std::exit(1);                                                                        \
        }                                                                                        \
    } while (0)

// Writes `value` into the first word of every 4 KiB of the allocation.
__global__ void touch(uint32_t* p, size_t words, uint32_t value) {
    size_t stride = 1024;  // words per 4 KiB
    for (size_t i = (blockIdx.x * (size_t)blockDim.x + threadIdx.x) * stride; i < words;
         i += (size_t)gridDim.x * blockDim.x * stride) {
        p[i] = value;
    }
}

struct Options {
    long iters = 20000;
    long warmup = 200;
    long touch_every = 100;
    std::vector<size_t> sizes = {4096, 1 << 20, 64 << 20};
    std::string api = "both";
};

static Options parse(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "%s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "--iters") {
            o.iters = std::atol(next().c_str());
        } else if (a == "--warmup") {
            o.warmup = std::atol(next().c_str());
        } else if (a == "--touch-every") {
            o.touch_every = std::atol(next().c_str());
        } else if (a == "--api") {
            o.api = next();
        } else if (a == "--sizes") {
            o.sizes.clear();
            std::string s = next();
            size_t pos = 0;
            while (pos < s.size()) {
                size_t comma = s.find(',', pos);
                if (comma == std::string::npos) comma = s.size();
                o.sizes.push_back(std::strtoull(s.substr(pos, comma - pos).c_str(), nullptr, 10));
                pos = comma + 1;
            }
        } else {
            std::fprintf(stderr,
                         "usage: %s [--iters N] [--warmup N] [--touch-every N] [--sizes a,b,c] "
                         "[--api sync|async|both]\n",
                         argv[0]);
            std::exit(2);
        }
    }
    if (o.iters <= 0 || o.sizes.empty() || (o.api != "sync" && o.api != "async" && o.api != "both")) {
        std::fprintf(stderr, "bad options\n");
        std::exit(2);
    }
    return o;
}

static double now_ns() {
    return std::chrono::duration<double, std::nano>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

static double percentile(std::vector<double>& v, double q) {
    if (v.empty()) return 0.0;
    size_t k = std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5));
    std::nth_element(v.begin(), v.begin() + k, v.end());
    return v[k];
}

// One (api, size) run: returns after printing its JSON line. Exits on any CUDA error or on a
// touched value that does not read back.
static void run(const Options& o, bool async, size_t size, cudaStream_t stream, bool slotpool,
                const char* device_name) {
    std::vector<double> pair_ns;
    pair_ns.reserve(o.iters);
    double alloc_total = 0.0, free_total = 0.0;
    long touched = 0;
    for (long i = -o.warmup; i < o.iters; i++) {
        void* p = nullptr;
        double t0 = now_ns();
        cudaError_t e = async ? cudaMallocAsync(&p, size, stream) : cudaMalloc(&p, size);
        double t1 = now_ns();
        CHECK(e);
        if (o.touch_every > 0 && i >= 0 && i % o.touch_every == 0) {
            uint32_t value = 0x51070000u ^ static_cast<uint32_t>(i);
            size_t words = size / sizeof(uint32_t);
            size_t pages = (words + 1023) / 1024;
            unsigned blocks = static_cast<unsigned>(std::min<size_t>(1024, (pages + 255) / 256));
            touch<<<blocks, 256, 0, stream>>>(static_cast<uint32_t*>(p), words, value);
            CHECK(cudaGetLastError());
            uint32_t back = 0;
            size_t last_page = (words - 1) / 1024 * 1024;  // the last 4 KiB the kernel wrote
            CHECK(cudaMemcpyAsync(&back, static_cast<uint32_t*>(p) + last_page, sizeof back,
                                  cudaMemcpyDeviceToHost, stream));
            CHECK(cudaStreamSynchronize(stream));
            if (back != value) {
                std::fprintf(stderr, "size %zu iteration %ld: read back %#x, wrote %#x\n", size, i,
                             back, value);
                std::exit(1);
            }
            touched++;
        }
        double t2 = now_ns();
        e = async ? cudaFreeAsync(p, stream) : cudaFree(p);
        double t3 = now_ns();
        CHECK(e);
        if (i >= 0) {
            alloc_total += t1 - t0;
            free_total += t3 - t2;
            pair_ns.push_back((t1 - t0) + (t3 - t2));
        }
    }
    CHECK(cudaStreamSynchronize(stream));
    // The same pairs again, untouched and timed as one batch: each steady_clock read costs about
    // 34 ns on the H200 host (runtime_calls.cu), and the loop above reads it four times a pair.
    double b0 = now_ns();
    for (long i = 0; i < o.iters; i++) {
        void* p = nullptr;
        CHECK(async ? cudaMallocAsync(&p, size, stream) : cudaMalloc(&p, size));
        CHECK(async ? cudaFreeAsync(p, stream) : cudaFree(p));
    }
    double batch = (now_ns() - b0) / static_cast<double>(o.iters);
    CHECK(cudaStreamSynchronize(stream));
    double n = static_cast<double>(o.iters);
    double mean = (alloc_total + free_total) / n;
    double p50 = percentile(pair_ns, 0.50);
    double p99 = percentile(pair_ns, 0.99);
    double max = *std::max_element(pair_ns.begin(), pair_ns.end());
    std::printf(
        "{\"bench\":\"preload_loop\",\"api\":\"%s\",\"size\":%zu,\"iters\":%ld,\"touch_every\":%ld,"
        "\"touched\":%ld,\"slotpool\":%s,\"device\":\"%s\",\"ns_per_pair\":%.1f,"
        "\"ns_alloc\":%.1f,\"ns_free\":%.1f,\"p50_ns\":%.1f,\"p99_ns\":%.1f,\"max_ns\":%.1f,"
        "\"ns_per_pair_batch\":%.1f}\n",
        async ? "cudaMallocAsync+cudaFreeAsync" : "cudaMalloc+cudaFree", size, o.iters,
        o.touch_every, touched, slotpool ? "true" : "false", device_name, mean, alloc_total / n,
        free_total / n, p50, p99, max, batch);
    std::fflush(stdout);
}

int main(int argc, char** argv) {
    Options o = parse(argc, argv);
    CHECK(cudaFree(nullptr));  // context up before anything is timed
    int device = 0;
    CHECK(cudaGetDevice(&device));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, device));
    cudaStream_t stream;
    CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Did slotpool serve? The preload library opens libslotpool.so (RTLD_GLOBAL) at the first
    // allocation; sp_allocation_info then recognises the pointers it handed out.
    using info_fn = int (*)(void*, void**, size_t*, size_t*, int*);
    void* first = nullptr;
    CHECK(cudaMalloc(&first, 4096));
    bool interposed = false;
    if (auto info = reinterpret_cast<info_fn>(dlsym(RTLD_DEFAULT, "sp_allocation_info"))) {
        void* base = nullptr;
        size_t rounded = 0, requested = 0;
        int dev = -1;
        interposed = info(first, &base, &rounded, &requested, &dev) == 0;
    }
    CHECK(cudaFree(first));
    std::fprintf(stderr, "preload_loop: %s, slotpool %s\n", prop.name,
                 interposed ? "serves cudaMalloc" : "not serving (the real CUDA allocator)");
    for (size_t size : o.sizes) {
        if (o.api != "async") run(o, false, size, stream, interposed, prop.name);
        if (o.api != "sync") run(o, true, size, stream, interposed, prop.name);
    }
    CHECK(cudaStreamDestroy(stream));
    return 0;
}
