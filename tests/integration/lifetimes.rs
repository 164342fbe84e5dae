//! What lives how long: checkpoints across reclaim and `empty_cache`, allocations at a reused
//! address across a restore, pool ids, routes and their pools, the memory limit, and what the
//! cache reports as servable.

use slotpool::core::{AllocError, Allocator, Config, GrowthMode, PoolId, PoolOptions, RouteFilter};
use slotpool::sim::SimDevice;

use crate::common::{MIB, setup};

const GROWTHS: [GrowthMode; 2] = [GrowthMode::Vmm, GrowthMode::Classic];

fn check(a: &Allocator<SimDevice>) {
    a.check_invariants()
        .unwrap_or_else(|e| panic!("invariant: {e}"));
}

/// A pool's cache is reclaimed by memory pressure (its shard on stream 7 left empty), a
/// checkpoint is taken, the cache is emptied, and the checkpoint restores; so does a variant
/// group's. The empty shard used to be forgotten under the live checkpoint, and the restore
/// failed with "stream 7: the shard no longer exists".
#[test]
fn a_checkpoint_survives_reclaim_and_empty_cache() {
    for growth in GROWTHS {
        let (_dev, a) = setup(growth, 256 * MIB);
        let pool = PoolId(0, 3);
        a.create_or_incref_pool(pool, PoolOptions::default())
            .unwrap();
        let p = a.alloc_in(pool, 100 * MIB, 7).unwrap();
        a.free(p).unwrap();
        // Only fits once the pool's cache is given back.
        let big = a
            .alloc(200 * MIB, 0)
            .expect("the OOM ladder reclaims the pool");
        check(&a);
        let cp = a.checkpoint(pool).unwrap();
        a.empty_cache();
        check(&a);
        let delta = a
            .restore(pool, &cp, &[])
            .expect("restore after empty_cache");
        assert!(
            delta.freed.is_empty() && delta.created.is_empty(),
            "{delta:?}"
        );
        check(&a);
        // The pool still serves its stream, and a restore takes that back.
        let q = a.alloc_in(pool, MIB, 7).unwrap();
        a.empty_cache();
        let delta = a.restore(pool, &cp, &[]).unwrap();
        assert_eq!(delta.freed.len(), 1, "{delta:?}");
        assert_eq!(delta.freed[0].0, q);
        check(&a);
        drop(cp);

        let mut group = a.variant_group(pool, 2).unwrap();
        a.empty_cache();
        a.begin_variant(&mut group, 0)
            .expect("variant after empty_cache");
        let v = a.alloc_in(pool, MIB, 7).unwrap();
        a.end_variant(&mut group).unwrap();
        a.empty_cache();
        let delta = a.begin_variant(&mut group, 1).unwrap();
        assert_eq!(delta.freed.iter().map(|x| x.0).collect::<Vec<_>>(), [v]);
        a.end_variant(&mut group).unwrap();
        drop(group);
        check(&a);
        a.free(big).unwrap();
        a.release_pool(pool).unwrap();
        a.empty_cache();
        check(&a);
        assert_eq!(a.held_bytes(), 0, "{growth:?}");
    }
}

/// A pool with no shard at all when checkpointed, released since: the live checkpoint keeps it
/// registered through `empty_cache`, and restores.
#[test]
fn a_checkpoint_keeps_its_released_pool() {
    let (_dev, a) = setup(GrowthMode::Vmm, 256 * MIB);
    let pool = PoolId(0, 4);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let cp = a.checkpoint(pool).unwrap();
    a.release_pool(pool).unwrap();
    a.empty_cache();
    assert_eq!(a.pool_use_count(pool).unwrap(), 0);
    let p = a.alloc_in(pool, MIB, 2).unwrap();
    let delta = a.restore(pool, &cp, &[]).unwrap();
    assert_eq!(delta.freed.iter().map(|x| x.0).collect::<Vec<_>>(), [p]);
    drop(cp);
    a.empty_cache();
    check(&a);
    assert!(
        a.pool_use_count(pool).is_err(),
        "forgotten once no checkpoint needs it"
    );
}

/// An allocation freed and made again at the same address and size since a checkpoint is
/// another allocation: the restore frees it and re-creates the checkpoint's (both listed),
/// whose requested size comes back with it, and refuses to keep it live. Restoring twice to a
/// checkpoint whose allocation the first restore brought back changes nothing.
#[test]
fn a_restore_lists_an_allocation_made_again_at_its_address() {
    for growth in GROWTHS {
        let (_dev, a) = setup(growth, 1 << 30);
        let pool = PoolId(0, 5);
        a.create_or_incref_pool(pool, PoolOptions::default())
            .unwrap();
        let _before = a.alloc_in(pool, 4096, 0).unwrap();
        let p = a.alloc_in(pool, 3000, 0).unwrap();
        let _after = a.alloc_in(pool, 4096, 0).unwrap();
        let cp = a.checkpoint(pool).unwrap();
        a.free(p).unwrap();
        let q = a.alloc_in(pool, 3070, 0).unwrap();
        assert_eq!(q, p, "{growth:?}: best fit takes the same hole");
        let size = a.allocation_info(q).unwrap().1;
        match a.restore(pool, &cp, &[q]) {
            Err(AllocError::CheckpointMismatch(diff)) => {
                assert_eq!(diff.added, [(q, size)], "{diff}");
                assert_eq!(diff.removed, [(p, size)], "{diff}");
            }
            other => panic!("{growth:?}: kept an allocation the checkpoint lacks: {other:?}"),
        }
        assert_eq!(
            a.allocation_info(q).unwrap().2,
            3070,
            "a refusal changes nothing"
        );
        let delta = a.restore(pool, &cp, &[]).unwrap();
        assert_eq!(delta.freed, [(q, size)], "{growth:?}");
        assert_eq!(delta.created, [(p, size)], "{growth:?}");
        assert_eq!(
            a.allocation_info(p).unwrap().2,
            3000,
            "the checkpoint's request"
        );
        check(&a);
        // A later checkpoint alive: the first restore is journaled; the second finds the
        // checkpoint's own allocation and does nothing.
        let later = a.checkpoint(pool).unwrap();
        a.free(p).unwrap();
        let delta = a.restore(pool, &cp, &[]).unwrap();
        assert_eq!((delta.freed.len(), delta.created), (0, vec![(p, size)]));
        let delta = a.restore(pool, &cp, &[p]).unwrap();
        assert!(
            delta.freed.is_empty() && delta.created.is_empty(),
            "{delta:?}"
        );
        let delta = a.restore(pool, &later, &[p]).unwrap();
        assert!(
            delta.freed.is_empty() && delta.created.is_empty(),
            "{delta:?}"
        );
        check(&a);
    }
}

/// A user pool that holds an id of the named range keeps it: `named_pool` takes the next free
/// id, and the user pool's use count and limit stay as they were.
#[test]
fn a_named_pool_never_replaces_a_user_pool() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let taken = PoolId(0, (1 << 63) | 1);
    let limited = PoolOptions {
        limit: Some(64 * MIB),
        ..PoolOptions::default()
    };
    a.create_or_incref_pool(taken, limited.clone()).unwrap();
    a.create_or_incref_pool(taken, limited.clone()).unwrap();
    let p = a.alloc_in(taken, MIB, 0).unwrap();
    let fresh = a.named_pool("fresh", PoolOptions::default()).unwrap();
    assert_ne!(fresh, taken);
    assert_eq!(a.pool_by_name("fresh"), Some(fresh));
    assert_eq!(a.pool_use_count(taken).unwrap(), 2);
    assert_eq!(a.pool_options(taken).unwrap(), limited);
    assert_eq!(a.pool_use_count(fresh).unwrap(), 1);
    assert!(a.alloc_in(taken, 128 * MIB, 0).is_err(), "the limit holds");
    assert_eq!(a.live_allocations(taken).unwrap().len(), 1);
    a.free(p).unwrap();
    check(&a);
}

/// The last use of a pool with an active route is not released: the route would outlive its
/// pool, and every allocation it takes would fail. Ending the route first releases it.
#[test]
fn a_routed_pool_keeps_its_last_use() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let pool = PoolId(0, 9);
    a.begin_allocate_to_pool(pool, RouteFilter::All).unwrap();
    assert_eq!(a.pool_use_count(pool).unwrap(), 1);
    let before = a.state_dump();
    match a.release_pool(pool) {
        Err(AllocError::InvalidState(m)) => assert!(m.contains("route"), "{m}"),
        other => panic!("released the last use of a routed pool: {other:?}"),
    }
    assert_eq!(a.pool_use_count(pool).unwrap(), 1);
    assert_eq!(a.state_dump(), before);
    a.empty_cache();
    let p = a.alloc(MIB, 0).expect("the route still has its pool");
    assert_eq!(a.live_allocations(pool).unwrap(), [(p, MIB)]);
    // A use beyond the route's may go.
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    assert_eq!(a.release_pool(pool).unwrap(), 1);
    a.free(p).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    assert_eq!(a.release_pool(pool).unwrap(), 0);
    a.empty_cache();
    let p = a.alloc(MIB, 0).unwrap();
    assert!(a.pool_use_count(pool).is_err(), "forgotten");
    a.free(p).unwrap();
    check(&a);
}

/// A zero memory limit is no limit, from a configuration string and from `set_memory_limit`.
#[test]
fn a_zero_memory_limit_is_no_limit() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.set_memory_limit(64 * MIB);
    assert_eq!(a.memory_limit(), 64 * MIB);
    a.set_memory_limit(0);
    assert_eq!(a.memory_limit(), 1 << 30);
    let b = Allocator::new(dev, Config::parse("memory_limit_mb:0").unwrap());
    assert_eq!(b.memory_limit(), 1 << 30);
    let p = b.alloc(512 * MIB, 0).expect("no cap");
    b.free(p).unwrap();
}

/// `largest_free_block` is the largest request the cache serves without new physical memory:
/// in vmm mode a free block counts up to its first unmapped page (it once reported the whole
/// 1 GiB reservation with 2 MiB mapped).
#[test]
fn the_largest_free_block_is_mapped_memory() {
    let (dev, a) = setup(GrowthMode::Vmm, 4 << 30);
    assert_eq!(a.largest_free_block(), 0);
    let p = a.alloc(2 * MIB, 0).unwrap();
    assert_eq!(a.stats().reserved_bytes.all().current, 2 << 20);
    assert_eq!(
        a.largest_free_block(),
        0,
        "the rest of the reservation is unmapped"
    );
    a.free(p).unwrap();
    assert_eq!(a.largest_free_block(), 2 * MIB);
    let held = dev.physical_bytes();
    let q = a.alloc(a.largest_free_block(), 0).unwrap();
    assert_eq!(dev.physical_bytes(), held, "served without new memory");
    // A block in the middle of a mapped run: what is mapped from the free block's start.
    let r = a.alloc(6 * MIB, 0).unwrap();
    a.free(q).unwrap();
    assert_eq!(a.largest_free_block(), 2 * MIB);
    a.free(r).unwrap();
    assert_eq!(a.largest_free_block(), 8 * MIB);
    a.empty_cache();
    assert_eq!(a.largest_free_block(), 0);
    check(&a);

    let (_dev, c) = setup(GrowthMode::Classic, 4 << 30);
    let p = c.alloc(3 * MIB, 0).unwrap();
    c.free(p).unwrap();
    // Classic: the whole 20 MiB segment is cached and mapped.
    assert_eq!(c.largest_free_block(), 20 * MIB);
}
