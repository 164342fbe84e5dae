//! Statistics, history and snapshots.

use crate::device::{Device, DevicePtr};
use crate::error::{AllocError, AllocResult};
use crate::history::TraceSink;
use crate::pool::PoolId;
use crate::shard::Shard;
pub use crate::snapshot::{BlockSnapshot, SegmentSnapshot};
use crate::stats::MemoryStats;
use crate::sync::lock;
use std::sync::atomic::Ordering;

use super::Allocator;

impl<D: Device> Allocator<D> {
    /// Pages and live-map ops logged for the live checkpoints of `pool` (host memory a
    /// checkpoint holds: it grows with what changes in the pool while a checkpoint is alive, and
    /// stays bounded by the pool's pages and addresses).
    pub fn checkpoint_journal_len(&self, pool: PoolId) -> AllocResult<usize> {
        self.sum_over_pool(pool, Shard::journal_len)
    }

    /// Bytes of `pool` that captured graphs may touch and that therefore stay mapped while the
    /// pool is in use (see [`crate::block::PageTable`]).
    pub fn retained_bytes(&self, pool: PoolId) -> AllocResult<u64> {
        self.sum_over_pool(pool, |s| s.retained_bytes(self.shared.page_size))
    }

    /// `f` summed over the shards of `pool`; an unknown pool is an error.
    fn sum_over_pool<T: std::iter::Sum>(
        &self,
        pool: PoolId,
        f: impl Fn(&Shard) -> T,
    ) -> AllocResult<T> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        Ok(self
            .pool_shards(pool)
            .iter()
            .map(|c| f(&lock(&c.shard)))
            .sum())
    }

    /// Device-wide statistics (`torch.cuda.memory_stats`). Current values and totals are exact;
    /// peaks are exact while one (pool, stream) shard is active, else an upper bound.
    pub fn stats(&self) -> MemoryStats {
        let mut out = MemoryStats {
            max_split_size: if self.config.policy.max_split_size == u64::MAX {
                -1
            } else {
                self.config.policy.max_split_size as i64
            },
            ..Default::default()
        };
        for cell in self.all_shards().values() {
            out.merge(lock(&cell.shard).stats());
        }
        self.merge_arena_stats(&mut out, None);
        out.num_alloc_retries += self.num_alloc_retries.load(Ordering::Relaxed);
        out.num_ooms += self.num_ooms.load(Ordering::Relaxed);
        // Device-wide peaks from one counter (the merged per-shard peaks add up per shard).
        out.allocated_bytes
            .set_all_peak(self.shared.allocated.peak());
        out.reserved_bytes
            .set_all_peak(self.shared.budget.peak() as i64);
        out
    }

    /// Bytes handed out now (rounded), summed over shards: `memory_allocated()`.
    pub fn allocated_bytes(&self) -> u64 {
        let shards: u64 = lock(&self.shards)
            .values()
            .map(|c| lock(&c.shard).stats().allocated_bytes.all().current as u64)
            .sum();
        shards + self.arena_allocated_bytes()
    }

    /// Statistics of one pool.
    pub fn pool_stats(&self, pool: PoolId) -> AllocResult<MemoryStats> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        let mut out = MemoryStats::default();
        for cell in self.pool_shards(pool) {
            out.merge(lock(&cell.shard).stats());
        }
        self.merge_arena_stats(&mut out, Some(pool));
        Ok(out)
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&self) {
        for cell in self.all_shards().values() {
            let mut s = lock(&cell.shard);
            s.reset_peak_stats();
            // The device-wide counter restarts from the exact allocated bytes.
            s.settle_credit(&self.env(&cell.pool_budget));
        }
        self.arena_stats_mut(MemoryStats::reset_peak);
        self.shared.allocated.reset_peak();
        self.shared.budget.reset_peak();
    }

    /// `reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&self) {
        for cell in self.all_shards().values() {
            lock(&cell.shard).reset_accumulated_stats();
        }
        self.arena_stats_mut(MemoryStats::reset_accumulated);
        self.num_alloc_retries.store(0, Ordering::Relaxed);
        self.num_ooms.store(0, Ordering::Relaxed);
    }

    /// The largest request the cache serves without new physical memory (`cacheInfo`, used by
    /// cuDNN benchmark): the largest cached free block, vmm blocks up to their first unmapped
    /// page ([`Shard::largest_free`]).
    pub fn largest_free_block(&self) -> u64 {
        let ps = self.shared.page_size;
        self.all_shards()
            .values()
            .map(|c| lock(&c.shard).largest_free(ps))
            .max()
            .unwrap_or(0)
    }

    /// Record allocator events into a ring of `max_entries` (0 stops recording), as
    /// `torch.cuda.memory._record_memory_history` does.
    pub fn record_history(&self, max_entries: usize) {
        self.shared.trace.set(max_entries);
    }

    /// Hand every trace entry to `sink` as it is made (`None` detaches): PyTorch's
    /// `attachAllocatorTraceTracker`. The sink runs under a shard's lock and must not call the
    /// allocator.
    pub fn set_trace_sink(&self, sink: Option<TraceSink>) {
        self.shared.trace.set_sink(sink);
    }

    /// Forget the recorded history.
    pub fn clear_history(&self) {
        self.shared.trace.clear();
    }

    /// The recorded history, oldest first.
    pub fn history(&self) -> Vec<crate::history::TraceEntry> {
        self.shared.trace.entries()
    }

    /// Every segment of every pool and stream with its blocks, in address order (for PyTorch's
    /// `memory_snapshot()`). A vmm reservation is reported as one segment per contiguous run of
    /// mapped pages, as PyTorch reports expandable segments; free blocks are clipped to the run.
    /// A paused pool's segments are reported with the pages that its resume maps, `paused` set.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let ps = self.shared.page_size.max(1);
        let mut out = Vec::new();
        for cell in self.all_shards().values() {
            let s = lock(&cell.shard);
            for (sid, seg) in s.segments() {
                let blocks: Vec<BlockSnapshot> = s
                    .segment_blocks(sid)
                    .map(|(_, b)| BlockSnapshot {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        state: b.state,
                    })
                    .collect();
                let runs: Vec<(DevicePtr, DevicePtr)> = match &seg.kind {
                    crate::block::SegmentKind::Classic => vec![(seg.addr, seg.addr + seg.size)],
                    crate::block::SegmentKind::Vmm(pt) => {
                        let mut runs = Vec::new();
                        let mut start: Option<usize> = None;
                        let pages = seg.size.div_ceil(ps) as usize;
                        for p in 0..=pages {
                            // A paused page is shown where it was, as a paused run.
                            let mapped =
                                p < pages && (pt.shows_page(p) || s.is_paused_page(sid, p));
                            match (mapped, start) {
                                (true, None) => start = Some(p),
                                (false, Some(a)) => {
                                    let lo = seg.addr + a as u64 * ps;
                                    let hi = (seg.addr + p as u64 * ps).min(seg.addr + seg.size);
                                    runs.push((lo, hi));
                                    start = None;
                                }
                                _ => {}
                            }
                        }
                        runs
                    }
                };
                for (lo, hi) in runs {
                    let clipped = blocks
                        .iter()
                        .filter(|b| b.addr < hi && b.addr + b.size > lo)
                        .map(|b| {
                            let a = b.addr.max(lo);
                            BlockSnapshot {
                                addr: a,
                                size: (b.addr + b.size).min(hi) - a,
                                ..b.clone()
                            }
                        })
                        .collect();
                    out.push(SegmentSnapshot {
                        pool: s.pool(),
                        stream: s.stream(),
                        addr: lo,
                        size: hi - lo,
                        small: seg.small,
                        vmm: seg.is_vmm(),
                        paused: s.is_paused(),
                        blocks: clipped,
                    });
                }
            }
        }
        out.extend(self.arena_snapshots());
        out.sort_unstable_by_key(|seg| seg.addr);
        out
    }
}
