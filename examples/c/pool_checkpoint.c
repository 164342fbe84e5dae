/* A C program against libslotpool: a named pool, a checkpoint of it, a restore, the statistics.
 *
 * Build and run from the repository root, without a GPU (the simulated device):
 *   cargo build --release -p slotpool-capi
 *   ln -sf libslotpool.so target/release/libslotpool.so.0    # the SONAME the program loads
 *   cc -std=c11 -Iinclude examples/c/pool_checkpoint.c -Ltarget/release -lslotpool \
 *      -Wl,-rpath,"$PWD/target/release" -o pool_checkpoint
 *   SLOTPOOL_BACKEND=sim ./pool_checkpoint
 * With the library installed (scripts/install.sh --prefix DIR), build with
 *   cc examples/c/pool_checkpoint.c $(pkg-config --cflags --libs slotpool) -o pool_checkpoint
 * and run without SLOTPOOL_BACKEND on a machine with a GPU. */
#include <stdio.h>

#include "slotpool.h"

/* Prints the failed call's message and leaves main with 1. */
#define CHECK(call)                                                                   \
    do {                                                                              \
        if ((call) != SP_OK) {                                                        \
            fprintf(stderr, "%s failed: %s\n", #call, sp_last_error_message());      \
            return 1;                                                                 \
        }                                                                             \
    } while (0)

int main(void) {
    const int dev = 0;
    sp_pool_id pool;
    CHECK(sp_pool_named(dev, "scratch", NULL, &pool));

    void* weights = NULL;
    void* temp = NULL;
    CHECK(sp_pool_alloc(dev, pool, 4u << 20, 0, &weights));
    CHECK(sp_pool_alloc(dev, pool, 1u << 20, 0, &temp));

    sp_checkpoint* cp = NULL;
    CHECK(sp_checkpoint_take(dev, pool, &cp));
    CHECK(sp_free(temp)); /* freed since the checkpoint: the restore re-creates it */
    void* later = NULL;
    CHECK(sp_pool_alloc(dev, pool, 3u << 20, 0, &later)); /* made since: the restore frees it */

    sp_restore_delta* delta = NULL;
    void* keep[1] = {weights};
    CHECK(sp_checkpoint_restore(cp, keep, 1, &delta));
    printf("restore freed %zu allocation(s) and re-created %zu\n", sp_delta_freed_count(delta),
           sp_delta_created_count(delta));
    void* again = NULL;
    size_t size = 0;
    CHECK(sp_delta_created(delta, 0, &again, &size));
    if (again != temp || size != (1u << 20)) {
        fprintf(stderr, "the re-created block is not the one freed\n");
        return 1;
    }
    CHECK(sp_delta_free(delta));
    CHECK(sp_checkpoint_free(cp));

    sp_memory_stats stats;
    CHECK(sp_memory_stats_get(dev, &stats));
    printf("allocated %lld B in %lld blocks, reserved %lld B\n",
           (long long)stats.allocated_bytes.all.current, (long long)stats.allocation.all.current,
           (long long)stats.reserved_bytes.all.current);

    /* The caller owns what the restore re-created; `later` was freed by the restore. */
    CHECK(sp_free(temp));
    CHECK(sp_free(weights));
    CHECK(sp_pool_release(dev, pool, NULL));
    CHECK(sp_check_invariants(dev));
    printf("ok\n");
    return 0;
}
