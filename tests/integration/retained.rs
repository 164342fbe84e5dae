//! Graph-retained memory: what a captured graph may touch stays mapped while its pool is in use;
//! everything else a pool caches is released by `empty_cache` like the default pool's.

use slotpool::core::{Allocator, GrowthMode, PoolId, PoolOptions, RouteFilter};
use slotpool::sim::SimDevice;

use crate::common::{MIB, check_all, setup, setup_with_pool};

const POOL: PoolId = PoolId(0, 7);

fn reserved(a: &Allocator<SimDevice>, pool: PoolId) -> u64 {
    a.pool_stats(pool).unwrap().reserved_bytes.all().current as u64
}

fn mapped(dev: &SimDevice, ptr: u64) -> bool {
    dev.read(ptr, 1).is_ok()
}

/// Capture on `stream` into POOL: `f` runs with the capture route active.
fn capture<R>(dev: &SimDevice, a: &Allocator<SimDevice>, stream: u64, f: impl FnOnce() -> R) -> R {
    let id = dev.begin_capture(stream).unwrap();
    a.begin_allocate_to_pool(POOL, RouteFilter::Capture(id))
        .unwrap();
    let r = f();
    dev.end_capture(stream).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    r
}

#[test]
fn a_pool_in_use_releases_what_no_graph_touched() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup_with_pool(growth, POOL);
        let x = a.alloc_in(POOL, 64 * MIB, 0).unwrap();
        a.free(x).unwrap();
        assert!(reserved(&a, POOL) >= 64 * MIB);
        a.empty_cache();
        check_all(&dev, &a, &[]);
        assert_eq!(
            reserved(&a, POOL),
            0,
            "{growth:?}: nothing retained, all released"
        );
        assert_eq!(a.pool_use_count(POOL).unwrap(), 1, "still in use");
    }
}

#[test]
fn memory_a_graph_touched_stays_mapped_until_the_pool_is_released() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup_with_pool(growth, POOL);
        // Scratch of the pool, freed before the capture: no graph touches it.
        let scratch = a.alloc_in(POOL, 32 * MIB, 5).unwrap();
        a.free(scratch).unwrap();
        // A temporary of the graph: allocated and freed during the capture.
        let temp = capture(&dev, &a, 6, || {
            let t = a.alloc(8 * MIB, 6).unwrap();
            a.free(t).unwrap();
            t
        });
        assert!(a.retained_bytes(POOL).unwrap() >= 8 * MIB);
        a.empty_cache();
        check_all(&dev, &a, &[]);
        assert!(mapped(&dev, temp), "{growth:?}: replay touches it");
        assert!(!mapped(&dev, scratch), "{growth:?}: no graph touches it");
        assert!(reserved(&a, POOL) >= 8 * MIB && reserved(&a, POOL) < 32 * MIB);
        // The graph is gone (its use and ours): the pool is freeable and empty_cache takes all.
        assert_eq!(a.release_pool(POOL).unwrap(), 1);
        assert_eq!(a.release_pool(POOL).unwrap(), 0);
        a.empty_cache();
        check_all(&dev, &a, &[]);
        assert!(!mapped(&dev, temp));
        assert_eq!(a.held_bytes(), 0);
    }
}

#[test]
fn reclaim_never_moves_a_graph_retained_page() {
    // No vmm slack: a page short is taken from idle pages before a new one is created.
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let temps = capture(&dev, &a, 6, || {
        let t1 = a.alloc(4 * MIB, 6).unwrap();
        let t2 = a.alloc(4 * MIB, 6).unwrap();
        a.free(t1).unwrap();
        (t1, t2)
    });
    let retained = a.retained_bytes(POOL).unwrap();
    // Too big for t1's hole: needs fresh pages above t2, where idle t1 pages would be moved.
    let big = a.alloc_in(POOL, 6 * MIB, 6).unwrap();
    check_all(&dev, &a, &[]);
    assert!(mapped(&dev, temps.0), "a graph-retained page was unmapped");
    assert_eq!(a.retained_bytes(POOL).unwrap(), retained);
    a.free(big).unwrap();
    a.free(temps.1).unwrap();
    check_all(&dev, &a, &[]);
}

#[test]
fn blocks_a_restore_takes_back_stay_mapped_while_the_pool_is_in_use() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    let ck = a.checkpoint(POOL).unwrap();
    let held = a.alloc_in(POOL, 16 * MIB, 0).unwrap();
    let delta = a.restore(POOL, &ck, &[]).unwrap();
    assert_eq!(delta.freed.len(), 1);
    drop(ck);
    a.empty_cache();
    check_all(&dev, &a, &[]);
    assert!(mapped(&dev, held), "its owner still holds it");
    assert_eq!(a.release_pool(POOL).unwrap(), 0);
    a.empty_cache();
    assert!(!mapped(&dev, held));
    check_all(&dev, &a, &[]);
}

#[test]
fn graph_retained_but_reusable_memory_serves_the_next_capture_and_stays_mapped() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    // Graph 0 leaves an output its owner keeps (PyTorch: a static output of the graph).
    let out0 = capture(&dev, &a, 6, || a.alloc(16 * MIB, 6).unwrap());
    let before = a.state_dump();
    assert!(a.mark_reusable(0xdead_0000).is_err(), "unknown pointer");
    assert_eq!(a.state_dump(), before, "a refused call changes nothing");
    assert_eq!(a.mark_reusable(out0).unwrap(), 16 * MIB);
    check_all(&dev, &a, &[]);
    assert_eq!(a.pool_stats(POOL).unwrap().allocated_bytes.all().current, 0);
    // Graph 1 (the other variant) reuses those addresses instead of growing the pool.
    let reserved0 = reserved(&a, POOL);
    let out1 = capture(&dev, &a, 6, || a.alloc(16 * MIB, 6).unwrap());
    assert_eq!(out1, out0);
    assert_eq!(reserved(&a, POOL), reserved0);
    a.free(out1).unwrap();
    a.empty_cache();
    check_all(&dev, &a, &[]);
    assert!(mapped(&dev, out0), "graph 0 still writes there on replay");
}
