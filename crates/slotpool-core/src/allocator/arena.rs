//! The allocator's arena calls: each finds its arena under the arenas' lock and feeds it an
//! [`Env`]; creating and destroying an arena takes and gives back a use of its pool; and the
//! arenas' part of the statistics, the snapshot, the state dump and the invariants.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Allocator;
use crate::arena::{Arena, ArenaId, ArenaReport};
use crate::device::{Device, DevicePtr, DeviceResult, StreamId};
use crate::env::{Budget, Env};
use crate::error::{AllocError, AllocResult};
use crate::pool::PoolId;
use crate::snapshot::SegmentSnapshot;
use crate::stats::MemoryStats;
use crate::sync::lock;

impl<D: Device> Allocator<D> {
    /// Create an arena in `pool` (created if new) for work on `stream`. It reserves address
    /// space only; pages are mapped as slots are placed. The arena holds a use of the pool until
    /// it is destroyed.
    pub fn arena_create(&self, pool: PoolId, stream: StreamId) -> AllocResult<ArenaId> {
        // A pause refuses pools with arenas, and a paused pool takes no arena (`pause.rs`).
        if lock(&self.pools)
            .get(&pool)
            .is_some_and(|e| e.paused.is_some())
        {
            return Err(AllocError::PoolPaused(Box::new(pool)));
        }
        let capacity = self.shared.vmm_reservation;
        let base = self.dev.reserve(capacity)?;
        let pool_budget = match self.take_pool_use(pool) {
            Ok(b) => b,
            Err(e) => {
                let _ = self.dev.release_reservation(base, capacity);
                return Err(e);
            }
        };
        let id = self.next_arena.fetch_add(1, Ordering::Relaxed);
        lock(&self.arenas).insert(id, Arena::new(pool, stream, pool_budget, base, capacity));
        Ok(ArenaId(id))
    }

    /// One use of `pool` (created if new) and its budget.
    fn take_pool_use(&self, pool: PoolId) -> AllocResult<Arc<Budget>> {
        if !pool.is_default() {
            self.create_or_incref_pool(pool, Default::default())?;
        }
        lock(&self.pools)
            .get(&pool)
            .map(|e| e.budget.clone())
            .ok_or_else(|| AllocError::UnknownPool(Box::new(pool)))
    }

    /// Give back the use an arena took of its pool, if that pool is still the one it took.
    fn give_pool_use(&self, a: &Arena) {
        if a.pool().is_default() {
            return;
        }
        if let Some(e) = lock(&self.pools).get_mut(&a.pool())
            && Arc::ptr_eq(&e.budget, a.pool_budget())
        {
            e.use_count = e.use_count.saturating_sub(1);
        }
    }

    /// Run `f` on arena `arena` with its environment.
    fn with_arena<R>(
        &self,
        arena: ArenaId,
        f: impl FnOnce(&mut Arena, &Env) -> AllocResult<R>,
    ) -> AllocResult<R> {
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        let budget = a.pool_budget().clone();
        let env = self.env(&budget);
        f(a, &env)
    }

    /// Turn the overlap check on or off.
    pub fn arena_set_debug(&self, arena: ArenaId, on: bool) -> AllocResult<()> {
        self.with_arena(arena, |a, _| {
            a.set_debug(on);
            Ok(())
        })
    }

    /// Declare slot `slot`'s size before any branch uses it, so that it never moves.
    pub fn arena_reserve_slot(&self, arena: ArenaId, slot: u32, size: u64) -> AllocResult<u64> {
        self.with_arena(arena, |a, env| a.reserve_slot(env, slot, size))
    }

    /// Allocate slot `slot` for `branch`: the same address for every branch.
    pub fn arena_alloc(
        &self,
        arena: ArenaId,
        branch: u32,
        slot: u32,
        size: u64,
    ) -> AllocResult<DevicePtr> {
        let attempt = || self.with_arena(arena, |a, env| a.alloc(env, branch, slot, size));
        match attempt() {
            // Out of memory: the rest of the device's cache is reclaimed first, as for blocks.
            Err(AllocError::OutOfMemory(_)) => {
                self.reclaim_and_retry(size, size.next_multiple_of(512), attempt)
            }
            other => other,
        }
    }

    /// Free slot `slot` of `branch`.
    pub fn arena_free(&self, arena: ArenaId, branch: u32, slot: u32) -> AllocResult<()> {
        self.with_arena(arena, |a, env| a.free(env, branch, slot))
    }

    /// What the arena holds.
    pub fn arena_report(&self, arena: ArenaId) -> AllocResult<ArenaReport> {
        let ps = self.shared.page_size;
        self.with_arena(arena, |a, _| Ok(a.report(ps)))
    }

    /// Destroy an arena: its pages go to the device's page pool, its reservation back to the
    /// device, and its use of the pool is given back. Refused while any (branch, slot) is live
    /// and during a capture.
    pub fn arena_destroy(&self, arena: ArenaId) -> AllocResult<()> {
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        if a.live_count() > 0 {
            return Err(AllocError::InvalidState(Box::new(format!(
                "arena {} has {} live allocations",
                arena.0,
                a.live_count()
            ))));
        }
        if self.capture_underway() {
            return Err(AllocError::InvalidState(Box::new(
                "cannot unmap during a capture".into(),
            )));
        }
        let budget = a.pool_budget().clone();
        a.unmap_all(&self.env(&budget))?;
        let a = arenas
            .remove(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        self.give_pool_use(&a);
        drop(arenas);
        let (base, capacity) = a.reservation();
        self.dev.release_reservation(base, capacity)?;
        Ok(())
    }

    /// Give every added peer access to the arenas' pages (see `peer.rs`); under the arenas'
    /// lock, which their mapping and unmapping take.
    pub(super) fn refresh_arena_access(&self) -> DeviceResult<()> {
        let ps = self.shared.page_size;
        for a in lock(&self.arenas).values() {
            let (base, bytes) = a.mapped(ps);
            if bytes > 0 {
                self.dev.refresh_access(base, bytes)?;
            }
        }
        Ok(())
    }

    /// Physical bytes held by arenas, per pool (part of `held_bytes`).
    pub(super) fn arena_bytes(&self) -> Vec<(PoolId, u64)> {
        let ps = self.shared.page_size;
        lock(&self.arenas)
            .values()
            .map(|a| (a.pool(), a.mapped(ps).1))
            .collect()
    }

    /// The arenas' statistics merged into `out`, those of `pool` only when given.
    pub(super) fn merge_arena_stats(&self, out: &mut MemoryStats, pool: Option<PoolId>) {
        for a in lock(&self.arenas).values() {
            if pool.is_none_or(|p| p == a.pool()) {
                out.merge(a.stats());
            }
        }
    }

    /// Apply `f` to every arena's statistics (peak and total resets).
    pub(super) fn arena_stats_mut(&self, f: impl Fn(&mut MemoryStats)) {
        for a in lock(&self.arenas).values_mut() {
            f(a.stats_mut());
        }
    }

    /// The pools arenas live in (never forgotten while they do).
    pub(super) fn arena_pools(&self) -> Vec<PoolId> {
        lock(&self.arenas).values().map(|a| a.pool()).collect()
    }

    /// Bytes the arenas' live slots count as allocated.
    pub(super) fn arena_allocated_bytes(&self) -> u64 {
        lock(&self.arenas)
            .values()
            .map(|a| a.counted_bytes() as u64)
            .sum()
    }

    /// The arenas' mapped pages as snapshot segments.
    pub(super) fn arena_snapshots(&self) -> Vec<SegmentSnapshot> {
        let ps = self.shared.page_size;
        lock(&self.arenas)
            .values()
            .filter_map(|a| a.snapshot(ps))
            .collect()
    }

    /// Check every arena's invariants; the bytes their live slots count as allocated.
    pub(super) fn check_arenas(&self) -> Result<i64, String> {
        let ps = self.shared.page_size;
        let arenas = lock(&self.arenas);
        let pools = lock(&self.pools);
        let mut allocated = 0;
        for (id, a) in arenas.iter() {
            a.check(ps).map_err(|e| format!("arena {id}: {e}"))?;
            if !a.pool().is_default()
                && !pools
                    .get(&a.pool())
                    .is_some_and(|e| Arc::ptr_eq(&e.budget, a.pool_budget()))
            {
                return Err(format!(
                    "arena {id}: its pool {} is not registered",
                    a.pool()
                ));
            }
            allocated += a.counted_bytes();
        }
        Ok(allocated)
    }

    /// Every arena's pages, slots and live allocations, in id order, for
    /// [`Allocator::state_dump`] (debug-mode overlap reports are left out: recording one is what
    /// a refused overlapping call does).
    pub(super) fn arena_dump(&self) -> String {
        let arenas = lock(&self.arenas);
        let mut ids: Vec<_> = arenas.keys().copied().collect();
        ids.sort_unstable();
        let mut out = String::new();
        for id in ids {
            arenas[&id].dump(id, &mut out);
        }
        out
    }

    /// The stream an arena was made for.
    pub fn arena_stream(&self, arena: ArenaId) -> AllocResult<StreamId> {
        self.with_arena(arena, |a, _| Ok(a.stream()))
    }
}

fn unknown_arena(arena: ArenaId) -> AllocError {
    AllocError::InvalidArgument(Box::new(format!("unknown arena {}", arena.0)))
}
