//! Checkpoint / restore on the allocator, and variant groups built on them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crate::allocator::{Allocator, ShardRef};
use crate::checkpoint::{Checkpoint, CheckpointToken, MarkHolder, RestoreDelta, RestoreDiff};
use crate::device::{Device, DevicePtr};
use crate::error::{AllocError, AllocResult, OomReport};
use crate::pool::PoolId;
use crate::shard::{ShardCell, ShardError};
use crate::sync::lock;

static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

/// "Capture these N variants into one pool; only one of them runs at a time." Capturing variant
/// k starts from the checkpoint taken when the group was made, so every variant reuses the same
/// addresses, in any order, and the pool holds the largest variant, not the sum.
#[derive(Debug)]
pub struct VariantGroup {
    pool: PoolId,
    base: Checkpoint,
    count: usize,
    active: Option<usize>,
}

impl VariantGroup {
    pub fn pool(&self) -> PoolId {
        self.pool
    }

    pub fn count(&self) -> usize {
        self.count
    }

    /// The variant being captured, if any.
    pub fn active(&self) -> Option<usize> {
        self.active
    }
}

impl<D: Device> Allocator<D> {
    /// The shards of `pool` in stream order. Only checkpoint, restore, pause and resume hold more
    /// than one shard locked, and they do so under the `reclaim` lock, so this order cannot
    /// deadlock.
    fn pool_shards_sorted(&self, pool: PoolId) -> Vec<ShardRef> {
        let mut cells = self.pool_shards(pool);
        cells.sort_by_key(|c| lock(&c.shard).stream());
        cells
    }

    /// Take a checkpoint of `pool`: its segments, split topology and live set. Costs O(1) per
    /// (pool, stream) shard. Refused while frees of the pool wait on cross-stream events.
    pub fn checkpoint(&self, pool: PoolId) -> AllocResult<Checkpoint> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        let _reclaim = lock(&self.reclaim);
        let token = Arc::new(CheckpointToken {
            id: NEXT_TOKEN.fetch_add(1, Ordering::Relaxed),
        });
        if let Some(e) = lock(&self.pools).get_mut(&pool) {
            e.checkpoints.retain(|c| c.strong_count() > 0);
            e.checkpoints.push(Arc::downgrade(&token));
        }
        let cells = self.pool_shards(pool);
        // Validate every shard first so that a refusal leaves no marks behind.
        for c in &cells {
            let s = lock(&c.shard);
            if s.waits_on_events() {
                return Err(AllocError::InvalidState(Box::new(format!(
                    "pool {pool}: frees on stream {} wait on cross-stream events; call \
                     synchronize or process_events first",
                    s.stream()
                ))));
            }
        }
        let mut marks = Vec::with_capacity(cells.len());
        let mut live = 0;
        for c in &cells {
            let mut s = lock(&c.shard);
            // The checkpoint holds no cached blocks (shard invariant 9).
            s.flush_quick(&self.env(&c.pool_budget));
            s.add_mark(&token)
                .map_err(|e| AllocError::InvalidState(Box::new(e)))?;
            live += s.stats().allocation.all().current as usize;
            let holder: Weak<dyn MarkHolder> = Arc::downgrade(c) as Weak<ShardCell>;
            marks.push((s.stream(), holder));
        }
        Ok(Checkpoint {
            allocator: self.uid,
            pool,
            marks,
            token,
            live_blocks: live,
        })
    }

    /// Return `pool` to `checkpoint` while every allocation in `keep_live` survives at its
    /// address. Allocations made since are freed and allocations of the checkpoint freed since
    /// are re-created (the caller owns them); the delta says which. A transaction: on any
    /// mismatch nothing changes and the error carries a [`RestoreDiff`]. Costs what changed
    /// since the checkpoint.
    pub fn restore(
        &self,
        pool: PoolId,
        checkpoint: &Checkpoint,
        keep_live: &[DevicePtr],
    ) -> AllocResult<RestoreDelta> {
        self.restore_into(pool, checkpoint, keep_live, RestoreDelta::default())
    }

    /// [`Allocator::restore`] with its delta built in `buffers`' lists (cleared first).
    pub(crate) fn restore_into(
        &self,
        pool: PoolId,
        checkpoint: &Checkpoint,
        keep_live: &[DevicePtr],
        buffers: RestoreDelta,
    ) -> AllocResult<RestoreDelta> {
        // A retry after an out-of-memory starts from fresh lists.
        let buffers = std::cell::Cell::new(Some(buffers));
        let attempt = || {
            let delta = buffers.take().unwrap_or_default();
            self.restore_once(pool, checkpoint, keep_live, delta)
        };
        match attempt() {
            // Out of memory: the rest of the device's cache is reclaimed first, as for blocks.
            Err(AllocError::OutOfMemory(r)) => {
                self.reclaim_and_retry(r.requested, r.rounded, attempt)
            }
            other => other,
        }
    }

    /// [`Allocator::restore`] without reclaiming: out of memory comes back with the bytes the
    /// restore needed and no other figure.
    fn restore_once(
        &self,
        pool: PoolId,
        checkpoint: &Checkpoint,
        keep_live: &[DevicePtr],
        mut delta: RestoreDelta,
    ) -> AllocResult<RestoreDelta> {
        if checkpoint.allocator != self.uid {
            return Err(AllocError::InvalidArgument(Box::new(
                "checkpoint belongs to another allocator".into(),
            )));
        }
        if checkpoint.pool != pool {
            return Err(AllocError::InvalidArgument(Box::new(format!(
                "checkpoint of pool {} cannot restore pool {pool}",
                checkpoint.pool
            ))));
        }
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        let mut reclaim = lock(&self.reclaim);
        let scratch = &mut *reclaim;
        // Under `reclaim`, which pause and resume hold too.
        if lock(&self.pools)
            .get(&pool)
            .is_some_and(|e| e.paused.is_some())
        {
            return Err(AllocError::PoolPaused(Box::new(pool)));
        }
        let mut diff = RestoreDiff::default();
        for (stream, weak) in &checkpoint.marks {
            if weak.upgrade().is_none() {
                diff.mismatches
                    .push(format!("stream {stream}: the shard no longer exists"));
            }
        }
        let cells = self.pool_shards_sorted(pool);
        let mut guards: Vec<_> = cells.iter().map(|c| lock(&c.shard)).collect();
        // keep_live grouped by shard, looked up in the pool's own shards (locked now): one
        // live-map probe a pointer, where the registry took a read lock, a shard lock and two
        // reference counts each (30 ns a pointer on a 2-core VM). Pointers found in none are
        // named once the locks are gone (`with_owner` takes a shard's lock).
        let mut keeps: Vec<Vec<(DevicePtr, usize)>> = vec![Vec::new(); cells.len()];
        let mut strays = Vec::new();
        let mut last = 0;
        for &p in keep_live {
            let found = (0..guards.len())
                .map(|k| (last + k) % guards.len())
                .find_map(|i| guards[i].lookup(p).map(|id| (i, id)));
            match found {
                Some((i, id)) => {
                    keeps[i].push((p, id));
                    last = i;
                }
                None => strays.push(p),
            }
        }
        let mut plans = Vec::with_capacity(cells.len());
        for ((cell, shard), keep) in cells.iter().zip(guards.iter_mut()).zip(&keeps) {
            let mark = checkpoint
                .marks
                .iter()
                .any(|(_, w)| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(cell)))
                .then_some(checkpoint.token.id);
            if mark.is_none() {
                // A shard born after the checkpoint keeps no quick cache (`Shard::quick_off`)
                // unless it raced with the checkpoint; the plan needs its blocks free or live.
                shard.flush_quick(&self.env(&cell.pool_budget));
            }
            plans.push(shard.plan_restore(mark, keep, &mut diff, scratch));
        }
        if !diff.mismatches.is_empty() || !strays.is_empty() {
            drop(guards);
            for &p in &strays {
                let owner = self.with_owner(p, |_, s| s.pool());
                diff.mismatches.push(match owner {
                    Some(owner) if owner != pool => format!("{p:#x} belongs to another pool"),
                    _ => format!("{p:#x} is not a live allocation"),
                });
            }
            // Only a refusal reports the lists: copying them on every restore cost ~5%.
            for plan in &plans {
                diff.added.extend(plan.freed());
                diff.removed.extend(plan.created());
            }
            diff.added.sort_unstable();
            diff.removed.sort_unstable();
            return Err(AllocError::CheckpointMismatch(Box::new(diff)));
        }
        for ((cell, shard), plan) in cells.iter().zip(guards.iter_mut()).zip(&plans) {
            let env = self.env(&cell.pool_budget);
            match shard.restore_map(&env, plan) {
                Ok(()) => {}
                Err(ShardError::OutOfMemory) => {
                    let bytes = plans.iter().flat_map(|p| p.created()).map(|(_, s)| s).sum();
                    return Err(AllocError::OutOfMemory(Box::new(OomReport {
                        requested: bytes,
                        rounded: bytes,
                        ..OomReport::default()
                    })));
                }
                Err(other) => return Err(crate::allocator::shard_error(other)),
            }
        }
        delta.freed.clear();
        delta.created.clear();
        delta
            .freed
            .reserve(plans.iter().map(|p| p.freed().len()).sum());
        delta
            .created
            .reserve(plans.iter().map(|p| p.created().len()).sum());
        for ((cell, shard), plan) in cells.iter().zip(guards.iter_mut()).zip(plans) {
            let env = self.env(&cell.pool_budget);
            shard.restore_apply(&env, plan, &mut delta, scratch);
        }
        drop(guards);
        Ok(delta)
    }

    /// Start a variant group on `pool` (created if new): checkpoints it now.
    pub fn variant_group(&self, pool: PoolId, count: usize) -> AllocResult<VariantGroup> {
        if count == 0 {
            return Err(AllocError::InvalidArgument(Box::new(
                "a variant group needs variants".into(),
            )));
        }
        if !lock(&self.pools).contains_key(&pool) {
            self.create_or_incref_pool(pool, Default::default())?;
        }
        let base = self.checkpoint(pool)?;
        Ok(VariantGroup {
            pool,
            base,
            count,
            active: None,
        })
    }

    /// Begin variant `k`: the pool returns to the group's checkpoint, so `k` reuses the addresses
    /// every other variant used. The delta lists what earlier variants still held (now free).
    pub fn begin_variant(&self, group: &mut VariantGroup, k: usize) -> AllocResult<RestoreDelta> {
        if k >= group.count {
            return Err(AllocError::InvalidArgument(Box::new(format!(
                "variant {k} of a group of {}",
                group.count
            ))));
        }
        if let Some(a) = group.active {
            return Err(AllocError::InvalidState(Box::new(format!(
                "variant {a} has not ended"
            ))));
        }
        let delta = self.restore(group.pool, &group.base, &[])?;
        group.active = Some(k);
        Ok(delta)
    }

    /// End the variant being captured; its allocations stay as they are until the next variant
    /// begins.
    pub fn end_variant(&self, group: &mut VariantGroup) -> AllocResult<()> {
        group.active.take().map(|_| ()).ok_or_else(|| {
            AllocError::InvalidState(Box::new("no variant of this group is active".into()))
        })
    }
}

#[cfg(test)]
mod tests;
