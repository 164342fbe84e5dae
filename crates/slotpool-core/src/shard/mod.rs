//! `Shard`: every segment and block of one (pool, stream) pair, as a plain `&mut self` state
//! machine. The lock is one layer up, in [`crate::Allocator`]; nothing here is shared.

mod alloc;
mod check;
mod checkpoint;
mod free;
mod pages;
mod pause;
mod quick;
mod release;
mod restore_pages;
mod runs;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::sync::Arc;

use crate::block_slab::BlockSlab;
use crate::id_slab::IdSlab;
use crate::live_map::LiveMap;

use crate::block::{Block, BlockId, BlockState, Segment, SegmentId, SegmentKind};
use crate::device::{DeviceError, DevicePtr, EventHandle, StreamId};
use crate::env::{Budget, Env, Shared};
use crate::free_index::FreeIndex;
use crate::peak::{CREDIT_MAX, Lease};
use crate::policy::SizePolicy;
use crate::pool::PoolId;
use crate::stats::MemoryStats;
use checkpoint::Mark;
pub(crate) use checkpoint::RestoreScratch;
pub(crate) use pause::PausePlan;

/// Why a shard operation failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardError {
    /// No cached block fits and the backend (or the byte limit) refused growth.
    OutOfMemory,
    /// The backend failed for another reason (boxed: the error type stays two words, so that
    /// the hot paths return their results in registers).
    Device(Box<DeviceError>),
    /// No allocated block of this shard starts at the pointer (it may be another shard's).
    UnknownPointer,
    /// A page operation named a classic segment.
    NotVmm,
    /// A page operation named a page that is not mapped.
    PageNotMapped,
    /// The allocator forgot this shard (it was empty; see `Shard::retired`); the caller looks
    /// its (pool, stream) up again.
    Retired,
    /// The range needs a stale page slot unmapped (see [`crate::alias`]) while a capture is
    /// underway, when unmapping is illegal: the allocation is served from a new reservation.
    StaleDuringCapture,
    /// The shard's pool is paused: nothing is handed out until it is resumed.
    Paused,
    /// A page operation named one slot of a physical run, which is unmapped only whole
    /// ([`crate::block::runs`]).
    InRun,
}

impl From<DeviceError> for ShardError {
    fn from(e: DeviceError) -> Self {
        match e {
            DeviceError::OutOfMemory => ShardError::OutOfMemory,
            other => ShardError::Device(Box::new(other)),
        }
    }
}

/// Memory released by a cache-emptying call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub bytes: u64,
    pub segments: u64,
}

/// All segments and blocks of one pool on one stream.
///
/// Invariants, checked by [`Shard::check_invariants`]:
///
/// 1. The blocks of each segment tile it exactly: from `first`, `next` links walk contiguous
///    addresses whose sizes add up to the segment size, and `prev` links mirror `next` links.
/// 2. No two neighbouring blocks are both `Free` (free neighbours always merge).
/// 3. The free index holds exactly the `Free` blocks, each under its current size and address,
///    in the index of its segment's size class; except the free block that ends a vmm segment,
///    which is that segment's `free_tail` instead.
/// 4. A `PendingFree` block waits on `pending_events > 0` events in `pending`, or sits in
///    `deferred`; no other block has pending events.
/// 5. Every block in the slab belongs to exactly one segment chain; segments never overlap.
/// 6. vmm pages: `live[p]` equals the number of non-free blocks overlapping page p; every page a
///    non-free block overlaps is mapped (or paused, 10); a page is idle exactly when mapped with `live == 0`;
///    only mapped pages are graph-retained; counts match the bitmaps.
/// 7. Statistics equal a recount of the blocks and segments.
/// 8. The live map holds exactly the `Allocated` and `Cached` blocks, each under its address (a
///    cached block stays there, so that the quick cache's round trip costs no hashing).
/// 9. The quick cache holds exactly the `Cached` blocks, each under its size, at most
///    `QUICK_MAX` of them; they have no events or stream uses, count as live for their vmm
///    pages (6) and as inactive for the statistics (7), and there are none while a checkpoint is
///    alive.
/// 10. Paused (`pause` is set, see `shard/pause.rs`): the pause lists each paused page once, in a vmm
///     segment, unmapped, with its own stretch of the host backup if there is one; the quick
///     cache is empty and off; `reserved_paused_bytes` counts the listed pages. Not paused:
///     `reserved_paused_bytes` is 0.
/// 11. vmm page aliasing ([`crate::alias`]): every mapped slot is listed once under its
///     physical page; a physical page backs at most one occupied slot (live blocks over it, or
///     graph-retained); no two non-free blocks reach the same byte of a physical page through
///     any of its slots; `reserved_bytes` counts each physical page once.
/// 12. Physical runs ([`crate::block::runs`]): runs lie inside their reservation and do not
///     overlap; each slot of a run is mapped to its own tag, never an alias; no other slot holds
///     a tag.
///
/// The fields are the shard's own: its children in `shard/` read them, everything else goes
/// through methods.
#[derive(Debug)]
pub struct Shard {
    pool: PoolId,
    stream: StreamId,
    no_split: bool,
    blocks: BlockSlab,
    segments: IdSlab<Segment>,
    free_small: FreeIndex,
    free_large: FreeIndex,
    /// Cross-stream events that `PendingFree` blocks wait on, oldest first.
    pending: VecDeque<(EventHandle, BlockId)>,
    /// `PendingFree` blocks freed during a capture: their events are recorded after it ends.
    deferred: Vec<BlockId>,
    /// vmm: frees since the last recorded event belong to `epoch`; pages idle since an epoch below
    /// `safe_epoch` may be unmapped.
    epoch: u64,
    safe_epoch: u64,
    epoch_events: VecDeque<(u64, EventHandle)>,
    /// The live checkpoints' marks, oldest first (see `checkpoint.rs`).
    marks: Vec<Mark>,
    /// Allocated (and cached) blocks by address: `free(ptr)` finds its block here, under the
    /// shard's lock.
    live: LiveMap,
    /// Segments added (true) or released (false) since the allocator last looked: (addr, size).
    seg_log: Vec<(DevicePtr, u64, bool)>,
    /// Bytes counted in the device-wide allocated counter beyond this shard's allocated bytes:
    /// freed here and kept for its next allocations, at most [`CREDIT_MAX`] (see
    /// [`crate::peak`]).
    peak_credit: i64,
    /// Freed bytes beyond the credit, still counted device-wide; other shards may take them back.
    lease: Arc<Lease>,
    /// Blocks freed on this stream and kept whole, most recent last: (size, block). A request of
    /// exactly a cached size takes one back without touching the free index, the slab or the
    /// vmm page counts, which is most of an alloc + free pair's cost. Anything that needs the
    /// cache merged (growth, releasing memory, a checkpoint) calls [`Shard::flush_quick`] first.
    quick: Vec<(u64, BlockId)>,
    /// No quick cache in this shard: it was created while a checkpoint of its pool was alive,
    /// so a restore may wipe it, and its plan knows only free and live blocks.
    quick_off: bool,
    /// Whether the quick cache pays here: a hit adds 2 (up to [`QUICK_CREDIT_MAX`]), a miss
    /// takes 1, and frees are cached only while it is positive. Below zero, each free counts it
    /// further down, and at `-QUICK_PROBE_EVERY` one free is cached again to probe. A workload
    /// whose sizes rarely recur (1% of requests in the training traces) then pays nothing.
    quick_credit: i32,
    /// Allocations that searched the free index: the clock of garbage collection's ages
    /// (PyTorch's `get_free_blocks_call_count`).
    free_searches: u64,
    /// The allocator's shard table forgot this shard, empty, under its lock: a thread that
    /// found it just before (a cached reference, a lookup a moment earlier) must not give it
    /// memory that no table knows. Allocation past the quick cache refuses with
    /// [`ShardError::Retired`]; the quick cache of an empty shard is empty.
    retired: bool,
    /// The pool is pausable: every segment grows as vmm memory ([`crate::PoolOptions::pausable`]).
    pausable: bool,
    /// Set while the pool is paused: what the resume maps again (`pause.rs`).
    pause: Option<Box<pause::ShardPause>>,
    /// The pinned host buffer of the last backup, kept for the next one (pinning memory costs
    /// far more than copying it); freed with the rest of the cache by `release_cached`.
    host_spare: Option<(crate::device::HostBuffer, u64)>,
    stats: MemoryStats,
}

/// A shard and the budget of the pool it belongs to. Aligned to two cache lines (what x86's
/// adjacent-line prefetch pulls in together), so that shards allocated one after another share
/// no line.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct ShardCell {
    pub shard: crate::sync::ShardMutex<Shard>,
    pub pool_budget: Arc<Budget>,
}

impl ShardCell {
    /// `shard` behind its lock, keyed by its pool and stream (the order in which a pool's shards
    /// are locked together).
    pub(crate) fn new(shard: Shard, pool_budget: Arc<Budget>) -> Self {
        let PoolId(a, b) = shard.pool;
        let key = ((a as u128) << 64 | b as u128, shard.stream);
        ShardCell {
            shard: crate::sync::ShardMutex::new(shard, key),
            pool_budget,
        }
    }
}

/// A shared shard, as the allocator's shard table holds it.
pub(crate) type ShardRef = Arc<ShardCell>;

/// Most blocks one shard keeps in its quick cache.
pub(crate) const QUICK_MAX: usize = 16;
const QUICK_CREDIT_MAX: i32 = 16;
const QUICK_PROBE_EVERY: i32 = 64;

impl Shard {
    /// A shard of (`pool`, `stream`) that counts its freed bytes beyond the credit in `lease`
    /// (from [`crate::peak::PeakCounter::new_lease`]).
    pub fn new(
        pool: PoolId,
        stream: StreamId,
        no_split: bool,
        policy: &SizePolicy,
        lease: Arc<Lease>,
    ) -> Self {
        let stats = MemoryStats {
            max_split_size: if policy.max_split_size == u64::MAX {
                i64::MAX
            } else {
                policy.max_split_size as i64
            },
            ..Default::default()
        };
        // The containers that every pair writes start with room to spare: a shard is often made
        // by one thread for another (a warm-up pair per stream), and small first allocations of
        // several shards made in a row share cache lines, which the shards' threads then fight
        // over (on the H200 host, 16 threads of 64 MiB pairs cost 1.5x more each; see
        // "Shards share no cache line" in docs/design.md).
        Shard {
            pool,
            stream,
            no_split,
            blocks: BlockSlab::default(),
            segments: IdSlab::with_capacity(8),
            free_small: FreeIndex::default(),
            free_large: FreeIndex::default(),
            pending: VecDeque::new(),
            deferred: Vec::new(),
            epoch: 1,
            safe_epoch: 0,
            epoch_events: VecDeque::new(),
            marks: Vec::new(),
            live: LiveMap::default(),
            seg_log: Vec::new(),
            peak_credit: 0,
            lease,
            quick: Vec::with_capacity(QUICK_MAX),
            quick_off: false,
            quick_credit: QUICK_CREDIT_MAX,
            free_searches: 0,
            retired: false,
            pausable: false,
            pause: None,
            host_spare: None,
            stats,
        }
    }

    /// This shard's pool and (`quick_off`) whether a checkpoint of it was alive at its birth,
    /// (`pausable`) whether the pool may be paused.
    pub(crate) fn with_pool_state(mut self, quick_off: bool, pausable: bool) -> Self {
        self.quick_off = quick_off;
        self.pausable = pausable;
        self
    }

    pub fn pool(&self) -> PoolId {
        self.pool
    }

    pub fn stream(&self) -> StreamId {
        self.stream
    }

    pub fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    /// `reset_peak_memory_stats` for this shard: its peaks restart from the current values.
    pub(crate) fn reset_peak_stats(&mut self) {
        self.stats.reset_peak();
    }

    /// `reset_accumulated_memory_stats` for this shard: its totals and event counters go to 0.
    pub(crate) fn reset_accumulated_stats(&mut self) {
        self.stats.reset_accumulated();
    }

    /// Whether segments came or went since [`Shard::take_segment_changes`] last ran.
    #[inline]
    pub(crate) fn segments_changed(&self) -> bool {
        !self.seg_log.is_empty()
    }

    /// The segments added (true) or released (false) since the last call: (addr, size, added).
    pub(crate) fn take_segment_changes(&mut self) -> std::vec::Drain<'_, (DevicePtr, u64, bool)> {
        self.seg_log.drain(..)
    }

    /// The allocator forgets this (empty) shard: its credit and lease go back to the device-wide
    /// counter, and allocation past the quick cache refuses with [`ShardError::Retired`].
    pub(crate) fn retire(&mut self, env: &Env<'_>) {
        self.settle_credit(env);
        env.allocated.end_lease(&self.lease);
        self.retired = true;
    }

    pub(crate) fn is_retired(&self) -> bool {
        self.retired
    }

    /// What this shard counts in the device-wide allocated counter: its allocated bytes, its
    /// credit and its lease.
    pub(crate) fn counted_allocated(&self) -> i64 {
        self.stats.allocated_bytes.all().current + self.peak_credit + self.lease.get()
    }

    /// Frees of this shard wait on cross-stream events (or on the end of a capture).
    pub(crate) fn waits_on_events(&self) -> bool {
        !self.pending.is_empty() || !self.deferred.is_empty()
    }

    /// Block ids the slab has minted (vacant ones included).
    #[cfg(test)]
    pub(crate) fn slab_ids(&self) -> usize {
        self.blocks.capacity_ids()
    }

    pub fn block(&self, id: BlockId) -> Option<&Block> {
        self.blocks.get(id)
    }

    pub fn segment(&self, id: SegmentId) -> Option<&Segment> {
        self.segments.get(id)
    }

    pub fn segments(&self) -> impl Iterator<Item = (SegmentId, &Segment)> {
        self.segments.iter()
    }

    /// Blocks of a segment in address order.
    pub fn segment_blocks(&self, seg: SegmentId) -> impl Iterator<Item = (BlockId, &Block)> {
        let mut next = self.segments.get(seg).map(|s| s.first);
        std::iter::from_fn(move || {
            let id = next?;
            let b = &self.blocks[id];
            next = b.next();
            Some((id, b))
        })
    }

    /// True when the shard holds no memory at all.
    pub fn is_empty(&self) -> bool {
        self.segments.is_empty()
    }

    /// Number of blocks handed out and not yet freed (or pending).
    pub fn live_blocks(&self) -> usize {
        self.blocks
            .iter()
            .filter(|(_, b)| matches!(b.state, BlockState::Allocated | BlockState::PendingFree))
            .count()
    }

    /// The allocated block that starts at `ptr`.
    #[inline]
    pub fn lookup(&self, ptr: DevicePtr) -> Option<BlockId> {
        let id = self.live.get(ptr)?.block();
        // The live map holds the allocated and the cached blocks (invariant 8), and an empty
        // quick cache means none is cached (9): then the block itself need not be read (a
        // restore checks thousands of kept pointers this way, each block a cache miss).
        let allocated = if self.quick.is_empty() {
            debug_assert_eq!(self.blocks[id].state, BlockState::Allocated);
            true
        } else {
            self.blocks[id].state == BlockState::Allocated
        };
        allocated.then_some(id)
    }

    /// Frees waiting on cross-stream events or on the end of a capture.
    pub fn pending_frees(&self) -> usize {
        self.blocks
            .iter()
            .filter(|(_, b)| b.state == BlockState::PendingFree)
            .count()
    }

    /// The largest request this shard's cache serves without new physical memory (`cacheInfo`):
    /// the largest free or cached block, where a vmm block counts only its mapped prefix (an
    /// allocation starts at its block's address, so an unmapped page cuts it off there). This
    /// is PyTorch's meaning, whose expandable segments keep unmapped space out of the free
    /// blocks. Costs O(free blocks).
    pub fn largest_free(&self, page_size: u64) -> u64 {
        let tails = self.segments.iter().filter_map(|(_, s)| s.free_tail);
        let free = self
            .free_small
            .iter()
            .chain(self.free_large.iter())
            .map(|(_, _, id)| id)
            .chain(tails)
            .map(|id| self.mapped_prefix(page_size, id))
            .max()
            .unwrap_or(0);
        let q = self.quick.iter().map(|&(size, _)| size).max().unwrap_or(0);
        free.max(q)
    }

    /// Bytes of free block `id` from its start up to its first unmapped page (all of it in a
    /// classic segment).
    fn mapped_prefix(&self, page_size: u64, id: BlockId) -> u64 {
        let b = &self.blocks[id];
        let seg = &self.segments[b.segment];
        let SegmentKind::Vmm(pt) = &seg.kind else {
            return b.size;
        };
        let (first, end) = Self::page_range(page_size, seg.addr, b.addr, b.size);
        let run = (first..end).take_while(|&p| pt.is_mapped(p)).count();
        if run == 0 {
            return 0;
        }
        (seg.addr + (first + run) as u64 * page_size).min(b.end()) - b.addr
    }

    /// True while a checkpoint of this shard is alive: changes are logged for it.
    #[inline]
    fn journaling(&self) -> bool {
        !self.marks.is_empty()
    }

    /// The free index of the small or the large pool.
    #[inline]
    fn index(&self, small: bool) -> &FreeIndex {
        if small {
            &self.free_small
        } else {
            &self.free_large
        }
    }

    #[inline]
    fn index_mut(&mut self, small: bool) -> &mut FreeIndex {
        if small {
            &mut self.free_small
        } else {
            &mut self.free_large
        }
    }

    fn is_inactive_split(&self, id: BlockId) -> bool {
        let b = &self.blocks[id];
        !self.segments[b.segment].is_vmm() && b.is_split()
    }

    /// What the index needs of free block `id`, read once (the slab is two pointers deep):
    /// (size, address, segment, small, whether it is an inactive split ([`Shard::is_inactive_split`]),
    /// whether it ends its vmm segment and so lives in the segment's `free_tail`).
    #[inline]
    fn index_facts(&self, id: BlockId) -> (u64, DevicePtr, SegmentId, bool, bool, bool) {
        let b = &self.blocks[id];
        let (size, addr, seg, split) = (b.size, b.addr, b.segment, b.is_split());
        let s = &self.segments[seg];
        let vmm = s.is_vmm();
        let tail = vmm && addr + size == s.addr + s.size;
        (size, addr, seg, s.small, !vmm && split, tail)
    }

    fn index_insert(&mut self, id: BlockId) {
        let (size, addr, seg, small, inactive_split, tail) = self.index_facts(id);
        if inactive_split {
            self.stats.inactive_split.inc(small, 1);
            self.stats.inactive_split_bytes.inc(small, size as i64);
        }
        if tail {
            debug_assert!(self.segments[seg].free_tail.is_none(), "two free tails");
            self.segments[seg].free_tail = Some(id);
            return;
        }
        self.index_mut(small).insert((size, addr, id));
    }

    fn index_remove(&mut self, id: BlockId) {
        let (size, addr, seg, small, inactive_split, _) = self.index_facts(id);
        if inactive_split {
            self.stats.inactive_split.dec(small, 1);
            self.stats.inactive_split_bytes.dec(small, size as i64);
        }
        if self.segments[seg].free_tail == Some(id) {
            self.segments[seg].free_tail = None;
            return;
        }
        let removed = self.index_mut(small).remove(&(size, addr, id));
        debug_assert!(removed, "free block missing from the index");
    }

    /// Report `delta` allocated bytes to the device-wide counter ([`crate::peak::PeakCounter`])
    /// through this shard's credit and lease: small pairs stay within the credit, large ones
    /// within the lease, and only growth beyond what the shard freed reaches the shared counter.
    #[inline]
    pub(crate) fn count_allocated(&mut self, env: &Env<'_>, delta: i64) {
        self.peak_credit -= delta;
        if !(0..=CREDIT_MAX).contains(&self.peak_credit) {
            // The shared part alone: an `Env` handed to a call out of line would have to be
            // built in memory on the quick cache's round trip, which otherwise keeps it in
            // registers.
            self.rebalance_credit(env.shared);
        }
    }

    /// The credit left its range: over it, everything goes to the lease (where another shard
    /// reaching a peak can take it back); under it, the lease pays first (what is left of it
    /// refills the credit), then the counter.
    #[inline(never)]
    fn rebalance_credit(&mut self, shared: &Shared) {
        if self.peak_credit > CREDIT_MAX {
            self.lease.give(self.peak_credit);
            self.peak_credit = 0;
            return;
        }
        let need = -self.peak_credit;
        let got = self.lease.take();
        if got >= need {
            // Keep a credit's worth: the allocations that follow a large free then spend it
            // without a read-modify-write each.
            let spare = got - need;
            self.peak_credit = spare.min(CREDIT_MAX);
            if spare > CREDIT_MAX {
                self.lease.give(spare - CREDIT_MAX);
            }
        } else {
            self.peak_credit = 0;
            shared.allocated.add(need - got);
        }
    }

    /// Hand the credit back (peaks are being reset, or the shard is dropped). The lease goes back
    /// through the counter itself ([`crate::peak::PeakCounter::reset_peak`], `end_lease`).
    pub(crate) fn settle_credit(&mut self, env: &Env<'_>) {
        env.allocated.add(-self.peak_credit);
        self.peak_credit = 0;
    }
}
