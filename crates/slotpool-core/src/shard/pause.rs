//! The shard's half of pause and resume ([`crate::pause`] states the rules): which pages a pause
//! gives back, their backup, unmapping and releasing them (a physical run whole, a stretch of
//! pages mapped one by one with one unmap where the backend can), mapping them again at the
//! resume, and the record a paused shard keeps in between. The allocator's half
//! (`allocator/pause.rs`) finds and locks the pool's shards, refuses what cannot be done,
//! reclaims other pools' cache and retries, and turns each step's result into the caller's; it
//! reaches a shard only through the methods here.
//!
//! A pause is three steps per shard, each shard's step done before the next step starts on any:
//! [`Shard::pause_plan`] (the pages mapped now), [`Shard::back_up`] (their contents, for a
//! backed-up pause; a failure frees the backups taken and pauses no shard), then
//! [`Shard::pause_commit`]. A resume is [`Shard::resume_map`], [`Shard::resume_copy`], then
//! [`Shard::resume_commit`]; a failed step is undone with [`Shard::resume_undo`] on every shard
//! it reached.
//!
//! Invariant 10 of [`Shard`] is this module's, checked by [`Shard::check_pause`]:
//!
//! 1. The record lists each paused page once, sorted by (segment, page), in a vmm segment, inside
//!    it and unmapped.
//! 2. With a backup, each listed page has a stretch of it of its own, inside the buffer.
//! 3. A paused shard's quick cache is empty and off (its state before the pause is in the record).
//! 4. `reserved_paused_bytes` counts the listed pages, per pool part; it is 0 when not paused.

use crate::block::{SegmentId, SegmentKind};
use crate::device::{Device, DeviceError, HostBuffer, PageHandle};
use crate::env::Env;

use super::{Shard, ShardError};

/// One page given back by a pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PausedPage {
    seg: SegmentId,
    page: usize,
    /// Graph-retained when paused: retained again after the resume.
    retained: bool,
    /// Where the page's bytes lie in the shard's backup.
    host_offset: u64,
}

/// A paused shard's record (invariant 10).
#[derive(Debug, Default)]
pub(super) struct ShardPause {
    /// `Shard::quick_off` before the pause.
    quick_off: bool,
    /// Sorted by (segment, page).
    pages: Vec<PausedPage>,
    /// The backup and its size.
    host: Option<(HostBuffer, u64)>,
}

/// What a pause of one shard will give back ([`Shard::pause_plan`]) and, once
/// [`Shard::back_up`] took it, the backup of those pages.
#[derive(Debug)]
pub(crate) struct PausePlan {
    /// The pages mapped at planning, sorted by (segment, page), host offsets in that order.
    pages: Vec<PausedPage>,
    /// The backup and its size.
    host: Option<(HostBuffer, u64)>,
}

impl PausePlan {
    /// Free the plan's backup, if it has one: a pause given up after some shards backed up.
    pub(crate) fn free_backup(self, dev: &dyn Device) {
        if let Some((buf, _)) = self.host {
            let _ = dev.free_host(buf);
        }
    }
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
fn give_back(env: &Env<'_>, h: PageHandle) {
    if env.dev.release_page(h).is_ok() {
        env.budget.release(env.page_size());
    } else {
        env.pages.put(h);
    }
}

impl Shard {
    /// Whether the shard's pool is paused.
    pub(crate) fn is_paused(&self) -> bool {
        self.pause.is_some()
    }

    /// Whether the shard keeps the pinned buffer of its last backup for the next one (the
    /// allocator then keeps the shard, empty or not).
    pub(crate) fn keeps_host_spare(&self) -> bool {
        self.host_spare.is_some()
    }

    /// Bytes of this shard that a pause cannot give back: classic segments.
    pub(crate) fn unpausable_bytes(&self) -> u64 {
        self.segments()
            .filter(|(_, s)| !s.is_vmm())
            .map(|(_, s)| s.size)
            .sum()
    }

    /// What a pause would give back now: the pages mapped, sorted by (segment, page), host
    /// offsets in that order; no backup yet.
    pub(crate) fn pause_plan(&self, ps: u64) -> PausePlan {
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
        PausePlan {
            pages: out,
            host: None,
        }
    }

    /// Copy the pages of `plan` to a pinned host buffer, which the plan then holds: the spare
    /// one of the last backup if it is large enough, else a new one. On error nothing is held
    /// (and the plan has no backup).
    pub(crate) fn back_up(
        &mut self,
        env: &Env<'_>,
        plan: &mut PausePlan,
    ) -> Result<(), DeviceError> {
        let ps = env.page_size();
        let size = plan.pages.len() as u64 * ps;
        if size == 0 {
            return Ok(());
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
        for (seg, first, n, off) in runs_of(&plan.pages, ps) {
            let addr = self.segments[seg].addr + first as u64 * ps;
            if let Err(e) = env.dev.copy_to_host(buf, off, addr, n as u64 * ps) {
                let _ = env.dev.free_host(buf);
                return Err(e);
            }
        }
        plan.host = Some((buf, held));
        Ok(())
    }

    /// Pause this shard, the device synchronised by the caller: complete the frees waiting on
    /// events, then unmap and give back the pages of `plan` (from [`Shard::pause_plan`]),
    /// keeping its backup. Returns the bytes that could not be unmapped (a driver failure: they
    /// stay mapped and are not part of the pause).
    pub(crate) fn pause_commit(&mut self, env: &Env<'_>, plan: PausePlan) -> u64 {
        let PausePlan { pages, host } = plan;
        let ps = env.page_size();
        // The device is synchronised: frees waiting on events complete now.
        self.synchronize_events(env);
        self.device_synchronized(env);
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
    pub(crate) fn resume_map(&mut self, env: &Env<'_>) -> Result<(), ShardError> {
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
    pub(crate) fn resume_undo(&mut self, env: &Env<'_>) {
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
    pub(crate) fn resume_copy(&self, env: &Env<'_>) -> Result<(), DeviceError> {
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
    pub(crate) fn resume_commit(&mut self, env: &Env<'_>) {
        let Some(pause) = self.end_pause(env) else {
            return;
        };
        // A backed-up pause took the spare buffer (`back_up`); a discarding one left it spare.
        if pause.host.is_some() {
            debug_assert!(self.host_spare.is_none(), "the backup took the spare");
            self.host_spare = pause.host;
        }
    }

    /// Forget the pause of a shard that holds no live block (its pool is released): the
    /// paused pages stop counting as reserved, the backup is freed (kept as the spare buffer,
    /// freed by the next empty-cache, if the backend refuses).
    pub(crate) fn abandon_pause(&mut self, env: &Env<'_>) {
        let Some(pause) = self.end_pause(env) else {
            return;
        };
        if let Some((buf, n)) = pause.host
            && env.dev.free_host(buf).is_err()
        {
            tracing::warn!("a released paused pool's backup could not be freed");
            if let Some((old, _)) = self.host_spare.replace((buf, n)) {
                let _ = env.dev.free_host(old);
            }
        }
    }

    /// Take the shard's pause record, if any: its pages stop counting as paused, the quick
    /// cache's state before the pause comes back. The caller deals with the backup.
    fn end_pause(&mut self, env: &Env<'_>) -> Option<Box<ShardPause>> {
        let ps = env.page_size() as i64;
        let pause = self.pause.take()?;
        for p in &pause.pages {
            let small = self.segments[p.seg].small;
            self.stats.reserved_paused_bytes.dec(small, ps);
        }
        self.quick_off = pause.quick_off;
        Some(pause)
    }

    /// (paused bytes, host bytes: the backup and the spare buffer) of this shard.
    pub(crate) fn pause_bytes(&self, ps: u64) -> (u64, u64) {
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
    pub(super) fn check_pause(&self, page_size: u64) -> Result<(), String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn page(seg: SegmentId, page: usize, host_offset: u64) -> PausedPage {
        PausedPage {
            seg,
            page,
            retained: false,
            host_offset,
        }
    }

    /// A run of the copy or the mapping goes on while the slots and the host stretches both
    /// follow each other in one segment; a gap in either, or a new segment, starts another.
    #[test]
    fn runs_follow_slots_and_host_stretches() {
        let ps = 4;
        let pages = [
            page(0, 2, 0),
            page(0, 3, 4),
            page(0, 4, 8),
            page(0, 6, 12), // a slot skipped
            page(0, 7, 20), // a host stretch skipped
            page(1, 8, 24), // another segment
            page(1, 9, 28),
        ];
        assert_eq!(
            runs_of(&pages, ps),
            [(0, 2, 3, 0), (0, 6, 1, 12), (0, 7, 1, 20), (1, 8, 2, 24)]
        );
        assert!(runs_of(&[], ps).is_empty());
    }
}
