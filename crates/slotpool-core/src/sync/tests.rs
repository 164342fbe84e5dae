//! The lock order is enforced: a wrong order panics naming both locks, the declared exception
//! (a pool's shards in stream order under `reclaim`) passes, and the record follows releases in
//! any order.

use super::rank::{self, LockRank};
use super::{Mutex, RwLock, ShardMutex, lock};

fn panic_text(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let e = std::panic::catch_unwind(f).expect_err("the wrong order was not caught");
    e.downcast_ref::<String>()
        .cloned()
        .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn the_ranks_are_one_order() {
    for w in rank::ALL.windows(2) {
        assert!(
            w[0].order < w[1].order,
            "{} before {}",
            w[0].name,
            w[1].name
        );
    }
    assert_eq!(rank::SHARD.several_under, Some(&rank::RECLAIM));
}

#[test]
fn taking_locks_in_order_passes() {
    let reclaim = Mutex::new(rank::RECLAIM, ());
    let pools = Mutex::new(rank::POOLS, ());
    let routes = Mutex::new(rank::ROUTES, ());
    let shard = ShardMutex::new(0u8, (1, 0));
    let segments = RwLock::new(rank::SEGMENTS, ());
    let _r = lock(&reclaim);
    let _p = lock(&pools);
    let _q = lock(&routes);
    let _s = lock(&shard);
    let _w = segments.write();
    assert_eq!(
        rank::held(),
        [
            rank::RECLAIM,
            rank::POOLS,
            rank::ROUTES,
            rank::SHARD,
            rank::SEGMENTS
        ]
    );
}

/// `begin_allocate_to_pool` once took `routes` and then `pools`, against `release_pool`, which
/// reads the routes under the pools.
#[test]
fn routes_then_pools_is_caught() {
    let m = panic_text(|| {
        let pools = Mutex::new(rank::POOLS, ());
        let routes = Mutex::new(rank::ROUTES, ());
        let _q = lock(&routes);
        let _p = lock(&pools);
    });
    assert!(
        m.contains("taking Allocator::pools") && m.contains("while holding Allocator::routes"),
        "{m}"
    );
    assert!(
        m.contains("sync/tests.rs"),
        "names where each was taken: {m}"
    );
    assert!(rank::held().is_empty(), "the unwound guard left the record");
}

#[test]
fn a_table_lock_under_a_shard_is_caught() {
    let m = panic_text(|| {
        let shards = Mutex::new(rank::SHARDS, ());
        let shard = ShardMutex::new((), (1, 0));
        let _s = lock(&shard);
        let _t = lock(&shards);
    });
    assert!(m.contains("taking Allocator::shards (rank 5) at"), "{m}");
    assert!(m.contains("while holding a shard (rank 6"), "{m}");
}

#[test]
fn a_pools_shards_in_stream_order_under_reclaim_pass() {
    let reclaim = Mutex::new(rank::RECLAIM, ());
    let shards: Vec<ShardMutex<()>> = (0..4).map(|s| ShardMutex::new((), (7, s))).collect();
    let _r = lock(&reclaim);
    let guards: Vec<_> = shards.iter().map(lock).collect();
    assert_eq!(rank::held().len(), 5);
    drop(guards);
    assert_eq!(rank::held(), [rank::RECLAIM]);
}

#[test]
fn two_shards_without_reclaim_are_caught() {
    let m = panic_text(|| {
        let a = ShardMutex::new((), (7, 0));
        let b = ShardMutex::new((), (7, 1));
        let _a = lock(&a);
        let _b = lock(&b);
    });
    assert!(m.contains("only under Allocator::reclaim"), "{m}");
}

#[test]
fn shards_out_of_stream_order_are_caught() {
    let m = panic_text(|| {
        let reclaim = Mutex::new(rank::RECLAIM, ());
        let a = ShardMutex::new((), (7, 1));
        let b = ShardMutex::new((), (7, 0));
        let _r = lock(&reclaim);
        let _a = lock(&a);
        let _b = lock(&b);
    });
    assert!(
        m.contains("taking a shard") && m.contains("increasing order"),
        "{m}"
    );
}

#[test]
fn shards_of_two_pools_are_caught() {
    let m = panic_text(|| {
        let reclaim = Mutex::new(rank::RECLAIM, ());
        let a = ShardMutex::new((), (7, 0));
        let b = ShardMutex::new((), (8, 1));
        let _r = lock(&reclaim);
        let _a = lock(&a);
        let _b = lock(&b);
    });
    assert!(m.contains("while holding a shard"), "{m}");
}

#[test]
fn the_same_lock_twice_is_caught() {
    // A second `lock` of a held spin lock would spin for ever; the check panics first.
    let m = panic_text(|| {
        let reclaim = Mutex::new(rank::RECLAIM, ());
        let a = ShardMutex::new((), (7, 0));
        let _r = lock(&reclaim);
        let _a = lock(&a);
        let _b = lock(&a);
    });
    assert!(m.contains("taking a shard"), "{m}");
}

#[test]
fn releases_in_any_order_keep_the_record() {
    let pools = Mutex::new(rank::POOLS, ());
    let routes = Mutex::new(rank::ROUTES, ());
    let shards = Mutex::new(rank::SHARDS, ());
    let p = lock(&pools);
    let q = lock(&routes);
    // `begin_allocate_to_pool` lets the pools go while it still holds the routes.
    drop(p);
    assert_eq!(rank::held(), [rank::ROUTES]);
    let t = lock(&shards);
    drop(q);
    drop(t);
    assert!(rank::held().is_empty());
    // With the pools gone, taking them again is in order.
    let _p = lock(&pools);
}

#[test]
fn a_later_rank_under_reclaim_is_no_exception() {
    // The exception is for several locks of the shard rank only.
    const FAKE: LockRank = LockRank {
        order: 2,
        name: "another",
        several_under: None,
    };
    let m = panic_text(|| {
        let reclaim = Mutex::new(rank::RECLAIM, ());
        let a = Mutex::new(FAKE, ());
        let b = Mutex::new(FAKE, ());
        let _r = lock(&reclaim);
        let _a = lock(&a);
        let _b = lock(&b);
    });
    assert!(m.contains("taking another (rank 2)"), "{m}");
}
