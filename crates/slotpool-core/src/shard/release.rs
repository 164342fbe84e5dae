//! Releasing cached memory: garbage collection before growth, cache release, graph-retained pages, segments given back.

use crate::block::{BlockState, Segment, SegmentId, SegmentKind};
use crate::env::Env;
use crate::history::TraceAction;

use super::{Released, Shard};

impl Shard {
    /// PyTorch's `garbage_collection_threshold`, before growth: when a limit is set and the device
    /// holds more than `threshold` of it, release whole free classic segments of the large pool
    /// whose age (free-index searches since they became free) is at least the average, and
    /// again over those left, until the excess is reclaimed or none goes. Only the default pool
    /// collects, as PyTorch's large blocks are its own; vmm memory is left to the page slack
    /// (PyTorch skips expandable segments too); nothing is released during a capture.
    pub(super) fn collect_garbage(&mut self, env: &Env<'_>, threshold: f64) {
        let limit = env.budget.limit();
        if limit == u64::MAX || env.capture_underway || !self.pool.is_default() {
            return;
        }
        let keep = (limit as f64 * threshold) as u64;
        let Some(excess) = env.budget.held().checked_sub(keep).filter(|&e| e > 0) else {
            return;
        };
        let mut candidates: Vec<(SegmentId, u64)> = self
            .segments
            .iter()
            .filter(|(_, s)| !s.is_vmm() && !s.small && !s.retained)
            .filter(|(_, s)| {
                let b = &self.blocks[s.first];
                b.state == BlockState::Free && b.next().is_none()
            })
            .map(|(id, s)| (id, self.free_searches - s.freed_at))
            .collect();
        let mut total_age: u64 = candidates.iter().map(|&(_, age)| age).sum();
        let mut reclaimed = 0;
        let mut freed_any = true;
        while reclaimed < excess && freed_any && !candidates.is_empty() {
            let average = total_age as f64 / candidates.len() as f64;
            freed_any = false;
            // Like PyTorch, a pass does not stop at the target: collecting again soon after
            // would cost more than the segments left are worth.
            candidates.retain(|&(seg, age)| {
                if (age as f64) < average {
                    return true;
                }
                match self.release_segment_if_unused(env, seg) {
                    Some(bytes) => {
                        reclaimed += bytes;
                        total_age -= age;
                        freed_any = true;
                        false
                    }
                    None => true,
                }
            });
        }
        if reclaimed > 0 {
            tracing::debug!(pool = ?self.pool, stream = self.stream, reclaimed, "garbage collected");
        }
    }

    /// Return cached memory to the backend: whole free classic segments, idle vmm pages (to the
    /// device page pool when `keep_pages`, else released), and empty vmm reservations.
    /// `synchronize` says the device may be synchronised (no capture underway): the shard then
    /// synchronises it under its own lock, so that everything free can go; pending cross-stream
    /// events are waited for too.
    /// `keep_retained`: the pool is in use, so graph-retained memory stays (see [`crate::block::PageTable`]).
    pub fn release_cached(
        &mut self,
        env: &Env<'_>,
        synchronize: bool,
        keep_pages: bool,
        keep_retained: bool,
    ) -> Released {
        let mut out = Released::default();
        if env.capture_underway {
            return out;
        }
        // The pinned buffer of the last backup stays while the pool is in use: pinning it again
        // costs seconds per 10 GB, far more than any cycle.
        if !keep_retained
            && let Some((buf, _)) = self.host_spare.take()
            && env.dev.free_host(buf).is_err()
        {
            tracing::warn!("a paused pool's spare host buffer could not be freed");
        }
        // A paused shard holds no mapped page, and its segments stay for the resume.
        if self.pause.is_some() {
            return out;
        }
        self.flush_quick(env);
        self.prune_marks();
        // The caller's synchronisation covers only pages idle before it; another thread may have
        // freed a block onto this shard's stream, with work still queued there, since. Under this
        // shard's lock no page can become idle, so one more synchronisation here covers every idle
        // page (the device is mostly idle by now: it costs little).
        if synchronize && env.dev.synchronize().is_ok() {
            self.synchronize_events(env);
            self.device_synchronized(env);
        } else {
            self.process_events(env);
            self.advance_epoch(env);
        }
        let ids: Vec<SegmentId> = self.segments.iter().map(|(i, _)| i).collect();
        for seg in ids {
            if self.segments[seg].is_vmm() {
                let idle: Vec<usize> = {
                    let SegmentKind::Vmm(pt) = &self.segments[seg].kind else {
                        continue;
                    };
                    pt.idle_pages()
                        .filter(|&p| {
                            pt.idle_epoch[p] < self.safe_epoch
                                && !(keep_retained && pt.is_retained(p))
                                && !pt.in_run(p)
                        })
                        .collect()
                };
                out.bytes += self.release_idle_runs(env, seg, keep_retained);
                for p in idle {
                    // A slot whose page is mapped at another slot too frees no memory.
                    let Ok(Some(h)) = self.unmap_page(env, seg, p) else {
                        continue;
                    };
                    out.bytes += env.page_size();
                    if keep_pages {
                        env.pages.put(h);
                    } else if env.dev.release_page(h).is_ok() {
                        env.budget.release(env.page_size());
                    } else {
                        env.pages.put(h);
                    }
                }
            }
            if keep_retained && self.segments[seg].retained {
                continue;
            }
            if let Some(bytes) = self.release_segment_if_unused(env, seg) {
                out.segments += 1;
                out.bytes += bytes;
            }
        }
        out
    }

    /// Mark [addr, addr+size) of segment `seg` graph-retained (its pages, or the whole classic
    /// segment).
    pub(crate) fn retain_range(&mut self, env: &Env<'_>, seg: SegmentId, addr: u64, size: u64) {
        let segment = &mut self.segments[seg];
        let (first, end) = Self::page_range(env.page_size(), segment.addr, addr, size);
        Self::retain_pages_of(segment, first, end);
    }

    /// Mark pages [first, end) of `segment` graph-retained (a classic segment as a whole).
    pub(crate) fn retain_pages_of(segment: &mut Segment, first: usize, end: usize) {
        match &mut segment.kind {
            SegmentKind::Classic => segment.retained = true,
            SegmentKind::Vmm(pt) => {
                for p in first..end.min(pt.handle.len()) {
                    if pt.handle[p].is_some() {
                        pt.set_retained(p, true);
                    }
                }
            }
        }
    }

    /// Graph-retained bytes (mapped vmm pages, or whole classic segments).
    pub fn retained_bytes(&self, page_size: u64) -> u64 {
        self.segments
            .iter()
            .map(|(_, s)| match &s.kind {
                SegmentKind::Classic => {
                    if s.retained {
                        s.size
                    } else {
                        0
                    }
                }
                SegmentKind::Vmm(pt) => {
                    pt.retained_bits
                        .iter()
                        .map(|w| w.count_ones() as u64)
                        .sum::<u64>()
                        * page_size
                }
            })
            .sum()
    }

    /// Release a segment that is one free block (and, for vmm, has nothing mapped); returns the
    /// physical bytes freed.
    pub(super) fn release_segment_if_unused(
        &mut self,
        env: &Env<'_>,
        seg: SegmentId,
    ) -> Option<u64> {
        if self.journaling() {
            // A live checkpoint may need this segment back.
            return None;
        }
        let s = self.segments.get(seg)?;
        let b = &self.blocks[s.first];
        if b.state != BlockState::Free || b.next().is_some() {
            return None;
        }
        if let SegmentKind::Vmm(pt) = &s.kind
            && pt.mapped_count > 0
        {
            return None;
        }
        let (addr, size, small, first, vmm) = (s.addr, s.size, s.small, s.first, s.is_vmm());
        let freed = if vmm {
            env.dev.release_reservation(addr, size)
        } else {
            env.dev.free_segment(addr, size)
        };
        if freed.is_err() {
            return None;
        }
        self.index_remove(first);
        self.blocks.remove(first);
        self.segments.remove(seg);
        self.seg_log.push((addr, size, false));
        self.stats.segment.dec(small, 1);
        if !vmm {
            env.trace
                .record(TraceAction::SegmentFree, addr, size, self.stream);
            env.budget.release(size);
            self.stats.reserved_bytes.dec(small, size as i64);
            self.stats.num_device_free += 1;
            env.pool_budget.release(size);
            if env.policy.is_oversize(size) {
                self.stats.oversize_segments.update(-1);
            }
        }
        Some(if vmm { 0 } else { size })
    }
}
