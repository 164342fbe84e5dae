//! The shard table: one shard per (pool, stream), created on first use, forgotten once empty.

use super::ReclaimGuard;
use crate::device::{Device, StreamId};
use crate::error::{AllocError, AllocResult};
use crate::pool::PoolId;
use crate::shard::Shard;
pub(crate) use crate::shard::{ShardCell, ShardRef};
use crate::sync::lock;
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Allocator;
use super::thread_cache::with_cached_shard_of;

impl<D: Device> Allocator<D> {
    /// The shard of (pool, stream), created on first use.
    pub(super) fn shard_for(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        if let Some(cell) = with_cached_shard_of!(self, pool, stream, |cell| Some(cell.clone())) {
            return Ok(cell);
        }
        self.refresh_shard(pool, stream)
    }

    /// The shard of (pool, stream) from the table itself (created if missing), cached for the
    /// calling thread: after a [`ShardError::Retired`], whose shard the cache may still name.
    pub(super) fn refresh_shard(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        let generation = self.generation.load(Ordering::Acquire);
        let cell = self.shard_for_slow(pool, stream)?;
        self.cache_shard(generation, pool, stream, &cell);
        Ok(cell)
    }

    /// The table's shard of (pool, stream), created if missing. A shard in the table is never
    /// retired (see [`Allocator::drop_empty_shards`]).
    fn shard_for_slow(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        let pools = lock(&self.pools);
        let entry = pools
            .get(&pool)
            .ok_or_else(|| AllocError::UnknownPool(Box::new(pool)))?;
        let mut shards = lock(&self.shards);
        if let Some(cell) = shards.get(&(pool, stream)) {
            return Ok(cell.clone());
        }
        if entry.paused.is_some() {
            // A new shard would have nothing to serve from.
            return Err(AllocError::PoolPaused(Box::new(pool)));
        }
        let shard = Shard::new(
            pool,
            stream,
            entry.options.no_split,
            &self.config.policy,
            self.shared.allocated.new_lease(),
        )
        .with_pool_state(
            entry.checkpoints.iter().any(|c| c.strong_count() > 0),
            entry.options.pausable,
        );
        let cell = Arc::new(ShardCell::new(shard, entry.budget.clone()));
        shards.insert((pool, stream), cell.clone());
        Ok(cell)
    }

    pub(crate) fn existing_shard(&self, pool: PoolId, stream: StreamId) -> Option<ShardRef> {
        lock(&self.shards).get(&(pool, stream)).cloned()
    }

    /// A copy of the shard table, so that shards can be locked one at a time without the table
    /// lock.
    pub(super) fn all_shards(&self) -> FxHashMap<(PoolId, StreamId), ShardRef> {
        lock(&self.shards).clone()
    }

    pub(super) fn pool_shards(&self, pool: PoolId) -> Vec<ShardRef> {
        shards_of(&lock(&self.shards), pool)
    }

    /// Forget the empty shards of private pools (of `pool` only, if given) that no live
    /// checkpoint marked; invalidates thread caches.
    ///
    /// The protocol with allocation: a shard leaves the table under the table's lock and its own,
    /// and is marked [`Shard::retired`] in the same critical section. A thread that found the
    /// shard before (its cached shard, or a lookup that released the table's lock) locks it
    /// next, sees the mark and looks (pool, stream) up again; so no segment is ever added to a
    /// shard outside the table, and the segment registry names only shards in it. Called under
    /// `reclaim` (the guard proves it), which checkpoints, restores and the OOM ladder also
    /// hold: no shard they have looked up is retired under them.
    pub(crate) fn drop_empty_shards(&self, _reclaim: &ReclaimGuard<'_>, pool: Option<PoolId>) {
        let mut shards = lock(&self.shards);
        let before = shards.len();
        shards.retain(|&(p, _), cell| {
            if pool.is_some_and(|q| q != p) || p.is_default() {
                return true;
            }
            let mut s = lock(&cell.shard);
            // A live checkpoint's shard stays: restoring it needs its marks; so does one that
            // keeps a pinned backup buffer for its pool's next pause.
            if !s.is_empty() || s.has_live_mark() || s.keeps_host_spare() {
                return true;
            }
            s.retire(&self.env(&cell.pool_budget));
            false
        });
        if shards.len() != before {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The shard table: one shard per (pool, stream).
pub(crate) type ShardTable = FxHashMap<(PoolId, StreamId), ShardRef>;

/// The shards of `pool` in `table`.
pub(crate) fn shards_of(table: &ShardTable, pool: PoolId) -> Vec<ShardRef> {
    table
        .iter()
        .filter(|((p, _), _)| *p == pool)
        .map(|(_, c)| c.clone())
        .collect()
}
