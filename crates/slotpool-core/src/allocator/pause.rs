//! Pausing a pool: its physical pages go back to the driver while every virtual address, block and
//! statistic stays, so that pointers held by the program and CUDA graphs captured on the pool stay
//! valid; resuming maps new pages at the same addresses and copies a backup back.
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

use crate::allocator::pools::PoolEntry;
use crate::allocator::{Allocator, ShardRef, ShardTable, shards_of};
use crate::block::{SegmentId, SegmentKind};
use crate::device::{Device, DeviceError, HostBuffer};
use crate::env::Env;
use crate::error::{AllocError, AllocResult};
use crate::pool::PoolId;
use crate::shard::{Shard, ShardError};
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

/// One page given back by a pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PausedPage {
    pub seg: SegmentId,
    pub page: usize,
    /// Graph-retained when paused: retained again after the resume.
    pub retained: bool,
    /// Where the page's bytes lie in the shard's backup.
    pub host_offset: u64,
}

/// A paused shard's record (shard invariant 10).
#[derive(Debug, Default)]
pub(crate) struct ShardPause {
    /// `Shard::quick_off` before the pause.
    quick_off: bool,
    /// Sorted by (segment, page).
    pages: Vec<PausedPage>,
    /// The backup and its size.
    host: Option<(HostBuffer, u64)>,
}

/// Runs of pages to copy or map: (segment, first page, pages, host offset of the first).
type Run = (SegmentId, usize, usize, u64);

/// Runs of consecutive pages of one segment whose host stretches follow each other too.
fn runs_of(pages: &[PausedPage], ps: u64) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for p in pages {
        match out.last_mut() {
            Some((seg, first, n, off))
                if *seg == p.seg
                    && *first + *n == p.page
                    && *off + *n as u64 * ps == p.host_offset =>
            {
                *n += 1
            }
            _ => out.push((p.seg, p.page, 1, p.host_offset)),
        }
    }
    out
}

/// Give an unmapped physical page back to the driver (to the device's page pool if it refuses).
fn give_back(env: &Env<'_>, h: crate::device::PageHandle) {
    if env.dev.release_page(h).is_ok() {
        env.budget.release(env.page_size());
    } else {
        env.pages.put(h);
    }
}

impl Shard {
    /// Bytes of this shard that a pause cannot give back: classic segments.
    fn unpausable_bytes(&self) -> u64 {
        self.segments()
            .filter(|(_, s)| !s.is_vmm())
            .map(|(_, s)| s.size)
            .sum()
    }

    /// The pages mapped now, sorted by (segment, page), host offsets in that order.
    fn mapped_pages(&self, ps: u64) -> Vec<PausedPage> {
        let mut out = Vec::new();
        let mut segs: Vec<SegmentId> = self.segments().map(|(id, _)| id).collect();
        segs.sort_unstable();
        for seg in segs {
            let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
                continue;
            };
            for page in 0..pt.handle.len() {
                if pt.is_mapped(page) {
                    out.push(PausedPage {
                        seg,
                        page,
                        retained: pt.is_retained(page),
                        host_offset: out.len() as u64 * ps,
                    });
                }
            }
        }
        out
    }

    /// Copy `pages` to a pinned host buffer: the spare one of the last backup if it is large
    /// enough, else a new one. On error nothing is held.
    fn back_up(
        &mut self,
        env: &Env<'_>,
        pages: &[PausedPage],
    ) -> Result<Option<(HostBuffer, u64)>, DeviceError> {
        let ps = env.page_size();
        let size = pages.len() as u64 * ps;
        if size == 0 {
            return Ok(None);
        }
        let (buf, held) = match self.host_spare.take() {
            Some((buf, held)) if held >= size => (buf, held),
            spare => {
                if let Some((old, _)) = spare {
                    env.dev.free_host(old)?;
                }
                (env.dev.alloc_host(size)?, size)
            }
        };
        for (seg, first, n, off) in runs_of(pages, ps) {
            let addr = self.segments[seg].addr + first as u64 * ps;
            if let Err(e) = env.dev.copy_to_host(buf, off, addr, n as u64 * ps) {
                let _ = env.dev.free_host(buf);
                return Err(e);
            }
        }
        Ok(Some((buf, held)))
    }

    /// Pause this shard: unmap and give back `pages` (from [`Shard::mapped_pages`], the device
    /// synchronised), keeping `host` as their backup. Returns the bytes that could not be
    /// unmapped (a driver failure: they stay mapped and are not part of the pause).
    fn pause_commit(
        &mut self,
        env: &Env<'_>,
        pages: Vec<PausedPage>,
        host: Option<(HostBuffer, u64)>,
    ) -> u64 {
        let ps = env.page_size();
        self.flush_quick(env);
        let mut kept = Vec::with_capacity(pages.len());
        let mut unreleased = 0;
        let mut i = 0;
        while i < pages.len() {
            let p = pages[i];
            let small = self.segments[p.seg].small;
            let run = match &self.segments[p.seg].kind {
                SegmentKind::Vmm(pt) => pt.run_of(p.page),
                SegmentKind::Classic => None,
            };
            // A run goes with one unmap and one release (its slots are all mapped, so all listed
            // from its first on).
            if let Some((first, r)) = run {
                let n = (first + r.pages - p.page).min(pages.len() - i);
                match self.release_run(env, p.seg, first) {
                    Ok(bytes) => {
                        self.stats.reserved_paused_bytes.inc(small, bytes as i64);
                        kept.extend_from_slice(&pages[i..i + n]);
                    }
                    Err(_) => unreleased += r.pages as u64 * ps,
                }
                i += n;
                continue;
            }
            // Slots mapped page by page next to each other: one unmap where the backend can.
            let n = 1 + pages[i + 1..]
                .iter()
                .zip(&pages[i..])
                .take_while(|&(b, a)| b.seg == a.seg && b.page == a.page + 1)
                .take_while(|&(b, _)| {
                    matches!(&self.segments[b.seg].kind, SegmentKind::Vmm(pt) if !pt.in_run(b.page))
                })
                .count();
            if let Some(left) = self.unmap_stretch(env, p.seg, p.page, n) {
                for h in left {
                    give_back(env, h);
                }
                self.stats
                    .reserved_paused_bytes
                    .inc(small, (n as u64 * ps) as i64);
                kept.extend_from_slice(&pages[i..i + n]);
                i += n;
                continue;
            }
            for &q in &pages[i..i + n] {
                // A page mapped at several slots (an alias, see `alias.rs`) leaves with its last
                // slot; each slot is resumed with a page of its own.
                match self.unmap_page(env, q.seg, q.page) {
                    Ok(left) => {
                        if let Some(h) = left {
                            give_back(env, h);
                        }
                        self.stats.reserved_paused_bytes.inc(small, ps as i64);
                        kept.push(q);
                    }
                    Err(_) => unreleased += ps,
                }
            }
            i += n;
        }
        self.pause = Some(Box::new(ShardPause {
            quick_off: self.quick_off,
            pages: kept,
            host,
        }));
        self.quick_off = true;
        unreleased
    }

    /// Map new memory under every paused page, each stretch of consecutive slots as physical
    /// runs ([`Shard::map_runs`]), retained slots retained again. On error nothing stays mapped.
    fn resume_map(&mut self, env: &Env<'_>) -> Result<(), ShardError> {
        let ps = env.page_size();
        let Some(pause) = self.pause.take() else {
            return Ok(());
        };
        let mut result = Ok(());
        for (seg, first, n, _) in runs_of(&pause.pages, ps) {
            if let Err(e) = self.map_runs(env, seg, first, n) {
                result = Err(e);
                break;
            }
        }
        if result.is_ok() {
            for p in pause.pages.iter().filter(|p| p.retained) {
                Shard::retain_pages_of(&mut self.segments[p.seg], p.page, p.page + 1);
            }
        }
        self.pause = Some(pause);
        if result.is_err() {
            self.resume_undo(env);
        }
        result
    }

    /// Undo [`Shard::resume_map`]: unmap and give back every paused page mapped now (a run
    /// whole).
    fn resume_undo(&mut self, env: &Env<'_>) {
        let Some(pause) = self.pause.take() else {
            return;
        };
        for p in &pause.pages {
            let (mapped, run) = match &self.segments[p.seg].kind {
                SegmentKind::Vmm(pt) => (pt.is_mapped(p.page), pt.run_of(p.page)),
                SegmentKind::Classic => (false, None),
            };
            if let Some((first, _)) = run {
                let _ = self.release_run(env, p.seg, first);
            } else if mapped && let Ok(Some(h)) = self.unmap_page(env, p.seg, p.page) {
                give_back(env, h);
            }
        }
        self.pause = Some(pause);
    }

    /// Copy the backup back over the pages [`Shard::resume_map`] mapped.
    fn resume_copy(&self, env: &Env<'_>) -> Result<(), DeviceError> {
        let ps = env.page_size();
        let Some(pause) = &self.pause else {
            return Ok(());
        };
        let Some((buf, _)) = pause.host else {
            return Ok(());
        };
        for (seg, first, n, off) in runs_of(&pause.pages, ps) {
            let addr = self.segments[seg].addr + first as u64 * ps;
            env.dev.copy_from_host(addr, buf, off, n as u64 * ps)?;
        }
        Ok(())
    }

    /// The resume is done: forget the pause; its backup's buffer stays for the next one.
    fn resume_commit(&mut self, env: &Env<'_>) {
        let ps = env.page_size() as i64;
        let Some(pause) = self.pause.take() else {
            return;
        };
        for p in &pause.pages {
            let small = self.segments[p.seg].small;
            self.stats.reserved_paused_bytes.dec(small, ps);
        }
        self.quick_off = pause.quick_off;
        debug_assert!(self.host_spare.is_none(), "the backup took the spare");
        if pause.host.is_some() {
            self.host_spare = pause.host;
        }
    }

    /// Forget the pause of a shard that holds no live block (its pool is released): the
    /// paused pages stop counting as reserved, the backup is freed (kept as the spare buffer,
    /// freed by the next empty-cache, if the backend refuses).
    fn abandon_pause(&mut self, env: &Env<'_>) {
        let ps = env.page_size() as i64;
        let Some(pause) = self.pause.take() else {
            return;
        };
        for p in &pause.pages {
            let small = self.segments[p.seg].small;
            self.stats.reserved_paused_bytes.dec(small, ps);
        }
        self.quick_off = pause.quick_off;
        if let Some((buf, n)) = pause.host
            && env.dev.free_host(buf).is_err()
        {
            tracing::warn!("a released paused pool's backup could not be freed");
            if let Some((old, _)) = self.host_spare.replace((buf, n)) {
                let _ = env.dev.free_host(old);
            }
        }
    }

    /// (paused bytes, host bytes: the backup and the spare buffer) of this shard.
    fn pause_bytes(&self, ps: u64) -> (u64, u64) {
        let spare = self.host_spare.map_or(0, |(_, n)| n);
        self.pause.as_ref().map_or((0, spare), |p| {
            (
                p.pages.len() as u64 * ps,
                spare + p.host.map_or(0, |(_, n)| n),
            )
        })
    }

    /// Whether page `page` of segment `seg` is paused.
    pub(crate) fn is_paused_page(&self, seg: SegmentId, page: usize) -> bool {
        self.pause.as_ref().is_some_and(|p| {
            p.pages
                .binary_search_by_key(&(seg, page), |q| (q.seg, q.page))
                .is_ok()
        })
    }

    /// Shard invariant 10.
    pub(crate) fn check_pause(&self, page_size: u64) -> Result<(), String> {
        let mut recount = crate::stats::StatArray::default();
        if let Some(p) = &self.pause {
            if !self.quick.is_empty() || !self.quick_off {
                return Err("10: a paused shard has a quick cache".into());
            }
            if p.pages
                .windows(2)
                .any(|w| (w[0].seg, w[0].page) >= (w[1].seg, w[1].page))
            {
                return Err("10: paused pages are not sorted and distinct".into());
            }
            for q in &p.pages {
                let seg = self
                    .segments
                    .get(q.seg)
                    .ok_or(format!("10: paused page in missing segment {}", q.seg))?;
                let SegmentKind::Vmm(pt) = &seg.kind else {
                    return Err(format!("10: paused page in classic segment {}", q.seg));
                };
                if (q.page as u64 + 1) * page_size > seg.size || pt.is_mapped(q.page) {
                    return Err(format!(
                        "10: paused page {} of segment {} is out of range or mapped",
                        q.page, q.seg
                    ));
                }
                if let Some((_, size)) = p.host
                    && q.host_offset + page_size > size
                {
                    return Err(format!("10: paused page {} lies past the backup", q.page));
                }
                recount.inc(seg.small, page_size as i64);
            }
            if p.host.is_some() {
                let mut offs: Vec<u64> = p.pages.iter().map(|q| q.host_offset).collect();
                offs.sort_unstable();
                if offs.windows(2).any(|w| w[1] < w[0] + page_size) {
                    return Err("10: paused pages share backup bytes".into());
                }
            }
        }
        let have = &self.stats.reserved_paused_bytes;
        for (part, h, w) in [
            (
                "small_pool",
                have.small_pool().current,
                recount.small_pool().current,
            ),
            (
                "large_pool",
                have.large_pool().current,
                recount.large_pool().current,
            ),
        ] {
            if h != w {
                return Err(format!(
                    "10: reserved_paused_bytes.{part}.current is {h}, recount {w}"
                ));
            }
        }
        Ok(())
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
        let plans: Vec<_> = guards.iter().map(|s| s.mapped_pages(ps)).collect();
        let mut backups = Vec::with_capacity(cells.len());
        if mode == PauseMode::Backup {
            for ((cell, s), pages) in cells.iter().zip(guards.iter_mut()).zip(&plans) {
                match s.back_up(&self.env(&cell.pool_budget), pages) {
                    Ok(b) => backups.push(b),
                    Err(e) => {
                        for (buf, _) in backups.into_iter().flatten() {
                            let _ = self.dev.free_host(buf);
                        }
                        return Err(e.into());
                    }
                }
            }
        } else {
            backups.resize(cells.len(), None);
        }
        let mut unreleased = 0;
        for ((cell, s), (pages, host)) in cells
            .iter()
            .zip(guards.iter_mut())
            .zip(plans.into_iter().zip(backups))
        {
            let env = self.env(&cell.pool_budget);
            // The device is synchronised: frees waiting on events complete now.
            s.synchronize_events(&env);
            s.device_synchronized(&env);
            unreleased += s.pause_commit(&env, pages, host);
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
    pub(crate) fn end_orphaned_pauses(&self, _reclaim: &crate::sync::MutexGuard<'_, ()>) {
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
    cells.sort_by_key(|c| lock(&c.shard).stream);
    cells
}
