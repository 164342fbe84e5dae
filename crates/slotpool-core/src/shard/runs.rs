//! The shard's side of physical runs ([`crate::block::runs`]): a resume maps stretches as runs,
//! a release or a pause unmaps and releases them whole, a pause unmaps a stretch of pages mapped
//! one by one with one call.

use crate::block::runs::{PhysRun, RUN_MAX_BYTES};
use crate::block::{SegmentId, SegmentKind};
use crate::device::{DeviceError, PageHandle};
use crate::env::Env;
use crate::history::TraceAction;

use super::{Shard, ShardError};

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
