//! vmm pages and epochs: which page slots are mapped, live and idle, where idle pages move, and when a page may be unmapped.

use rustc_hash::FxHashMap;

use crate::block::{SegmentId, SegmentKind};
use crate::device::{DevicePtr, PageHandle};
use crate::env::Env;
use crate::history::TraceAction;

use super::{Shard, ShardError};

impl Shard {
    pub(crate) fn page_range(ps: u64, seg_addr: u64, addr: u64, size: u64) -> (usize, usize) {
        let first = ((addr - seg_addr) / ps) as usize;
        let end = (addr + size - seg_addr).div_ceil(ps) as usize;
        (first, end)
    }

    /// Adjust the live counts of the pages under [addr, addr+size); pages that fall idle remember
    /// the current epoch.
    pub(super) fn pages_live(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        addr: u64,
        size: u64,
        delta: i32,
    ) {
        let epoch = self.epoch;
        let segment = &mut self.segments[seg];
        let (first, end) = Self::page_range(env.page_size(), segment.addr, addr, size);
        let SegmentKind::Vmm(pt) = &mut segment.kind else {
            return;
        };
        pt.cover(end);
        if delta > 0 {
            pt.add_live(first, end);
        } else {
            pt.drop_live(first, end, epoch);
        }
    }

    /// Back every page slot under [addr, addr+size) with a physical page of its own. A slot
    /// mapped to a page that backs no other occupied slot is used as it is (no driver call);
    /// a stale slot (its page backs another occupied slot, see [`crate::alias`]) is unmapped
    /// first. Pages come from the device pool, as an alias of an idle page of this reservation,
    /// from this shard's other reservations, or are created. On error nothing changed but stale
    /// slots left unmapped.
    pub(crate) fn map_range(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        addr: u64,
        size: u64,
        allow_reclaim: bool,
    ) -> Result<(), ShardError> {
        let seg_addr = self.segments[seg].addr;
        let (first, end) = Self::page_range(env.page_size(), seg_addr, addr, size);
        {
            let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
                return Ok(());
            };
            // Mapped already, each page to this slot alone: the common case of every large
            // allocation, answered without building a list.
            if pt
                .handle
                .get(first..end)
                .is_some_and(|h| h.iter().all(Option::is_some))
                && !pt.any_shared(first, end)
            {
                return Ok(());
            }
        }
        if self.slots_ready(seg, first, end) {
            return Ok(());
        }
        let mut taken = FxHashMap::default();
        self.map_slots(env, seg, first, end, allow_reclaim, &mut taken)
    }

    /// Whether pages [first, end) of vmm segment `seg` may take live bytes as they are mapped
    /// now: every slot mapped to a page that backs no other occupied slot, nor another slot of
    /// the range. Allocates nothing: it is the second fast path of every allocation that lands
    /// on aliased slots.
    pub(super) fn slots_ready(&self, seg: SegmentId, first: usize, end: usize) -> bool {
        let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
            return true;
        };
        let Some(handles) = pt.handle.get(first..end) else {
            return false;
        };
        if handles.iter().any(Option::is_none) {
            return false;
        }
        if !pt.any_shared(first, end) {
            return true;
        }
        (first..end).all(|p| {
            if !pt.is_shared(p) || pt.live[p] > 0 {
                // Alone on its page, or its page's occupant already (invariant 10).
                return true;
            }
            let h = pt.handle[p].expect("checked above");
            pt.slots_of(h).iter().all(|&s| {
                let s = s as usize;
                s == p || (!pt.occupied(s) && !(first..end).contains(&s))
            })
        })
    }

    /// [`Shard::map_range`] past its fast path, for slots [first, end). `taken` holds the pages
    /// that other ranges of the same operation (a restore re-creates many blocks) claimed, by
    /// slot: none of them is given to another slot.
    pub(super) fn map_slots(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        first: usize,
        end: usize,
        allow_reclaim: bool,
        taken: &mut FxHashMap<PageHandle, usize>,
    ) -> Result<(), ShardError> {
        let ps = env.page_size();
        let seg_addr = self.segments[seg].addr;
        let small = self.segments[seg].small;
        // Which slots need a page: unmapped ones, and stale ones.
        let mut missing: Vec<usize> = Vec::new();
        let mut stale: Vec<usize> = Vec::new();
        {
            let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind else {
                return Ok(());
            };
            pt.cover(end);
            for p in first..end {
                let Some(h) = pt.handle[p] else {
                    missing.push(p);
                    continue;
                };
                let conflict = pt
                    .busy_alias(p, h)
                    .or_else(|| taken.get(&h).copied().filter(|&q| q != p));
                match conflict {
                    Some(other) => {
                        pt.learn_conflict(p, other);
                        stale.push(p);
                        missing.push(p);
                    }
                    None => {
                        taken.insert(h, p);
                    }
                }
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        if !stale.is_empty() {
            // Unmapping is illegal during a capture, and only safe once the stream's work that
            // last touched the slot is complete.
            if env.capture_underway {
                return Err(ShardError::StaleDuringCapture);
            }
            for &p in &stale {
                self.wait_idle_safe(env, seg, p)?;
                self.unmap_page(env, seg, p)?;
            }
        }
        let live = self.stats.active_bytes.all().current as u64 + (end - first) as u64 * ps;
        let slack = env.vmm_slack(live);
        let mapped = self.stats.reserved_bytes.all().current as u64;
        // (slot, page, whether the page is new to this reservation and claimed from its pool's
        // budget).
        let mut got: Vec<(usize, PageHandle, bool)> = Vec::with_capacity(missing.len());
        let give_back = |env: &Env<'_>, got: &[(usize, PageHandle, bool)]| {
            for &(_, h, fresh) in got {
                if fresh {
                    env.pages.put(h);
                    env.pool_budget.release(ps);
                }
            }
        };
        let mut new_bytes = 0u64;
        for &p in &missing {
            let within_slack = slack > 0 && mapped + new_bytes + ps <= live + slack;
            // Without reclaim (a resume, a restore), every slot gets a page of its own: a
            // resumed pool copies its backup into every slot it had, idle ones included, so no
            // two of its slots may share a page then.
            let alias = (!within_slack && allow_reclaim)
                .then(|| self.idle_page_for(seg, p, taken))
                .flatten();
            let page = match alias {
                Some(h) => Ok((h, false)),
                None => {
                    if !env.pool_budget.try_claim(ps) {
                        give_back(env, &got);
                        return Err(ShardError::OutOfMemory);
                    }
                    let fresh = match env.pages.take() {
                        Some(h) => Ok(h),
                        None if within_slack || !allow_reclaim => env.new_page().or_else(|e| {
                            allow_reclaim
                                .then(|| self.idle_page_for(seg, p, taken))
                                .flatten()
                                .inspect(|_| env.pool_budget.release(ps))
                                .or_else(|| self.reclaim_elsewhere(env, seg, allow_reclaim))
                                .ok_or(e)
                        }),
                        None => match self.reclaim_elsewhere(env, seg, allow_reclaim) {
                            Some(h) => Ok(h),
                            None => env.new_page(),
                        },
                    };
                    match fresh {
                        // An alias found after the claim gave the claim back.
                        Ok(h) if self.page_in(seg, h) => Ok((h, false)),
                        Ok(h) => Ok((h, true)),
                        Err(e) => {
                            env.pool_budget.release(ps);
                            Err(e)
                        }
                    }
                }
            };
            match page {
                Ok((h, fresh)) => {
                    taken.insert(h, p);
                    if fresh {
                        new_bytes += ps;
                    }
                    got.push((p, h, fresh));
                }
                Err(e) => {
                    give_back(env, &got);
                    return Err(e.into());
                }
            }
        }
        // Runs of consecutive slots map with one call each (one access call on CUDA).
        let mut i = 0;
        while i < got.len() {
            let run = 1 + got[i + 1..]
                .iter()
                .zip(&got[i..])
                .take_while(|&(b, a)| b.0 == a.0 + 1)
                .count();
            let pages: Vec<PageHandle> = got[i..i + run].iter().map(|g| g.1).collect();
            if let Err(e) = env.dev.map_run(seg_addr + got[i].0 as u64 * ps, &pages) {
                for &(q, _, _) in &got[..i] {
                    let _ = env.dev.unmap(seg_addr + q as u64 * ps);
                    let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind else {
                        unreachable!()
                    };
                    if let Some((_, true)) = pt.remove_mapping(q) {
                        self.stats.reserved_bytes.update(small, -(ps as i64));
                    }
                }
                give_back(env, &got);
                return Err(e.into());
            }
            for &(p, h, _) in &got[i..i + run] {
                let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind else {
                    unreachable!()
                };
                if pt.add_mapping(p, h) {
                    self.stats.reserved_bytes.update(small, ps as i64);
                }
                env.trace.record(
                    TraceAction::SegmentMap,
                    seg_addr + p as u64 * ps,
                    ps,
                    self.stream,
                );
                if pt.live[p] == 0 {
                    pt.set_idle(p, true);
                    pt.idle_epoch[p] = self.epoch;
                }
            }
            i += run;
        }
        self.stats.num_device_alloc += got.len() as i64;
        Ok(())
    }

    /// Whether `page` is mapped somewhere in reservation `seg`.
    fn page_in(&self, seg: SegmentId, page: PageHandle) -> bool {
        matches!(&self.segments[seg].kind, SegmentKind::Vmm(pt) if !pt.slots_of(page).is_empty())
    }

    /// An idle physical page of reservation `seg` for slot `p`: one that backs no occupied slot
    /// and is not taken by the operation. Preferred: a page none of whose slots was ever needed
    /// at the same time as `p`, then the page whose lowest slot is highest. Best fit favours low
    /// addresses, so a page mapped only high up is the least likely to be wanted back soon where
    /// it is (each slot of the page taken becomes stale, and costs an unmap and a map if it is
    /// needed while `p` is live).
    fn idle_page_for(
        &self,
        seg: SegmentId,
        p: usize,
        taken: &FxHashMap<PageHandle, usize>,
    ) -> Option<PageHandle> {
        let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
            return None;
        };
        if pt.idle_count == 0 {
            return None;
        }
        let mut best: Option<((bool, usize), PageHandle)> = None;
        let mut seen = rustc_hash::FxHashSet::default();
        for q in pt.idle_pages_rev() {
            // A page met from here down has a slot at q or below: none beats a best whose lowest
            // slot is at q or above.
            if let Some(((true, low), _)) = best
                && low >= q
            {
                break;
            }
            let Some(h) = pt.handle[q] else { continue };
            if pt.in_run(q) || !seen.insert(h) || taken.contains_key(&h) || !pt.page_idle(h) {
                continue;
            }
            let lowest = pt
                .slots_of(h)
                .iter()
                .map(|&s| s as usize)
                .min()
                .unwrap_or(q);
            let score = (!pt.conflicts_with(p, h), lowest);
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, h));
            }
        }
        best.map(|(_, h)| h)
    }

    /// Wait until the stream's work that last touched idle slot `p` is complete (its epoch is
    /// safe), synchronising on the epoch's event if a query does not say so.
    fn wait_idle_safe(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        p: usize,
    ) -> Result<(), ShardError> {
        let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
            return Err(ShardError::NotVmm);
        };
        let need = pt.idle_epoch[p];
        if need < self.safe_epoch {
            return Ok(());
        }
        self.advance_epoch(env);
        while need >= self.safe_epoch {
            let Some(&(e, ev)) = self.epoch_events.front() else {
                return Err(ShardError::OutOfMemory);
            };
            env.dev.synchronize_event(ev)?;
            self.epoch_events.pop_front();
            env.events.put(ev);
            self.safe_epoch = e + 1;
        }
        Ok(())
    }

    /// Take a physical page from one of this shard's other vmm reservations: an idle page
    /// whose every slot is safe to unmap and not graph-retained, unmapped from all of them.
    fn reclaim_elsewhere(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        allow_reclaim: bool,
    ) -> Option<PageHandle> {
        if !allow_reclaim || env.capture_underway {
            return None;
        }
        for attempt in 0..2 {
            if let Some((sid, h)) = self.find_safe_idle(seg) {
                let slots: Vec<u32> = match &self.segments[sid].kind {
                    SegmentKind::Vmm(pt) => pt.slots_of(h).to_vec(),
                    SegmentKind::Classic => return None,
                };
                let mut left = None;
                for q in slots {
                    match self.unmap_page(env, sid, q as usize) {
                        Ok(Some(page)) => left = Some(page),
                        Ok(None) => {}
                        Err(_) => return None,
                    }
                }
                if let Some(page) = left {
                    // It left its reservation (and its pool's budget): this one claims it.
                    return Some(page);
                }
                return None;
            }
            if attempt == 0 && !self.advance_epoch(env) {
                return None;
            }
        }
        None
    }

    /// An idle physical page of a reservation other than `exclude` whose slots are all idle
    /// since a safe epoch and not graph-retained.
    fn find_safe_idle(&self, exclude: SegmentId) -> Option<(SegmentId, PageHandle)> {
        for (sid, seg) in self.segments.iter() {
            let SegmentKind::Vmm(pt) = &seg.kind else {
                continue;
            };
            if pt.idle_count == 0 || sid == exclude {
                continue;
            }
            let found = pt.idle_pages_rev().find_map(|p| {
                let h = pt.handle[p].filter(|_| !pt.in_run(p))?;
                pt.slots_of(h)
                    .iter()
                    .map(|&s| s as usize)
                    .all(|s| {
                        pt.live[s] == 0 && !pt.is_retained(s) && pt.idle_epoch[s] < self.safe_epoch
                    })
                    .then_some(h)
            });
            if let Some(h) = found {
                return Some((sid, h));
            }
        }
        None
    }

    fn has_idle_pages(&self) -> bool {
        self.segments
            .iter()
            .any(|(_, s)| matches!(&s.kind, SegmentKind::Vmm(pt) if pt.idle_count > 0))
    }

    /// Record an event closing the current epoch (if idle pages wait on it) and retire completed
    /// epoch events. Returns whether anything may have become safe.
    pub(super) fn advance_epoch(&mut self, env: &Env<'_>) -> bool {
        if env.capture_underway || !self.has_idle_pages() {
            return false;
        }
        if self
            .epoch_events
            .back()
            .is_none_or(|&(e, _)| e < self.epoch)
            && let Ok(ev) = env.events.get(env.dev)
        {
            if env.dev.record_event(ev, self.stream).is_ok() {
                self.epoch_events.push_back((self.epoch, ev));
                self.epoch += 1;
            } else {
                env.events.put(ev);
            }
        }
        let mut advanced = false;
        while let Some(&(e, ev)) = self.epoch_events.front() {
            if env.dev.query_event(ev) != Ok(true) {
                break;
            }
            self.epoch_events.pop_front();
            env.events.put(ev);
            self.safe_epoch = e + 1;
            advanced = true;
        }
        advanced
    }

    /// The device was synchronised: every page idle now is safe to unmap. (No event is recorded
    /// on the shard's stream here: the program may have destroyed it since.)
    pub(crate) fn device_synchronized(&mut self, env: &Env<'_>) {
        for (_, ev) in self.epoch_events.drain(..) {
            env.events.put(ev);
        }
        self.epoch += 1;
        self.safe_epoch = self.epoch;
    }

    /// Unmap slot `p` of reservation `seg`. Returns its page when no other slot of the
    /// reservation maps it (the page left the reservation and its pool's budget), else `None`.
    pub(crate) fn unmap_page(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        p: usize,
    ) -> Result<Option<PageHandle>, ShardError> {
        let ps = env.page_size();
        let segment = &mut self.segments[seg];
        let small = segment.small;
        let addr = segment.addr + p as u64 * ps;
        let SegmentKind::Vmm(pt) = &mut segment.kind else {
            return Err(ShardError::NotVmm);
        };
        if !pt.is_mapped(p) {
            return Err(ShardError::PageNotMapped);
        }
        if pt.in_run(p) {
            return Err(ShardError::InRun);
        }
        env.dev.unmap(addr)?;
        env.trace
            .record(TraceAction::SegmentUnmap, addr, ps, self.stream);
        let (h, last) = pt.remove_mapping(p).ok_or(ShardError::PageNotMapped)?;
        self.stats.num_device_free += 1;
        if !last {
            return Ok(None);
        }
        env.pool_budget.release(ps);
        self.stats.reserved_bytes.dec(small, ps as i64);
        Ok(Some(h))
    }

    /// The runs of consecutive mapped pages of this shard's vmm segments: (address, bytes).
    pub(crate) fn mapped_runs(&self, page_size: u64) -> Vec<(DevicePtr, u64)> {
        let mut runs = Vec::new();
        for (_, seg) in self.segments() {
            let SegmentKind::Vmm(pt) = &seg.kind else {
                continue;
            };
            let mut first = 0u64;
            for run in pt.handle.chunk_by(|a, b| a.is_some() == b.is_some()) {
                let len = run.len() as u64;
                if run[0].is_some() {
                    runs.push((seg.addr + first * page_size, len * page_size));
                }
                first += len;
            }
        }
        runs
    }
}
