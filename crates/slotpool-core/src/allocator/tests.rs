//! The allocator's calls that hold two of its locks at once follow the lock ranks
//! (`sync/rank.rs`; the crate's tests always check them, so a call that took them out of order
//! would panic here).

use super::test_device::Dev;
use crate::sync::rank;
use crate::{AllocError, Allocator, Config, GrowthMode, PoolId, RouteFilter};

/// `begin_allocate_to_pool` and `release_pool` take the pools and then the routes (the first
/// once took them the other way round); an allocation through a route to a new shard the pools
/// and then the shard table; a checkpoint and a restore of a pool with shards on three streams
/// `reclaim` and then the pool's shards in stream order; `empty_cache` `reclaim`, the table,
/// each shard and the registry.
#[test]
fn calls_that_nest_locks_follow_the_ranks() {
    for growth in [GrowthMode::Classic, GrowthMode::Vmm] {
        let a = Allocator::new(
            Dev::new(),
            Config {
                growth,
                ..Config::default()
            },
        );
        let pool = PoolId(0, 9);
        a.begin_allocate_to_pool(pool, RouteFilter::All).unwrap();
        assert!(matches!(
            a.release_pool(pool),
            Err(AllocError::InvalidState(_))
        ));
        // Streams in descending order: the table hands the shards out unsorted.
        let live: Vec<_> = [2, 1, 0]
            .iter()
            .map(|&s| a.alloc(1 << 20, s).unwrap())
            .collect();
        let cp = a.checkpoint(pool).unwrap();
        let extra = a.alloc(3 << 20, 1).unwrap();
        a.end_allocate_to_pool(pool).unwrap();
        let delta = a.restore(pool, &cp, &live).unwrap();
        assert_eq!(delta.freed, [(extra, 3 << 20)], "{growth:?}");
        for p in live {
            a.free(p).unwrap();
        }
        drop(cp);
        a.empty_cache();
        a.check_invariants().unwrap();
        assert_eq!(a.release_pool(pool).unwrap(), 0);
        assert!(rank::held().is_empty(), "a guard outlived its call");
    }
}
