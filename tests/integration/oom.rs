//! The out-of-memory report counts each reserved byte once: allocated, cached in private pools,
//! or unallocated in the default pool; the three add up to what is reserved.

use slotpool::core::{AllocError, GrowthMode, OomReport, PoolId, PoolOptions};

use crate::common::*;

fn oom(err: AllocError) -> OomReport {
    match err {
        AllocError::OutOfMemory(report) => *report,
        other => panic!("expected out of memory, got {other}"),
    }
}

/// The three parts of the report, checked to add up to `reserved`.
#[track_caller]
fn parts(r: &OomReport) -> (u64, u64, u64) {
    assert_eq!(
        r.allocated + r.private_pools_cached + r.unallocated,
        r.reserved,
        "the parts do not add up: {r:?}"
    );
    (r.allocated, r.private_pools_cached, r.unallocated)
}

#[test]
fn a_private_pools_cache_is_counted_once() {
    let (_dev, a) = setup(GrowthMode::Classic, 1 << 30);
    let pool = PoolId(0, 7);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    // 2 MiB live in the pool, in a 20 MiB segment (PyTorch's size for 1-10 MiB requests): 18 MiB
    // that only the pool can use, and that freeing caches cannot return while the 2 MiB live.
    let _in_pool = a.alloc_in(pool, 2 * MIB, 0).unwrap();
    let _live = a.alloc(900 * MIB, 0).unwrap();
    let spare = a.alloc(64 * MIB, 0).unwrap();
    a.free(spare).unwrap();
    a.check_invariants().unwrap();

    let r = oom(a.alloc(200 * MIB, 0).unwrap_err());
    // The default pool's 64 MiB cache was released before giving up; the pool's was not.
    assert_eq!(r.reserved, 920 * MIB, "{r:?}");
    assert_eq!(parts(&r), (902 * MIB, 18 * MIB, 0), "{r:?}");
    let text = r.to_string();
    assert!(
        text.contains("0.90 GiB reserved of a 1.00 GiB limit: 0.88 GiB allocated, 0.02 GiB cached in private pools, 0.00 GiB reserved but unallocated"),
        "{text}"
    );
    a.check_invariants().unwrap();

    // A request that can never fit is reported the same way, before anything is released.
    let r = oom(a.alloc(2 << 30, 0).unwrap_err());
    assert_eq!(parts(&r), (902 * MIB, 18 * MIB, 0), "{r:?}");
}

#[test]
fn the_parts_add_up_under_vmm_growth() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let pool = PoolId(0, 8);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let _in_pool: Vec<_> = (0..5)
        .map(|i| a.alloc_in(pool, (3 + i) * MIB, 0).unwrap())
        .collect();
    let _live = a.alloc(800 * MIB, 0).unwrap();
    let r = oom(a.alloc(300 * MIB, 0).unwrap_err());
    let (allocated, _, _) = parts(&r);
    assert!(allocated >= 825 * MIB, "{r:?}");
    a.check_invariants().unwrap();
}

#[test]
fn without_private_pools_everything_unallocated_is_the_default_pools() {
    let (_dev, a) = setup(GrowthMode::Classic, 1 << 30);
    let _live = a.alloc(900 * MIB, 0).unwrap();
    let r = oom(a.alloc(200 * MIB, 0).unwrap_err());
    let (allocated, private_cached, unallocated) = parts(&r);
    assert_eq!(allocated, 900 * MIB);
    assert_eq!(private_cached, 0);
    assert_eq!(unallocated, r.reserved - 900 * MIB);
    assert!(
        r.to_string().contains("0.00 GiB cached in private pools"),
        "{r}"
    );
}

#[test]
fn idle_pages_the_ladder_kept_do_not_starve_a_small_segment() {
    // 16 MiB pages: small blocks take 2 MiB classic segments, which cannot use a page. The
    // ladder keeps idle pages in the device's page pool for its retry; a small request under a
    // limit full of them once failed with nothing allocated.
    let (dev, a) = setup_paged(GrowthMode::Vmm, 1 << 30, Some(16 * MIB));
    a.set_memory_limit(48 * MIB);
    let big = a.alloc(48 * MIB, 0).unwrap();
    a.free(big).unwrap();
    let small = a
        .alloc(4096, 0)
        .unwrap_or_else(|e| panic!("a small block under an idle limit: {e}"));
    a.check_invariants().unwrap();
    assert!(dev.physical_bytes() <= 48 * MIB);
    a.free(small).unwrap();
    // And a page-backed request still takes the kept pages.
    let big = a.alloc(32 * MIB, 0).unwrap();
    a.free(big).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn an_arena_slot_reclaims_the_cache_and_counts_as_allocated() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let pool = PoolId(0, 9);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let arena = a.arena_create(pool, 0).unwrap();
    // 600 MiB cached in the default pool: the slot fits only once that cache is released.
    let cached = a.alloc(600 * MIB, 0).unwrap();
    a.free(cached).unwrap();
    a.arena_alloc(arena, 0, 0, 600 * MIB)
        .unwrap_or_else(|e| panic!("the slot after the cache was reclaimed: {e}"));
    a.check_invariants().unwrap();
    // No room for a second: the report counts the first slot as allocated, in a private pool.
    let r = oom(a.arena_alloc(arena, 0, 1, 600 * MIB).unwrap_err());
    assert_eq!(r.requested, 600 * MIB, "{r:?}");
    let (allocated, _, _) = parts(&r);
    assert_eq!(allocated, 600 * MIB, "{r:?}");
    assert!(r.reserved >= 600 * MIB && r.limit == 1 << 30, "{r:?}");
    a.arena_free(arena, 0, 0).unwrap();
    a.arena_destroy(arena).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_restore_out_of_memory_reports_what_it_needed() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let pool = PoolId(0, 10);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let block = a.alloc_in(pool, 100 * MIB, 0).unwrap();
    let cp = a.checkpoint(pool).unwrap();
    a.free(block).unwrap();
    a.empty_pool_cache(pool).unwrap();
    // The rest of the device, live: the restore cannot re-create the block.
    let fill = a.alloc(1000 * MIB, 0).unwrap();
    let r = oom(a.restore(pool, &cp, &[]).unwrap_err());
    assert_eq!(r.requested, 100 * MIB, "{r:?}");
    let (allocated, _, _) = parts(&r);
    assert_eq!(allocated, 1000 * MIB, "{r:?}");
    assert_eq!(r.limit, 1 << 30, "{r:?}");
    a.check_invariants().unwrap();
    // Freed, the fill is the default pool's cache: the restore reclaims it.
    a.free(fill).unwrap();
    a.restore(pool, &cp, &[])
        .unwrap_or_else(|e| panic!("the restore after the cache was reclaimed: {e}"));
    a.check_invariants().unwrap();
}
