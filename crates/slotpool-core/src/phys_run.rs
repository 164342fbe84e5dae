//! Physical runs: one physical allocation backing several consecutive page slots of a vmm
//! reservation, mapped with one call and unmapped with one call.
//!
//! A resume maps a paused pool back as runs ([`Shard::map_runs`]) instead of a page per slot:
//! on the H200 a page costs one `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` (about 33 us at 4
//! MiB), a run of any length costs the same three calls. The driver's rules shape the rest:
//!
//! - a run is mapped whole at offset 0 (`cuMemMap` may take an offset into the allocation on
//!   recent drivers, HIP's may not; nothing here needs it), at one place: its pages are never
//!   aliases (`crate::alias`) of other slots, nor given to other reservations;
//! - `cuMemUnmap` must cover whole mappings, so a run is unmapped and released as a unit: an
//!   empty-cache or a release frees a run only when every slot of it is idle and safe
//!   ([`Shard::release_idle_runs`]); a run with live or graph-retained slots stays, every byte
//!   of it counted in `reserved_bytes`;
//! - a pause unmaps each run with one call and releases it with one call, and unmaps a stretch
//!   of pages mapped one by one with one call too where the backend can ([`Device::unmap_range`]).
//!
//! In the page table a run slot holds a *tag* in place of a page handle ([`slot_tag`], unique in
//! its reservation), so that the per-slot machinery (live counts, idle bits, aliases, snapshots)
//! sees one page per slot; [`Runs`] says which slots form which run and holds the run's handle.
//! Shard invariant 12 ([`PageTable::check_runs`]).
//!
//! [`Device::unmap_range`]: crate::device::Device::unmap_range

use std::collections::BTreeMap;

use crate::block::{PageTable, SegmentId, SegmentKind};
use crate::device::{DeviceError, PageHandle};
use crate::env::Env;
use crate::history::TraceAction;
use crate::shard::{Shard, ShardError};

/// The most bytes one run of a resume takes. Larger runs cost no more driver calls, but a run
/// goes back to the driver only whole: past this, an empty-cache after a resume could keep
/// gigabytes for one live block.
pub const RUN_MAX_BYTES: u64 = 2 << 30;

/// The bit that marks a tag: page handles of the CUDA driver and of the simulated device are
/// below 2^63.
const TAG: u64 = 1 << 63;

/// What the page table holds at slot `p` of a run.
pub fn slot_tag(p: usize) -> PageHandle {
    PageHandle(TAG | p as u64)
}

/// Whether `h` is a run slot's tag rather than a page.
pub fn is_tag(h: PageHandle) -> bool {
    h.0 & TAG != 0
}

/// One physical allocation of `pages` pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhysRun {
    pub handle: PageHandle,
    pub pages: usize,
}

/// The runs of one reservation (a part of [`PageTable`]).
#[derive(Clone, Debug, Default)]
pub struct Runs {
    /// First slot -> run. Runs never overlap.
    by_first: BTreeMap<usize, PhysRun>,
    /// Bit p set when slot p belongs to a run.
    bits: Vec<u64>,
}

impl PageTable {
    /// Whether slot `p` belongs to a run.
    #[inline]
    pub fn in_run(&self, p: usize) -> bool {
        self.runs
            .bits
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }

    /// Whether any slot of [first, end) belongs to a run.
    pub fn any_in_run(&self, first: usize, end: usize) -> bool {
        !self.runs.by_first.is_empty() && (first..end).any(|p| self.in_run(p))
    }

    /// The run slot `p` belongs to, with its first slot.
    pub fn run_of(&self, p: usize) -> Option<(usize, PhysRun)> {
        if !self.in_run(p) {
            return None;
        }
        let (&first, &run) = self.runs.by_first.range(..=p).next_back()?;
        (first + run.pages > p).then_some((first, run))
    }

    /// Every run, by first slot.
    pub fn runs(&self) -> impl Iterator<Item = (usize, PhysRun)> + '_ {
        self.runs.by_first.iter().map(|(&f, &r)| (f, r))
    }

    /// Physical allocations behind this reservation's slots (a run counts once).
    pub fn run_count(&self) -> usize {
        self.runs.by_first.len()
    }

    fn set_run_bits(&mut self, first: usize, pages: usize, on: bool) {
        let words = (first + pages).div_ceil(64);
        if self.runs.bits.len() < words {
            self.runs.bits.resize(words, 0);
        }
        for p in first..first + pages {
            let (w, b) = (p / 64, 1u64 << (p % 64));
            if on {
                self.runs.bits[w] |= b;
            } else {
                self.runs.bits[w] &= !b;
            }
        }
    }

    /// Record `run`, just mapped at slots [first, first + run.pages), where nothing was mapped.
    pub fn add_run(&mut self, first: usize, run: PhysRun) {
        self.cover(first + run.pages - 1);
        for p in first..first + run.pages {
            self.add_mapping(p, slot_tag(p));
        }
        self.set_run_bits(first, run.pages, true);
        self.runs.by_first.insert(first, run);
    }

    /// Forget the run that starts at slot `first` (the caller unmapped it): its slots are
    /// unmapped, neither idle nor retained.
    pub fn remove_run(&mut self, first: usize) -> Option<PhysRun> {
        let run = self.runs.by_first.remove(&first)?;
        self.set_run_bits(first, run.pages, false);
        for p in first..first + run.pages {
            self.remove_mapping(p);
        }
        Some(run)
    }

    /// Shard invariant 12: runs lie inside the reservation's `slots`, do not overlap, and their
    /// slots (exactly the run bits) are mapped to their own tags, alone; no other slot holds a
    /// tag.
    pub fn check_runs(&self, slots: usize) -> Result<(), String> {
        let mut end = 0;
        let mut in_runs = 0;
        for (first, run) in self.runs() {
            if run.pages == 0 || first < end || first + run.pages > slots {
                return Err(format!(
                    "12: run at slot {first} of {} pages overlaps or leaves the reservation",
                    run.pages
                ));
            }
            if is_tag(run.handle) {
                return Err(format!("12: run at slot {first} has a tag for a handle"));
            }
            for p in first..first + run.pages {
                if self.handle.get(p).copied().flatten() != Some(slot_tag(p)) || !self.in_run(p) {
                    return Err(format!("12: slot {p} of the run at {first} is not its tag"));
                }
                if self.is_shared(p) {
                    return Err(format!("12: run slot {p} is an alias"));
                }
            }
            end = first + run.pages;
            in_runs += run.pages;
        }
        let bits: usize = self.runs.bits.iter().map(|w| w.count_ones() as usize).sum();
        if bits != in_runs {
            return Err(format!("12: {bits} run bits for {in_runs} run slots"));
        }
        for (p, h) in self.handle.iter().enumerate() {
            if h.is_some_and(is_tag) && !self.in_run(p) {
                return Err(format!("12: slot {p} holds a tag outside any run"));
            }
        }
        Ok(())
    }
}

/// Give a run that nothing maps back to the driver; one the driver refuses stays held (device
/// budget included) in the device pool's stray runs, tried again by the next empty-cache.
pub(crate) fn free_run(env: &Env<'_>, run: PhysRun, page_size: u64) {
    let bytes = run.pages as u64 * page_size;
    if env.dev.release_page(run.handle).is_ok() {
        env.budget.release(bytes);
    } else {
        tracing::warn!(
            handle = run.handle.0,
            bytes,
            "the driver refused to release a run"
        );
        env.pages.put_run(run.handle, bytes);
    }
}

impl Shard {
    /// Map slots [first, first + n) of reservation `seg`, none of them mapped, with physical runs
    /// of at most [`RUN_MAX_BYTES`]. A run the device cannot make is made in halves; with a
    /// backend that has no runs, and for single pages, slots are mapped page by page
    /// ([`Shard::map_range`], without reclaim: every slot gets a page of its own). On error what
    /// was mapped stays mapped and recorded (the caller undoes it).
    pub(crate) fn map_runs(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        first: usize,
        n: usize,
    ) -> Result<(), ShardError> {
        let ps = env.page_size();
        let max = (RUN_MAX_BYTES / ps).max(1) as usize;
        let seg_addr = self.segments[seg].addr;
        let mut work: Vec<(usize, usize)> = (first..first + n)
            .step_by(max)
            .map(|f| (f, max.min(first + n - f)))
            .rev()
            .collect();
        let mut runs_ok = true;
        while let Some((f, k)) = work.pop() {
            if k == 1 || !runs_ok {
                self.map_range(env, seg, seg_addr + f as u64 * ps, k as u64 * ps, false)?;
                continue;
            }
            match self.map_one_run(env, seg, f, k) {
                Ok(()) => {}
                Err(ShardError::OutOfMemory) => {
                    work.push((f + k / 2, k - k / 2));
                    work.push((f, k / 2));
                }
                Err(ShardError::Device(e)) if matches!(*e, DeviceError::Unavailable(_)) => {
                    runs_ok = false;
                    work.push((f, k));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Create one run of `k` pages and map it at slot `f` of `seg`; on error nothing changed.
    fn map_one_run(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        f: usize,
        k: usize,
    ) -> Result<(), ShardError> {
        let ps = env.page_size();
        let bytes = k as u64 * ps;
        if !env.pool_budget.try_claim(bytes) {
            return Err(ShardError::OutOfMemory);
        }
        if !env.budget.try_claim(bytes) {
            env.pool_budget.release(bytes);
            return Err(ShardError::OutOfMemory);
        }
        let unclaim = || {
            env.pool_budget.release(bytes);
            env.budget.release(bytes);
        };
        let segment = &self.segments[seg];
        let (addr, small) = (segment.addr + f as u64 * ps, segment.small);
        let handle = env.dev.create_run(k).inspect_err(|_| unclaim())?;
        if let Err(e) = env.dev.map_whole(addr, handle, k) {
            env.pool_budget.release(bytes);
            free_run(env, PhysRun { handle, pages: k }, ps);
            return Err(e.into());
        }
        let epoch = self.epoch;
        let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind else {
            unreachable!("runs map into vmm reservations")
        };
        pt.add_run(f, PhysRun { handle, pages: k });
        for p in f..f + k {
            if pt.live[p] == 0 {
                pt.set_idle(p, true);
                pt.idle_epoch[p] = epoch;
            }
        }
        self.stats.reserved_bytes.update(small, bytes as i64);
        self.stats.num_device_alloc += 1;
        env.trace
            .record(TraceAction::SegmentMap, addr, bytes, self.stream);
        Ok(())
    }

    /// Unmap the run that starts at slot `first` of `seg` and give it back to the driver.
    /// Returns its bytes. On error nothing changed.
    pub(crate) fn release_run(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        first: usize,
    ) -> Result<u64, ShardError> {
        let ps = env.page_size();
        let segment = &mut self.segments[seg];
        let (small, seg_addr) = (segment.small, segment.addr);
        let SegmentKind::Vmm(pt) = &mut segment.kind else {
            return Err(ShardError::NotVmm);
        };
        let Some((f, run)) = pt.run_of(first).filter(|&(f, _)| f == first) else {
            return Err(ShardError::PageNotMapped);
        };
        let (addr, bytes) = (seg_addr + f as u64 * ps, run.pages as u64 * ps);
        env.dev.unmap_range(addr, bytes)?;
        pt.remove_run(f);
        env.trace
            .record(TraceAction::SegmentUnmap, addr, bytes, self.stream);
        self.stats.num_device_free += 1;
        self.stats.reserved_bytes.dec(small, bytes as i64);
        env.pool_budget.release(bytes);
        free_run(env, run, ps);
        Ok(bytes)
    }

    /// Release the runs of `seg` whose every slot is idle since a safe epoch (and, with
    /// `keep_retained`, not graph-retained). Returns the bytes given back.
    pub(crate) fn release_idle_runs(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        keep_retained: bool,
    ) -> u64 {
        let firsts: Vec<usize> = match &self.segments[seg].kind {
            SegmentKind::Vmm(pt) if pt.run_count() > 0 => pt
                .runs()
                .filter(|&(f, r)| {
                    (f..f + r.pages).all(|p| {
                        pt.is_idle(p)
                            && pt.idle_epoch[p] < self.safe_epoch
                            && !(keep_retained && pt.is_retained(p))
                    })
                })
                .map(|(f, _)| f)
                .collect(),
            _ => return 0,
        };
        firsts
            .into_iter()
            .filter_map(|f| self.release_run(env, seg, f).ok())
            .sum()
    }

    /// Unmap slots [first, first + n) of `seg`, each mapped to a page of its own mapping (no
    /// run slot), with one [`crate::Device::unmap_range`] call; pages that leave the reservation
    /// with their last slot are returned. `None` when the backend refuses the range (nothing
    /// changed: unmap page by page).
    pub(crate) fn unmap_stretch(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
        first: usize,
        n: usize,
    ) -> Option<Vec<PageHandle>> {
        let ps = env.page_size();
        let segment = &mut self.segments[seg];
        let (small, addr) = (segment.small, segment.addr + first as u64 * ps);
        let SegmentKind::Vmm(pt) = &mut segment.kind else {
            return None;
        };
        if n < 2 || (first..first + n).any(|p| !pt.is_mapped(p) || pt.in_run(p)) {
            return None;
        }
        env.dev.unmap_range(addr, n as u64 * ps).ok()?;
        env.trace
            .record(TraceAction::SegmentUnmap, addr, n as u64 * ps, self.stream);
        let mut left = Vec::new();
        for p in first..first + n {
            if let Some((h, true)) = pt.remove_mapping(p) {
                env.pool_budget.release(ps);
                self.stats.reserved_bytes.dec(small, ps as i64);
                left.push(h);
            }
        }
        self.stats.num_device_free += n as i64;
        Some(left)
    }
}
