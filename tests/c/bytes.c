/*
 * bytes.c - every live allocation keeps its bytes: across frees of other allocations, reuse of
 * their memory, sp_empty_cache, pool caches emptied, checkpoint restores, variant groups and
 * arenas. Each live allocation holds its own pattern (sp_sim_fill) and every one is checked
 * (sp_sim_verify) after every phase. Built and run by crates/slotpool-capi/tests/c_programs.rs
 * on the simulated device with host-backed bytes, once per growth mode:
 *
 *   cc -std=c11 -Wall -Wextra -Werror -Iinclude tests/c/bytes.c -Ltarget/release -lslotpool
 *   SLOTPOOL_BACKEND=sim SLOTPOOL_CONF=sim_bytes:1,sim_memory_mb:1024,growth:vmm ./bytes
 *
 * Exit status 0 = all checks passed.
 */
#include "slotpool.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The live allocations this program owns, each with the seed of its pattern. */
#define MAX_LIVE 512
static struct {
    void* ptr;
    size_t size;
    uint64_t seed;
} live[MAX_LIVE];
static size_t n_live = 0;
static uint64_t next_seed = 1;

static void track(void* p, size_t size) {
    if (n_live == MAX_LIVE) {
        fprintf(stderr, "too many live allocations\n");
        exit(2);
    }
    live[n_live].ptr = p;
    live[n_live].size = size;
    live[n_live].seed = next_seed++;
    OK(sp_sim_fill(0, p, size, live[n_live].seed));
    n_live++;
}

/* Forgets the tracked allocation at p (freed by the caller, or by a restore). */
static void untrack(void* p) {
    for (size_t i = 0; i < n_live; i++) {
        if (live[i].ptr == p) {
            live[i] = live[--n_live];
            return;
        }
    }
    fprintf(stderr, "untrack: %p is not tracked\n", p);
    failures++;
}

static void* alloc_on(sp_pool_id pool, int in_pool, size_t size, uint64_t stream) {
    void* p = NULL;
    if (in_pool) {
        OK(sp_pool_alloc(0, pool, size, stream, &p));
    } else {
        OK(sp_alloc(0, size, stream, &p));
    }
    if (p) track(p, size);
    return p;
}

static void free_tracked(void* p) {
    OK(sp_free(p));
    untrack(p);
}

/* Every live allocation still holds its pattern. */
static void verify_all(const char* phase) {
    for (size_t i = 0; i < n_live; i++) {
        sp_status s = sp_sim_verify(0, live[i].ptr, live[i].size, live[i].seed);
        checks++;
        if (s != SP_OK) {
            fprintf(stderr, "after %s: allocation %p (%zu bytes, seed %llu): %s\n", phase,
                    live[i].ptr, live[i].size, (unsigned long long)live[i].seed,
                    sp_last_error_message());
            failures++;
        }
    }
    OK(sp_check_invariants(0));
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t next_rand(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static size_t random_size(void) {
    static const size_t sizes[] = {1, 512, 4000, 65536, 300000, 1 << 20, 3 << 20, 9 << 20};
    size_t s = sizes[next_rand() % (sizeof sizes / sizeof sizes[0])];
    return s + next_rand() % 1000;
}

static const sp_pool_id DEFAULT_POOL = {0, 0};

static void frees_and_reuse(void) {
    for (int round = 0; round < 8; round++) {
        for (int i = 0; i < 10; i++) alloc_on(DEFAULT_POOL, 0, random_size(), next_rand() % 3);
        /* Free about half, at random: their memory is reused by the next round. */
        for (size_t i = 0; i < n_live;) {
            if (next_rand() % 2) {
                free_tracked(live[i].ptr);
            } else {
                i++;
            }
        }
        verify_all("frees and reuse");
    }
    OK(sp_empty_cache(0));
    verify_all("sp_empty_cache");
}

static void pools_and_restores(void) {
    sp_pool_id pool = {0, 77};
    OK(sp_pool_create_or_incref(0, pool, NULL, NULL));
    void* kept = alloc_on(pool, 1, 2 << 20, 0);
    void* dropped = alloc_on(pool, 1, 6 << 20, 0);
    sp_checkpoint* cp = NULL;
    OK(sp_checkpoint_take(0, pool, &cp));
    free_tracked(dropped);
    for (int i = 0; i < 6; i++) alloc_on(pool, 1, random_size(), 0);
    verify_all("allocations after a checkpoint");
    sp_restore_delta* d = NULL;
    OK(sp_checkpoint_restore(cp, &kept, 1, &d));
    for (size_t i = 0; i < sp_delta_freed_count(d); i++) {
        void* p = NULL;
        size_t size = 0;
        OK(sp_delta_freed(d, i, &p, &size));
        untrack(p);
    }
    CHECK(sp_delta_created_count(d) == 1);
    for (size_t i = 0; i < sp_delta_created_count(d); i++) {
        void* p = NULL;
        size_t size = 0;
        OK(sp_delta_created(d, i, &p, &size));
        CHECK(p == dropped);
        track(p, size); /* re-created: its bytes are the caller's to set again */
    }
    OK(sp_delta_free(d));
    verify_all("a restore");
    OK(sp_pool_empty_cache(0, pool));
    verify_all("sp_pool_empty_cache");
    /* A refused restore (a keep-live pointer the checkpoint lacks) changes no bytes either. */
    void* extra = alloc_on(pool, 1, 1 << 20, 0);
    EXPECT(sp_checkpoint_restore(cp, &extra, 1, NULL), SP_ERR_INVALID_STATE);
    verify_all("a refused restore");
    OK(sp_checkpoint_free(cp));
}

static void variant_groups(void) {
    sp_pool_id pool = {0, 78};
    OK(sp_pool_create_or_incref(0, pool, NULL, NULL));
    alloc_on(pool, 1, 3 << 20, 0); /* before the group: never touched by its variants */
    sp_variant_group* g = NULL;
    OK(sp_variant_group_create(0, pool, 3, &g));
    for (size_t k = 0; k < 3; k++) {
        sp_restore_delta* d = NULL;
        OK(sp_variant_begin(g, k, &d));
        for (size_t i = 0; i < sp_delta_freed_count(d); i++) {
            void* p = NULL;
            size_t size = 0;
            OK(sp_delta_freed(d, i, &p, &size));
            untrack(p);
        }
        OK(sp_delta_free(d));
        for (int i = 0; i < 4; i++) alloc_on(pool, 1, random_size(), 0);
        OK(sp_variant_end(g));
        verify_all("a variant");
    }
    OK(sp_variant_group_free(g));
}

static void arenas(void) {
    sp_pool_id pool = {0, 79};
    uint64_t arena = 0;
    OK(sp_arena_create(0, pool, 0, &arena));
    /* Slots of one branch never overlap; other allocations never overlap the arena. */
    void* slots[4];
    size_t sizes[4] = {1 << 20, 3 << 20, 100000, 2 << 20};
    uint64_t seeds[4];
    for (uint32_t s = 0; s < 4; s++) {
        OK(sp_arena_alloc(0, arena, 0, s, sizes[s], &slots[s]));
        seeds[s] = next_seed++;
        OK(sp_sim_fill(0, slots[s], sizes[s], seeds[s]));
    }
    for (int i = 0; i < 4; i++) alloc_on(DEFAULT_POOL, 0, random_size(), 1);
    for (uint32_t s = 0; s < 4; s++) OK(sp_sim_verify(0, slots[s], sizes[s], seeds[s]));
    verify_all("arena slots");
    /* A freed slot re-allocated larger moves or grows; the other live slots keep their bytes. */
    OK(sp_arena_free(0, arena, 0, 2));
    OK(sp_arena_alloc(0, arena, 0, 2, 4 << 20, &slots[2]));
    sizes[2] = 4 << 20;
    OK(sp_sim_fill(0, slots[2], sizes[2], seeds[2]));
    for (uint32_t s = 0; s < 4; s++) OK(sp_sim_verify(0, slots[s], sizes[s], seeds[s]));
    for (uint32_t s = 0; s < 4; s++) OK(sp_arena_free(0, arena, 0, s));
    OK(sp_arena_destroy(0, arena));
    OK(sp_empty_cache(0));
    verify_all("an arena destroyed");
}

static void bad_access(void) {
    void* p = NULL;
    OK(sp_alloc(0, 1 << 20, 0, &p));
    unsigned char buf[16] = {0};
    /* Host pointers and addresses never mapped are refused, nothing copied. */
    EXPECT(sp_sim_write(0, buf, buf, sizeof buf), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_sim_read(0, (void*)(uintptr_t)0x10, buf, sizeof buf), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_sim_read(0, p, buf, (size_t)1 << 60), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_sim_write(0, p, NULL, 4), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_sim_read(0, p, NULL, 4), SP_ERR_INVALID_ARGUMENT);
    EXPECT(sp_sim_fill(7, p, 4, 1), SP_ERR_INVALID_ARGUMENT); /* no device 7 */
    OK(sp_sim_read(0, p, NULL, 0));
    /* Round trip, and a mismatch is reported with its address. */
    const char msg[] = "slotpool bytes";
    OK(sp_sim_write(0, (char*)p + 100, msg, sizeof msg));
    char back[sizeof msg];
    OK(sp_sim_read(0, (char*)p + 100, back, sizeof back));
    CHECK(memcmp(msg, back, sizeof msg) == 0);
    OK(sp_sim_fill(0, p, 1 << 20, 5));
    EXPECT(sp_sim_verify(0, p, 1 << 20, 6), SP_ERR_INVALID_STATE);
    CHECK(strstr(sp_last_error_message(), "byte at") != NULL);
    OK(sp_free(p));
}

int main(void) {
    OK(sp_init("sim", NULL));
    CHECK(sp_has_feature("sim_bytes") == 1);
    bad_access();
    frees_and_reuse();
    pools_and_restores();
    variant_groups();
    arenas();
    frees_and_reuse();
    while (n_live > 0) free_tracked(live[0].ptr);
    OK(sp_empty_cache(0));
    OK(sp_check_invariants(0));
    if (failures) {
        fprintf(stderr, "%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("bytes: %d checks passed\n", checks);
    return 0;
}
