/*
 * preload_probe.c - a tiny CUDA program for the LD_PRELOAD tests of crates/slotpool-preload.
 *
 * Linked against the real libcudart.so.13 (the nvidia-cuda-runtime wheel, see
 * scripts/fetch-cudart.sh), it makes the interposed calls and prints one line per call:
 *
 *     NAME rc=CODE [ptr=0x...] [owned=0|1|-1] [requested=BYTES] [same=0|1] ...
 *
 * It checks nothing itself; crates/slotpool-preload/tests/preload.rs runs it without preload
 * (the real runtime; on a machine without a driver every call fails with 35 or 100) and with
 * LD_PRELOAD=libslotpool_preload.so, and compares. "owned" asks slotpool's sp_allocation_info,
 * found with dlsym(RTLD_DEFAULT) (libslotpool.so is opened RTLD_GLOBAL by the preload library):
 * 1 = slotpool served this pointer, 0 = it did not, -1 = no slotpool in the process. The driver
 * API calls are made through dlsym(RTLD_DEFAULT) too, since the probe does not link libcuda:
 * without a driver they exist only when the preload library provides them.
 *
 * Build: cc -std=c11 -Wall -Wextra -Werror preload_probe.c -L<wheel>/nvidia/cu13/lib
 *            -l:libcudart.so.13 -Wl,-rpath,<wheel>/nvidia/cu13/lib -ldl -lpthread
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The prototypes of cuda_runtime_api.h and cuda.h that are used. The wheel's headers need
 * crt/host_defines.h from the nvcc package, so they are not included; cudaError_t and CUresult
 * are C enums, i.e. int. */
typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
extern cudaError_t cudaMalloc(void** devPtr, size_t size);
extern cudaError_t cudaFree(void* devPtr);
extern cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream);
extern cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream);
extern cudaError_t cudaStreamCreate(cudaStream_t* stream);
extern cudaError_t cudaStreamDestroy(cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);
extern cudaError_t cudaMallocManaged(void** devPtr, size_t size, unsigned int flags);
extern cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags);
/* Entry points of programs built with --default-stream per-thread. */
extern cudaError_t cudaMallocAsync_ptsz(void** devPtr, size_t size, cudaStream_t stream);
extern cudaError_t cudaFreeAsync_ptsz(void* devPtr, cudaStream_t stream);

typedef int (*sp_allocation_info_fn)(void*, void**, size_t*, size_t*, int*);
typedef CUresult (*cu_mem_alloc_fn)(CUdeviceptr*, size_t);
typedef CUresult (*cu_mem_free_fn)(CUdeviceptr);

static sp_allocation_info_fn allocation_info;

/* " owned=.. requested=.." for p. */
static void print_owner(void* p) {
    if (allocation_info == NULL) {
        printf(" owned=-1");
        return;
    }
    void* base = NULL;
    size_t size = 0, requested = 0;
    int device = -1;
    int st = allocation_info(p, &base, &size, &requested, &device);
    if (st == 0) {
        printf(" owned=1 requested=%zu device=%d", requested, device);
    } else {
        printf(" owned=0");
    }
}

/* ----------------------------------------------------------------------------------------- */
/* Threads: many allocations at once from the first call on (races the lazy start).           */

enum { THREADS = 8, ROUNDS = 300 };
static pthread_barrier_t barrier;

struct thread_result {
    int ok;
    int failed;
    int first_rc;
};

static void* worker(void* arg) {
    struct thread_result* r = arg;
    pthread_barrier_wait(&barrier);
    uintptr_t seed = (uintptr_t)arg;
    for (int i = 0; i < ROUNDS; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        size_t size = 512 + (size_t)(seed >> 40) % (4u << 20);
        void* p = NULL;
        int rc = (i % 2 == 0) ? (int)cudaMalloc(&p, size) : (int)cudaMallocAsync(&p, size, 0);
        if (rc == 0) {
            rc = (i % 3 == 0) ? (int)cudaFreeAsync(p, 0) : (int)cudaFree(p);
        }
        if (rc == 0) {
            r->ok++;
        } else {
            if (r->failed++ == 0) r->first_rc = rc;
        }
    }
    return NULL;
}

static void threads(void) {
    pthread_t t[THREADS];
    struct thread_result r[THREADS] = {{0, 0, 0}};
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) pthread_create(&t[i], NULL, worker, &r[i]);
    int ok = 0, failed = 0, first_rc = 0;
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        ok += r[i].ok;
        if (r[i].failed && !failed) first_rc = r[i].first_rc;
        failed += r[i].failed;
    }
    pthread_barrier_destroy(&barrier);
    printf("threads rc=%d ok=%d failed=%d\n", first_rc, ok, failed);
}

/* ----------------------------------------------------------------------------------------- */

int main(void) {
    /* First: concurrent first calls. */
    threads();

    allocation_info = (sp_allocation_info_fn)dlsym(RTLD_DEFAULT, "sp_allocation_info");
    printf("slotpool present=%d\n", allocation_info != NULL);

    int rc = cudaFree(NULL);
    printf("free_null rc=%d\n", rc);

    void* p = NULL;
    rc = cudaMalloc(&p, 1 << 20);
    printf("malloc rc=%d ptr=%p", rc, p);
    print_owner(p);
    printf("\n");
    void* first = p;

    rc = cudaMalloc(NULL, 1 << 20);
    printf("malloc_null_out rc=%d\n", rc);

    void* z = NULL;
    rc = cudaMalloc(&z, 0);
    printf("malloc_zero rc=%d\n", rc);

    rc = cudaFree(p);
    printf("free rc=%d\n", rc);
    rc = cudaFree(p);
    printf("double_free rc=%d\n", rc);

    rc = cudaMalloc(&p, 1 << 20);
    printf("malloc_again rc=%d same=%d\n", rc, p == first && p != NULL);
    rc = cudaFree(p);
    printf("free_again rc=%d\n", rc);

    int host_object = 0;
    rc = cudaFree(&host_object);
    printf("free_foreign rc=%d\n", rc);

    void* a = NULL;
    rc = cudaMallocAsync(&a, 4096, 0);
    printf("malloc_async rc=%d ptr=%p", rc, a);
    print_owner(a);
    printf("\n");
    rc = cudaFreeAsync(a, 0);
    printf("free_async rc=%d\n", rc);

    /* Two created streams; without a driver, made-up handles (the simulated backend takes any
     * handle, and the real runtime is never given them). */
    cudaStream_t s1 = NULL, s2 = NULL;
    int real_streams = cudaStreamCreate(&s1) == 0 && cudaStreamCreate(&s2) == 0;
    if (!real_streams) {
        s1 = (cudaStream_t)(uintptr_t)0x5100;
        s2 = (cudaStream_t)(uintptr_t)0x5200;
    }
    rc = cudaMallocAsync(&a, 3 << 20, s1);
    printf("malloc_async_stream rc=%d ptr=%p", rc, a);
    print_owner(a);
    printf("\n");
    rc = cudaFreeAsync(a, s2);
    printf("free_async_other_stream rc=%d\n", rc);
    if (real_streams) {
        cudaDeviceSynchronize();
        cudaStreamDestroy(s1);
        cudaStreamDestroy(s2);
    }

    rc = cudaMallocAsync(NULL, 4096, 0);
    printf("malloc_async_null_out rc=%d\n", rc);
    rc = cudaMallocAsync(&a, 0, 0);
    printf("malloc_async_zero rc=%d\n", rc);

    rc = cudaMallocAsync_ptsz(&a, 8192, 0);
    printf("malloc_async_ptsz rc=%d ptr=%p", rc, a);
    print_owner(a);
    printf("\n");
    rc = cudaFreeAsync_ptsz(a, 0);
    printf("free_async_ptsz rc=%d\n", rc);

    /* Freed with the other API than it was allocated with. */
    rc = cudaMallocAsync(&a, 65536, 0);
    int rc2 = rc == 0 ? cudaFree(a) : -1;
    printf("malloc_async_then_free rc=%d free_rc=%d\n", rc, rc2);

    /* Not interposed: managed memory is the real runtime's, and so is its cudaFree. */
    void* m = NULL;
    rc = cudaMallocManaged(&m, 1 << 20, 1 /* cudaMemAttachGlobal */);
    rc2 = rc == 0 ? cudaFree(m) : -1;
    printf("managed rc=%d free_rc=%d\n", rc, rc2);

    /* Interposed, but the real runtime decides: slotpool only follows a grant that succeeded. */
    rc = cudaDeviceEnablePeerAccess(1, 0);
    printf("peer_access rc=%d\n", rc);

    cu_mem_alloc_fn cu_alloc = (cu_mem_alloc_fn)dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    cu_mem_free_fn cu_free = (cu_mem_free_fn)dlsym(RTLD_DEFAULT, "cuMemFree_v2");
    printf("driver present=%d\n", cu_alloc != NULL && cu_free != NULL);
    if (cu_alloc != NULL && cu_free != NULL) {
        CUdeviceptr d = 0;
        rc = (int)cu_alloc(&d, 2 << 20);
        printf("cu_mem_alloc rc=%d ptr=%p", rc, (void*)(uintptr_t)d);
        print_owner((void*)(uintptr_t)d);
        printf("\n");
        rc = (int)cu_free(d);
        printf("cu_mem_free rc=%d\n", rc);
        rc = (int)cu_alloc(NULL, 4096);
        printf("cu_mem_alloc_null_out rc=%d\n", rc);
    }

    /* Exit without freeing: the exit line must still come. */
    void* leaked = NULL;
    rc = cudaMalloc(&leaked, 12345);
    printf("malloc_leaked rc=%d\n", rc);
    return 0;
}
