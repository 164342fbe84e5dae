//! Reclaiming memory: the out-of-memory ladder, `empty_cache`, and releasing a shard's cache.

use super::ReclaimGuard;
use crate::device::{Device, DevicePtr, StreamId};
use crate::error::{AllocError, AllocResult, OomReport};
use crate::pool::PoolId;
use crate::shard::ShardError;
pub(crate) use crate::shard::ShardRef;
use crate::sync::lock;
use std::sync::atomic::Ordering;

use super::{Allocator, shard_error};

impl<D: Device> Allocator<D> {
    /// Release a shard's cache, unregistering the segments it gave back.
    fn release_on(&self, pool: PoolId, cell: &ShardRef, synchronize: bool, keep_pages: bool) {
        let keep_retained = self.pool_in_use(pool);
        let env = self.env(&cell.pool_budget);
        let mut s = lock(&cell.shard);
        s.release_cached(&env, synchronize, keep_pages, keep_retained);
        self.register_segments(cell, &mut s);
    }

    /// PyTorch's retry ladder: free this pool's cache, try `use_on_oom` pools, free every unused
    /// cached byte on the device, retry; then fail with a report.
    pub(super) fn alloc_after_oom(
        &self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        size: u64,
    ) -> AllocResult<DevicePtr> {
        let _reclaim = lock(&self.reclaim);
        // Shards are retired only under `reclaim`: the one looked up now stays in the table
        // until this returns.
        let cell = self.refresh_shard(pool, stream)?;
        let attempt = |cell: &ShardRef| self.alloc_on(cell, rounded, size);
        // 1. This shard's own cache.
        self.release_on(pool, &cell, false, true);
        if let Ok(addr) = attempt(&cell) {
            return Ok(addr);
        }
        // 2. Free blocks of pools marked use_on_oom, on the same stream.
        for other in self.use_on_oom_pools(pool) {
            if let Some(oc) = self.existing_shard(other, stream)
                && let Ok(addr) = attempt(&oc)
            {
                return Ok(addr);
            }
        }
        // 3. Every unused cached byte on the device (never during a capture).
        if let Some(r) = self
            .retry_after_release_all(|| attempt(&cell), |e| matches!(e, ShardError::OutOfMemory))
        {
            return r.map_err(shard_error);
        }
        self.num_ooms.fetch_add(1, Ordering::Relaxed);
        self.shared
            .trace
            .record(crate::history::TraceAction::Oom, 0, rounded, stream);
        let report = self.oom_report(size, rounded);
        tracing::info!(%report, "out of memory");
        Err(AllocError::OutOfMemory(Box::new(report)))
    }

    /// The last rungs of the ladder for memory that is no shard's (an arena's slot, a
    /// restore's blocks): every unused cached byte of the device is released and `attempt`
    /// retried, first with the idle pages kept in the device's page pool, then without them;
    /// then the report.
    pub(crate) fn reclaim_and_retry<T>(
        &self,
        size: u64,
        rounded: u64,
        attempt: impl Fn() -> AllocResult<T>,
    ) -> AllocResult<T> {
        if let Some(r) =
            self.retry_after_release_all(attempt, |e| matches!(e, AllocError::OutOfMemory(_)))
        {
            return r;
        }
        self.num_ooms.fetch_add(1, Ordering::Relaxed);
        Err(AllocError::OutOfMemory(Box::new(
            self.oom_report(size, rounded),
        )))
    }

    /// The ladder's last rung, shared by both ladders: outside captures, release every unused
    /// cached byte of the device and retry `attempt`, first with the idle pages kept in the
    /// device's page pool, then (those it could not use, as a classic segment takes no page)
    /// after giving them back to the driver. `None` when it is still out of memory (`is_oom`)
    /// or a capture is underway; else what the attempt returned.
    fn retry_after_release_all<T, E>(
        &self,
        attempt: impl Fn() -> Result<T, E>,
        is_oom: impl Fn(&E) -> bool,
    ) -> Option<Result<T, E>> {
        if self.capture_underway() {
            return None;
        }
        let synced = self.counted.synchronize().is_ok();
        self.release_all_cached(synced, true);
        self.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
        for last in [false, true] {
            if last {
                self.release_page_pool();
            }
            match attempt() {
                Err(e) if is_oom(&e) => {}
                other => return Some(other),
            }
        }
        None
    }

    pub(super) fn oom_report(&self, size: u64, rounded: u64) -> OomReport {
        // Arena slots are allocated bytes of the arenas' (private) pools.
        let arena_allocated = self.arena_allocated_bytes();
        let arena_reserved: u64 = self.arena_bytes().iter().map(|&(_, b)| b).sum();
        let (mut allocated, mut private_reserved, mut private_allocated) =
            (arena_allocated, arena_reserved, arena_allocated);
        for (&(pool, _), cell) in self.all_shards().iter() {
            let s = lock(&cell.shard);
            let shard_allocated = s.stats().allocated_bytes.all().current as u64;
            allocated += shard_allocated;
            if !pool.is_default() {
                private_reserved += s.stats().reserved_bytes.all().current as u64;
                private_allocated += shard_allocated;
            }
        }
        OomReport {
            requested: size,
            rounded,
            limit: self.shared.budget.limit(),
            device_free: self.dev.free_memory(),
            ..OomReport::counting(
                self.shared.budget.held(),
                allocated,
                private_reserved,
                private_allocated,
            )
        }
    }

    /// Return every unused cached byte of the default pool and of freeable private pools to the
    /// device (`torch.cuda.empty_cache`). Pools in use keep their graph-retained memory (live
    /// graphs may touch it) and release the rest.
    pub fn empty_cache(&self) {
        let reclaim = lock(&self.reclaim);
        let synced = !self.capture_underway() && self.counted.synchronize().is_ok();
        self.end_orphaned_pauses(&reclaim);
        self.release_all_cached(synced, false);
        self.release_page_pool();
        self.forget_freeable_pools(&reclaim);
    }

    /// `empty_cache` for one pool; a pool in use keeps its graph-retained memory.
    pub fn empty_pool_cache(&self, pool: PoolId) -> AllocResult<()> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        let reclaim = lock(&self.reclaim);
        let synced = !self.capture_underway() && self.counted.synchronize().is_ok();
        self.end_orphaned_pauses(&reclaim);
        for cell in self.pool_shards(pool) {
            self.release_on(pool, &cell, synced, false);
        }
        self.release_page_pool();
        self.forget_freeable_pools(&reclaim);
        Ok(())
    }

    /// Release cached memory, one shard at a time: all of it in the default pool and freeable
    /// pools; in pools in use, what no captured graph may touch (not graph-retained).
    fn release_all_cached(&self, synchronize: bool, keep_pages: bool) {
        for ((pool, _), cell) in self.all_shards() {
            self.release_on(pool, &cell, synchronize, keep_pages);
        }
    }

    fn release_page_pool(&self) {
        if self.capture_underway() {
            return;
        }
        for page in self.shared.pages.drain() {
            if self.counted.release_page(page).is_ok() {
                self.shared.budget.release(self.shared.page_size);
            } else {
                self.shared.pages.put(page);
                break;
            }
        }
        for (run, bytes) in self.shared.pages.drain_runs() {
            if self.counted.release_page(run).is_ok() {
                self.shared.budget.release(bytes);
            } else {
                self.shared.pages.put_run(run, bytes);
            }
        }
    }

    /// Forget freeable pools that hold nothing any more (no shard, no live arena) and that no
    /// live checkpoint needs.
    fn forget_freeable_pools(&self, reclaim: &ReclaimGuard<'_>) {
        self.drop_empty_shards(reclaim, None);
        let arena_pools = self.arena_pools();
        let mut pools = lock(&self.pools);
        let shards = lock(&self.shards);
        pools.retain(|id, e| {
            id.is_default()
                || e.use_count > 0
                || e.checkpoints.iter().any(|c| c.strong_count() > 0)
                || shards.keys().any(|(p, _)| p == id)
                || arena_pools.contains(id)
        });
    }
}
