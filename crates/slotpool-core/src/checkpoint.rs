//! Transactional checkpoint / restore of a pool.
//!
//! A checkpoint costs O(1) per shard of the pool: it places a *mark* in each shard's journal, an
//! undo log that records a block's before-image whenever a block changes while a mark is alive.
//! A restore walks the journal back from its end to the mark, so it costs what changed since the
//! checkpoint, not what the pool holds. While a mark is alive, an id the journal names is never reused (so
//! before-images can go back under their ids) and segments are never released (so the
//! checkpointed topology always exists).
//!
//! A restore is a transaction: it first plans every shard and validates the caller's `keep_live`
//! set against the plan; any mismatch fails with a [`RestoreDiff`] and changes nothing. A restore
//! journals its own changes when checkpoints taken after the restored one are alive, so every
//! live checkpoint stays restorable, in any order (CUDA graph trees switch paths back and forth).

use std::cell::RefCell;
use std::sync::{Arc, Weak};

use crate::block::{Block, BlockId, BlockState, SegmentId, SegmentKind, StreamUses};
use crate::device::{DevicePtr, StreamId};
use crate::env::Env;
use crate::free_index::IndexMark;
use crate::pool::PoolId;
use crate::shard::{Shard, ShardError};
use crate::stats::{MemoryStats, StatArray};

/// One change to undo, as the shard reports it to its [`Journal`].
#[derive(Debug)]
pub(crate) enum Undo {
    /// Block `id` looked like this before a change.
    Modified(BlockId, Block),
    /// Block `id` was created (a restore putting a block back under its old id).
    Inserted(BlockId),
    /// Block `id` was created under an id fresh from the slab: no entry of any window names it.
    Minted(BlockId),
    /// Block `id` (as it was) was removed.
    Removed(BlockId, Block),
    /// Segment `id` was added.
    SegmentAdded(SegmentId),
    /// Segment `id`'s first block was this one before a restore reset the segment.
    SegmentFirst(SegmentId, BlockId),
}

/// A journal entry. Small and `Copy`: a restore scans every entry after its mark, and cutting
/// the journal back must not visit entries one by one to drop them.
#[derive(Clone, Copy, Debug)]
enum Entry {
    /// Block `id` looked like `images[img]` before a change (or before it was removed: a restore
    /// treats both alike).
    Image { id: BlockId, img: u32 },
    /// Block `id` was created.
    Inserted(BlockId),
    /// Segment `id` was added.
    SegmentAdded(SegmentId),
    /// Segment `seg`'s first block was `first` before a restore reset the segment.
    SegmentFirst { seg: u32, first: BlockId },
}

/// No block: the `prev`/`next` of an image, or a plan's image of a block that did not exist.
const NONE: usize = usize::MAX;
const NO_IMAGE: u32 = u32::MAX;

/// A block's before-image without its heap part: `stream_uses` lives in [`Journal::uses`].
/// One cache line: a restore reads thousands of them.
#[derive(Clone, Copy, Debug)]
#[repr(align(64))]
struct Image {
    addr: DevicePtr,
    size: u64,
    requested: u64,
    segment: SegmentId,
    prev: BlockId,
    next: BlockId,
    uses: u32,
    uses_len: u32,
    pending_events: u32,
    state: BlockState,
}

impl Image {
    fn share(&self) -> BlockShare {
        BlockShare {
            state: self.state,
            addr: self.addr,
            size: self.size,
            requested: self.requested,
            segment: self.segment,
        }
    }
}

/// The undo log of a shard since its oldest live checkpoint mark.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    entries: Vec<Entry>,
    images: Vec<Image>,
    uses: Vec<StreamId>,
    /// Per block id, `(window + 1) << 1` once an entry names it after the newest mark, plus 1
    /// when that entry is its minting: a restore reads only a block's first entry after any
    /// mark, so later changes of it add nothing (without this, churn under a live checkpoint grew
    /// the journal by five entries a pair).
    recorded: Vec<u32>,
    /// Counts the newest mark's windows; a new mark, or entries cut away, opens a new one.
    window: u32,
    /// Buffers of restores (boxed: a shard that never restores carries a pointer, not them); a
    /// `RefCell` because planning reads the shard.
    scratch: Box<RefCell<Scratch>>,
}

/// Buffers kept from one restore to the next: a restore of thousands of blocks then allocates
/// (and page-faults) nothing, and its cost does not grow with the slab.
#[derive(Debug, Default)]
struct Scratch {
    /// Which blocks a plan saw, indexed by block id: `(generation, plan image index)`.
    seen: Seen,
    images: Vec<(BlockId, u32)>,
    to_map: Vec<(SegmentId, DevicePtr, u64)>,
    now: Vec<(DevicePtr, u64)>,
    then: Vec<(DevicePtr, u64)>,
    freed: Vec<(DevicePtr, u64)>,
    created: Vec<(DevicePtr, u64)>,
    pairs: Vec<(DevicePtr, u64)>,
    pages: Vec<(SegmentId, usize)>,
    live_in: Vec<(DevicePtr, BlockId)>,
    live_out: Vec<DevicePtr>,
}

/// Which blocks a pass has seen, and a value for each, indexed by block id: a generation count
/// makes starting a pass O(1).
#[derive(Debug, Default)]
struct Seen {
    generation: u32,
    slots: Vec<(u32, u32)>,
}

impl Seen {
    /// Start a new generation: every block reads as unseen.
    fn begin(&mut self) {
        if self.generation == u32::MAX {
            self.slots.fill((0, 0));
            self.generation = 0;
        }
        self.generation += 1;
    }

    /// Mark `id` seen with value `v`; returns whether it was new (the value is kept otherwise).
    #[inline]
    fn first(&mut self, id: BlockId, v: u32) -> bool {
        if id >= self.slots.len() {
            self.slots.resize((id + 1).next_power_of_two(), (0, 0));
        }
        let slot = &mut self.slots[id];
        if slot.0 == self.generation {
            return false;
        }
        *slot = (self.generation, v);
        true
    }

    fn get(&self, id: BlockId) -> Option<u32> {
        self.slots
            .get(id)
            .filter(|s| s.0 == self.generation)
            .map(|s| s.1)
    }
}

impl Journal {
    /// Whether an entry names block `id` since the newest mark.
    #[inline]
    pub(crate) fn records(&self, id: BlockId) -> bool {
        self.recorded
            .get(id)
            .is_some_and(|&s| s >> 1 == self.window + 1)
    }

    /// Whether block id `id` was minted since the newest mark: its one entry anywhere is that
    /// minting, so at every live mark the id was vacant, and a restore to any of them removes
    /// whatever holds it then. Such an id can be reused at once when its block goes.
    #[inline]
    pub(crate) fn minted_since_mark(&self, id: BlockId) -> bool {
        self.recorded.get(id) == Some(&(((self.window + 1) << 1) | 1))
    }

    /// Note that an entry names `id` from now on (`minted`: the entry is its minting); false if
    /// one already did.
    #[inline]
    fn first_record(&mut self, id: BlockId, minted: bool) -> bool {
        if id >= self.recorded.len() {
            self.recorded.resize((id + 1).next_power_of_two(), 0);
        }
        let stamp = &mut self.recorded[id];
        if *stamp >> 1 == self.window + 1 {
            return false;
        }
        *stamp = ((self.window + 1) << 1) | minted as u32;
        true
    }

    /// Forget which blocks are recorded: a mark was placed, or entries were cut away.
    pub(crate) fn new_window(&mut self) {
        if self.window >= (u32::MAX >> 1) - 1 {
            self.recorded.fill(0);
            self.window = 0;
        }
        self.window += 1;
    }

    /// Record one change (the shard only calls this while a mark is alive); a block that an
    /// entry names since the newest mark is not recorded again.
    #[inline]
    pub(crate) fn push(&mut self, u: Undo) {
        let e = match u {
            Undo::Modified(id, b) | Undo::Removed(id, b) => {
                if !self.first_record(id, false) {
                    return;
                }
                Entry::Image {
                    id,
                    img: self.add_image(&b),
                }
            }
            Undo::Inserted(id) | Undo::Minted(id) => {
                if !self.first_record(id, matches!(u, Undo::Minted(_))) {
                    return;
                }
                Entry::Inserted(id)
            }
            Undo::SegmentAdded(seg) => Entry::SegmentAdded(seg),
            Undo::SegmentFirst(seg, first) => Entry::SegmentFirst {
                seg: u32::try_from(seg).expect("segment id over u32"),
                first,
            },
        };
        self.entries.push(e);
    }

    #[inline]
    fn add_image(&mut self, b: &Block) -> u32 {
        let img = u32::try_from(self.images.len()).expect("journal over u32 images");
        let uses = self.uses.len() as u32;
        self.uses.extend_from_slice(b.stream_uses.as_slice());
        self.images.push(Image {
            addr: b.addr,
            size: b.size,
            requested: b.requested,
            segment: b.segment,
            prev: b.prev().unwrap_or(NONE),
            next: b.next().unwrap_or(NONE),
            uses,
            uses_len: b.stream_uses.len() as u32,
            pending_events: b.pending_events,
            state: b.state,
        });
        img
    }

    fn block(&self, img: u32) -> Block {
        let i = &self.images[img as usize];
        let link = |id: BlockId| (id != NONE).then_some(id);
        let mut b = Block::free(i.addr, i.size, i.segment, link(i.prev), link(i.next));
        b.requested = i.requested;
        b.state = i.state;
        b.pending_events = i.pending_events;
        if i.uses_len != 0 {
            b.stream_uses =
                StreamUses::from_slice(&self.uses[i.uses as usize..][..i.uses_len as usize]);
        }
        b
    }

    /// Overwrite `slot` with image `img`, field by field: building a `Block` and moving it in
    /// went through the stack and cost a store-forwarding stall per restored block.
    #[inline]
    fn restore_into(&self, img: u32, slot: &mut Block) {
        let i = &self.images[img as usize];
        let link = |id: BlockId| (id != NONE).then_some(id);
        slot.addr = i.addr;
        slot.size = i.size;
        slot.requested = i.requested;
        slot.segment = i.segment;
        slot.set_prev(link(i.prev));
        slot.set_next(link(i.next));
        slot.state = i.state;
        slot.pending_events = i.pending_events;
        slot.stream_uses = if i.uses_len == 0 {
            StreamUses::default()
        } else {
            StreamUses::from_slice(&self.uses[i.uses as usize..][..i.uses_len as usize])
        };
    }

    /// Record block `id`'s before-image from a reference (no clone of its stream uses).
    #[inline]
    fn push_modified(&mut self, id: BlockId, b: &Block) {
        if !self.first_record(id, false) {
            return;
        }
        let img = self.add_image(b);
        self.entries.push(Entry::Image { id, img });
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Mark in the scratch `seen` array every block id an entry names.
    fn name_ids(&mut self) {
        let seen = &mut self.scratch.get_mut().seen;
        seen.begin();
        for e in &self.entries {
            match *e {
                Entry::Image { id, .. } | Entry::Inserted(id) => {
                    seen.first(id, 0);
                }
                Entry::SegmentFirst { first, .. } => {
                    seen.first(first, 0);
                }
                Entry::SegmentAdded(_) => {}
            }
        }
    }

    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.images.clear();
        self.uses.clear();
        self.new_window();
    }

    /// The image index and uses index where entries from `pos` on begin.
    fn split_at(&self, pos: usize) -> (usize, usize) {
        let img = self.entries[pos.min(self.entries.len())..]
            .iter()
            .find_map(|e| match e {
                Entry::Image { img, .. } => Some(*img as usize),
                _ => None,
            })
            .unwrap_or(self.images.len());
        let uses = self
            .images
            .get(img)
            .map_or(self.uses.len(), |i| i.uses as usize);
        (img, uses)
    }

    /// Cut the journal back to its first `pos` entries.
    fn truncate(&mut self, pos: usize) {
        let (img, uses) = self.split_at(pos);
        self.entries.truncate(pos);
        self.images.truncate(img);
        self.uses.truncate(uses);
        self.new_window();
    }

    /// Drop the first `n` entries.
    fn drain_front(&mut self, n: usize) {
        let (img, uses) = self.split_at(n);
        self.entries.drain(..n);
        self.images.drain(..img);
        self.uses.drain(..uses);
        for e in &mut self.entries {
            if let Entry::Image { img: i, .. } = e {
                *i -= img as u32;
            }
        }
        for i in &mut self.images {
            i.uses -= uses as u32;
        }
    }

    /// Keep, from entry `start` on, only the first entry of each block and of each segment's
    /// first block.
    fn dedup_from(&mut self, start: usize) {
        let (img0, uses0) = self.split_at(start);
        let seen = &mut self.scratch.get_mut().seen;
        seen.begin();
        let mut firsts: Vec<u32> = Vec::new();
        let (mut w, mut wi, mut wu) = (start, img0, uses0);
        for r in start..self.entries.len() {
            let keep = match self.entries[r] {
                Entry::Image { id, .. } | Entry::Inserted(id) => seen.first(id, 0),
                Entry::SegmentFirst { seg, .. } => {
                    let new = !firsts.contains(&seg);
                    if new {
                        firsts.push(seg);
                    }
                    new
                }
                Entry::SegmentAdded(_) => true,
            };
            if !keep {
                continue;
            }
            let mut e = self.entries[r];
            if let Entry::Image { img, .. } = &mut e {
                let mut i = self.images[*img as usize];
                let from = i.uses as usize;
                i.uses = wu as u32;
                self.uses.copy_within(from..from + i.uses_len as usize, wu);
                wu += i.uses_len as usize;
                self.images[wi] = i;
                *img = wi as u32;
                wi += 1;
            }
            self.entries[w] = e;
            w += 1;
        }
        self.entries.truncate(w);
        self.images.truncate(wi);
        self.uses.truncate(wu);
    }
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
    /// The free indexes' places (large, small): they journal themselves (`crate::paged`).
    pub index: [IndexMark; 2],
    /// Segments that existed, sorted: the free indexes at the mark know nothing of the others.
    pub segments: Arc<[SegmentId]>,
    /// The block statistics then.
    pub stats: BlockStats,
}

/// A pool's state at one moment: segments, how they are split, and which blocks are live.
/// Dropping it ends the journaling it needs: its shards forget its mark at once (each locked in
/// turn, so it must not be dropped while one of its pool's shards is locked).
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

impl Drop for Checkpoint {
    fn drop(&mut self) {
        // Without this, a shard would journal every change (and keep its quick cache off) until
        // its next checkpoint, restore or cache release noticed the mark was dead.
        for (_, shard, _) in &self.marks {
            if let Some(cell) = shard.upgrade() {
                crate::sync::lock(&cell.shard).forget_mark(self.token.id);
            }
        }
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
    /// Touched blocks and the journal image of their state at the checkpoint (`NO_IMAGE`: did
    /// not exist).
    images: Vec<(BlockId, u32)>,
    /// Ranges that blocks changed by the restore need mapped: (segment, address, size).
    to_map: Vec<(SegmentId, DevicePtr, u64)>,
    /// The free indexes at the checkpoint (large, small), the segments that existed then, and
    /// whether marks were placed after it; `None`: empty (the shard is newer).
    index: Option<([IndexMark; 2], Arc<[SegmentId]>, bool)>,
    /// The block statistics at the checkpoint (all zero for a shard newer than it).
    stats: BlockStats,
    /// Segments added since: each becomes one free block.
    reset_segments: Vec<SegmentId>,
    /// First blocks of segments that a restore reset since: (segment, first block then).
    seg_firsts: Vec<(SegmentId, BlockId)>,
    /// No block kept live: the freed / created lists are left to the apply step, which reads
    /// every changed block anyway (or to [`Shard::plan_lists`] if the restore is refused).
    light: bool,
    /// Allocated now, not at the checkpoint.
    pub freed: Vec<(DevicePtr, u64)>,
    /// Allocated at the checkpoint, not now.
    pub created: Vec<(DevicePtr, u64)>,
}

/// What a block contributes to the statistics, page counts and maps.
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

/// The statistics that follow from the blocks alone (not from the segments), as current values:
/// allocations, active blocks, allocated, active and requested bytes, inactive splits, oversize
/// allocations. At the end of a restore they are exactly what they were at its mark (the blocks
/// are; a segment added since is one free, unsplit block), so a mark keeps them and a restore
/// sets them back, where it used to sum what every changed block took out and put in (a pass
/// that read each block's neighbours). Totals and peaks move by the net change.
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
    pub(crate) fn of(st: &mut MemoryStats) -> Self {
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

/// Sort `v` by `key`, which must be unique and fit in `bits` bits; `tmp` is a buffer. A restore
/// sorts thousands of addresses, and this radix sort costs a fraction of a comparison sort (with
/// `sort_unstable` instead, half_changed/10000 took 1.77 ms instead of 1.45 ms).
fn radix_sort<T: Copy>(v: &mut Vec<T>, tmp: &mut Vec<T>, bits: u32, key: impl Fn(&T) -> u64) {
    const MAX_DIGIT: u32 = 11;
    if v.len() < 256 {
        v.sort_unstable_by_key(|x| key(x));
        return;
    }
    let passes = bits.div_ceil(MAX_DIGIT).max(1);
    let digit = bits.div_ceil(passes).max(1);
    let mask = (1u64 << digit) - 1;
    let mut counts = vec![0u32; (passes as usize) << digit];
    for x in v.iter() {
        let k = key(x);
        for p in 0..passes {
            counts[((p as usize) << digit) + ((k >> (p * digit)) & mask) as usize] += 1;
        }
    }
    // Every pass writes all of `tmp`: it only needs the length (kept from the last restore,
    // a copy of `v` cost as much as a pass).
    if tmp.len() < v.len() {
        tmp.resize(v.len(), v[0]);
    }
    tmp.truncate(v.len());
    for (p, c) in counts.chunks_exact_mut(1 << digit).enumerate() {
        // A digit that is the same everywhere leaves the order as it is.
        if c.iter().any(|&n| n as usize == v.len()) {
            continue;
        }
        let mut sum = 0;
        for n in c.iter_mut() {
            let here = *n;
            *n = sum;
            sum += here;
        }
        let shift = p as u32 * digit;
        for x in v.iter() {
            let d = ((key(x) >> shift) & mask) as usize;
            tmp[c[d] as usize] = *x;
            c[d] += 1;
        }
        std::mem::swap(v, tmp);
    }
}

/// Bits needed for `x`.
fn bits(x: u64) -> u32 {
    64 - x.leading_zeros()
}

/// What a changed block adds to the live-now and live-then lists: its address and size now if it
/// is not free, then if it was allocated.
#[inline]
fn push_lists(
    n: Option<BlockShare>,
    t: Option<BlockShare>,
    now: &mut Vec<(DevicePtr, u64)>,
    then: &mut Vec<(DevicePtr, u64)>,
) {
    if let Some(n) = n
        && n.state != BlockState::Free
    {
        now.push((n.addr, n.size));
    }
    // No block is cached while a checkpoint is alive (shard invariant 9).
    if let Some(t) = t
        && t.state == BlockState::Allocated
    {
        then.push((t.addr, t.size));
    }
}

/// Sort the live-now and live-then lists by address and merge them into what a restore frees
/// (live now, not then) and creates (live then, not now); `pairs` is a buffer.
fn merge_lists(
    now: &mut Vec<(DevicePtr, u64)>,
    then: &mut Vec<(DevicePtr, u64)>,
    pairs: &mut Vec<(DevicePtr, u64)>,
    freed: &mut Vec<(DevicePtr, u64)>,
    created: &mut Vec<(DevicePtr, u64)>,
) {
    sort_by_addr(now, pairs);
    sort_by_addr(then, pairs);
    // Addresses are unique on each side: one merge finds what differs.
    let (mut i, mut j) = (0, 0);
    while i < now.len() || j < then.len() {
        let a = now.get(i).map_or(u64::MAX, |x| x.0);
        let b = then.get(j).map_or(u64::MAX, |x| x.0);
        if a < b || j == then.len() {
            freed.push(now[i]);
            i += 1;
        } else if b < a || i == now.len() {
            created.push(then[j]);
            j += 1;
        } else {
            if now[i].1 != then[j].1 {
                freed.push(now[i]);
                created.push(then[j]);
            }
            i += 1;
            j += 1;
        }
    }
}

/// Sort (address, size) pairs with unique addresses by address.
fn sort_by_addr(v: &mut Vec<(DevicePtr, u64)>, tmp: &mut Vec<(DevicePtr, u64)>) {
    let (mut lo, mut hi, mut any) = (u64::MAX, 0, 0);
    for &(addr, _) in v.iter() {
        lo = lo.min(addr);
        hi = hi.max(addr);
        any |= addr;
    }
    // Addresses are multiples of 512: drop the zero bits they share.
    let zeros = any.trailing_zeros().min(63);
    radix_sort(v, tmp, bits(hi.saturating_sub(lo) >> zeros), |x| {
        (x.0 - lo) >> zeros
    });
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
        self.journal.new_window();
        self.blocks.seal();
        let index = [self.free_large.mark(), self.free_small.mark()];
        let mut segments: Vec<SegmentId> = self.segments.iter().map(|(s, _)| s).collect();
        segments.sort_unstable();
        self.marks.push(Mark {
            pos,
            token: token.id,
            alive: Arc::downgrade(token),
            index,
            segments: segments.into(),
            stats: BlockStats::of(&mut self.stats),
        });
        self.blocks.set_hold(true);
        Ok(pos)
    }

    /// After the newest mark, only the first entry of each block (and of each segment's first
    /// block) can matter to any mark: every mark lies before it. Dropping the later duplicates
    /// keeps a program that switches between checkpoints forever (graph trees changing paths)
    /// from growing the journal with every switch.
    fn compact_journal_tail(&mut self) {
        if let Some(start) = self.marks.iter().map(|m| m.pos).max() {
            self.journal.dedup_from(start);
        }
    }

    /// Undo entries kept for the live checkpoints: block entries, and free-index leaves and
    /// directories.
    pub fn journal_len(&self) -> usize {
        self.journal.len() + self.free_large.log_len() + self.free_small.log_len()
    }

    /// Forget marks whose checkpoints were dropped; with none left, stop journaling.
    /// Drop the mark of checkpoint `token` (being dropped) and any other dead one.
    pub(crate) fn forget_mark(&mut self, token: u64) {
        self.marks.retain(|m| m.token != token);
        self.prune_marks();
    }

    pub(crate) fn prune_marks(&mut self) {
        self.marks.retain(|m| m.alive.strong_count() > 0);
        // Marks are in the order they were placed: the first is the oldest.
        if let Some(first) = self.marks.first() {
            let [large, small] = first.index;
            self.free_large.forget_before(large);
            self.free_small.forget_before(small);
        }
        if let Some(oldest) = self.marks.iter().map(|m| m.pos).min() {
            if oldest > 0 && self.marks.iter().all(|m| m.pos >= oldest) {
                self.journal.drain_front(oldest);
                for m in &mut self.marks {
                    m.pos -= oldest;
                }
            }
        } else {
            self.journal.clear();
            self.blocks.set_hold(false);
            self.free_large.forget_all();
            self.free_small.forget_all();
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
        let mut scratch = self.journal.scratch.borrow_mut();
        let sc = &mut *scratch;
        plan.images = std::mem::take(&mut sc.images);
        plan.to_map = std::mem::take(&mut sc.to_map);
        plan.freed = std::mem::take(&mut sc.freed);
        plan.created = std::mem::take(&mut sc.created);
        let (seen, now, then, pairs) = (&mut sc.seen, &mut sc.now, &mut sc.then, &mut sc.pairs);
        match mark {
            Some((pos, token)) => {
                let Some(k) = self
                    .marks
                    .iter()
                    .position(|m| m.pos == pos && m.token == token)
                else {
                    diff.mismatches.push(format!(
                        "stream {}: the checkpoint's mark is gone from this shard",
                        self.stream
                    ));
                    return plan;
                };
                let m = &self.marks[k];
                plan.pos = Some(pos);
                plan.index = Some((m.index, m.segments.clone(), k + 1 < self.marks.len()));
                plan.stats = m.stats;
                seen.begin();
                // Oldest first: the first entry of a block is its state at the checkpoint.
                for e in &self.journal.entries[pos..] {
                    let (id, img) = match *e {
                        Entry::Image { id, img } => (id, img),
                        Entry::Inserted(id) => (id, NO_IMAGE),
                        Entry::SegmentAdded(seg) => {
                            plan.reset_segments.push(seg);
                            continue;
                        }
                        Entry::SegmentFirst { seg, first } => {
                            let seg = seg as SegmentId;
                            if !plan.seg_firsts.iter().any(|(s, _)| *s == seg) {
                                plan.seg_firsts.push((seg, first));
                            }
                            continue;
                        }
                    };
                    if seen.first(id, plan.images.len() as u32) {
                        plan.images.push((id, img));
                        self.plan_map(img, &mut plan);
                    }
                }
            }
            None => {
                seen.begin();
                for (id, _) in self.blocks.iter() {
                    seen.first(id, plan.images.len() as u32);
                    plan.images.push((id, NO_IMAGE));
                }
                plan.reset_segments = self.segments.iter().map(|(s, _)| s).collect();
            }
        }
        // With nothing to keep live, the lists wait for the apply step.
        plan.light = keep.is_empty();
        if !plan.light {
            self.lists_of(&mut plan, now, then, pairs);
        }
        // With no entry since the mark, every kept block is as it was at the checkpoint.
        let keep = if plan.images.is_empty() { &[] } else { keep };
        for &(addr, id) in keep {
            // A block the journal does not name is as it was at the checkpoint: live then too.
            let Some(k) = seen.get(id) else {
                continue;
            };
            let size = self.blocks.get(id).map_or(0, |b| b.size);
            let img = plan.images[k as usize].1;
            // Its own image, unchanged and live, or another block live there then.
            let survives = (img != NO_IMAGE && {
                let t = &self.journal.images[img as usize];
                t.state == BlockState::Allocated && t.addr == addr && t.size == size
            }) || then
                .binary_search_by_key(&addr, |x| x.0)
                .is_ok_and(|k| then[k].1 == size);
            if !survives {
                diff.mismatches.push(format!(
                    "{addr:#x}+{size} must stay live but the checkpoint does not have it"
                ));
            }
        }
        plan
    }

    /// The pages that image `img` (a block's state at the checkpoint) needs mapped, if it is a
    /// live block of a vmm segment. Ranges still mapped are skipped by [`Shard::restore_map`].
    #[inline]
    fn plan_map(&self, img: u32, plan: &mut Plan) {
        if img == NO_IMAGE {
            return;
        }
        let t = &self.journal.images[img as usize];
        if t.state != BlockState::Free && self.segments.get(t.segment).is_some_and(|s| s.is_vmm()) {
            plan.to_map.push((t.segment, t.addr, t.size));
        }
    }

    /// What block `id`, whose state at the checkpoint is image `img`, adds to the live-now and
    /// live-then lists. Blocks whose share did not change cancel out and are left out.
    #[inline]
    fn plan_block(
        &self,
        id: BlockId,
        img: u32,
        now: &mut Vec<(DevicePtr, u64)>,
        then: &mut Vec<(DevicePtr, u64)>,
    ) {
        let n = self.blocks.get(id).map(BlockShare::of);
        let t = (img != NO_IMAGE).then(|| self.journal.images[img as usize].share());
        if n.is_some() && n == t && n.is_some_and(|n| n.state != BlockState::PendingFree) {
            return;
        }
        push_lists(n, t, now, then);
    }

    /// The plan's freed / created lists, from its images; `now` and `then` keep the sorted
    /// live-now and live-then lists (keep-live checks search `then`).
    fn lists_of(
        &self,
        plan: &mut Plan,
        now: &mut Vec<(DevicePtr, u64)>,
        then: &mut Vec<(DevicePtr, u64)>,
        pairs: &mut Vec<(DevicePtr, u64)>,
    ) {
        now.clear();
        then.clear();
        for &(id, img) in &plan.images {
            self.plan_block(id, img, now, then);
        }
        merge_lists(now, then, pairs, &mut plan.freed, &mut plan.created);
    }

    /// A light plan's freed / created lists, before the apply step would have made them: a
    /// refused restore reports them.
    pub(crate) fn plan_lists(&self, plan: &mut Plan) {
        if !plan.light {
            return;
        }
        let mut scratch = self.journal.scratch.borrow_mut();
        let sc = &mut *scratch;
        self.lists_of(plan, &mut sc.now, &mut sc.then, &mut sc.pairs);
        plan.light = false;
    }

    /// Map the pages that the planned live blocks need (vmm). Pages mapped here stay mapped (idle)
    /// if a later step fails, which keeps the state consistent.
    pub(crate) fn restore_map(&mut self, env: &Env<'_>, plan: &Plan) -> Result<(), ShardError> {
        let pages = PageWork::new(env.page_size(), Vec::new());
        for &(seg, addr, size) in &plan.to_map {
            // Most ranges are mapped already (blocks that were live, then freed and not yet
            // unmapped): check them here instead of through `map_range`, which divides.
            let s = &self.segments[seg];
            let (first, end) = pages.range(s.addr, addr, size);
            if let SegmentKind::Vmm(pt) = &s.kind
                && pt
                    .handle
                    .get(first..end)
                    .is_some_and(|h| h.iter().all(Option::is_some))
            {
                continue;
            }
            self.map_range(env, seg, addr, size, false)?;
        }
        Ok(())
    }

    /// Apply a validated plan; what it frees and creates goes to `delta`.
    pub(crate) fn restore_apply(
        &mut self,
        env: &Env<'_>,
        mut plan: Plan,
        delta: &mut RestoreDelta,
    ) {
        // Checkpoints taken after this one stay valid: the restore's own changes go into the
        // journal like any others (undoing everything after a mark, in order, always yields the
        // state at that mark). With no later mark, the journal is simply cut back instead.
        let keep_marks = match plan.pos {
            Some(pos) => self.marks.iter().any(|m| m.pos > pos),
            None => !self.marks.is_empty(),
        };
        let sc = self.journal.scratch.get_mut();
        let mut w = Work {
            pages: PageWork::new(env.page_size(), std::mem::take(&mut sc.pages)),
            live_out: std::mem::take(&mut sc.live_out),
            live_in: std::mem::take(&mut sc.live_in),
            tails: Vec::new(),
        };
        // A light plan's lists are made here, from the shares the pass reads anyway.
        let (mut now_list, mut then_list) =
            (std::mem::take(&mut sc.now), std::mem::take(&mut sc.then));
        now_list.clear();
        then_list.clear();
        // One pass: each block's share goes out, the block is restored, its old share comes in.
        // Sums of statistics, page counts and index entries do not depend on the order; what
        // does (a live-map address or a segment's free tail that changes hands) waits for the
        // end of the pass. Newest first: planning just read those blocks, still in the cache.
        for &(id, img) in plan.images.iter().rev() {
            let now = self.blocks.get(id).map(BlockShare::of);
            let then = (img != NO_IMAGE).then(|| self.journal.images[img as usize].share());
            // A block whose share is the same now and at the checkpoint (only its links changed)
            // keeps its statistics, index entry and map entry: only the block itself is restored.
            let same = now.is_some() && now == then;
            if plan.light && !same {
                push_lists(now, then, &mut now_list, &mut then_list);
            }
            if let Some(now) = now {
                if now.state != BlockState::Free {
                    // Blocks the restore takes back are still held by their owners (and graphs
                    // may touch them): their memory stays mapped while the pool is in use.
                    self.retain_pages(&mut w.pages, now.segment, now.addr, now.size);
                }
                if !same {
                    self.take_out(id, now, &mut w);
                }
            }
            let Some(then) = then else {
                if let Some(gone) = self.blocks.take(id)
                    && keep_marks
                {
                    self.journal.push(Undo::Removed(id, gone));
                }
                continue;
            };
            if let Some(slot) = self.blocks.get_mut(id) {
                if keep_marks {
                    self.journal.push_modified(id, slot);
                }
                self.journal.restore_into(img, slot);
            } else {
                self.blocks.put(id, self.journal.block(img));
                if keep_marks {
                    self.journal.push(Undo::Inserted(id));
                }
            }
            if !same {
                self.put_in(id, then, &mut w);
            }
        }
        for &(seg, first) in &plan.seg_firsts {
            if let Some(s) = self.segments.get_mut(seg) {
                let old = std::mem::replace(&mut s.first, first);
                if keep_marks {
                    self.journal.push(Undo::SegmentFirst(seg, old));
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
            // reusing it keeps repeated journaled restores from minting ids (an id the journal
            // names is not reused, so each would stay in the journal and the slab).
            let id = if self.blocks.contains(s.first) {
                self.blocks.insert(block)
            } else {
                self.blocks.put(s.first, block);
                s.first
            };
            let old = std::mem::replace(&mut self.segments[seg].first, id);
            if keep_marks {
                self.journal.push(Undo::SegmentFirst(seg, old));
                self.journal.push(Undo::Inserted(id));
            }
            fresh.push(id);
        }
        let Work {
            mut pages,
            mut live_out,
            mut live_in,
            tails,
        } = w;
        // The live map in two tight loops rather than one random access per block of the pass.
        for addr in &live_out {
            self.live.remove(addr);
        }
        for &(addr, id) in &live_in {
            self.live.insert(addr, id);
        }
        for id in tails {
            let seg = self.blocks[id].segment;
            debug_assert!(self.segments[seg].free_tail.is_none(), "two free tails");
            self.segments[seg].free_tail = Some(id);
        }
        plan.stats.set(self, env);
        let sc = self.journal.scratch.get_mut();
        if plan.light {
            merge_lists(
                &mut now_list,
                &mut then_list,
                &mut sc.pairs,
                &mut plan.freed,
                &mut plan.created,
            );
        }
        (sc.now, sc.then) = (now_list, then_list);
        delta.freed.extend_from_slice(&plan.freed);
        delta.created.extend_from_slice(&plan.created);
        self.settle_pages(&mut pages);
        // The free indexes go back whole: their leaves changed since the mark move back, a
        // pointer each (or, with later marks to keep, are copied back and logged).
        match &plan.index {
            // By placement, not by block-journal position: a later mark can share its block
            // position with this one (nothing journaled in between) while the indexes logged
            // changes between them (a reset segment's block, indexed by a restore that cut the
            // block journal).
            Some(([large, small], then, later)) => {
                self.free_large.restore(*large, *later);
                self.free_small.restore(*small, *later);
                self.index_new_segments(then, &plan.reset_segments);
            }
            None => {
                self.free_large.clear();
                self.free_small.clear();
            }
        }
        for id in fresh {
            self.index_insert(id);
        }
        // Hand the buffers back for the next restore.
        let sc = self.journal.scratch.get_mut();
        let Plan {
            pos,
            mut images,
            mut to_map,
            mut freed,
            mut created,
            ..
        } = plan;
        images.clear();
        to_map.clear();
        freed.clear();
        created.clear();
        pages.touched.clear();
        live_in.clear();
        live_out.clear();
        (sc.images, sc.to_map, sc.freed, sc.created) = (images, to_map, freed, created);
        (sc.pages, sc.live_in, sc.live_out) = (pages.touched, live_in, live_out);
        if keep_marks {
            self.compact_journal_tail();
        } else {
            match pos {
                Some(pos) => self.journal.truncate(pos),
                None => self.journal.clear(),
            }
            // Ids freed since the mark are named by no entry any more, unless an older mark's
            // entries name them: the others can be reused, so that restoring over and over does
            // not grow the slab.
            self.journal.name_ids();
            let seen = &self.journal.scratch.get_mut().seen;
            self.blocks.release_held(|id| seen.get(id).is_some());
        }
        self.prune_marks();
    }

    /// Index the free block of each segment added since the mark that is not being reset (the
    /// index at the mark has none of them). A segment whose addition the journal no longer
    /// names was reset by an earlier restore that cut the journal: it is one free block now,
    /// or the restore just put it back to one.
    fn index_new_segments(&mut self, then: &[SegmentId], reset: &[SegmentId]) {
        let new: Vec<BlockId> = self
            .segments
            .iter()
            .filter(|(s, seg)| {
                then.binary_search(s).is_err()
                    && !reset.contains(s)
                    && seg.free_tail != Some(seg.first)
            })
            .map(|(_, seg)| seg.first)
            .collect();
        for id in new {
            let b = &self.blocks[id];
            debug_assert!(
                b.state == BlockState::Free && b.next().is_none(),
                "a new segment in use"
            );
            let key = (b.size, b.addr, id);
            let small = self.segments[b.segment].small;
            self.index_mut(small).insert(key);
        }
    }

    /// Take block `id`'s share out: its live-map entry or free tail, and its vmm page counts
    /// (statistics are set back whole, [`BlockStats`]; the free index is put back whole).
    fn take_out(&mut self, id: BlockId, b: BlockShare, w: &mut Work) {
        match b.state {
            BlockState::Free => {
                let seg = &mut self.segments[b.segment];
                if seg.free_tail == Some(id) {
                    seg.free_tail = None;
                }
            }
            BlockState::Allocated => w.live_out.push(b.addr),
            // No block is cached while a checkpoint is alive (shard invariant 9).
            BlockState::PendingFree | BlockState::Cached => {}
        }
        self.count_vmm_pages(b, -1, w);
    }

    /// Put restored block `id`'s share in: a segment's free tail is set at the end of the pass.
    fn put_in(&mut self, id: BlockId, b: BlockShare, w: &mut Work) {
        match b.state {
            BlockState::Free => {
                if self.is_vmm_tail(id) {
                    w.tails.push(id);
                }
            }
            BlockState::Allocated => w.live_in.push((b.addr, id)),
            BlockState::PendingFree | BlockState::Cached => {}
        }
        self.count_vmm_pages(b, 1, w);
    }

    /// Page counts of a non-free block of a vmm segment.
    fn count_vmm_pages(&mut self, b: BlockShare, sign: i32, w: &mut Work) {
        if b.state == BlockState::Free || !self.segments.get(b.segment).is_some_and(|s| s.is_vmm())
        {
            return;
        }
        self.count_pages(&mut w.pages, b.segment, b.addr, b.size, sign);
    }

    /// `pages_live` for a restore: adds to the live counts and leaves the idle bits to
    /// [`Shard::settle_pages`].
    fn count_pages(&mut self, w: &mut PageWork, seg: SegmentId, addr: u64, size: u64, d: i32) {
        let segment = &mut self.segments[seg];
        let (first, end) = w.range(segment.addr, addr, size);
        let SegmentKind::Vmm(pt) = &mut segment.kind else {
            return;
        };
        pt.cover(end);
        for p in first..end {
            pt.live[p] = pt.live[p].wrapping_add_signed(d);
            if w.touched.last() != Some(&(seg, p)) {
                w.touched.push((seg, p));
            }
        }
    }

    /// Idle bits of the pages whose live counts changed. Pages that fall idle remember the current
    /// epoch, as with `pages_live`. A block only takes out what it put in, so the counts end where
    /// one block at a time would leave them; a page idle before the restore has no block to take
    /// out (it stays idle or turns live).
    fn settle_pages(&mut self, w: &mut PageWork) {
        let epoch = self.epoch;
        for &(seg, p) in &w.touched {
            let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind else {
                continue;
            };
            let idle = pt.live[p] == 0 && pt.handle[p].is_some();
            if idle != pt.is_idle(p) {
                pt.set_idle(p, idle);
                if idle {
                    pt.idle_epoch[p] = epoch;
                }
            }
        }
    }

    /// `retain_range` for a restore, which retains block after block of the same pages.
    fn retain_pages(&mut self, w: &mut PageWork, seg: SegmentId, addr: u64, size: u64) {
        let segment = &mut self.segments[seg];
        let (first, end) = w.range(segment.addr, addr, size);
        let (s, f, e) = w.retained;
        if s == seg && f <= first && end <= e {
            return;
        }
        w.retained = (seg, first, end);
        Self::retain_pages_of(segment, first, end);
    }
}

/// What a restore's apply step collects on its way.
#[derive(Debug)]
struct Work {
    pages: PageWork,
    /// Live-map entries to drop, then to add: (address, block).
    live_out: Vec<DevicePtr>,
    live_in: Vec<(DevicePtr, BlockId)>,
    /// Restored blocks that become their segment's free tail once the current tails are gone.
    tails: Vec<BlockId>,
}

/// vmm page work of a restore: live counts per block, idle bits once per page at the end.
#[derive(Debug)]
struct PageWork {
    page_size: u64,
    /// `log2(page_size)` when it is a power of two (a shift instead of two divisions a block).
    shift: Option<u32>,
    /// Pages whose live counts changed (consecutive repeats left out).
    touched: Vec<(SegmentId, usize)>,
    /// The last range `retain_pages` marked: (segment, first page, end page).
    retained: (SegmentId, usize, usize),
}

impl PageWork {
    fn new(page_size: u64, touched: Vec<(SegmentId, usize)>) -> Self {
        PageWork {
            page_size,
            shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
            touched,
            retained: (usize::MAX, 0, 0),
        }
    }

    /// Pages under [addr, addr+size) of a segment at `seg_addr` (`Shard::page_range`).
    #[inline]
    fn range(&self, seg_addr: u64, addr: u64, size: u64) -> (usize, usize) {
        let (from, to) = (addr - seg_addr, addr + size - seg_addr);
        match self.shift {
            Some(s) => (
                (from >> s) as usize,
                ((to + self.page_size - 1) >> s) as usize,
            ),
            None => (
                (from / self.page_size) as usize,
                to.div_ceil(self.page_size) as usize,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use crate::device::{CaptureStatus, Device, DevicePtr, DeviceResult, EventHandle, PageHandle};
    use crate::{AllocError, Allocator, Config, GrowthMode, PoolId, PoolOptions, StreamId};

    /// A device that always has memory and whose events are always complete.
    #[derive(Debug)]
    struct Dev {
        next: AtomicU64,
        handles: AtomicU64,
    }

    impl Dev {
        fn new() -> Arc<Self> {
            Arc::new(Dev {
                next: AtomicU64::new(1 << 32),
                handles: AtomicU64::new(1),
            })
        }

        fn bump(&self, size: u64) -> DevicePtr {
            self.next
                .fetch_add(size.next_multiple_of(2 << 20), Ordering::Relaxed)
        }

        fn handle(&self) -> u64 {
            self.handles.fetch_add(1, Ordering::Relaxed)
        }
    }

    impl Device for Dev {
        fn page_size(&self) -> u64 {
            2 << 20
        }
        fn total_memory(&self) -> u64 {
            1 << 40
        }
        fn free_memory(&self) -> u64 {
            1 << 40
        }
        fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
            Ok(self.bump(size))
        }
        fn free_segment(&self, _: DevicePtr, _: u64) -> DeviceResult<()> {
            Ok(())
        }
        fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
            Ok(self.bump(size))
        }
        fn release_reservation(&self, _: DevicePtr, _: u64) -> DeviceResult<()> {
            Ok(())
        }
        fn create_page(&self) -> DeviceResult<PageHandle> {
            Ok(PageHandle(self.handle()))
        }
        fn release_page(&self, _: PageHandle) -> DeviceResult<()> {
            Ok(())
        }
        fn map(&self, _: DevicePtr, _: PageHandle) -> DeviceResult<()> {
            Ok(())
        }
        fn unmap(&self, _: DevicePtr) -> DeviceResult<()> {
            Ok(())
        }
        fn create_event(&self) -> DeviceResult<EventHandle> {
            Ok(EventHandle(self.handle()))
        }
        fn destroy_event(&self, _: EventHandle) -> DeviceResult<()> {
            Ok(())
        }
        fn record_event(&self, _: EventHandle, _: StreamId) -> DeviceResult<()> {
            Ok(())
        }
        fn query_event(&self, _: EventHandle) -> DeviceResult<bool> {
            Ok(true)
        }
        fn synchronize_event(&self, _: EventHandle) -> DeviceResult<()> {
            Ok(())
        }
        fn synchronize(&self) -> DeviceResult<()> {
            Ok(())
        }
        fn stream_wait_event(&self, _: StreamId, _: EventHandle) -> DeviceResult<()> {
            Ok(())
        }
        fn capture_status(&self, _: StreamId) -> DeviceResult<CaptureStatus> {
            Ok(CaptureStatus::None)
        }
    }

    const POOL: PoolId = PoolId(0, 1);
    const N: usize = 600;

    /// Segments and blocks of the pool's shard on `stream` (the dump without statistics, whose
    /// totals and peaks grow; invariant 7 checks the current values).
    fn blocks_on(a: &Allocator<Dev>, stream: StreamId) -> Vec<String> {
        let header = format!("shard {POOL}/{stream}:");
        let mut inside = false;
        let mut out = Vec::new();
        for l in a.state_dump().lines() {
            if l.starts_with("shard ") || l.starts_with("held ") {
                inside = l.starts_with(&header);
            } else if inside {
                out.push(l.to_string());
            }
        }
        out
    }

    fn blocks(a: &Allocator<Dev>) -> Vec<String> {
        blocks_on(a, 0)
    }

    type Live = BTreeSet<(DevicePtr, u64)>;

    /// An allocator in `growth` mode with [`POOL`] created.
    fn with_pool(growth: GrowthMode) -> Allocator<Dev> {
        let a = Allocator::new(
            Dev::new(),
            Config {
                growth,
                ..Config::default()
            },
        );
        a.create_or_incref_pool(POOL, PoolOptions::default())
            .unwrap();
        a
    }

    /// `2 * N` allocations of which every second one is freed again: N live blocks, N holes.
    fn holes(growth: GrowthMode) -> (Allocator<Dev>, Live) {
        let a = with_pool(growth);
        let all: Vec<(DevicePtr, u64)> = (0..2 * N as u64)
            .map(|i| 512 * (1 + (i * 7) % 64))
            .map(|size| (a.alloc_in(POOL, size, 0).unwrap(), size))
            .collect();
        let mut live = Live::new();
        for (i, x) in all.into_iter().enumerate() {
            if i % 2 == 0 {
                live.insert(x);
            } else {
                a.free(x.0).unwrap();
            }
        }
        (a, live)
    }

    /// Free every `step`th live block and allocate as many others, on stream 0 and (a shard the
    /// checkpoint does not have when `new_stream`) on stream 7. Returns the live set after.
    fn churn(a: &Allocator<Dev>, live: &Live, step: usize, salt: u64, new_stream: bool) -> Live {
        let mut now = live.clone();
        for &(p, size) in live.iter().step_by(step) {
            a.free(p).unwrap();
            now.remove(&(p, size));
        }
        for i in 0..(N / step) as u64 {
            let size = 512 * (1 + (i * 13 + salt) % 64);
            let stream = if new_stream && i % 3 == 0 { 7 } else { 0 };
            now.insert((a.alloc_in(POOL, size, stream).unwrap(), size));
        }
        now
    }

    /// The delta turns the live set `before` into `after`.
    fn check_delta(delta: &super::RestoreDelta, before: &Live, after: &Live) {
        let freed: Live = before.difference(after).copied().collect();
        let created: Live = after.difference(before).copied().collect();
        assert_eq!(delta.freed, freed.into_iter().collect::<Vec<_>>());
        assert_eq!(delta.created, created.into_iter().collect::<Vec<_>>());
    }

    /// Restores where most blocks changed (free-index rebuilds, radix sorts), repeated (buffers
    /// reused), with a later checkpoint alive (journaled restores), and to a checkpoint that does
    /// not have a shard.
    fn many_changes(growth: GrowthMode) {
        let (a, live) = holes(growth);
        let cp = a.checkpoint(POOL).unwrap();
        let at_cp = blocks(&a);
        for round in 0..5 {
            // Round 2 leaves most free blocks as they were (the index keeps them).
            let step = if round == 2 { 5 } else { 2 };
            let now = churn(&a, &live, step, round, round == 3);
            let later = (round == 1).then(|| (a.checkpoint(POOL).unwrap(), blocks(&a)));
            let delta = a.restore(POOL, &cp, &[]).unwrap();
            a.check_invariants().unwrap();
            assert_eq!(blocks(&a), at_cp, "round {round}");
            check_delta(&delta, &now, &live);
            // A shard made since keeps its segments (they are never released while journaling),
            // each one free block.
            assert!(
                blocks_on(&a, 7)
                    .iter()
                    .all(|l| l.starts_with(" segment") || l.contains(" Free "))
            );
            if let Some((later, at_later)) = later {
                // Back to the later checkpoint, and back again.
                let delta = a.restore(POOL, &later, &[]).unwrap();
                a.check_invariants().unwrap();
                assert_eq!(blocks(&a), at_later);
                check_delta(&delta, &live, &now);
                a.restore(POOL, &cp, &[]).unwrap();
                a.check_invariants().unwrap();
                assert_eq!(blocks(&a), at_cp);
            }
        }
    }

    #[test]
    fn restores_of_many_changes_vmm() {
        many_changes(GrowthMode::Vmm);
    }

    #[test]
    fn restores_of_many_changes_classic() {
        many_changes(GrowthMode::Classic);
    }

    /// Churn and restore, over and over: block ids freed since the checkpoint are named by no
    /// journal entry once the restore cuts the journal back, so they are reused and the slab
    /// stops growing (it grew by about N / 2 slots per round when no id was reused while a
    /// checkpoint was alive).
    #[test]
    fn restoring_over_and_over_keeps_the_slab_bounded() {
        for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
            let (a, live) = holes(growth);
            let cp = a.checkpoint(POOL).unwrap();
            let at_cp = blocks(&a);
            let slots = || {
                let cell = a.existing_shard(POOL, 0).unwrap();
                crate::sync::lock(&cell.shard).blocks.capacity_ids()
            };
            let mut after = Vec::new();
            for round in 0..12 {
                churn(&a, &live, 2, round, false);
                a.restore(POOL, &cp, &[]).unwrap();
                a.check_invariants().unwrap();
                assert_eq!(blocks(&a), at_cp, "round {round}");
                after.push(slots());
            }
            // A few slots may still be minted (the vacant stack's order shifts between rounds).
            assert!(
                after[11] - after[2] < N / 20,
                "{growth:?}: slab slots per round {after:?}"
            );
        }
    }

    /// The sequence the model test found when freed ids were reused while a checkpoint was
    /// alive: a block freed after the first checkpoint, a segment added after the second one,
    /// then restores in both orders. Cutting the journal back to the second checkpoint left the
    /// new segment's reset block under an id that the first checkpoint's entries still named.
    #[test]
    fn ids_named_by_an_older_checkpoint_are_not_reused() {
        for growth in [GrowthMode::Classic, GrowthMode::Vmm] {
            for freed in 0..3 {
                for order in [[0, 1], [1, 0], [1, 1], [0, 0]] {
                    let a = with_pool(growth);
                    let mut live = vec![
                        a.alloc_in(POOL, 1, 0).unwrap(),
                        a.alloc_in(POOL, (1 << 20) + 1, 0).unwrap(),
                    ];
                    let cp1 = a.checkpoint(POOL).unwrap();
                    let at_cp1 = blocks(&a);
                    live.push(a.alloc_in(POOL, 1, 0).unwrap());
                    a.free(live[freed]).unwrap();
                    let cp2 = a.checkpoint(POOL).unwrap();
                    let at_cp2 = blocks(&a);
                    a.alloc_in(POOL, (20 << 20) + 1, 0).unwrap();
                    for which in order {
                        let (cp, at) = if which == 0 {
                            (&cp1, &at_cp1)
                        } else {
                            (&cp2, &at_cp2)
                        };
                        a.restore(POOL, cp, &[]).unwrap();
                        a.check_invariants().unwrap();
                        // Segments added since stay, as one free block each.
                        let now: Vec<String> =
                            blocks(&a).into_iter().filter(|l| at.contains(l)).collect();
                        assert_eq!(&now, at, "{growth:?}, freed {freed}, order {order:?}");
                    }
                }
            }
        }
    }

    /// Keep-live checks when most blocks changed: blocks the checkpoint has survive, a block it
    /// does not have refuses the restore and changes nothing.
    #[test]
    fn keep_live_with_many_changes() {
        let (a, live) = holes(GrowthMode::Vmm);
        let cp = a.checkpoint(POOL).unwrap();
        let at_cp = blocks(&a);
        let now = churn(&a, &live, 2, 0, false);
        let kept: Vec<DevicePtr> = now.intersection(&live).map(|x| x.0).collect();
        let new = now.difference(&live).next().unwrap().0;
        let before = a.state_dump();
        let mut keep = kept.clone();
        keep.push(new);
        match a.restore(POOL, &cp, &keep) {
            Err(AllocError::CheckpointMismatch(diff)) => {
                assert_eq!(diff.mismatches.len(), 1, "{diff}");
                assert!(diff.mismatches[0].starts_with(&format!("{new:#x}+")));
                let added: Live = now.difference(&live).copied().collect();
                assert_eq!(diff.added, added.into_iter().collect::<Vec<_>>());
            }
            other => panic!("restore kept a block the checkpoint lacks: {other:?}"),
        }
        assert_eq!(
            a.state_dump(),
            before,
            "a refused restore changed the state"
        );
        a.restore(POOL, &cp, &kept).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(blocks(&a), at_cp);
    }

    /// A restore sets the block statistics back to the checkpoint's current values (a shard
    /// newer than the checkpoint to zero); peaks keep what the changes reached.
    #[test]
    fn a_restore_sets_block_statistics_back() {
        for growth in [GrowthMode::Classic, GrowthMode::Vmm] {
            let (a, live) = holes(growth);
            let cp = a.checkpoint(POOL).unwrap();
            let at = a.pool_stats(POOL).unwrap();
            let now = churn(&a, &live, 2, 1, true);
            // A big allocation after the checkpoint raises the peaks.
            a.alloc_in(POOL, 300 << 20, 0).unwrap();
            let high = a.pool_stats(POOL).unwrap();
            assert_ne!(now, live);
            a.restore(POOL, &cp, &[]).unwrap();
            a.check_invariants().unwrap();
            let back = a.pool_stats(POOL).unwrap();
            for (name, then, after, top) in [
                (
                    "allocation",
                    &at.allocation,
                    &back.allocation,
                    &high.allocation,
                ),
                (
                    "active_bytes",
                    &at.active_bytes,
                    &back.active_bytes,
                    &high.active_bytes,
                ),
                (
                    "allocated_bytes",
                    &at.allocated_bytes,
                    &back.allocated_bytes,
                    &high.allocated_bytes,
                ),
                (
                    "requested_bytes",
                    &at.requested_bytes,
                    &back.requested_bytes,
                    &high.requested_bytes,
                ),
                (
                    "inactive_split",
                    &at.inactive_split,
                    &back.inactive_split,
                    &high.inactive_split,
                ),
            ] {
                assert_eq!(after.all().current, then.all().current, "{growth:?} {name}");
                assert_eq!(after.all().peak, top.all().peak, "{growth:?} {name} peak");
            }
            assert!(back.allocated_bytes.all().peak > at.allocated_bytes.all().peak);
            // The shard on stream 7 is newer than the checkpoint: nothing of it stays live.
            assert_eq!(
                a.live_allocations(POOL).unwrap().len(),
                live.len(),
                "{growth:?}"
            );
        }
    }

    /// The model test's case: a restore that cut the block journal reset a new segment, a
    /// checkpoint followed at the same journal position, and a restore of the older one had to
    /// keep the free indexes' changes in between (the later mark is later by placement, though
    /// not by position); restoring the later one then gives back its index.
    #[test]
    fn a_later_mark_at_the_same_journal_position_keeps_its_index() {
        for growth in [GrowthMode::Classic, GrowthMode::Vmm] {
            let a = with_pool(growth);
            let _cp0 = a.checkpoint(POOL).unwrap();
            a.alloc_in(POOL, (1 << 20) + 1, 0).unwrap();
            let cp1 = a.checkpoint(POOL).unwrap();
            a.alloc_in(POOL, 1, 0).unwrap();
            a.restore(POOL, &cp1, &[]).unwrap();
            let cp2 = a.checkpoint(POOL).unwrap();
            let at_cp2 = blocks(&a);
            a.restore(POOL, &cp1, &[]).unwrap();
            a.check_invariants().unwrap();
            a.alloc_in(POOL, 1, 0).unwrap();
            a.restore(POOL, &cp2, &[]).unwrap();
            a.check_invariants().unwrap();
            assert_eq!(blocks(&a), at_cp2, "{growth:?}");
            // The index answers as at cp2: the small segment's one free block serves again.
            let p = a.alloc_in(POOL, 1, 0).unwrap();
            a.check_invariants().unwrap();
            let was = format!("block {p:#x}+");
            assert!(
                at_cp2
                    .iter()
                    .any(|l| l.contains(&was) && l.contains(" Free ")),
                "{growth:?}: {p:#x} in {at_cp2:?}"
            );
        }
    }
}
