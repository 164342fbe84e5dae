//! Transactional checkpoint / restore of a pool.
//!
//! A checkpoint costs O(1) per shard of the pool: it places a *mark* in each shard's journal, an
//! undo log that records a block's before-image whenever a block changes while a mark is alive.
//! A restore walks the journal back from its end to the mark, so it costs what changed since the
//! checkpoint, not what the pool holds. While a mark is alive, block ids are never reused (so
//! before-images can go back under their ids) and segments are never released (so the
//! checkpointed topology always exists).
//!
//! A restore is a transaction: it first plans every shard and validates the caller's `keep_live`
//! set against the plan; any mismatch fails with a [`RestoreDiff`] and changes nothing. A restore
//! journals its own changes when checkpoints taken after the restored one are alive, so every
//! live checkpoint stays restorable, in any order (CUDA graph trees switch paths back and forth).

use std::sync::{Arc, Weak};

use rustc_hash::FxHashMap;

use crate::block::{Block, BlockId, BlockState, SegmentId, SegmentKind};
use crate::device::{DevicePtr, StreamId};
use crate::env::Env;
use crate::pool::PoolId;
use crate::shard::{Shard, ShardError};

/// One journal entry: how to undo one change.
#[derive(Clone, Debug)]
pub(crate) enum Undo {
    /// Block `id` looked like this before a change.
    Modified(BlockId, Block),
    /// Block `id` was created.
    Inserted(BlockId),
    /// Block `id` (as it was) was removed.
    Removed(BlockId, Block),
    /// Segment `id` was added.
    SegmentAdded(SegmentId),
    /// Segment `id`'s first block was this one before a restore reset the segment.
    SegmentFirst(SegmentId, BlockId),
}

/// Keeps a checkpoint's marks alive; shards hold weak references to it.
#[derive(Debug)]
pub struct CheckpointToken {
    pub(crate) id: u64,
}

/// A checkpoint's place in one shard's journal.
#[derive(Clone, Debug)]
pub(crate) struct Mark {
    pub pos: usize,
    pub token: u64,
    pub alive: Weak<CheckpointToken>,
}

/// A pool's state at one moment: segments, how they are split, and which blocks are live.
/// Dropping it ends the journaling it needs (lazily, on the next checkpoint call).
#[derive(Debug)]
pub struct Checkpoint {
    pub(crate) allocator: u64,
    pub(crate) pool: PoolId,
    pub(crate) marks: Vec<(StreamId, Weak<crate::allocator::ShardCell>, usize)>,
    pub(crate) token: Arc<CheckpointToken>,
    /// Blocks live when it was taken.
    pub live_blocks: usize,
}

impl Checkpoint {
    /// The pool it belongs to.
    pub fn pool(&self) -> PoolId {
        self.pool
    }
}

/// What a restore did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDelta {
    /// Allocations live before the restore that it freed: (address, size).
    pub freed: Vec<(DevicePtr, u64)>,
    /// Allocations of the checkpoint that were not live and that the restore re-created; the
    /// caller owns them: (address, size).
    pub created: Vec<(DevicePtr, u64)>,
}

/// Why a restore was refused; nothing changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDiff {
    /// Human-readable reasons, one per mismatch.
    pub mismatches: Vec<String>,
    /// Allocations live now that the checkpoint does not have: (address, size).
    pub added: Vec<(DevicePtr, u64)>,
    /// Allocations of the checkpoint that are not live now: (address, size).
    pub removed: Vec<(DevicePtr, u64)>,
}

impl std::fmt::Display for RestoreDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.mismatches.join("; "))?;
        let list = |v: &[(DevicePtr, u64)]| {
            v.iter()
                .take(8)
                .map(|(a, s)| format!("{a:#x}+{s}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !self.added.is_empty() {
            write!(
                f,
                "; {} added since: {}",
                self.added.len(),
                list(&self.added)
            )?;
        }
        if !self.removed.is_empty() {
            write!(
                f,
                "; {} removed since: {}",
                self.removed.len(),
                list(&self.removed)
            )?;
        }
        Ok(())
    }
}

/// How one shard gets back to its checkpoint.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Journal length to truncate to (`None`: the shard is newer than the checkpoint).
    pos: Option<usize>,
    /// Touched blocks and their state at the checkpoint (`None`: did not exist).
    images: Vec<(BlockId, Option<Block>)>,
    /// Segments added since: each becomes one free block.
    reset_segments: Vec<SegmentId>,
    /// First blocks of segments that a restore reset since: (segment, first block then).
    seg_firsts: Vec<(SegmentId, BlockId)>,
    /// Allocated now, not at the checkpoint.
    pub freed: Vec<(DevicePtr, u64)>,
    /// Allocated at the checkpoint, not now.
    pub created: Vec<(DevicePtr, u64)>,
}

/// What a block contributes to the statistics, page counts and maps (a copy, so that a restore
/// moves block images instead of cloning them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct BlockShare {
    state: BlockState,
    addr: DevicePtr,
    size: u64,
    requested: u64,
    segment: SegmentId,
}

impl BlockShare {
    fn of(b: &Block) -> Self {
        BlockShare {
            state: b.state,
            addr: b.addr,
            size: b.size,
            requested: b.requested,
            segment: b.segment,
        }
    }
}

impl Shard {
    /// Place a checkpoint mark; refused while frees wait on cross-stream events.
    pub(crate) fn add_mark(&mut self, token: &Arc<CheckpointToken>) -> Result<usize, String> {
        self.prune_marks();
        if !self.pending.is_empty() || !self.deferred.is_empty() {
            return Err(format!(
                "stream {}: {} frees wait on cross-stream events",
                self.stream,
                self.pending.len() + self.deferred.len()
            ));
        }
        let pos = self.journal.len();
        self.marks.push(Mark {
            pos,
            token: token.id,
            alive: Arc::downgrade(token),
        });
        self.blocks.reuse = false;
        Ok(pos)
    }

    /// After the newest mark, only the first entry of each block (and of each segment's first
    /// block) can matter to any mark: every mark lies before it. Dropping the later duplicates
    /// keeps a program that switches between checkpoints forever (graph trees changing paths)
    /// from growing the journal with every switch.
    fn compact_journal_tail(&mut self) {
        let Some(start) = self.marks.iter().map(|m| m.pos).max() else {
            return;
        };
        let mut blocks = rustc_hash::FxHashSet::default();
        let mut firsts = rustc_hash::FxHashSet::default();
        let tail = self.journal.split_off(start);
        self.journal.extend(tail.into_iter().filter(|u| match u {
            Undo::Modified(id, _) | Undo::Removed(id, _) | Undo::Inserted(id) => blocks.insert(*id),
            Undo::SegmentFirst(seg, _) => firsts.insert(*seg),
            Undo::SegmentAdded(_) => true,
        }));
    }

    /// Undo entries kept for the live checkpoints.
    pub fn journal_len(&self) -> usize {
        self.journal.len()
    }

    /// Forget marks whose checkpoints were dropped; with none left, stop journaling.
    pub(crate) fn prune_marks(&mut self) {
        self.marks.retain(|m| m.alive.strong_count() > 0);
        if let Some(oldest) = self.marks.iter().map(|m| m.pos).min() {
            if oldest > 0 && self.marks.iter().all(|m| m.pos >= oldest) {
                self.journal.drain(..oldest);
                for m in &mut self.marks {
                    m.pos -= oldest;
                }
            }
        } else {
            self.journal.clear();
            self.blocks.reuse = true;
        }
    }

    /// Plan the way back to mark (`pos`, `token`), or to an empty shard when `mark` is `None`
    /// (the shard is newer than the checkpoint). `keep` are live allocations of this shard that
    /// must survive; mismatches go to `diff`.
    pub(crate) fn plan_restore(
        &self,
        mark: Option<(usize, u64)>,
        keep: &[(DevicePtr, BlockId)],
        diff: &mut RestoreDiff,
    ) -> Plan {
        let mut plan = Plan::default();
        if !self.pending.is_empty() || !self.deferred.is_empty() {
            diff.mismatches.push(format!(
                "stream {}: frees wait on cross-stream events; synchronize first",
                self.stream
            ));
        }
        let mut images: FxHashMap<BlockId, Option<Block>> = FxHashMap::default();
        if let Some((pos, _)) = mark {
            images.reserve(self.journal.len().saturating_sub(pos));
        }
        match mark {
            Some((pos, token)) => {
                if !self.marks.iter().any(|m| m.pos == pos && m.token == token) {
                    diff.mismatches.push(format!(
                        "stream {}: the checkpoint's mark is gone from this shard",
                        self.stream
                    ));
                    return plan;
                }
                plan.pos = Some(pos);
                // Oldest first: the first entry of a block is its state at the checkpoint; later
                // ones are skipped without cloning.
                for u in &self.journal[pos..] {
                    match u {
                        Undo::Modified(id, b) | Undo::Removed(id, b) => {
                            images.entry(*id).or_insert_with(|| Some(b.clone()));
                        }
                        Undo::Inserted(id) => {
                            images.entry(*id).or_insert(None);
                        }
                        Undo::SegmentAdded(seg) => plan.reset_segments.push(*seg),
                        Undo::SegmentFirst(seg, first) => {
                            if !plan.seg_firsts.iter().any(|(s, _)| s == seg) {
                                plan.seg_firsts.push((*seg, *first));
                            }
                        }
                    }
                }
            }
            None => {
                for (id, _) in self.blocks.iter() {
                    images.insert(id, None);
                }
                plan.reset_segments = self.segments.iter().map(|(s, _)| s).collect();
            }
        }
        let mut now: FxHashMap<DevicePtr, (u64, BlockId)> = FxHashMap::default();
        let mut then: FxHashMap<DevicePtr, (u64, BlockId)> = FxHashMap::default();
        now.reserve(images.len() / 2);
        then.reserve(images.len() / 2);
        for (&id, img) in &images {
            if let Some(b) = self.blocks.get(id)
                && b.state != BlockState::Free
            {
                now.insert(b.addr, (b.size, id));
            }
            if let Some(b) = img
                && b.state == BlockState::Allocated
            {
                then.insert(b.addr, (b.size, id));
            }
        }
        for (&addr, &(size, _)) in &now {
            if then.get(&addr).is_none_or(|t| t.0 != size) {
                plan.freed.push((addr, size));
            }
        }
        for (&addr, &(size, _)) in &then {
            if now.get(&addr).is_none_or(|n| n.0 != size) {
                plan.created.push((addr, size));
            }
        }
        for &(addr, id) in keep {
            let size = self.blocks.get(id).map_or(0, |b| b.size);
            let survives = match images.get(&id) {
                None => true,
                Some(_) => then.get(&addr).is_some_and(|&(s, _)| s == size),
            };
            if !survives {
                diff.mismatches.push(format!(
                    "{addr:#x}+{size} must stay live but the checkpoint does not have it"
                ));
            }
        }
        plan.freed.sort_unstable();
        plan.created.sort_unstable();
        diff.added.extend_from_slice(&plan.freed);
        diff.removed.extend_from_slice(&plan.created);
        plan.images = images.into_iter().collect();
        plan
    }

    /// Map the pages that the planned live blocks need (vmm). Pages mapped here stay mapped (idle)
    /// if a later step fails, which keeps the state consistent.
    pub(crate) fn restore_map(&mut self, env: &Env<'_>, plan: &Plan) -> Result<(), ShardError> {
        for (_, img) in &plan.images {
            if let Some(b) = img
                && b.state != BlockState::Free
                && self.segments.get(b.segment).is_some_and(|s| s.is_vmm())
            {
                self.map_range(env, b.segment, b.addr, b.size, false)?;
            }
        }
        Ok(())
    }

    /// Apply a validated plan.
    pub(crate) fn restore_apply(&mut self, env: &Env<'_>, plan: Plan) {
        // A block whose share is the same now and at the checkpoint (only its links changed)
        // keeps its statistics, index entry and map entry: only the block itself is restored.
        let mut same = Vec::with_capacity(plan.images.len());
        for (id, img) in &plan.images {
            let Some(now) = self.blocks.get(*id).map(BlockShare::of) else {
                same.push(false);
                continue;
            };
            if now.state != BlockState::Free {
                // Blocks the restore takes back are still held by their owners (and graphs may
                // touch them): their memory stays mapped while the pool is in use.
                self.retain_range(env, now.segment, now.addr, now.size);
            }
            let unchanged = img.as_ref().is_some_and(|then| BlockShare::of(then) == now);
            same.push(unchanged);
            if !unchanged {
                self.place(env, *id, now, -1);
            }
        }
        // Checkpoints taken after this one stay valid: the restore's own changes go into the
        // journal like any others (undoing everything after a mark, in order, always yields the
        // state at that mark). With no later mark, the journal is simply cut back instead.
        let keep_marks = match plan.pos {
            Some(pos) => self.marks.iter().any(|m| m.pos > pos),
            None => !self.marks.is_empty(),
        };
        let mut undo: Vec<Undo> = Vec::new();
        let mut restored: Vec<(BlockId, BlockShare)> = Vec::with_capacity(plan.images.len());
        for ((id, img), same) in plan.images.into_iter().zip(same) {
            match img {
                None => {
                    if let Some(gone) = self.blocks.take(id)
                        && keep_marks
                    {
                        undo.push(Undo::Removed(id, gone));
                    }
                }
                Some(b) => {
                    if !same {
                        restored.push((id, BlockShare::of(&b)));
                    }
                    if self.blocks.contains(id) {
                        let old = std::mem::replace(&mut self.blocks[id], b);
                        if keep_marks {
                            undo.push(Undo::Modified(id, old));
                        }
                    } else {
                        self.blocks.put(id, b);
                        if keep_marks {
                            undo.push(Undo::Inserted(id));
                        }
                    }
                }
            }
        }
        for &(seg, first) in &plan.seg_firsts {
            if let Some(s) = self.segments.get_mut(seg) {
                let old = std::mem::replace(&mut s.first, first);
                if keep_marks {
                    undo.push(Undo::SegmentFirst(seg, old));
                }
            }
        }
        let mut fresh = Vec::new();
        for &seg in &plan.reset_segments {
            let Some(s) = self.segments.get(seg) else {
                continue;
            };
            let block = Block::free(s.addr, s.size, seg, None, None);
            // The segment's first block id is vacant by now (the block was made after the mark):
            // reusing it keeps repeated restores from minting ids (ids are not reused while
            // journaling, so each would stay in the journal and the slab).
            let id = if self.blocks.contains(s.first) {
                self.blocks.insert(block)
            } else {
                self.blocks.put(s.first, block);
                s.first
            };
            let old = std::mem::replace(&mut self.segments[seg].first, id);
            if keep_marks {
                undo.push(Undo::SegmentFirst(seg, old));
                undo.push(Undo::Inserted(id));
            }
            fresh.push(id);
        }
        for (id, share) in restored {
            self.place(env, id, share, 1);
        }
        for id in fresh {
            self.index_insert(id);
        }
        if keep_marks {
            self.journal.append(&mut undo);
            self.compact_journal_tail();
        } else {
            match plan.pos {
                Some(pos) => self.journal.truncate(pos),
                None => self.journal.clear(),
            }
        }
        self.prune_marks();
    }

    /// Put block `id`'s share in (`sign` = 1) or take it out (-1): statistics and page counts, and
    /// the free index or the live map.
    fn place(&mut self, env: &Env<'_>, id: BlockId, share: BlockShare, sign: i64) {
        self.account(env, share, sign);
        match (share.state, sign > 0) {
            (BlockState::Free, true) => self.index_insert(id),
            (BlockState::Free, false) => self.index_remove(id),
            (BlockState::Allocated, true) => {
                self.live.insert(share.addr, id);
            }
            (BlockState::Allocated, false) => {
                self.live.remove(&share.addr);
            }
            (BlockState::PendingFree, _) => {}
        }
    }

    /// Add (`sign` = 1) or remove (-1) a block's share of the statistics and page counts.
    fn account(&mut self, env: &Env<'_>, b: BlockShare, sign: i64) {
        if b.state == BlockState::Free {
            return;
        }
        let Some(seg) = self.segments.get(b.segment) else {
            return;
        };
        let (small, vmm) = (seg.small, matches!(seg.kind, SegmentKind::Vmm(_)));
        let st = &mut self.stats;
        if b.state == BlockState::Allocated {
            st.allocation.update(small, sign);
            st.allocated_bytes.update(small, sign * b.size as i64);
            if !vmm && env.policy.is_oversize(b.size) {
                st.oversize_allocations.update(sign);
            }
        }
        st.active.update(small, sign);
        st.active_bytes.update(small, sign * b.size as i64);
        st.requested_bytes.update(small, sign * b.requested as i64);
        if b.state == BlockState::Allocated {
            self.count_allocated(env, sign * b.size as i64);
        }
        if vmm {
            self.pages_live(env, b.segment, b.addr, b.size, sign as i32);
        }
    }
}
