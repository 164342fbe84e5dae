/*
 * smoke.c - the C ABI from C: every group of calls and every error code reachable on the
 * simulated backend. Built and run by crates/slotpool-capi/tests/c_programs.rs:
 *
 *   cc -std=c11 -Wall -Wextra -Werror -Iinclude tests/c/smoke.c -Ltarget/release -lslotpool
 *   ln -sf libslotpool.so target/release/libslotpool.so.0     (the SONAME the program records)
 *   LD_LIBRARY_PATH=target/release SLOTPOOL_BACKEND=sim SLOTPOOL_CONF=sim_devices:2 ./smoke
 *
 * With SLOTPOOL_TEST_NO_CUDA=1 (set by the runner on machines without a driver) it also checks
 * that sp_init("cuda") fails with SP_ERR_BACKEND_UNAVAILABLE. Exit status 0 = all checks passed.
 */
#define _POSIX_C_SOURCE 200809L /* setenv, strdup */
#include "slotpool.h"

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Layout of the public structs: the same numbers as the const asserts in the Rust crate. */
_Static_assert(sizeof(sp_status) == sizeof(int), "sp_status is an int");
_Static_assert(sizeof(sp_route_kind) == sizeof(int), "sp_route_kind is an int");
_Static_assert(sizeof(sp_trace_action) == sizeof(int), "sp_trace_action is an int");
_Static_assert(sizeof(sp_trace_event) == 40, "sp_trace_event");
_Static_assert(offsetof(sp_trace_event, addr) == 8, "sp_trace_event.addr");
_Static_assert(offsetof(sp_trace_event, time_us) == 32, "sp_trace_event.time_us");
_Static_assert(sizeof(sp_pool_id) == 16, "sp_pool_id");
_Static_assert(offsetof(sp_pool_id, b) == 8, "sp_pool_id.b");
_Static_assert(sizeof(sp_pool_options) == 24, "sp_pool_options");
_Static_assert(offsetof(sp_pool_options, use_on_oom) == 4, "sp_pool_options.use_on_oom");
_Static_assert(offsetof(sp_pool_options, limit_bytes) == 8, "sp_pool_options.limit_bytes");
_Static_assert(offsetof(sp_pool_options, pausable) == 16, "sp_pool_options.pausable");
_Static_assert(sizeof(sp_stat) == 32, "sp_stat");
_Static_assert(offsetof(sp_stat, peak) == 8, "sp_stat.peak");
_Static_assert(offsetof(sp_stat, allocated) == 16, "sp_stat.allocated");
_Static_assert(offsetof(sp_stat, freed) == 24, "sp_stat.freed");
_Static_assert(sizeof(sp_stat_array) == 96, "sp_stat_array");
_Static_assert(offsetof(sp_stat_array, small_pool) == 32, "sp_stat_array.small_pool");
_Static_assert(offsetof(sp_stat_array, large_pool) == 64, "sp_stat_array.large_pool");
_Static_assert(sizeof(sp_memory_stats) == 1072, "sp_memory_stats");
_Static_assert(offsetof(sp_memory_stats, reserved_paused_bytes) == 976,
               "sp_memory_stats.reserved_paused_bytes");
_Static_assert(offsetof(sp_memory_stats, segment) == 96, "segment");
_Static_assert(offsetof(sp_memory_stats, requested_bytes) == 768, "requested_bytes");
_Static_assert(offsetof(sp_memory_stats, num_alloc_retries) == 864, "num_alloc_retries");
_Static_assert(offsetof(sp_memory_stats, num_device_free) == 896, "num_device_free");
_Static_assert(offsetof(sp_memory_stats, oversize_allocations) == 904, "oversize_allocations");
_Static_assert(offsetof(sp_memory_stats, oversize_segments) == 936, "oversize_segments");
_Static_assert(offsetof(sp_memory_stats, max_split_size) == 968, "max_split_size");
_Static_assert(sizeof(sp_allocation) == 32, "sp_allocation");
_Static_assert(offsetof(sp_allocation, stream) == 24, "sp_allocation.stream");
_Static_assert(sizeof(sp_block_state) == sizeof(int), "sp_block_state is an int");
_Static_assert(sizeof(sp_segment_view) == 64, "sp_segment_view");
_Static_assert(offsetof(sp_segment_view, pool) == 40, "sp_segment_view.pool");
_Static_assert(offsetof(sp_segment_view, block_count) == 56, "sp_segment_view.block_count");
_Static_assert(sizeof(sp_block_view) == 32, "sp_block_view");
_Static_assert(offsetof(sp_block_view, state) == 24, "sp_block_view.state");

static int failures = 0;
static int checks = 0;

#define EXPECT(call, want)                                                                     \
    do {                                                                                       \
        sp_status s_ = (call);                                                                 \
        checks++;                                                                              \
        if (s_ != (want)) {                                                                    \
            fprintf(stderr, "%s:%d: %s returned %d, expected %d (%s)\n", __FILE__, __LINE__,   \
                    #call, (int)s_, (int)(want), sp_last_error_message());                     \
            failures++;                                                                        \
        }                                                                                      \
    } while (0)
#define OK(call) EXPECT(call, SP_OK)
#define CHECK(cond)                                                                            \
    do {                                                                                       \
        checks++;                                                                              \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);           \
            failures++;                                                                        \
        }                                                                                      \
    } while (0)
#define MESSAGE_HAS(text) CHECK(strstr(sp_last_error_message(), (text)) != NULL)

static const size_t MiB = (size_t)1 << 20;

static void initialisation(void) {
    int init = -1;
    /* Status names, as cudaGetErrorName gives them; they never initialise the library. */
    CHECK(strcmp(sp_status_name(SP_OK), "SP_OK") == 0);
    CHECK(strcmp(sp_status_name(SP_ERR_OUT_OF_MEMORY), "SP_ERR_OUT_OF_MEMORY") == 0);
    CHECK(strcmp(sp_status_name(SP_ERR_CONFIG), "SP_ERR_CONFIG") == 0);
    CHECK(strcmp(sp_status_name(-1), "SP_ERR_UNRECOGNIZED") == 0);
    CHECK(strcmp(sp_status_name(1000), "SP_ERR_UNRECOGNIZED") == 0);
    OK(sp_is_initialized(&init));
    CHECK(init == 0);
    if (getenv("SLOTPOOL_TEST_NO_CUDA")) {
        EXPECT(sp_init("cuda", NULL), SP_ERR_BACKEND_UNAVAILABLE);
        MESSAGE_HAS("libcuda");
    }
    /* SP_ERR_CONFIG and SP_ERR_INVALID_ARGUMENT leave nothing initialised. */
    EXPECT(sp_init("sim", "growth:vmm,no_such_key:1"), SP_ERR_CONFIG);
    MESSAGE_HAS("no_such_key");
    EXPECT(sp_init("tpu", NULL), SP_ERR_INVALID_ARGUMENT);
    /* SP_ERR_NOT_INITIALIZED: lazy initialisation from a bad environment. */
    {
        const char* saved = getenv("SLOTPOOL_CONF");
        char* copy = saved ? strdup(saved) : NULL;
        int n = 0;
        setenv("SLOTPOOL_CONF", "bogus:1", 1);
        EXPECT(sp_device_count(&n), SP_ERR_NOT_INITIALIZED);
        MESSAGE_HAS("bogus");
        if (copy) {
            setenv("SLOTPOOL_CONF", copy, 1);
            free(copy);
        } else {
            unsetenv("SLOTPOOL_CONF");
        }
    }
    OK(sp_is_initialized(&init));
    CHECK(init == 0);
    /* The configuration readers never initialise: before sp_init they read what lazy
     * initialisation would use. */
    {
        char conf[512];
        size_t len = 0;
        double v = -1;
        OK(sp_config_get_str("conf", conf, sizeof conf, &len));
        CHECK(len == strlen(conf) && strstr(conf, "growth:") == conf);
        OK(sp_config_get_f64("sim_devices", &v));
        CHECK(v == 2);
        OK(sp_is_initialized(&init));
        CHECK(init == 0);
    }
    /* The first call initialises from SLOTPOOL_BACKEND / SLOTPOOL_CONF. */
    int count = 0;
    OK(sp_device_count(&count));
    CHECK(count == 2);
    OK(sp_is_initialized(&init));
    CHECK(init == 1);
    const char* backend = NULL;
    OK(sp_backend_name(&backend));
    CHECK(backend && strcmp(backend, "sim") == 0);
    EXPECT(sp_init("sim", NULL), SP_ERR_INVALID_STATE);
    MESSAGE_HAS("already initialised");

    int major = -1, minor = -1, patch = -1;
    OK(sp_version(&major, &minor, &patch));
    CHECK(major == SP_VERSION_MAJOR && minor == SP_VERSION_MINOR && patch == SP_VERSION_PATCH);
    CHECK(sp_has_feature("sim") == 1);
    CHECK(sp_has_feature("checkpoint") == 1);
    CHECK(sp_has_feature("traces") == 1);
    CHECK(sp_has_feature(NULL) == 0);
}

static void allocation(void) {
    /* Two streams. */
    void* a = NULL;
    void* b = NULL;
    OK(sp_alloc(0, MiB, 1, &a));
    OK(sp_alloc(0, 1000, 2, &b));
    CHECK(a != NULL && b != NULL && a != b);
    void* base = NULL;
    size_t size = 0, requested = 0;
    int device = -1;
    OK(sp_allocation_info(b, &base, &size, &requested, &device));
    CHECK(base == b && size == 1024 && requested == 1000 && device == 0);
    OK(sp_record_stream(a, 2));
    OK(sp_free(a));
    OK(sp_free(b));
    OK(sp_process_events(0));
    /* Freed memory comes back at once on its own stream. */
    void* c = NULL;
    OK(sp_alloc(0, 1000, 2, &c));
    CHECK(c == b);
    OK(sp_free(c));
    /* The second device. */
    void* d = NULL;
    OK(sp_alloc(1, 4096, 0, &d));
    OK(sp_allocation_info(d, &base, &size, &requested, &device));
    CHECK(device == 1);
    OK(sp_free(d));
    size_t largest = 0;
    OK(sp_largest_free_block(0, &largest));
    CHECK(largest >= MiB);
    OK(sp_empty_cache(0));
    OK(sp_empty_cache(-1));
    OK(sp_largest_free_block(0, &largest));
    CHECK(largest == 0);

    /* Memory limit and fraction. */
    uint64_t limit = 0, total = 0;
    OK(sp_set_memory_limit(1, 64 * MiB));
    void* big = (void*)1;
    EXPECT(sp_alloc(1, 128 * MiB, 0, &big), SP_ERR_OUT_OF_MEMORY);
    CHECK(big == NULL);
    MESSAGE_HAS("out of memory");
    OK(sp_set_memory_limit(1, 0));
    OK(sp_memory_limit_get(1, &limit, &total));
    CHECK(limit == total && total > 0);
    OK(sp_set_memory_fraction(1, 0.5));
    OK(sp_memory_limit_get(1, &limit, &total));
    CHECK(limit == total / 2);
    EXPECT(sp_set_memory_fraction(1, 0.0), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_set_memory_fraction(1, 1.5), SP_ERR_INVALID_ARGUMENT);
    OK(sp_set_memory_fraction(1, 1.0));
}

static void pools_and_routes(void) {
    sp_pool_id pool = {0, 42};
    sp_pool_options opts = {0, 1, 0, 0};
    uint64_t uses = 0;
    OK(sp_pool_create_or_incref(0, pool, &opts, &uses));
    CHECK(uses == 1);
    OK(sp_pool_create_or_incref(0, pool, NULL, &uses));
    CHECK(uses == 2);
    OK(sp_pool_use_count(0, pool, &uses));
    CHECK(uses == 2);
    void* p = NULL;
    OK(sp_pool_alloc(0, pool, 3 * MiB, 0, &p));
    sp_memory_stats ps;
    OK(sp_pool_stats_get(0, pool, &ps));
    CHECK(ps.allocation.all.current == 1);
    CHECK(ps.requested_bytes.all.current == (int64_t)(3 * MiB));
    OK(sp_free(p));
    opts.no_split = 1;
    opts.limit_bytes = 256 * MiB;
    OK(sp_pool_set_options(0, pool, &opts));
    sp_pool_options got = {9, 9, 9, 9};
    OK(sp_pool_options_get(0, pool, &got));
    CHECK(got.no_split == 1 && got.use_on_oom == 1 && got.limit_bytes == 256 * MiB && got.pausable == 0);
    sp_pool_id unknown = {0, 4242};
    EXPECT(sp_pool_options_get(0, unknown, &got), SP_ERR_UNKNOWN_POOL);
    EXPECT(sp_pool_options_get(0, pool, NULL), SP_ERR_INVALID_ARGUMENT);
    /* Live allocations: ask for the total, then read them, lowest address first. */
    {
        void *x = NULL, *y = NULL;
        OK(sp_pool_alloc(0, pool, 1000, 7, &x));
        OK(sp_pool_alloc(0, pool, 5000, 7, &y));
        size_t total = 0;
        OK(sp_pool_live_allocations(0, pool, NULL, 0, &total));
        CHECK(total == 2);
        sp_allocation live[2];
        OK(sp_pool_live_allocations(0, pool, live, 2, &total));
        void* low = x < y ? x : y;
        CHECK(live[0].ptr == low && live[0].ptr < live[1].ptr && live[0].stream == 7);
        CHECK(live[0].requested_size == (low == x ? 1000u : 5000u));
        CHECK(live[0].size >= live[0].requested_size);
        EXPECT(sp_pool_live_allocations(0, pool, NULL, 1, &total), SP_ERR_INVALID_ARGUMENT);
        EXPECT(sp_pool_live_allocations(0, pool, live, 2, NULL), SP_ERR_INVALID_ARGUMENT);
        EXPECT(sp_pool_live_allocations(0, unknown, NULL, 0, &total), SP_ERR_UNKNOWN_POOL);
        OK(sp_free(x));
        OK(sp_free(y));
    }
    OK(sp_pool_empty_cache(0, pool));

    sp_pool_id named = {0, 0}, again = {0, 0};
    OK(sp_pool_named(0, "activations", NULL, &named));
    OK(sp_pool_named(0, "activations", NULL, &again));
    CHECK(named.a == again.a && named.b == again.b && named.b != 0);

    /* A stream route: stream 9 goes to the pool, stream 8 does not. */
    sp_pool_id routed = {0, 43};
    OK(sp_begin_allocate_to_pool(0, routed, SP_ROUTE_STREAM, 9));
    EXPECT(sp_begin_allocate_to_pool(0, routed, SP_ROUTE_STREAM, 9), SP_ERR_INVALID_STATE);
    void* on = NULL;
    void* off = NULL;
    OK(sp_alloc(0, 2048, 9, &on));
    OK(sp_alloc(0, 2048, 8, &off));
    OK(sp_pool_stats_get(0, routed, &ps));
    CHECK(ps.allocation.all.current == 1);
    OK(sp_end_allocate_to_pool(0, routed));
    OK(sp_free(on));
    OK(sp_free(off));
    /* Every allocation, this thread, a capture id (nothing captures: no match). */
    OK(sp_begin_allocate_to_pool(0, routed, SP_ROUTE_ALL, 0));
    OK(sp_alloc(0, 2048, 5, &on));
    OK(sp_end_allocate_to_pool(0, routed));
    OK(sp_begin_allocate_to_pool(0, routed, SP_ROUTE_CURRENT_THREAD, 0));
    OK(sp_alloc(0, 2048, 5, &off));
    OK(sp_end_allocate_to_pool(0, routed));
    OK(sp_pool_stats_get(0, routed, &ps));
    CHECK(ps.allocation.all.current == 2);
    OK(sp_free(on));
    OK(sp_free(off));
    OK(sp_begin_allocate_to_pool(0, routed, SP_ROUTE_CAPTURE, 77));
    OK(sp_alloc(0, 2048, 5, &on));
    OK(sp_end_allocate_to_pool(0, routed));
    OK(sp_pool_stats_get(0, routed, &ps));
    CHECK(ps.allocation.all.current == 0);
    OK(sp_free(on));
    EXPECT(sp_end_allocate_to_pool(0, routed), SP_ERR_INVALID_STATE);

    /* Releases: routed had 4 uses (one per begin), pool 2. */
    uint64_t left = 99;
    OK(sp_pool_release(0, routed, &left));
    CHECK(left == 3);
    OK(sp_pool_release(0, routed, NULL));
    OK(sp_pool_release(0, routed, NULL));
    OK(sp_pool_release(0, routed, &left));
    CHECK(left == 0);
    EXPECT(sp_pool_release(0, routed, &left), SP_ERR_INVALID_STATE);
    OK(sp_pool_release(0, pool, NULL));
    OK(sp_pool_release(0, pool, &left));
    CHECK(left == 0);
    OK(sp_empty_cache(0));
}

static void statistics_and_snapshot(void) {
    OK(sp_reset_accumulated_stats(0));
    OK(sp_reset_peak_stats(0));
    void* p = NULL;
    OK(sp_alloc(0, 1000, 0, &p));
    sp_memory_stats st;
    OK(sp_memory_stats_get(0, &st));
    CHECK(st.allocation.all.current == 1);
    CHECK(st.allocated_bytes.small_pool.current == 1024);
    CHECK(st.requested_bytes.all.current == 1000);
    CHECK(st.reserved_bytes.all.current >= 1024);
    CHECK(st.max_split_size == -1);

    char* json = NULL;
    size_t len = 0;
    OK(sp_snapshot_json(0, &json, &len));
    CHECK(json != NULL && len > 0 && strlen(json) == len);
    CHECK(json && strstr(json, "\"segments\":[{") != NULL);
    CHECK(json && strstr(json, "\"active_allocated\"") != NULL);
    CHECK(json && strstr(json, "\"device_traces\":[[],[]]") != NULL);
    OK(sp_string_free(json));
    OK(sp_snapshot_json(-1, &json, NULL));
    OK(sp_string_free(json));
    OK(sp_string_free(NULL));

    /* The same snapshot as data: the segment holding p, and p's block in it. */
    sp_snapshot* snap = NULL;
    OK(sp_snapshot_take(0, 0, &snap));
    size_t n = sp_snapshot_segment_count(snap), found = 0;
    CHECK(n >= 1);
    for (size_t i = 0; i < n; i++) {
        sp_segment_view seg;
        OK(sp_snapshot_segment(snap, i, &seg));
        CHECK(seg.device == 0 && seg.reserved0 == 0 && seg.block_count >= 1);
        for (size_t j = 0; j < seg.block_count; j++) {
            sp_block_view b;
            OK(sp_snapshot_block(snap, i, j, &b));
            if (b.address == (uint64_t)(uintptr_t)p) {
                found++;
                CHECK(b.state == SP_BLOCK_ACTIVE_ALLOCATED && b.requested_size == 1000);
                CHECK(seg.is_large == 0 && seg.address <= b.address);
            }
        }
    }
    CHECK(found == 1);
    sp_segment_view none;
    EXPECT(sp_snapshot_segment(snap, n, &none), SP_ERR_INVALID_ARGUMENT);
    CHECK(sp_snapshot_trace_count(snap) == 0);
    OK(sp_snapshot_free(snap));
    CHECK(sp_snapshot_segment_count(snap) == 0);
    MESSAGE_HAS("freed");
    EXPECT(sp_snapshot_free(snap), SP_ERR_INVALID_ARGUMENT);
    OK(sp_snapshot_free(NULL));

    OK(sp_free(p));
    OK(sp_memory_stats_get(0, &st));
    CHECK(st.allocated_bytes.all.current == 0);
    CHECK(st.allocated_bytes.all.peak == 1024);
    CHECK(st.allocated_bytes.all.freed == 1024);
    OK(sp_reset_peak_stats(-1));
    OK(sp_reset_accumulated_stats(-1));
    OK(sp_memory_stats_get(0, &st));
    CHECK(st.allocated_bytes.all.peak == 0 && st.allocated_bytes.all.freed == 0);
}

static void torch_pair(void) {
    void* stream = (void*)(uintptr_t)7;
    void* t = sp_torch_malloc((ssize_t)MiB, 0, stream);
    CHECK(t != NULL);
    sp_torch_free(t, (ssize_t)MiB, 0, stream);
    CHECK(sp_torch_malloc(0, 0, stream) == NULL);
    CHECK(sp_torch_malloc(-1, 0, stream) == NULL);
    sp_torch_free(NULL, 0, 0, stream);
    sp_torch_free((void*)(uintptr_t)0x1234, 0, 0, stream); /* logged, no crash */
    MESSAGE_HAS("unknown pointer");
}

static void bad_input(void) {
    void* p = (void*)1;
    int host = 0;
    /* SP_ERR_INVALID_ARGUMENT */
    EXPECT(sp_alloc(0, 0, 0, &p), SP_ERR_INVALID_ARGUMENT);
    CHECK(p == NULL);
    EXPECT(sp_alloc(0, SIZE_MAX, 0, &p), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_alloc(0, 64, 0, NULL), SP_ERR_INVALID_ARGUMENT);
    MESSAGE_HAS("out is NULL");
    EXPECT(sp_alloc(-1, 64, 0, &p), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_alloc(99, 64, 0, &p), SP_ERR_INVALID_ARGUMENT);
    MESSAGE_HAS("device 99");
    EXPECT(sp_free(NULL), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_device_count(NULL), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_memory_stats_get(0, NULL), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_snapshot_json(0, NULL, NULL), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_pool_named(0, NULL, NULL, NULL), SP_ERR_INVALID_ARGUMENT);
    sp_pool_id pool = {0, 44};
    EXPECT(sp_begin_allocate_to_pool(0, pool, (sp_route_kind)99, 0), SP_ERR_INVALID_ARGUMENT);
    sp_pool_id dflt = {0, 0};
    EXPECT(sp_pool_release(0, dflt, NULL), SP_ERR_INVALID_ARGUMENT);
    /* SP_ERR_UNKNOWN_POINTER: random address, host pointer, double free, interior pointer. */
    EXPECT(sp_free((void*)(uintptr_t)0x1234), SP_ERR_UNKNOWN_POINTER);
    EXPECT(sp_free(&host), SP_ERR_UNKNOWN_POINTER);
    void* q = NULL;
    OK(sp_alloc(0, 8192, 0, &q));
    EXPECT(sp_free((char*)q + 512), SP_ERR_UNKNOWN_POINTER);
    EXPECT(sp_record_stream((char*)q + 512, 3), SP_ERR_UNKNOWN_POINTER);
    OK(sp_free(q));
    EXPECT(sp_free(q), SP_ERR_UNKNOWN_POINTER);
    MESSAGE_HAS("unknown pointer");
    /* SP_ERR_UNKNOWN_POOL */
    sp_pool_id none = {5, 5};
    uint64_t uses = 0;
    EXPECT(sp_pool_use_count(0, none, &uses), SP_ERR_UNKNOWN_POOL);
    EXPECT(sp_pool_alloc(0, none, 64, 0, &p), SP_ERR_UNKNOWN_POOL);
    /* SP_ERR_INVALID_STATE */
    EXPECT(sp_end_allocate_to_pool(0, none), SP_ERR_INVALID_STATE);
    /* SP_ERR_CONFIG after initialisation: the bad key is reported first. */
    EXPECT(sp_init("sim", "nope:1"), SP_ERR_CONFIG);
    /* Nothing leaked or changed. */
    sp_memory_stats st;
    OK(sp_memory_stats_get(0, &st));
    CHECK(st.allocation.all.current == 0);
}

static void checkpoints_and_variants(void) {
    sp_pool_id pool = {0, 555};
    OK(sp_pool_create_or_incref(0, pool, NULL, NULL));
    void *a = NULL, *b = NULL;
    OK(sp_pool_alloc(0, pool, 2 * MiB, 0, &a));
    sp_checkpoint* cp = NULL;
    OK(sp_checkpoint_take(0, pool, &cp));
    CHECK(cp != NULL);
    int cp_device = -1;
    sp_pool_id cp_pool = {0, 0};
    OK(sp_checkpoint_info(cp, &cp_device, &cp_pool));
    CHECK(cp_device == 0 && cp_pool.a == pool.a && cp_pool.b == pool.b);
    OK(sp_checkpoint_info(cp, NULL, NULL));
    OK(sp_free(a));
    OK(sp_pool_alloc(0, pool, 6 * MiB, 0, &b));
    void* keep[1] = {b};
    EXPECT(sp_checkpoint_restore(cp, keep, 1, NULL), SP_ERR_INVALID_STATE);
    MESSAGE_HAS("must stay live");
    sp_restore_delta* d = NULL;
    OK(sp_checkpoint_restore(cp, NULL, 0, &d));
    CHECK(sp_delta_freed_count(d) == 1 && sp_delta_created_count(d) == 1);
    void* p = NULL;
    size_t size = 0;
    OK(sp_delta_created(d, 0, &p, &size));
    CHECK(p == a && size == 2 * MiB);
    OK(sp_delta_free(d));
    void* live[1] = {a};
    OK(sp_pool_verify_live(0, pool, live, 1));
    OK(sp_checkpoint_free(cp));
    EXPECT(sp_checkpoint_free(cp), SP_ERR_INVALID_ARGUMENT);
    OK(sp_free(a));

    sp_variant_group* g = NULL;
    OK(sp_variant_group_create(0, pool, 3, &g));
    void* first[3] = {NULL, NULL, NULL};
    for (size_t k = 0; k < 3; k++) {
        OK(sp_variant_begin(g, 2 - k, NULL));
        OK(sp_pool_alloc(0, pool, (k + 2) * MiB, 0, &first[k]));
        OK(sp_variant_end(g));
    }
    CHECK(first[0] == first[1] && first[1] == first[2]);
    EXPECT(sp_variant_begin(g, 3, NULL), SP_ERR_INVALID_ARGUMENT);
    OK(sp_variant_group_free(g));
    OK(sp_free(first[2]));

    /* Graph-retained but reusable: the block goes back to its pool, the next request takes it. */
    void *out0 = NULL, *out1 = NULL;
    uint64_t reusable = 0;
    OK(sp_pool_alloc(0, pool, 3 * MiB, 0, &out0));
    OK(sp_mark_reusable(out0, &reusable));
    CHECK(reusable == 3 * MiB);
    OK(sp_pool_alloc(0, pool, 3 * MiB, 0, &out1));
    CHECK(out1 == out0);
    EXPECT(sp_mark_reusable(NULL, NULL), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_mark_reusable((char*)out1 + 256, NULL), SP_ERR_UNKNOWN_POINTER);
    OK(sp_free(out1));

    /* Exact device-wide peaks. */
    uint64_t peak_allocated = 0, peak_reserved = 0;
    OK(sp_memory_peaks(0, &peak_allocated, &peak_reserved));
    CHECK(peak_allocated >= 6 * MiB && peak_reserved >= peak_allocated);
    OK(sp_memory_peaks(0, NULL, NULL));
    EXPECT(sp_memory_peaks(99, NULL, NULL), SP_ERR_INVALID_ARGUMENT);

    uint64_t arena = 0;
    void *x = NULL, *y = NULL;
    OK(sp_arena_create(0, pool, 0, &arena));
    OK(sp_arena_alloc(0, arena, 0, 7, 3 * MiB, &x));
    OK(sp_arena_free(0, arena, 0, 7));
    OK(sp_arena_alloc(0, arena, 1, 7, MiB, &y));
    CHECK(x == y);
    OK(sp_arena_free(0, arena, 1, 7));
    OK(sp_arena_destroy(0, arena));
    OK(sp_check_invariants(0));
}

static void after_shutdown(void) {
    void* p = NULL;
    OK(sp_alloc(0, 4096, 0, &p));
    OK(sp_shutdown());
    EXPECT(sp_free(p), SP_ERR_SHUTDOWN);
    EXPECT(sp_alloc(0, 64, 0, &p), SP_ERR_SHUTDOWN);
    CHECK(p == NULL);
    EXPECT(sp_shutdown(), SP_ERR_SHUTDOWN);
    EXPECT(sp_init("sim", NULL), SP_ERR_SHUTDOWN);
    MESSAGE_HAS("shut down");
    CHECK(sp_torch_malloc(64, 0, NULL) == NULL);
}

int main(void) {
    initialisation();
    allocation();
    pools_and_routes();
    statistics_and_snapshot();
    torch_pair();
    checkpoints_and_variants();
    bad_input();
    after_shutdown();
    if (failures) {
        fprintf(stderr, "smoke.c: %d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("smoke.c: %d checks passed\n", checks);
    return 0;
}
