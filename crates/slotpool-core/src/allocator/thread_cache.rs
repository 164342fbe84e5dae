//! The calling thread's cached shard: the shard the thread last allocated from, named with the
//! allocator and the shard table's generation it was found at. Allocation uses it in place (no
//! reference count traffic), and a free looks there first (each shard maps its own live
//! pointers). Every look goes through one of two probes, [`with_cached_shard!`] and
//! [`with_cached_shard_of!`]: macros, so that the probe is written once and still expands into
//! the caller's own body (the hot paths inline it whole, as a closure handed to a function was
//! not).

use std::cell::RefCell;

use super::Allocator;
use crate::device::{Device, StreamId};
use crate::pool::PoolId;
use crate::shard::ShardRef;

/// What the thread remembers.
pub(super) struct CachedShard {
    pub(super) allocator: u64,
    generation: u64,
    pool: PoolId,
    stream: StreamId,
    pub(super) shard: ShardRef,
}

impl CachedShard {
    /// Whether this is the shard of (`pool`, `stream`) of allocator `allocator` at
    /// `generation` (no shard was forgotten since it was cached).
    #[inline(always)]
    pub(super) fn serves(
        &self,
        allocator: u64,
        generation: u64,
        pool: PoolId,
        stream: StreamId,
    ) -> bool {
        self.allocator == allocator
            && self.generation == generation
            && self.pool == pool
            && self.stream == stream
    }
}

thread_local! {
    pub(super) static LAST_SHARD: RefCell<Option<CachedShard>> = const { RefCell::new(None) };
}

/// `with_cached_shard!(allocator, |cell| body)`: `body` (an `Option`) with `cell` the calling
/// thread's cached shard, if it is one of `allocator`'s; `None` where there is none (or the
/// thread is being torn down). The shard may have been forgotten since: a free finds nothing in
/// it then.
macro_rules! with_cached_shard {
    ($allocator:expr, |$cell:ident| $body:expr) => {
        $crate::allocator::thread_cache::LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref().filter(|e| e.allocator == $allocator.uid)?;
                let $cell = &e.shard;
                $body
            })
            .ok()
            .flatten()
    };
}

/// `with_cached_shard_of!(allocator, pool, stream, |cell| body)`: `body` (an `Option`) with
/// `cell` the calling thread's cached shard if it is `allocator`'s table's shard of (`pool`,
/// `stream`) now (no shard was forgotten since it was cached); `None` otherwise.
macro_rules! with_cached_shard_of {
    ($allocator:expr, $pool:expr, $stream:expr, |$cell:ident| $body:expr) => {{
        let generation = $allocator
            .generation
            .load(::std::sync::atomic::Ordering::Acquire);
        $crate::allocator::thread_cache::LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref()?;
                if !e.serves($allocator.uid, generation, $pool, $stream) {
                    return None;
                }
                let $cell = &e.shard;
                $body
            })
            .ok()
            .flatten()
    }};
}

pub(super) use {with_cached_shard, with_cached_shard_of};

impl<D: Device> Allocator<D> {
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
