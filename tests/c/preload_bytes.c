/*
 * preload_bytes.c - under LD_PRELOAD=libslotpool_preload.so on the simulated device, every live
 * allocation keeps its bytes, seen through CUDA's own calls: frees of other allocations (on the
 * same thread and on others), reuse of their memory, cudaDeviceSynchronize and sp_empty_cache,
 * with several threads allocating and freeing at once.
 *
 * Each allocation gets its own content: the pattern of its seed over a head (cudaMemcpy
 * host-to-device) and one byte value over the rest (cudaMemset / cudaMemsetAsync); some are
 * copies of another allocation (cudaMemcpy device-to-device). Contents are read back with
 * cudaMemcpy / cudaMemcpyAsync (device-to-host and cudaMemcpyDefault) and compared. After every
 * free the edges of every live allocation of the thread are checked (where a wrong split or
 * merge would land); every allocation in full at each phase.
 *
 * Built and run by crates/slotpool-preload/tests/bytes.rs, linked like tests/c/preload_probe.c
 * against the real libcudart.so.13 (no driver needed):
 *
 *   SLOTPOOL_BACKEND=sim SLOTPOOL_CONF=sim_bytes:1,growth:vmm \
 *     LD_PRELOAD=libslotpool_preload.so ./preload_bytes
 *
 * Prints "bytes checks=N failures=N allocs=N frees=N sync_rc=N" and exits 0 when every check
 * passed, 1 otherwise (the first failures are on stderr).
 */
#define _GNU_SOURCE /* RTLD_DEFAULT */
#include <dlfcn.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum { H2D = 1, D2H = 2, D2D = 3, DEFAULT_KIND = 4 };
extern cudaError_t cudaMalloc(void** devPtr, size_t size);
extern cudaError_t cudaFree(void* devPtr);
extern cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t stream);
extern cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t stream);
extern cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, int kind);
extern cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind,
                                   cudaStream_t stream);
extern cudaError_t cudaMemset(void* devPtr, int value, size_t count);
extern cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream);
extern cudaError_t cudaDeviceSynchronize(void);

typedef int (*sp_empty_cache_fn)(int);
typedef int (*sp_check_invariants_fn)(int);
static sp_empty_cache_fn empty_cache;
static sp_check_invariants_fn check_invariants;

enum { THREADS = 4, LIVE = 16, ROUNDS = 300, EDGE = 4096, MAX_REPORTS = 20 };

static pthread_mutex_t report_lock = PTHREAD_MUTEX_INITIALIZER;
static int failures = 0;
static long checks = 0;
static int last_sync_rc = 0;
#define COUNT() __atomic_add_fetch(&checks, 1, __ATOMIC_RELAXED)

static void fail(const char* what, const void* p, size_t at, int rc) {
    pthread_mutex_lock(&report_lock);
    if (failures++ < MAX_REPORTS) {
        fprintf(stderr, "preload_bytes: %s: allocation %p, offset %zu, rc %d\n", what, p, at, rc);
    }
    pthread_mutex_unlock(&report_lock);
}

/* One allocation this program owns, and what it must hold. */
struct block {
    void* ptr;
    size_t size;
    uint64_t seed;  /* pattern of the head */
    size_t head;    /* bytes [0, head) hold the pattern, [head, size) the byte `value` */
    int value;
};

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The byte at offset i of block b. */
static unsigned char expected_byte(const struct block* b, size_t i) {
    if (i >= b->head) return (unsigned char)b->value;
    return (unsigned char)(mix(b->seed ^ ((uint64_t)(i / 8) << 20)) >> (8 * (i % 8)));
}

static void expected_into(const struct block* b, size_t from, size_t n, unsigned char* out) {
    for (size_t i = 0; i < n; i++) out[i] = expected_byte(b, from + i);
}

/* Writes b's content through the interposed calls. */
static void write_block(const struct block* b, unsigned char* host, cudaStream_t stream) {
    int rc = (b->seed & 1) ? cudaMemsetAsync(b->ptr, b->value, b->size, stream)
                           : cudaMemset(b->ptr, b->value, b->size);
    COUNT();
    if (rc != 0) fail("cudaMemset", b->ptr, 0, rc);
    if (b->head > 0) {
        expected_into(b, 0, b->head, host);
        rc = (b->seed & 2) ? cudaMemcpyAsync(b->ptr, host, b->head, H2D, stream)
                           : cudaMemcpy(b->ptr, host, b->head, (b->seed & 4) ? DEFAULT_KIND : H2D);
        COUNT();
        if (rc != 0) fail("cudaMemcpy host-to-device", b->ptr, 0, rc);
    }
}

/* Reads n bytes of b at offset from and compares them with what b must hold. */
static void check_range(const struct block* b, size_t from, size_t n, unsigned char* host,
                        unsigned char* want, const char* phase) {
    if (n == 0) return;
    memset(host, 0x5A, n);
    int kind = (from & 1) ? DEFAULT_KIND : D2H;
    int rc = cudaMemcpy(host, (const char*)b->ptr + from, n, kind);
    COUNT();
    if (rc != 0) {
        fail("cudaMemcpy device-to-host", b->ptr, from, rc);
        return;
    }
    expected_into(b, from, n, want);
    if (memcmp(host, want, n) != 0) {
        size_t at = 0;
        while (host[at] == want[at]) at++;
        char what[160];
        snprintf(what, sizeof what, "after %s: byte is %#04x, must be %#04x", phase, host[at],
                 want[at]);
        fail(what, b->ptr, from + at, 0);
    }
}

static void check_all(const struct block* live, int n, unsigned char* host, unsigned char* want,
                      int edges_only, const char* phase) {
    for (int i = 0; i < n; i++) {
        const struct block* b = &live[i];
        if (!edges_only || b->size <= 2 * EDGE) {
            check_range(b, 0, b->size, host, want, phase);
        } else {
            check_range(b, 0, EDGE, host, want, phase);
            check_range(b, b->size - EDGE, EDGE, host, want, phase);
        }
    }
}

static size_t random_size(uint64_t* rng) {
    static const size_t sizes[] = {1, 512, 4000, 65536, 300000, 1 << 20, (2 << 20) + 77};
    *rng = mix(*rng);
    size_t s = sizes[*rng % (sizeof sizes / sizeof sizes[0])];
    return s + (*rng >> 32) % 1000;
}

#define MAX_SIZE ((size_t)(2 << 20) + 77 + 1000)

struct worker {
    int id;
    struct block live[LIVE];
    int n;
    long allocs, frees;
};
static pthread_barrier_t barrier;
static long total_allocs = 0, total_frees = 0;

static void free_block(struct block* b, int async, cudaStream_t stream) {
    int rc = async ? cudaFreeAsync(b->ptr, stream) : cudaFree(b->ptr);
    COUNT();
    if (rc != 0) fail("free", b->ptr, 0, rc);
}

static void* run_worker(void* arg) {
    struct worker* w = arg;
    unsigned char* host = malloc(MAX_SIZE);
    unsigned char* want = malloc(MAX_SIZE);
    uint64_t rng = 0x1234 + (uint64_t)w->id * 0x9E3779B9ull;
    cudaStream_t stream = NULL; /* the legacy default stream */
    pthread_barrier_wait(&barrier);
    for (int round = 0; round < ROUNDS; round++) {
        rng = mix(rng);
        int op = (int)(rng % 8);
        if (w->n > 0 && (w->n == LIVE || op < 3)) {
            int i = (int)((rng >> 8) % (uint64_t)w->n);
            free_block(&w->live[i], (rng >> 16) & 1, stream);
            w->live[i] = w->live[--w->n];
            w->frees++;
            check_all(w->live, w->n, host, want, 1, "a free");
        } else if (w->n > 0 && op == 3) {
            /* A copy of a live allocation, device to device. */
            struct block* from = &w->live[(rng >> 8) % (uint64_t)w->n];
            struct block b = *from;
            int rc = cudaMalloc(&b.ptr, b.size);
            COUNT();
            if (rc != 0) {
                fail("cudaMalloc", NULL, 0, rc);
                continue;
            }
            w->allocs++;
            rc = cudaMemcpy(b.ptr, from->ptr, b.size, (rng & 0x100) ? DEFAULT_KIND : D2D);
            COUNT();
            if (rc != 0) fail("cudaMemcpy device-to-device", b.ptr, 0, rc);
            w->live[w->n++] = b;
            check_range(&b, 0, b.size, host, want, "a device-to-device copy");
        } else {
            struct block b;
            b.size = random_size(&rng);
            b.seed = mix(rng ^ (uint64_t)w->id);
            b.head = b.size * (size_t)(b.seed % 4) / 3;
            if (b.head > b.size) b.head = b.size;
            b.value = (int)((b.seed >> 8) & 0xFF);
            int rc = (rng & 0x200) ? cudaMallocAsync(&b.ptr, b.size, stream)
                                   : cudaMalloc(&b.ptr, b.size);
            COUNT();
            if (rc != 0) {
                fail("allocation", NULL, 0, rc);
                continue;
            }
            w->allocs++;
            write_block(&b, host, stream);
            w->live[w->n++] = b;
        }
        if (round % 50 == 49) {
            int rc = cudaDeviceSynchronize();
            __atomic_store_n(&last_sync_rc, rc, __ATOMIC_RELAXED);
            check_all(w->live, w->n, host, want, 0, "cudaDeviceSynchronize");
            rc = empty_cache(-1);
            COUNT();
            if (rc != 0) fail("sp_empty_cache", NULL, 0, rc);
            check_all(w->live, w->n, host, want, 0, "sp_empty_cache");
        }
    }
    check_all(w->live, w->n, host, want, 0, "the thread's last round");
    free(host);
    free(want);
    return NULL;
}

int main(void) {
    /* The preload library opens libslotpool.so at the first allocation call. */
    void* first = NULL;
    int rc = cudaMalloc(&first, 4096);
    empty_cache = (sp_empty_cache_fn)dlsym(RTLD_DEFAULT, "sp_empty_cache");
    check_invariants = (sp_check_invariants_fn)dlsym(RTLD_DEFAULT, "sp_check_invariants");
    if (rc != 0 || empty_cache == NULL || check_invariants == NULL) {
        fprintf(stderr, "preload_bytes: slotpool does not serve this process (cudaMalloc rc %d)\n",
                rc);
        return 2;
    }
    struct block probe = {first, 4096, 77, 1000, 0xA5};
    unsigned char* host = malloc(MAX_SIZE);
    unsigned char* want = malloc(MAX_SIZE);
    write_block(&probe, host, NULL);
    check_range(&probe, 0, probe.size, host, want, "the first write");

    static struct worker workers[THREADS];
    pthread_t t[THREADS];
    pthread_barrier_init(&barrier, NULL, THREADS);
    for (int i = 0; i < THREADS; i++) {
        workers[i].id = i;
        pthread_create(&t[i], NULL, run_worker, &workers[i]);
    }
    for (int i = 0; i < THREADS; i++) {
        pthread_join(t[i], NULL);
        total_allocs += workers[i].allocs;
        total_frees += workers[i].frees;
    }
    pthread_barrier_destroy(&barrier);

    /* Every thread's leftovers, checked from here; then half of them freed from this thread
     * (frees of other threads' allocations), the cache emptied, the rest checked again. */
    check_range(&probe, 0, probe.size, host, want, "the threads");
    for (int i = 0; i < THREADS; i++) {
        check_all(workers[i].live, workers[i].n, host, want, 0, "the threads");
    }
    for (int i = 0; i < THREADS; i++) {
        struct worker* w = &workers[i];
        for (int j = w->n - 1; j >= 0; j -= 2) {
            free_block(&w->live[j], j & 1, NULL);
            w->live[j] = w->live[--w->n];
            total_frees++;
        }
    }
    rc = empty_cache(-1);
    COUNT();
    if (rc != 0) fail("sp_empty_cache", NULL, 0, rc);
    check_range(&probe, 0, probe.size, host, want, "frees of other threads' allocations");
    for (int i = 0; i < THREADS; i++) {
        check_all(workers[i].live, workers[i].n, host, want, 0,
                  "frees of other threads' allocations and sp_empty_cache");
    }
    rc = check_invariants(0);
    COUNT();
    if (rc != 0) fail("sp_check_invariants", NULL, 0, rc);
    for (int i = 0; i < THREADS; i++) {
        for (int j = 0; j < workers[i].n; j++) free_block(&workers[i].live[j], 0, NULL);
        total_frees += workers[i].n;
    }
    free_block(&probe, 0, NULL);
    total_allocs++;
    total_frees++;
    rc = empty_cache(-1);
    COUNT();
    if (rc != 0) fail("sp_empty_cache", NULL, 0, rc);
    free(host);
    free(want);
    printf("bytes checks=%ld failures=%d allocs=%ld frees=%ld sync_rc=%d\n", checks, failures,
           total_allocs, total_frees, last_sync_rc);
    return failures == 0 ? 0 : 1;
}
