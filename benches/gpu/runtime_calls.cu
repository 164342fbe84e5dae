// runtime_calls.cu - what the CUDA calls that slotpool's LD_PRELOAD library makes on every
// allocation cost on this host: the mean host time of each, in a loop of a million calls on an
// idle device, plus the cost of one steady_clock read (preload_loop reads the clock four times a
// pair). One JSON line per call.
//
//   nvcc -O2 -std=c++17 -cudart shared -o runtime_calls benches/gpu/runtime_calls.cu -lcuda

#include <cuda.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

template <class F>
static void time_it(const char* name, F f) {
    const long n = 1000000;
    for (long i = 0; i < 1000; i++) f();
    auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < n; i++) f();
    auto t1 = std::chrono::steady_clock::now();
    double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
    std::printf("{\"call\":\"%s\",\"ns\":%.1f}\n", name, ns);
}

int main() {
    if (cudaFree(nullptr) != cudaSuccess) {
        std::fprintf(stderr, "no CUDA device\n");
        return 1;
    }
    cudaStream_t s;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    volatile int sink = 0;
    time_it("steady_clock_now", [&] {
        sink = sink + (int)std::chrono::steady_clock::now().time_since_epoch().count();
    });
    time_it("cudaGetDevice", [&] {
        int d;
        cudaGetDevice(&d);
        sink = sink + d;
    });
    time_it("cuCtxGetCurrent", [&] {
        CUcontext c;
        cuCtxGetCurrent(&c);
        sink = sink + (c != nullptr);
    });
    time_it("cuCtxGetDevice", [&] {
        CUdevice d;
        cuCtxGetDevice(&d);
        sink = sink + d;
    });
    time_it("cudaStreamGetDevice", [&] {
        int d;
        cudaStreamGetDevice(s, &d);
        sink = sink + d;
    });
    time_it("cuStreamGetCtx", [&] {
        CUcontext c;
        cuStreamGetCtx(s, &c);
        sink = sink + (c != nullptr);
    });
    time_it("cudaGetDevice+cuCtxGetCurrent", [&] {
        int d;
        CUcontext c;
        cudaGetDevice(&d);
        cuCtxGetCurrent(&c);
        sink = sink + d + (c != nullptr);
    });
    cudaStreamDestroy(s);
    return 0;
}
