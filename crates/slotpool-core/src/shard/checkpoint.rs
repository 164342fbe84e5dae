//! The shard's part of checkpoint / restore ([`crate::checkpoint`] describes the whole): a
//! checkpoint's marks in the shard's structures, the plan of a restore, and its two steps (map
//! the pages the plan needs, then apply it).

use std::sync::{Arc, Weak};

use crate::block::{Block, BlockId, PageTable, SegmentId, SegmentKind};
use crate::block_slab::{BlockSlab, SlabMark};
use crate::checkpoint::{CheckpointToken, MarkHolder, RESTORE_BUFFER_KEEP, RestoreDelta};
use crate::device::DevicePtr;
use crate::env::Env;
use crate::free_index::IndexMark;
use crate::live_map::{LiveEntry, LiveMap, LiveMark};
use crate::sync::lock;
use rustc_hash::FxHashMap;

use super::restore_pages::{PageGeom, PageWork};
use super::{Shard, ShardCell, ShardError};

use crate::error::RestoreDiff;
use crate::stats::{MemoryStats, StatArray};

/// A checkpoint's marks in one shard's structures.
#[derive(Clone, Debug)]
pub(crate) struct Mark {
    pub token: u64,
    pub alive: Weak<CheckpointToken>,
    pub slab: SlabMark,
    pub live: LiveMark,
    /// The free indexes' marks (large, small).
    pub index: [IndexMark; 2],
    /// Each segment that existed, sorted: (segment, first block, free tail). Segments added
    /// since are reset to one free block.
    pub segments: Arc<[(SegmentId, BlockId, Option<BlockId>)]>,
    /// The block statistics then.
    pub stats: BlockStats,
}

/// How one shard gets back to its checkpoint.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// The checkpoint's token (`None`: the shard is newer than the checkpoint).
    token: Option<u64>,
    /// Live now, not at the checkpoint (or at another size).
    freed: Vec<LiveEntry>,
    /// Live at the checkpoint, not now (or at another size).
    created: Vec<LiveEntry>,
}

impl Plan {
    /// Allocations the restore frees: (address, size).
    pub(crate) fn freed(&self) -> impl ExactSizeIterator<Item = (DevicePtr, u64)> + '_ {
        self.freed.iter().map(|e| (e.addr, e.size))
    }

    /// Allocations the restore re-creates: (address, size).
    pub(crate) fn created(&self) -> impl ExactSizeIterator<Item = (DevicePtr, u64)> + '_ {
        self.created.iter().map(|e| (e.addr, e.size))
    }
}

/// Buffers kept from one restore to the next, by the allocator for all its shards (restores
/// take turns under its `reclaim` lock): a restore of thousands of blocks then allocates (and
/// page-faults) nothing, even on a pool it has never restored, as a new graph's is.
#[derive(Debug, Default)]
pub(crate) struct RestoreScratch {
    /// Each changed address's first and last op ([`LiveMap::changes_since`]).
    ends: FxHashMap<DevicePtr, (usize, usize)>,
    pages: PageWork,
    /// A plan's freed / created lists, one pair per shard of the restore, given back by
    /// [`Shard::restore_apply`].
    lists: Vec<(Vec<LiveEntry>, Vec<LiveEntry>)>,
}

impl RestoreScratch {
    /// Whether the page work and the lists hold nothing over from a restore, as between
    /// restores (`ends` is cleared when it is used).
    #[cfg(test)]
    pub(crate) fn is_clear(&self) -> bool {
        self.pages.is_clear() && self.lists.iter().all(|(f, c)| f.is_empty() && c.is_empty())
    }
}

/// Drop `m`'s memory if it grew past [`RESTORE_BUFFER_KEEP`] entries.
fn trim_map<K, V>(m: &mut FxHashMap<K, V>) {
    if m.capacity() > RESTORE_BUFFER_KEEP {
        *m = FxHashMap::default();
    }
}

/// The statistics that follow from the blocks alone (not from the segments), as current values:
/// allocations, active blocks, allocated, active and requested bytes, inactive splits, oversize
/// allocations. At the end of a restore they are exactly what they were at its mark (the blocks
/// are; a segment added since is one free, unsplit block), so a mark keeps them and a restore
/// sets them back. Totals and peaks move by the net change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockStats {
    /// `[small][k]`, `k` as in [`block_stat`].
    current: [[i64; BLOCK_STATS]; 2],
    oversize: i64,
}

const BLOCK_STATS: usize = 7;

/// Block statistic `k` of `st`.
fn block_stat(st: &mut MemoryStats, k: usize) -> &mut StatArray {
    match k {
        0 => &mut st.allocation,
        1 => &mut st.allocated_bytes,
        2 => &mut st.active,
        3 => &mut st.active_bytes,
        4 => &mut st.requested_bytes,
        5 => &mut st.inactive_split,
        _ => &mut st.inactive_split_bytes,
    }
}

impl BlockStats {
    fn of(st: &mut MemoryStats) -> Self {
        let mut out = BlockStats {
            oversize: st.oversize_allocations.current,
            ..Default::default()
        };
        for k in 0..BLOCK_STATS {
            let stat = block_stat(st, k);
            out.current[0][k] = stat.large_pool().current;
            out.current[1][k] = stat.small_pool().current;
        }
        out
    }

    /// Set `shard`'s block statistics to these: decreases first, then increases (the peaks of
    /// taking out before putting in), and the device-wide allocated bytes by the net change.
    fn set(&self, shard: &mut Shard, env: &Env<'_>) {
        let now = BlockStats::of(&mut shard.stats);
        for rising in [false, true] {
            for small in [false, true] {
                for k in 0..BLOCK_STATS {
                    let d = self.current[small as usize][k] - now.current[small as usize][k];
                    if d != 0 && (d > 0) == rising {
                        block_stat(&mut shard.stats, k).update(small, d);
                    }
                }
            }
        }
        if self.oversize != now.oversize {
            shard
                .stats
                .oversize_allocations
                .update(self.oversize - now.oversize);
        }
        let bytes =
            (self.current[0][1] + self.current[1][1]) - (now.current[0][1] + now.current[1][1]);
        if bytes != 0 {
            shard.count_allocated(env, bytes);
        }
    }
}

impl MarkHolder for ShardCell {
    fn forget_mark(&self, token: u64) {
        lock(&self.shard).forget_mark(token);
    }
}

impl Shard {
    /// Place a checkpoint mark; refused while frees wait on cross-stream events.
    pub(crate) fn add_mark(&mut self, token: &Arc<CheckpointToken>) -> Result<(), String> {
        self.prune_marks();
        if !self.pending.is_empty() || !self.deferred.is_empty() {
            return Err(format!(
                "stream {}: {} frees wait on cross-stream events",
                self.stream,
                self.pending.len() + self.deferred.len()
            ));
        }
        let mut segments: Vec<(SegmentId, BlockId, Option<BlockId>)> = self
            .segments
            .iter()
            .map(|(s, seg)| (s, seg.first, seg.free_tail))
            .collect();
        segments.sort_unstable_by_key(|s| s.0);
        self.marks.push(Mark {
            token: token.id,
            alive: Arc::downgrade(token),
            slab: self.blocks.mark(),
            live: self.live.mark(),
            index: [self.free_large.mark(), self.free_small.mark()],
            segments: segments.into(),
            stats: BlockStats::of(&mut self.stats),
        });
        Ok(())
    }

    /// Whether a checkpoint that marked this shard is alive: the shard then stays in its
    /// allocator's table even when empty, so that the checkpoint can always be restored.
    pub(crate) fn has_live_mark(&self) -> bool {
        self.marks.iter().any(|m| m.alive.strong_count() > 0)
    }

    /// Pages (and logged values) kept for the live checkpoints: of the block slab, the live map
    /// and the free indexes.
    pub fn journal_len(&self) -> usize {
        self.blocks.log_len()
            + self.live.log_len()
            + self.free_large.log_len()
            + self.free_small.log_len()
    }

    /// Drop the mark of checkpoint `token` (being dropped) and any other dead one.
    pub(crate) fn forget_mark(&mut self, token: u64) {
        self.marks.retain(|m| m.token != token);
        self.prune_marks();
    }

    /// Forget marks whose checkpoints were dropped, and what only they needed logged; with none
    /// left, stop logging.
    pub(super) fn prune_marks(&mut self) {
        self.marks.retain(|m| m.alive.strong_count() > 0);
        // Marks are in the order they were placed: the first is the oldest.
        match self.marks.first() {
            Some(first) => {
                let (slab, live, [large, small]) = (first.slab, first.live, first.index);
                self.blocks.forget_before(slab);
                self.live.forget_before(live);
                self.free_large.forget_before(large);
                self.free_small.forget_before(small);
            }
            None => {
                self.blocks.forget_all();
                self.live.forget_all();
                self.free_large.forget_all();
                self.free_small.forget_all();
            }
        }
    }

    /// Plan the way back to checkpoint `token`'s mark, or to an empty shard when `token` is
    /// `None` (the shard is newer than the checkpoint). `keep` are live allocations of this
    /// shard that must survive; mismatches go to `diff`.
    pub(crate) fn plan_restore(
        &self,
        token: Option<u64>,
        keep: &[(DevicePtr, BlockId)],
        diff: &mut RestoreDiff,
        sc: &mut RestoreScratch,
    ) -> Plan {
        if !self.pending.is_empty() || !self.deferred.is_empty() {
            diff.mismatches.push(format!(
                "stream {}: frees wait on cross-stream events; synchronize first",
                self.stream
            ));
        }
        let (freed, created) = sc.lists.pop().unwrap_or_default();
        let mut plan = Plan {
            token,
            freed,
            created,
        };
        match token {
            Some(token) => {
                let Some(m) = self.marks.iter().find(|m| m.token == token) else {
                    diff.mismatches.push(format!(
                        "stream {}: the checkpoint's mark is gone from this shard",
                        self.stream
                    ));
                    return plan;
                };
                self.live
                    .changes_since(m.live, &mut sc.ends, &mut plan.freed, &mut plan.created);
                trim_map(&mut sc.ends);
            }
            None => plan.freed.extend(self.live.iter().copied()),
        }
        // A kept allocation is live now; it survives if nothing differs at its address (it was
        // live then at the same size).
        if !keep.is_empty() {
            let freed: FxHashMap<DevicePtr, u64> =
                plan.freed.iter().map(|e| (e.addr, e.size)).collect();
            for &(addr, _) in keep {
                if let Some(size) = freed.get(&addr) {
                    diff.mismatches.push(format!(
                        "{addr:#x}+{size} must stay live but the checkpoint does not have it"
                    ));
                }
            }
        }
        plan
    }

    /// Map the pages that the re-created blocks need (vmm). Pages mapped here stay mapped (idle)
    /// if a later step fails, which keeps the state consistent.
    pub(crate) fn restore_map(&mut self, env: &Env<'_>, plan: &Plan) -> Result<(), ShardError> {
        let pages = PageGeom::new(env.page_size());
        // The pages each re-created block takes, so that no two of them (in slots that alias
        // one page) are given the same one: none of them is live yet.
        let mut taken = FxHashMap::default();
        for run in segment_runs(&plan.created) {
            let seg = run[0].segment();
            let s = &self.segments[seg];
            let SegmentKind::Vmm(pt) = &s.kind else {
                continue;
            };
            // Most ranges are mapped already (blocks that were live, then freed and not yet
            // unmapped), each page to its slot alone: checked here instead of through
            // `map_range`, which divides. First over the run's whole span, which holds every
            // page of its blocks: a graph's pool usually passes, and then no block needs its own.
            let (from, end) = run.iter().fold((u64::MAX, 0), |(lo, hi), e| {
                (lo.min(e.addr), hi.max(e.addr + e.size))
            });
            if mapped_alone(pt, pages.range(s.addr, from, end - from)) {
                continue;
            }
            for e in run {
                let s = &self.segments[seg];
                let (first, end) = pages.range(s.addr, e.addr, e.size);
                if let SegmentKind::Vmm(pt) = &s.kind
                    && mapped_alone(pt, (first, end))
                {
                    continue;
                }
                self.map_slots(env, seg, first, end, false, &mut taken)?;
            }
        }
        Ok(())
    }

    /// Apply a validated plan; what it frees and creates goes to `delta`.
    pub(crate) fn restore_apply(
        &mut self,
        env: &Env<'_>,
        mut plan: Plan,
        delta: &mut RestoreDelta,
        sc: &mut RestoreScratch,
    ) {
        let geom = PageGeom::new(env.page_size());
        // vmm page counts: what stops being live comes out, what comes back goes in (at both
        // ends every block that is not free is live: no frees wait, nothing is cached).
        // Blocks the restore takes back are still held by their owners (and graphs may touch
        // them): their memory stays mapped while the pool is in use.
        self.count_pages(geom, &mut sc.pages, &plan.freed, -1, true);
        self.count_pages(geom, &mut sc.pages, &plan.created, 1, false);
        self.settle_pages(&mut sc.pages);
        let mark = plan
            .token
            .and_then(|t| self.marks.iter().position(|m| m.token == t));
        let reset: Vec<SegmentId> = match mark {
            Some(k) => {
                // Checkpoints taken after this one stay valid: the restore is logged like any
                // change. With no later mark, the logged pages simply move back.
                let later = k + 1 < self.marks.len();
                let m = self.marks[k].clone();
                self.blocks.restore(m.slab, later);
                self.live.restore(m.live, later, &plan.freed, &plan.created);
                self.free_large.restore(m.index[0], later);
                self.free_small.restore(m.index[1], later);
                let mut reset = Vec::new();
                for (id, s) in self.segments.iter_mut() {
                    match m.segments.binary_search_by_key(&id, |x| x.0) {
                        Ok(i) => (s.first, s.free_tail) = (m.segments[i].1, m.segments[i].2),
                        Err(_) => reset.push(id),
                    }
                }
                m.stats.set(self, env);
                reset
            }
            None => {
                if self.marks.is_empty() {
                    self.blocks = BlockSlab::default();
                    self.live = LiveMap::default();
                } else {
                    // Later checkpoints marked this shard: emptying it is logged.
                    let ids: Vec<BlockId> = self.blocks.iter().map(|(id, _)| id).collect();
                    for id in ids {
                        self.blocks.remove(id);
                    }
                    self.live.clear();
                }
                self.free_large.clear();
                self.free_small.clear();
                BlockStats::default().set(self, env);
                self.segments.iter().map(|(s, _)| s).collect()
            }
        };
        // Segments added since the checkpoint: the slab at the mark has none of their blocks,
        // and each becomes one free block (under a fresh id).
        for seg in reset {
            let s = &self.segments[seg];
            let id = self
                .blocks
                .insert(Block::free(s.addr, s.size, seg, None, None));
            let s = &mut self.segments[seg];
            (s.first, s.free_tail) = (id, None);
            self.index_insert(id);
        }
        delta.freed.extend(plan.freed());
        delta.created.extend(plan.created());
        // Hand the buffers back for the next restore.
        plan.freed.clear();
        plan.created.clear();
        if plan.freed.capacity().max(plan.created.capacity()) <= RESTORE_BUFFER_KEEP {
            sc.lists.push((plan.freed, plan.created));
        }
        self.prune_marks();
    }
}

/// The runs of `list` that lie in one segment each (a segment may have several).
fn segment_runs(list: &[LiveEntry]) -> impl Iterator<Item = &[LiveEntry]> {
    list.chunk_by(|a, b| a.segment == b.segment)
}

/// Whether every slot of pages `[first, end)` has a page mapped, one no other slot maps.
fn mapped_alone(pt: &PageTable, (first, end): (usize, usize)) -> bool {
    pt.handle
        .get(first..end)
        .is_some_and(|h| h.iter().all(Option::is_some))
        && !pt.any_shared(first, end)
}
