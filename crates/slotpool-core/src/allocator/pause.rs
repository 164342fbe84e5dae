//! Pausing a pool: its physical pages go back to the driver while every virtual address, block and
//! statistic stays, so that pointers held by the program and CUDA graphs captured on the pool stay
//! valid; resuming maps new pages at the same addresses and copies a backup back.
//!
//! This module holds the pool-wide part: finding and locking the pool's shards, refusing what
//! cannot be done, reclaiming other pools' cache before a resume gives up, and the results. Each
//! shard's part (the pages it gives back, their backup, mapping them again, its record while
//! paused: shard invariant 10) is the shard's own, in `shard/pause.rs`.
//!
//! Rules (docs/design.md, "Pause and resume"):
//!
//! - Only vmm memory can be paused: a classic segment (`cudaMalloc`) cannot give its memory back
//!   and keep its address. A pool declared [`crate::PoolOptions::pausable`] grows every segment,
//!   small ones too, as vmm memory; a pause of a pool that holds classic segments or arenas is
//!   refused, naming the bytes.
//! - Pausing is synchronous: it synchronises the device before unmapping anything, so that no page
//!   is released while queued work may still touch it (the driver's unmap is not stream-ordered,
//!   and graphs replayed on any stream may touch the pool).
//! - While paused, allocating from the pool fails with [`AllocError::PoolPaused`]; freeing into it
//!   works; nothing of it is released, cached or restored; a checkpoint may be taken (it records
//!   blocks only), a restore is refused.
//! - Pausing and resuming are transactions: on error nothing changed.
//! - A resume maps each stretch of paused slots as physical runs (`block/runs.rs`: one allocation
//!   and one mapping per run instead of per page); the next pause unmaps and releases each run with
//!   one call each, and a stretch of pages mapped one by one with one unmap where the backend can.
//! - The backup's pinned buffer is allocated at the first backed-up pause and kept for the next
//!   while the pool is in use (empty-cache calls keep it: pinning costs seconds per 10 GB); a
//!   released pool frees it at the next empty-cache.
//! - A released paused pool (no use left) stays paused while it holds live blocks; once it holds
//!   none (and no live checkpoint), the next empty-cache ends its pause
//!   (`Allocator::end_orphaned_pauses`): backup freed, paused bytes forgotten, reservations
//!   released, pool forgotten.

use super::ReclaimGuard;
use crate::allocator::pools::PoolEntry;
use crate::allocator::{Allocator, ShardRef, ShardTable, shards_of};
use crate::device::Device;
use crate::error::{AllocError, AllocResult};
use crate::pool::PoolId;
use crate::shard::{PausePlan, Shard, ShardError};
use crate::sync::lock;
use rustc_hash::FxHashMap;

/// What a pause does with the pool's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum PauseMode {
    /// The contents are lost; the resume maps fresh memory (a KV cache).
    Discard,
    /// The contents are copied to pinned host memory and copied back by the resume (weights).
    Backup,
}

/// Where a pool stands ([`Allocator::pool_pause_state`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PauseState {
    /// The pool is paused, and how.
    pub mode: Option<PauseMode>,
    /// Bytes given back to the driver that the resume maps again ("reserved, paused").
    pub paused_bytes: u64,
    /// Pinned host bytes that hold the backup.
    pub host_bytes: u64,
}

impl PauseState {
    pub fn is_paused(&self) -> bool {
        self.mode.is_some()
    }
}

impl<D: Device> Allocator<D> {
    /// Pause `pool`: give every physical page of it back to the driver, keeping every virtual
    /// address, block and statistic (`reserved_bytes` moves to `reserved_paused_bytes`). With
    /// [`PauseMode::Backup`] the contents are first copied to pinned host memory. Synchronises
    /// the device first. Returns the state after.
    ///
    /// Refused, with nothing changed: the default pool or an unknown one
    /// ([`AllocError::InvalidArgument`], [`AllocError::UnknownPool`]); a pool already paused,
    /// during a capture, or a pool holding classic segments or arenas
    /// ([`AllocError::InvalidState`], naming the bytes); a failed backup ([`AllocError::Device`]).
    pub fn pause_pool(&self, pool: PoolId, mode: PauseMode) -> AllocResult<PauseState> {
        if pool.is_default() {
            return Err(AllocError::InvalidArgument(Box::new(
                "the default pool cannot be paused".into(),
            )));
        }
        let _reclaim = lock(&self.reclaim);
        let arena_bytes: u64 = self
            .arena_bytes()
            .iter()
            .filter(|(p, _)| *p == pool)
            .map(|(_, b)| b)
            .sum();
        let mut pools = lock(&self.pools);
        let entry = self.pause_entry(&mut pools, pool, false)?;
        if arena_bytes > 0 {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {pool} holds {arena_bytes} bytes in arenas, which a pause does not release"
            ))));
        }
        let shards = lock(&self.shards);
        let cells = by_stream(&shards, pool);
        let mut guards: Vec<_> = cells.iter().map(|c| lock(&c.shard)).collect();
        let classic: u64 = guards.iter().map(|s| s.unpausable_bytes()).sum();
        if classic > 0 {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {pool} holds {classic} bytes in classic segments (cudaMalloc memory), which \
                 cannot be given back at their addresses: create it pausable"
            ))));
        }
        // Synchronous: nothing queued may touch a page once it is unmapped.
        self.dev.synchronize()?;
        let ps = self.shared.page_size;
        let mut plans: Vec<PausePlan> = guards.iter().map(|s| s.pause_plan(ps)).collect();
        if mode == PauseMode::Backup {
            let failed = cells
                .iter()
                .zip(guards.iter_mut())
                .zip(plans.iter_mut())
                .find_map(|((cell, s), plan)| s.back_up(&self.env(&cell.pool_budget), plan).err());
            if let Some(e) = failed {
                // The failed shard's plan holds nothing; the backups taken before it go.
                for plan in plans {
                    plan.free_backup(&*self.dev);
                }
                return Err(e.into());
            }
        }
        let mut unreleased = 0;
        for ((cell, s), plan) in cells.iter().zip(guards.iter_mut()).zip(plans) {
            unreleased += s.pause_commit(&self.env(&cell.pool_budget), plan);
        }
        entry.paused = Some(mode);
        let mut state = PauseState {
            mode: Some(mode),
            ..Default::default()
        };
        for s in &guards {
            let (paused, host) = s.pause_bytes(ps);
            state.paused_bytes += paused;
            state.host_bytes += host;
        }
        if unreleased > 0 {
            tracing::warn!(%pool, unreleased, "the driver refused to unmap some pages of a paused pool");
        }
        Ok(state)
    }

    /// Resume `pool`: map new physical memory at every paused address, copy the backup back, free
    /// it. Returns the bytes mapped. Refused, with nothing changed, for a pool that is not paused
    /// ([`AllocError::InvalidState`]), during a capture, or when the memory cannot be had
    /// ([`AllocError::OutOfMemory`]: the pool stays paused, its backup kept). Memory other pools
    /// cache is reclaimed first, as for an allocation (paused pools keep their state).
    pub fn resume_pool(&self, pool: PoolId) -> AllocResult<u64> {
        let attempt = || self.resume_once(pool);
        match attempt() {
            Err(AllocError::OutOfMemory(r)) => {
                self.reclaim_and_retry(r.requested, r.rounded, attempt)
            }
            other => other,
        }
    }

    /// `pool`'s entry, for a pause (`paused` false: the pool must not be paused) or a resume
    /// (`paused` true: it must be); refused for an unknown pool and during a capture.
    fn pause_entry<'a>(
        &self,
        pools: &'a mut FxHashMap<PoolId, PoolEntry>,
        pool: PoolId,
        paused: bool,
    ) -> AllocResult<&'a mut PoolEntry> {
        let entry = pools
            .get_mut(&pool)
            .ok_or_else(|| AllocError::UnknownPool(Box::new(pool)))?;
        let (wrong, verb) = match paused {
            false => (
                entry.paused.is_some().then_some("is paused already"),
                "paused",
            ),
            true => (entry.paused.is_none().then_some("is not paused"), "resumed"),
        };
        if let Some(why) = wrong {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {pool} {why}"
            ))));
        }
        if self.capture_underway() {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {pool} cannot be {verb} during a stream capture"
            ))));
        }
        Ok(entry)
    }

    /// [`Allocator::resume_pool`] without reclaiming: out of memory comes back with the bytes the
    /// resume needed.
    fn resume_once(&self, pool: PoolId) -> AllocResult<u64> {
        let _reclaim = lock(&self.reclaim);
        let mut pools = lock(&self.pools);
        let entry = self.pause_entry(&mut pools, pool, true)?;
        let shards = lock(&self.shards);
        let cells = by_stream(&shards, pool);
        let mut guards: Vec<_> = cells.iter().map(|c| lock(&c.shard)).collect();
        let ps = self.shared.page_size;
        let wanted: u64 = guards.iter().map(|s| s.pause_bytes(ps).0).sum();
        // Refuse what cannot fit before anything is mapped (a failure half-way is undone too,
        // but leaves its traffic in the totals).
        let pooled = self.shared.pages.len() as u64 * ps;
        let fresh = wanted.saturating_sub(pooled);
        let pool_limit = cells.first().map_or(u64::MAX, |c| c.pool_budget.limit());
        let pool_held = cells.first().map_or(0, |c| c.pool_budget.held());
        if fresh > self.dev.free_memory()
            || self.shared.budget.held() + fresh > self.shared.budget.limit()
            || pool_held + wanted > pool_limit
        {
            return Err(AllocError::OutOfMemory(Box::new(self.resume_oom(wanted))));
        }
        let undo = |guards: &mut Vec<crate::sync::ShardGuard<'_, Shard>>, upto: usize| {
            for (cell, s) in cells.iter().zip(guards.iter_mut()).take(upto) {
                s.resume_undo(&self.env(&cell.pool_budget));
            }
        };
        for i in 0..guards.len() {
            let env = self.env(&cells[i].pool_budget);
            if let Err(e) = guards[i].resume_map(&env) {
                undo(&mut guards, i);
                return Err(match e {
                    ShardError::OutOfMemory => {
                        AllocError::OutOfMemory(Box::new(self.resume_oom(wanted)))
                    }
                    other => crate::allocator::shard_error(other),
                });
            }
        }
        for i in 0..guards.len() {
            let env = self.env(&cells[i].pool_budget);
            if let Err(e) = guards[i].resume_copy(&env) {
                let n = guards.len();
                undo(&mut guards, n);
                return Err(e.into());
            }
        }
        let mut mapped = 0;
        for (cell, s) in cells.iter().zip(guards.iter_mut()) {
            mapped += s.pause_bytes(ps).0;
            s.resume_commit(&self.env(&cell.pool_budget));
        }
        entry.paused = None;
        Ok(mapped)
    }

    /// End the pauses that nothing can resume usefully: a paused pool whose last use was
    /// released ([`Allocator::release_pool`]), that holds no live block and that no live
    /// checkpoint needs. Its backup is freed and its paused bytes forgotten, so that the cache
    /// release that follows gives its reservations back and the pool is forgotten like any
    /// empty released pool. A released paused pool with live blocks stays paused, its backup
    /// kept, until it is resumed or its blocks are freed.
    pub(crate) fn end_orphaned_pauses(&self, _reclaim: &ReclaimGuard<'_>) {
        let mut pools = lock(&self.pools);
        let shards = lock(&self.shards);
        for (&id, entry) in pools.iter_mut() {
            if entry.paused.is_none()
                || entry.use_count > 0
                || entry.checkpoints.iter().any(|c| c.strong_count() > 0)
            {
                continue;
            }
            let cells = by_stream(&shards, id);
            let mut guards: Vec<_> = cells.iter().map(|c| lock(&c.shard)).collect();
            if guards.iter().any(|s| s.live_blocks() > 0) {
                continue;
            }
            for (cell, s) in cells.iter().zip(guards.iter_mut()) {
                s.abandon_pause(&self.env(&cell.pool_budget));
            }
            entry.paused = None;
        }
    }

    /// Whether `pool` is paused, how many bytes it gave back and how many the host holds.
    pub fn pool_pause_state(&self, pool: PoolId) -> AllocResult<PauseState> {
        let mode = lock(&self.pools)
            .get(&pool)
            .ok_or_else(|| AllocError::UnknownPool(Box::new(pool)))?
            .paused;
        let ps = self.shared.page_size;
        let mut state = PauseState {
            mode,
            ..Default::default()
        };
        for cell in self.pool_shards(pool) {
            let (paused, host) = lock(&cell.shard).pause_bytes(ps);
            state.paused_bytes += paused;
            state.host_bytes += host;
        }
        Ok(state)
    }

    /// What a refused resume reports: the bytes wanted against the limit and the device.
    fn resume_oom(&self, wanted: u64) -> crate::error::OomReport {
        crate::error::OomReport {
            requested: wanted,
            rounded: wanted,
            reserved: self.shared.budget.held(),
            limit: self.shared.budget.limit(),
            device_free: self.dev.free_memory(),
            ..Default::default()
        }
    }
}

/// The shards of `pool` in stream order: the order their locks are taken in.
fn by_stream(table: &ShardTable, pool: PoolId) -> Vec<ShardRef> {
    let mut cells = shards_of(table, pool);
    cells.sort_by_key(|c| lock(&c.shard).stream());
    cells
}
