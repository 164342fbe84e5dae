//! The calling thread's cached shard: the shard the thread last allocated from, named with the
//! allocator and the shard table's generation it was found at. Allocation uses it in place (no
//! reference count traffic), and a free looks there first (each shard maps its own live
//! pointers). Every use goes through [`Allocator::with_cached_shard`].

use std::cell::RefCell;
use std::sync::atomic::Ordering;

use super::Allocator;
use crate::device::{Device, StreamId};
use crate::pool::PoolId;
use crate::shard::ShardRef;

/// What the thread remembers.
struct CachedShard {
    allocator: u64,
    generation: u64,
    pool: PoolId,
    stream: StreamId,
    shard: ShardRef,
}

thread_local! {
    static LAST_SHARD: RefCell<Option<CachedShard>> = const { RefCell::new(None) };
}

impl<D: Device> Allocator<D> {
    /// `f` on the calling thread's cached shard, if it is one of this allocator's: the probe.
    /// `None` where there is none (or the thread is being torn down). The shard may have been
    /// forgotten since (a free finds nothing in it then; see [`Allocator::with_cached_shard_of`]).
    #[inline(always)]
    pub(super) fn with_cached_shard<R>(&self, f: impl FnOnce(&ShardRef) -> Option<R>) -> Option<R> {
        LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref().filter(|e| e.allocator == self.uid)?;
                f(&e.shard)
            })
            .ok()
            .flatten()
    }

    /// `f` on the calling thread's cached shard if it is the table's shard of (`pool`,
    /// `stream`) now: no shard was forgotten since it was cached.
    #[inline(always)]
    pub(super) fn with_cached_shard_of<R>(
        &self,
        pool: PoolId,
        stream: StreamId,
        f: impl FnOnce(&ShardRef) -> R,
    ) -> Option<R> {
        let generation = self.generation.load(Ordering::Acquire);
        LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref()?;
                (e.allocator == self.uid
                    && e.generation == generation
                    && e.pool == pool
                    && e.stream == stream)
                    .then(|| f(&e.shard))
            })
            .ok()
            .flatten()
    }

    /// Remember `cell` as the calling thread's shard of (`pool`, `stream`), found at table
    /// generation `generation` (read before the table was).
    pub(super) fn cache_shard(
        &self,
        generation: u64,
        pool: PoolId,
        stream: StreamId,
        cell: &ShardRef,
    ) {
        let _ = LAST_SHARD.try_with(|c| {
            *c.borrow_mut() = Some(CachedShard {
                allocator: self.uid,
                generation,
                pool,
                stream,
                shard: cell.clone(),
            })
        });
    }
}
