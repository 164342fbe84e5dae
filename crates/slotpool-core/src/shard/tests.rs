//! Tests of the shard on its own.

use std::sync::Arc;

use super::{QUICK_MAX, Shard, ShardCell, ShardRef};
use crate::env::Budget;
use crate::pool::PoolId;
use crate::sync::lock;

/// Shards made one after another by one thread (a warm-up pair per stream) must not share
/// cache lines: the cell is aligned to two lines, and the containers every pair writes start
/// large enough that their first heap blocks are not packed beside another shard's.
#[test]
fn shards_made_in_a_row_share_no_cache_line() {
    let policy = crate::policy::SizePolicy::default();
    let counter = crate::peak::PeakCounter::default();
    let cells: Vec<ShardRef> = (0..4)
        .map(|stream| {
            Arc::new(ShardCell::new(
                Shard::new(PoolId::DEFAULT, stream, false, &policy, counter.new_lease()),
                Arc::new(Budget::new(u64::MAX)),
            ))
        })
        .collect();
    for c in &cells {
        assert_eq!(
            Arc::as_ptr(c) as usize % 128,
            0,
            "cell not on its own lines"
        );
        let s = lock(&c.shard);
        assert!(s.blocks.capacity() >= 32);
        assert!(s.live.capacity() >= 32);
        assert!(s.quick.capacity() >= QUICK_MAX);
    }
}
