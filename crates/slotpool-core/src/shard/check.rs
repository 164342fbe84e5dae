//! The shard's invariant checker (the invariants are listed on [`Shard`]).

use crate::block::{BlockId, BlockState, SegmentId, SegmentKind};
use crate::device::PageHandle;
use crate::stats::MemoryStats;

use super::{QUICK_MAX, Shard};

impl Shard {
    /// Check every numbered invariant of [`Shard`]; the error names the first one broken.
    pub fn check_invariants(&self, page_size: u64) -> Result<(), String> {
        let mut seen = 0usize;
        let mut recount = MemoryStats::default();
        let mut free_seen = 0usize;
        let mut tails_seen = 0usize;
        let mut cached_seen = 0usize;
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (sid, seg) in self.segments.iter() {
            ranges.push((seg.addr, seg.addr + seg.size));
            let small = seg.small;
            recount.segment.inc(small, 1);
            if !seg.is_vmm() {
                recount.reserved_bytes.inc(small, seg.size as i64);
            }
            let mut expect_addr = seg.addr;
            let mut prev: Option<BlockId> = None;
            let mut prev_free = false;
            let mut next = Some(seg.first);
            let mut live_pages: Vec<u32> = Vec::new();
            while let Some(id) = next {
                let b = self
                    .blocks
                    .get(id)
                    .ok_or(format!("1: segment {sid} links to a missing block {id}"))?;
                seen += 1;
                if b.segment != sid {
                    return Err(format!(
                        "5: block {id} in segment {sid}'s chain says segment {}",
                        b.segment
                    ));
                }
                if b.addr != expect_addr {
                    return Err(format!(
                        "1: block {id} at {:#x}, expected {:#x}",
                        b.addr, expect_addr
                    ));
                }
                if b.prev() != prev {
                    return Err(format!(
                        "1: block {id} prev link {:?} != {:?}",
                        b.prev(),
                        prev
                    ));
                }
                if b.size == 0 {
                    return Err(format!("1: block {id} has size 0"));
                }
                let is_free = b.state == BlockState::Free;
                if is_free && prev_free {
                    return Err(format!(
                        "2: free block {id} at {:#x} follows a free block",
                        b.addr
                    ));
                }
                match b.state {
                    BlockState::Free => {
                        let index = self.index(small);
                        let tail = seg.is_vmm() && b.addr + b.size == seg.addr + seg.size;
                        if tail {
                            if seg.free_tail != Some(id) {
                                return Err(format!(
                                    "3: free block {id} ends vmm segment {sid} but is not its tail"
                                ));
                            }
                            tails_seen += 1;
                        } else {
                            free_seen += 1;
                            if !index.contains(&(b.size, b.addr, id)) {
                                return Err(format!(
                                    "3: free block {id} at {:#x} not indexed",
                                    b.addr
                                ));
                            }
                        }
                        if b.pending_events != 0 || !b.stream_uses.is_empty() {
                            return Err(format!("4: free block {id} has events or stream uses"));
                        }
                    }
                    BlockState::Cached => {
                        cached_seen += 1;
                        if self
                            .quick
                            .iter()
                            .filter(|&&(sz, q)| q == id && sz == b.size)
                            .count()
                            != 1
                        {
                            return Err(format!(
                                "9: cached block {id} is not in the quick cache once under its size"
                            ));
                        }
                        if b.pending_events != 0 || !b.stream_uses.is_empty() {
                            return Err(format!("9: cached block {id} has events or stream uses"));
                        }
                    }
                    BlockState::Allocated | BlockState::PendingFree => {
                        if b.state == BlockState::Allocated {
                            if b.pending_events != 0 {
                                return Err(format!("4: allocated block {id} has pending events"));
                            }
                            recount.allocation.inc(small, 1);
                            recount.allocated_bytes.inc(small, b.size as i64);
                            if !seg.is_vmm() && b.size >= self.stats_max_split() {
                                recount.oversize_allocations.update(1);
                            }
                        } else {
                            let waits = self.pending.iter().filter(|(_, x)| *x == id).count();
                            if waits as u32 != b.pending_events
                                || (waits == 0 && !self.deferred.contains(&id))
                            {
                                return Err(format!(
                                    "4: pending block {id} counts {} events, {} queued",
                                    b.pending_events, waits
                                ));
                            }
                        }
                        recount.active.inc(small, 1);
                        recount.active_bytes.inc(small, b.size as i64);
                        recount.requested_bytes.inc(small, b.requested as i64);
                    }
                }
                // Free and cached blocks of a split classic segment are inactive splits; every
                // block but a free one keeps its vmm pages live.
                if matches!(b.state, BlockState::Free | BlockState::Cached)
                    && !seg.is_vmm()
                    && b.is_split()
                {
                    recount.inactive_split.inc(small, 1);
                    recount.inactive_split_bytes.inc(small, b.size as i64);
                }
                if b.state != BlockState::Free && seg.is_vmm() {
                    let first = ((b.addr - seg.addr) / page_size) as usize;
                    let end = (b.end() - seg.addr).div_ceil(page_size) as usize;
                    if live_pages.len() < end {
                        live_pages.resize(end, 0);
                    }
                    for lp in &mut live_pages[first..end] {
                        *lp += 1;
                    }
                }
                prev_free = is_free;
                expect_addr = b.end();
                prev = Some(id);
                next = b.next();
            }
            if expect_addr != seg.addr + seg.size {
                return Err(format!(
                    "1: segment {sid} blocks end at {:#x}, segment at {:#x}",
                    expect_addr,
                    seg.addr + seg.size
                ));
            }
            if let SegmentKind::Vmm(pt) = &seg.kind {
                let mut mapped = 0;
                let mut idle = 0;
                for p in 0..pt.handle.len().max(live_pages.len()) {
                    let want = live_pages.get(p).copied().unwrap_or(0);
                    let have = pt.live.get(p).copied().unwrap_or(0);
                    if want != have {
                        return Err(format!(
                            "6: segment {sid} page {p} live {have}, recount {want}"
                        ));
                    }
                    let is_mapped = pt.is_mapped(p);
                    if want > 0 && !is_mapped && !self.is_paused_page(sid, p) {
                        return Err(format!("6: segment {sid} page {p} is live but not mapped"));
                    }
                    if is_mapped {
                        mapped += 1;
                    }
                    if pt.is_retained(p) && !is_mapped {
                        return Err(format!(
                            "6: segment {sid} page {p} is retained but not mapped"
                        ));
                    }
                    let should_idle = is_mapped && want == 0;
                    if pt.is_idle(p) != should_idle {
                        return Err(format!(
                            "6: segment {sid} page {p} idle bit is {}",
                            pt.is_idle(p)
                        ));
                    }
                    if should_idle {
                        idle += 1;
                    }
                }
                if mapped != pt.mapped_count || idle != pt.idle_count {
                    return Err(format!(
                        "6: segment {sid} page counts {}/{} vs {mapped}/{idle}",
                        pt.mapped_count, pt.idle_count
                    ));
                }
                pt.check_aliases()
                    .map_err(|e| format!("{e} (segment {sid})"))?;
                pt.check_runs((seg.size / page_size) as usize)
                    .map_err(|e| format!("{e} (segment {sid})"))?;
                self.check_no_shared_bytes(sid, page_size)?;
                recount
                    .reserved_bytes
                    .inc(small, (pt.phys_count() as u64 * page_size) as i64);
            }
        }
        let allocated = self
            .blocks
            .iter()
            .filter(|(_, b)| matches!(b.state, BlockState::Allocated | BlockState::Cached))
            .count();
        let wrong = self.live.iter().any(|e| {
            self.blocks.get(e.block()).is_none_or(|b| {
                b.addr != e.addr
                    || b.size != e.size
                    || b.segment != e.segment()
                    || !matches!(b.state, BlockState::Allocated | BlockState::Cached)
            })
        });
        self.live.check()?;
        self.blocks.check()?;
        if allocated != self.live.len() || wrong {
            return Err(format!(
                "8: the live map has {} entries for {allocated} allocated or cached blocks (wrong entry: {wrong})",
                self.live.len()
            ));
        }
        if cached_seen != self.quick.len() || self.quick.len() > QUICK_MAX {
            return Err(format!(
                "9: the quick cache has {} entries for {cached_seen} cached blocks",
                self.quick.len()
            ));
        }
        if cached_seen > 0 && self.journaling() {
            return Err(format!(
                "9: {cached_seen} cached blocks while a checkpoint is alive"
            ));
        }
        if seen != self.blocks.len() {
            return Err(format!(
                "5: {} blocks in the slab, {seen} in segment chains",
                self.blocks.len()
            ));
        }
        let tails = self
            .segments
            .iter()
            .filter(|(_, s)| s.free_tail.is_some())
            .count();
        if tails != tails_seen {
            return Err(format!(
                "3: {tails} segments name a free tail, {tails_seen} free tails found"
            ));
        }
        self.free_small.check()?;
        self.free_large.check()?;
        if free_seen != self.free_small.len() + self.free_large.len() {
            return Err(format!(
                "3: {free_seen} free blocks, {} indexed",
                self.free_small.len() + self.free_large.len()
            ));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("5: segments overlap".into());
        }
        let st = &self.stats;
        let pairs = [
            ("allocation", &st.allocation, &recount.allocation),
            ("segment", &st.segment, &recount.segment),
            ("active", &st.active, &recount.active),
            (
                "inactive_split",
                &st.inactive_split,
                &recount.inactive_split,
            ),
            (
                "allocated_bytes",
                &st.allocated_bytes,
                &recount.allocated_bytes,
            ),
            (
                "reserved_bytes",
                &st.reserved_bytes,
                &recount.reserved_bytes,
            ),
            ("active_bytes", &st.active_bytes, &recount.active_bytes),
            (
                "inactive_split_bytes",
                &st.inactive_split_bytes,
                &recount.inactive_split_bytes,
            ),
            (
                "requested_bytes",
                &st.requested_bytes,
                &recount.requested_bytes,
            ),
        ];
        for (name, have, want) in pairs {
            for (part, h, w) in [
                ("all", have.all().current, want.all().current),
                (
                    "small_pool",
                    have.small_pool().current,
                    want.small_pool().current,
                ),
                (
                    "large_pool",
                    have.large_pool().current,
                    want.large_pool().current,
                ),
            ] {
                if h != w {
                    return Err(format!("7: {name}.{part}.current is {h}, recount {w}"));
                }
            }
        }
        if st.oversize_allocations.current != recount.oversize_allocations.current {
            return Err("7: oversize_allocations differs from a recount".into());
        }
        self.check_pause(page_size)
    }

    /// Invariant 11, byte by byte: no two non-free blocks of vmm segment `sid` reach the same
    /// byte of a physical page, through whichever slots the page is mapped at.
    fn check_no_shared_bytes(&self, sid: SegmentId, page_size: u64) -> Result<(), String> {
        let seg = &self.segments[sid];
        let SegmentKind::Vmm(pt) = &seg.kind else {
            return Ok(());
        };
        // (page, first byte, end byte within the page, block).
        let mut pieces: Vec<(PageHandle, u64, u64, BlockId)> = Vec::new();
        for (id, b) in self.segment_blocks(sid) {
            if b.state == BlockState::Free {
                continue;
            }
            let (first, end) = Self::page_range(page_size, seg.addr, b.addr, b.size);
            for p in first..end {
                // Unmapped pages under live blocks are invariant 6's (a paused pool has them).
                let Some(h) = pt.handle.get(p).copied().flatten() else {
                    continue;
                };
                let base = seg.addr + p as u64 * page_size;
                let lo = b.addr.max(base) - base;
                let hi = b.end().min(base + page_size) - base;
                pieces.push((h, lo, hi, id));
            }
        }
        pieces.sort_unstable();
        for w in pieces.windows(2) {
            let ((h0, _, hi0, a), (h1, lo1, _, b)) = (w[0], w[1]);
            if h0 == h1 && lo1 < hi0 {
                return Err(format!(
                    "11: blocks {a} and {b} of segment {sid} share bytes of physical page {}",
                    h0.0
                ));
            }
        }
        Ok(())
    }

    fn stats_max_split(&self) -> u64 {
        if self.stats.max_split_size == i64::MAX {
            u64::MAX
        } else {
            self.stats.max_split_size as u64
        }
    }
}
