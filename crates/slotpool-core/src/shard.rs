//! `Shard`: every segment and block of one (pool, stream) pair, as a plain `&mut self` state
//! machine. The lock is one layer up, in [`crate::Allocator`]; nothing here is shared.

use std::collections::VecDeque;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::block_slab::BlockSlab;
use crate::id_slab::IdSlab;
use crate::live_map::{LiveEntry, LiveMap};

use crate::block::{
    Block, BlockId, BlockState, PageTable, Segment, SegmentId, SegmentKind, StreamUses,
};
use crate::checkpoint::{Mark, RestoreScratch};
use crate::config::GrowthMode;
use crate::device::{DeviceError, DevicePtr, EventHandle, PageHandle, StreamId};
use crate::env::Env;
use crate::free_index::{FreeIndex, FreeKey};
use crate::history::TraceAction;
use crate::peak::{CREDIT_MAX, Lease};
use crate::policy::{self, SizePolicy};
use crate::pool::PoolId;
use crate::stats::MemoryStats;

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
    /// ([`crate::phys_run`]).
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
/// 10. Paused (`pause` is set, see `pause.rs`): the pause lists each paused page once, in a vmm
///     segment, unmapped, with its own stretch of the host backup if there is one; the quick
///     cache is empty and off; `reserved_paused_bytes` counts the listed pages. Not paused:
///     `reserved_paused_bytes` is 0.
/// 11. vmm page aliasing ([`crate::alias`]): every mapped slot is listed once under its
///     physical page; a physical page backs at most one occupied slot (live blocks over it, or
///     graph-retained); no two non-free blocks reach the same byte of a physical page through
///     any of its slots; `reserved_bytes` counts each physical page once.
/// 12. Physical runs ([`crate::phys_run`]): runs lie inside their reservation and do not
///     overlap; each slot of a run is mapped to its own tag, never an alias; no other slot holds
///     a tag.
#[derive(Debug)]
pub struct Shard {
    pub pool: PoolId,
    pub stream: StreamId,
    pub no_split: bool,
    pub(crate) blocks: BlockSlab,
    pub(crate) segments: IdSlab<Segment>,
    pub(crate) free_small: FreeIndex,
    pub(crate) free_large: FreeIndex,
    /// Cross-stream events that `PendingFree` blocks wait on, oldest first.
    pub(crate) pending: VecDeque<(EventHandle, BlockId)>,
    /// `PendingFree` blocks freed during a capture: their events are recorded after it ends.
    pub(crate) deferred: Vec<BlockId>,
    /// vmm: frees since the last recorded event belong to `epoch`; pages idle since an epoch below
    /// `safe_epoch` may be unmapped.
    pub(crate) epoch: u64,
    pub(crate) safe_epoch: u64,
    epoch_events: VecDeque<(u64, EventHandle)>,
    /// The live checkpoints' marks, oldest first (see `checkpoint.rs`).
    pub(crate) marks: Vec<Mark>,
    /// Buffers of restores.
    pub(crate) restore_scratch: RestoreScratch,
    /// Allocated (and cached) blocks by address: `free(ptr)` finds its block here, under the
    /// shard's lock.
    pub(crate) live: LiveMap,
    /// Segments added (true) or released (false) since the allocator last looked: (addr, size).
    pub(crate) seg_log: Vec<(DevicePtr, u64, bool)>,
    /// Bytes counted in the device-wide allocated counter beyond this shard's allocated bytes:
    /// freed here and kept for its next allocations, at most [`CREDIT_MAX`] (see
    /// [`crate::peak`]).
    pub(crate) peak_credit: i64,
    /// Freed bytes beyond the credit, still counted device-wide; other shards may take them back.
    pub(crate) lease: Arc<Lease>,
    /// Blocks freed on this stream and kept whole, most recent last: (size, block). A request of
    /// exactly a cached size takes one back without touching the free index, the slab or the
    /// vmm page counts, which is most of an alloc + free pair's cost. Anything that needs the
    /// cache merged (growth, releasing memory, a checkpoint) calls [`Shard::flush_quick`] first.
    pub(crate) quick: Vec<(u64, BlockId)>,
    /// No quick cache in this shard: it was created while a checkpoint of its pool was alive,
    /// so a restore may wipe it, and its plan knows only free and live blocks.
    pub(crate) quick_off: bool,
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
    pub(crate) retired: bool,
    /// The pool is pausable: every segment grows as vmm memory ([`crate::PoolOptions::pausable`]).
    pub(crate) pausable: bool,
    /// Set while the pool is paused: what the resume maps again (`pause.rs`).
    pub(crate) pause: Option<Box<crate::pause::ShardPause>>,
    /// The pinned host buffer of the last backup, kept for the next one (pinning memory costs
    /// far more than copying it); freed with the rest of the cache by `release_cached`.
    pub(crate) host_spare: Option<(crate::device::HostBuffer, u64)>,
    pub stats: MemoryStats,
}

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
            restore_scratch: RestoreScratch::default(),
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
    pub(crate) fn journaling(&self) -> bool {
        !self.marks.is_empty()
    }

    /// The free index of the small or the large pool.
    #[inline]
    pub(crate) fn index(&self, small: bool) -> &FreeIndex {
        if small {
            &self.free_small
        } else {
            &self.free_large
        }
    }

    #[inline]
    pub(crate) fn index_mut(&mut self, small: bool) -> &mut FreeIndex {
        if small {
            &mut self.free_small
        } else {
            &mut self.free_large
        }
    }

    pub(crate) fn is_inactive_split(&self, id: BlockId) -> bool {
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

    pub(crate) fn index_insert(&mut self, id: BlockId) {
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

    pub(crate) fn index_remove(&mut self, id: BlockId) {
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

    // ----------------------------------------------------------------------------------------
    // Allocation

    /// Serve `rounded` bytes (`requested` asked) from the cache or by growing. On error nothing
    /// changed.
    #[inline]
    pub fn alloc(
        &mut self,
        env: &Env<'_>,
        rounded: u64,
        requested: u64,
    ) -> Result<(BlockId, DevicePtr), ShardError> {
        // The quick cache's hit, inlined into the caller: the hot path returns in registers.
        if let Some(hit) = self.alloc_quick(env, rounded, requested) {
            return Ok(hit);
        }
        self.alloc_uncached(env, rounded, requested)
    }

    /// [`Shard::alloc`]'s quick-cache hit alone: `None`, with nothing changed, where it would
    /// take any other path.
    #[inline(always)]
    pub fn alloc_quick(
        &mut self,
        env: &Env<'_>,
        rounded: u64,
        requested: u64,
    ) -> Option<(BlockId, DevicePtr)> {
        if env.capture_underway || !self.pending.is_empty() || !self.deferred.is_empty() {
            return None;
        }
        self.quick_hit(env, rounded, requested)
    }

    /// Hand out the cached block of exactly `rounded` bytes, if the quick cache has one.
    #[inline]
    fn quick_hit(
        &mut self,
        env: &Env<'_>,
        rounded: u64,
        requested: u64,
    ) -> Option<(BlockId, DevicePtr)> {
        let i = self.quick.iter().rposition(|&(size, _)| size == rounded)?;
        let (_, id) = self.quick.swap_remove(i);
        self.quick_credit = (self.quick_credit + 2).min(QUICK_CREDIT_MAX);
        Some(self.take_cached(env, id, requested))
    }

    /// [`Shard::alloc`] past a quick-cache hit.
    #[inline(never)]
    fn alloc_uncached(
        &mut self,
        env: &Env<'_>,
        rounded: u64,
        requested: u64,
    ) -> Result<(BlockId, DevicePtr), ShardError> {
        if self.retired {
            return Err(ShardError::Retired);
        }
        // A paused shard's quick cache is empty and off (invariant 10): every request comes here.
        if self.pause.is_some() {
            return Err(ShardError::Paused);
        }
        if !env.capture_underway && (!self.pending.is_empty() || !self.deferred.is_empty()) {
            self.process_events(env);
        }
        if !self.quick.is_empty() && !env.capture_underway {
            if let Some(hit) = self.quick_hit(env, rounded, requested) {
                return Ok(hit);
            }
            self.quick_credit -= 1;
            // A miss merges the oldest cached block back: sizes that do not recur leave the
            // cache, so that best fit sees their memory again.
            let (_, id) = self.quick.remove(0);
            self.uncache(env, id);
        }
        let small = policy::is_small(rounded);
        self.free_searches += 1;
        let mut stale = false;
        if let Some(id) = self.find_free(env, rounded, small)
            && (self.quick.is_empty() || !self.needs_pages(env, id, rounded))
        {
            match self.take_block(env, id, rounded, requested) {
                Err(ShardError::StaleDuringCapture) => stale = true,
                r => return r,
            }
        }
        if !self.quick.is_empty() && !stale {
            // Physical growth only once nothing cached could serve: merge the cache back first.
            self.flush_quick(env);
            if let Some(id) = self.find_free(env, rounded, small) {
                match self.take_block(env, id, rounded, requested) {
                    Err(ShardError::StaleDuringCapture) => stale = true,
                    r => return r,
                }
            }
        }
        if let Some(threshold) = env.gc_threshold {
            self.collect_garbage(env, threshold);
        }
        // A best fit whose page slots need unmapping during a capture: a reservation of just
        // the request's pages serves it instead (released once it is empty and unmapped).
        let id = self.grow(env, rounded, small, stale)?;
        match self.take_block(env, id, rounded, requested) {
            Ok(r) => Ok(r),
            Err(e) => {
                // A fresh segment the request could not use (vmm pages refused): give it back.
                self.release_segment_if_unused(env, self.blocks[id].segment);
                Err(e)
            }
        }
    }

    fn find_free(&self, env: &Env<'_>, rounded: u64, small: bool) -> Option<BlockId> {
        let mut best: Option<FreeKey> = self.index(small).first_at_least(rounded);
        if env.growth == GrowthMode::Vmm || self.pausable {
            // Best fit over the index and the segments' free tails, in the index's order.
            for (_, seg) in self.segments.iter() {
                if let Some(t) = seg.free_tail
                    && seg.small == small
                {
                    let b = &self.blocks[t];
                    let key = (b.size, b.addr, t);
                    if b.size >= rounded && best.is_none_or(|k| key < k) {
                        best = Some(key);
                    }
                }
            }
        }
        let (size, _, id) = best?;
        if !self.vmm_for(env, small) && !env.policy.may_serve(size, rounded) {
            return None;
        }
        Some(id)
    }

    /// Whether this shard grows blocks of this size class by vmm pages: as the device's
    /// [`Env::vmm_for`] says, and always in a pausable pool.
    #[inline]
    fn vmm_for(&self, env: &Env<'_>, small: bool) -> bool {
        self.pausable || env.vmm_for(small)
    }

    /// Add a segment big enough for `rounded` bytes; returns its one free block.
    fn grow(
        &mut self,
        env: &Env<'_>,
        rounded: u64,
        small: bool,
        exact: bool,
    ) -> Result<BlockId, ShardError> {
        let growth = if self.vmm_for(env, small) {
            GrowthMode::Vmm
        } else {
            GrowthMode::Classic
        };
        let (addr, size, kind) = match growth {
            GrowthMode::Classic => {
                let size = env.policy.segment_size(rounded);
                if !env.pool_budget.try_claim(size) {
                    return Err(ShardError::OutOfMemory);
                }
                if !env.budget.try_claim(size) {
                    env.pool_budget.release(size);
                    return Err(ShardError::OutOfMemory);
                }
                let addr = env.dev.alloc_segment(size).inspect_err(|_| {
                    env.budget.release(size);
                    env.pool_budget.release(size);
                })?;
                self.stats.reserved_bytes.inc(small, size as i64);
                self.stats.num_device_alloc += 1;
                env.trace
                    .record(TraceAction::SegmentAlloc, addr, size, self.stream);
                if env.policy.is_oversize(size) {
                    self.stats.oversize_segments.update(1);
                }
                (addr, size, SegmentKind::Classic)
            }
            GrowthMode::Vmm => {
                let ps = env.page_size();
                let want = if exact {
                    rounded
                } else {
                    env.vmm_reservation.max(rounded)
                };
                let size = want.div_ceil(ps) * ps;
                let addr = env.dev.reserve(size)?;
                (addr, size, SegmentKind::Vmm(PageTable::default()))
            }
        };
        self.stats.segment.inc(small, 1);
        let seg = self.segments.insert(Segment {
            addr,
            size,
            small,
            first: usize::MAX,
            kind,
            retained: false,
            free_tail: None,
            freed_at: self.free_searches,
        });
        let id = self.blocks.insert(Block::free(addr, size, seg, None, None));
        self.segments[seg].first = id;
        self.seg_log.push((addr, size, true));
        self.index_insert(id);
        tracing::debug!(pool = ?self.pool, stream = self.stream, addr, size, "segment added");
        Ok(id)
    }

    fn take_block(
        &mut self,
        env: &Env<'_>,
        id: BlockId,
        rounded: u64,
        requested: u64,
    ) -> Result<(BlockId, DevicePtr), ShardError> {
        // Each look at the slab is two pointers deep: read what is needed once.
        let (addr, size, seg, next) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.segment, b.next())
        };
        let (small, vmm) = {
            let s = &self.segments[seg];
            (s.small, s.is_vmm())
        };
        self.index_remove(id);
        if vmm && let Err(e) = self.map_range(env, seg, addr, rounded, true) {
            self.index_insert(id);
            return Err(e);
        }
        let split = (vmm || !self.no_split) && env.policy.should_split(size, rounded, small, vmm);
        let rest = split.then(|| {
            let rest = self.blocks.insert(Block::free(
                addr + rounded,
                size - rounded,
                seg,
                Some(id),
                next,
            ));
            if let Some(n) = next {
                self.blocks[n].set_prev(Some(rest));
            }
            rest
        });
        let b = &mut self.blocks[id];
        if let Some(rest) = rest {
            b.set_next(Some(rest));
            b.size = rounded;
        }
        b.state = BlockState::Allocated;
        b.requested = requested;
        let size = b.size;
        if let Some(rest) = rest {
            self.index_insert(rest);
        }
        env.trace
            .record(TraceAction::Alloc, addr, requested, self.stream);
        self.live.insert(LiveEntry::new(addr, size, id, seg));
        if vmm {
            self.pages_live(env, seg, addr, size, 1);
        }
        if env.capture_underway {
            // The graph being captured will touch this range on every replay.
            self.retain_range(env, seg, addr, size);
        }
        self.count_handed_out(env, small, vmm, size, requested);
        Ok((id, addr))
    }

    /// Statistics of a block of `size` bytes (`requested` asked) handed to the user. Inlined
    /// into the quick cache's hit, where a call's register saves were a tenth of its cost.
    #[inline(always)]
    fn count_handed_out(
        &mut self,
        env: &Env<'_>,
        small: bool,
        vmm: bool,
        size: u64,
        requested: u64,
    ) {
        self.count_allocated(env, size as i64);
        let st = &mut self.stats;
        st.allocation.inc(small, 1);
        st.allocated_bytes.inc(small, size as i64);
        st.active.inc(small, 1);
        st.active_bytes.inc(small, size as i64);
        st.requested_bytes.inc(small, requested as i64);
        if !vmm && env.policy.is_oversize(size) {
            st.oversize_allocations.update(1);
        }
    }

    // ----------------------------------------------------------------------------------------
    // Freeing

    /// The user frees block `id`. It becomes free at once unless other streams used it.
    pub fn free(&mut self, env: &Env<'_>, ptr: DevicePtr) -> Result<(), ShardError> {
        // One look at the block and one at its segment: this is half of every pair.
        let id = self
            .live
            .get(ptr)
            .ok_or(ShardError::UnknownPointer)?
            .block();
        let b = self.blocks.hot(id);
        if b.state != BlockState::Allocated {
            return Err(ShardError::UnknownPointer);
        }
        let (size, requested, seg, uses_empty) =
            (b.size, b.requested, b.segment, b.stream_uses.is_empty());
        let (small, vmm) = {
            let s = &self.segments[seg];
            (s.small, s.is_vmm())
        };
        self.stats.allocation.dec(small, 1);
        self.stats.allocated_bytes.dec(small, size as i64);
        self.count_allocated(env, -(size as i64));
        env.trace
            .record(TraceAction::FreeRequested, ptr, requested, self.stream);
        if !vmm && env.policy.is_oversize(size) {
            self.stats.oversize_allocations.update(-1);
        }
        if uses_empty {
            if self.quick_credit <= 0 {
                self.quick_credit -= 1;
                if self.quick_credit <= -QUICK_PROBE_EVERY {
                    self.quick_credit = 1;
                }
            }
            if self.quick_credit > 0
                && self.quick.len() < QUICK_MAX
                && policy::is_small(size)
                && !self.quick_off
                && !env.capture_underway
                && !self.journaling()
            {
                self.cache_block(env, id, small, vmm);
            } else {
                self.live.remove(ptr);
                self.free_block(env, id);
            }
            return Ok(());
        }
        self.live.remove(ptr);
        self.blocks[id].state = BlockState::PendingFree;
        if env.capture_underway {
            self.deferred.push(id);
        } else {
            self.insert_events(env, id);
        }
        Ok(())
    }

    /// Note that `stream` uses block `id` (`record_stream`); the own stream is ignored.
    pub fn record_stream(&mut self, ptr: DevicePtr, stream: StreamId) -> Result<(), ShardError> {
        let id = self.lookup(ptr).ok_or(ShardError::UnknownPointer)?;
        if stream == self.stream {
            return Ok(());
        }
        let b = &self.blocks[id];
        if !b.stream_uses.contains(&stream) {
            self.blocks[id].stream_uses.push(stream);
        }
        Ok(())
    }

    /// Record one event per stream that used the block; the block is free once all complete. If
    /// an event cannot be had, fall back to deferring (retried later) rather than reuse early.
    fn insert_events(&mut self, env: &Env<'_>, id: BlockId) {
        let uses = self.blocks[id].stream_uses.take();
        let mut recorded = 0;
        let mut failed = Vec::new();
        for &s in &uses {
            let ev = match env.events.get(env.dev) {
                Ok(ev) => ev,
                Err(_) => {
                    failed.push(s);
                    continue;
                }
            };
            if env.dev.record_event(ev, s).is_err() {
                env.events.put(ev);
                failed.push(s);
                continue;
            }
            self.pending.push_back((ev, id));
            recorded += 1;
        }
        let b = &mut self.blocks[id];
        b.pending_events += recorded;
        if !failed.is_empty() {
            b.stream_uses = StreamUses::from_slice(&failed);
            self.deferred.push(id);
        }
    }

    /// Retire completed cross-stream events and record those deferred by a capture.
    pub fn process_events(&mut self, env: &Env<'_>) {
        if env.capture_underway {
            return;
        }
        for id in std::mem::take(&mut self.deferred) {
            self.insert_events(env, id);
        }
        let mut i = 0;
        while i < self.pending.len() {
            let (ev, id) = self.pending[i];
            match env.dev.query_event(ev) {
                Ok(true) => {
                    self.pending.remove(i);
                    env.events.put(ev);
                    let b = &mut self.blocks[id];
                    b.pending_events -= 1;
                    if b.pending_events == 0 && !self.deferred.contains(&id) {
                        self.free_block(env, id);
                    }
                }
                _ => i += 1,
            }
        }
    }

    /// Wait for every cross-stream event (PyTorch's `synchronize_and_free_events`).
    pub fn synchronize_events(&mut self, env: &Env<'_>) {
        if env.capture_underway {
            return;
        }
        for id in std::mem::take(&mut self.deferred) {
            self.insert_events(env, id);
        }
        while let Some((ev, id)) = self.pending.pop_front() {
            if env.dev.synchronize_event(ev).is_err() {
                // Keep the block pending; it is retried on the next call.
                self.pending.push_front((ev, id));
                break;
            }
            env.events.put(ev);
            let b = &mut self.blocks[id];
            b.pending_events -= 1;
            if b.pending_events == 0 && !self.deferred.contains(&id) {
                self.free_block(env, id);
            }
        }
        self.stats.num_sync_all_streams += 1;
    }

    /// A block returns to the free index, merging with free neighbours.
    fn free_block(&mut self, env: &Env<'_>, id: BlockId) {
        let (addr, size, requested, seg) = {
            let b = &mut self.blocks[id];
            b.state = BlockState::Free;
            b.stream_uses.clear();
            let r = (b.addr, b.size, b.requested, b.segment);
            b.requested = 0;
            r
        };
        let small = self.segments[seg].small;
        env.trace
            .record(TraceAction::FreeCompleted, addr, requested, self.stream);
        let st = &mut self.stats;
        st.active.dec(small, 1);
        st.active_bytes.dec(small, size as i64);
        st.requested_bytes.dec(small, requested as i64);
        self.merge_free(env, id);
    }

    /// Return block `id`, already `Free` and out of every statistic of live memory, to its
    /// pages' idle counts and the free index, merged with its free neighbours.
    fn merge_free(&mut self, env: &Env<'_>, id: BlockId) {
        // Each look at the slab is two pointers deep: read the block and its neighbours once.
        let (addr, size, seg, prev, next) = {
            let b = &self.blocks[id];
            (b.addr, b.size, b.segment, b.prev(), b.next())
        };
        if self.segments[seg].is_vmm() {
            self.pages_live(env, seg, addr, size, -1);
        }
        let mut id = id;
        // The merged block's neighbours: merging into `prev` keeps `next` next.
        let (mut first_prev, mut last_next) = (prev, next);
        if let Some(p) = prev {
            let b = &self.blocks[p];
            if b.state == BlockState::Free {
                first_prev = b.prev();
                self.index_remove(p);
                id = self.merge_into_prev(p, id);
            }
        }
        if let Some(n) = next {
            let b = &self.blocks[n];
            if b.state == BlockState::Free {
                last_next = b.next();
                self.index_remove(n);
                id = self.merge_into_prev(id, n);
            }
        }
        self.index_insert(id);
        if first_prev.is_none() && last_next.is_none() {
            self.segments[seg].freed_at = self.free_searches;
        }
    }

    // ----------------------------------------------------------------------------------------
    // The quick cache (invariant 9)

    /// The user freed block `id` (no other stream used it, its segment is `small` / `vmm`):
    /// keep it whole in the quick cache.
    #[inline(always)]
    fn cache_block(&mut self, env: &Env<'_>, id: BlockId, small: bool, vmm: bool) {
        let (addr, size, requested, split) = {
            let b = self.blocks.hot_mut(id);
            b.state = BlockState::Cached;
            let r = (b.addr, b.size, b.requested, b.is_split());
            b.requested = 0;
            r
        };
        env.trace
            .record(TraceAction::FreeCompleted, addr, requested, self.stream);
        let st = &mut self.stats;
        st.active.dec(small, 1);
        st.active_bytes.dec(small, size as i64);
        st.requested_bytes.dec(small, requested as i64);
        // `is_inactive_split`, from what is at hand.
        if !vmm && split {
            st.inactive_split.inc(small, 1);
            st.inactive_split_bytes.inc(small, size as i64);
        }
        self.quick.push((size, id));
    }

    /// Hand out cached block `id` again, for `requested` bytes.
    #[inline(always)]
    fn take_cached(&mut self, env: &Env<'_>, id: BlockId, requested: u64) -> (BlockId, DevicePtr) {
        let (addr, size, seg, split) = {
            let b = self.blocks.hot_mut(id);
            debug_assert_eq!(b.state, BlockState::Cached);
            b.state = BlockState::Allocated;
            b.requested = requested;
            (b.addr, b.size, b.segment, b.is_split())
        };
        let (small, vmm) = {
            let s = &self.segments[seg];
            (s.small, s.is_vmm())
        };
        env.trace
            .record(TraceAction::Alloc, addr, requested, self.stream);
        // `is_inactive_split`, from what is at hand.
        if !vmm && split {
            self.stats.inactive_split.dec(small, 1);
            self.stats.inactive_split_bytes.dec(small, size as i64);
        }
        self.count_handed_out(env, small, vmm, size, requested);
        (id, addr)
    }

    /// Merge every cached block back into the free index, as a plain free would have.
    pub(crate) fn flush_quick(&mut self, env: &Env<'_>) {
        for (_, id) in std::mem::take(&mut self.quick) {
            self.uncache(env, id);
        }
    }

    /// Merge cached block `id`, already out of the quick cache, back into the free index.
    fn uncache(&mut self, env: &Env<'_>, id: BlockId) {
        self.live.remove(self.blocks[id].addr);
        if self.is_inactive_split(id) {
            let (small, size) = (
                self.segments[self.blocks[id].segment].small,
                self.blocks[id].size,
            );
            self.stats.inactive_split.dec(small, 1);
            self.stats.inactive_split_bytes.dec(small, size as i64);
        }
        self.blocks[id].state = BlockState::Free;
        self.merge_free(env, id);
    }

    /// Whether serving `rounded` bytes from free block `id` would map pages (physical growth).
    fn needs_pages(&self, env: &Env<'_>, id: BlockId, rounded: u64) -> bool {
        let b = &self.blocks[id];
        let seg = &self.segments[b.segment];
        if !seg.is_vmm() {
            return false;
        }
        let (first, end) = Self::page_range(env.page_size(), seg.addr, b.addr, rounded);
        !self.slots_ready(b.segment, first, end)
    }

    /// Merge block `b` into its predecessor `a`; returns `a`.
    fn merge_into_prev(&mut self, a: BlockId, b: BlockId) -> BlockId {
        let gone = self.blocks.remove(b);
        let blk = &mut self.blocks[a];
        blk.size += gone.size;
        blk.set_next(gone.next());
        if let Some(n) = gone.next() {
            self.blocks[n].set_prev(Some(a));
        }
        a
    }

    // ----------------------------------------------------------------------------------------
    // vmm pages

    pub(crate) fn page_range(ps: u64, seg_addr: u64, addr: u64, size: u64) -> (usize, usize) {
        let first = ((addr - seg_addr) / ps) as usize;
        let end = (addr + size - seg_addr).div_ceil(ps) as usize;
        (first, end)
    }

    /// Adjust the live counts of the pages under [addr, addr+size); pages that fall idle remember
    /// the current epoch.
    pub(crate) fn pages_live(
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
    pub(crate) fn slots_ready(&self, seg: SegmentId, first: usize, end: usize) -> bool {
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
    pub(crate) fn map_slots(
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
    fn advance_epoch(&mut self, env: &Env<'_>) -> bool {
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

    // ----------------------------------------------------------------------------------------
    // Releasing cached memory

    /// PyTorch's `garbage_collection_threshold`, before growth: when a limit is set and the device
    /// holds more than `threshold` of it, release whole free classic segments of the large pool
    /// whose age (free-index searches since they became free) is at least the average, and
    /// again over those left, until the excess is reclaimed or none goes. Only the default pool
    /// collects, as PyTorch's large blocks are its own; vmm memory is left to the page slack
    /// (PyTorch skips expandable segments too); nothing is released during a capture.
    fn collect_garbage(&mut self, env: &Env<'_>, threshold: f64) {
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
    /// `keep_retained`: the pool is in use, so graph-retained memory stays (see [`PageTable`]).
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

    /// Report `delta` allocated bytes to the device-wide counter ([`crate::peak::PeakCounter`])
    /// through this shard's credit and lease: small pairs stay within the credit, large ones
    /// within the lease, and only growth beyond what the shard freed reaches the shared counter.
    #[inline]
    pub(crate) fn count_allocated(&mut self, env: &Env<'_>, delta: i64) {
        self.peak_credit -= delta;
        if !(0..=CREDIT_MAX).contains(&self.peak_credit) {
            self.rebalance_credit(env);
        }
    }

    /// The credit left its range: over it, everything goes to the lease (where another shard
    /// reaching a peak can take it back); under it, the lease pays first (what is left of it
    /// refills the credit), then the counter.
    #[inline(never)]
    fn rebalance_credit(&mut self, env: &Env<'_>) {
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
            env.allocated.add(need - got);
        }
    }

    /// Hand the credit back (peaks are being reset, or the shard is dropped). The lease goes back
    /// through the counter itself ([`crate::peak::PeakCounter::reset_peak`], `end_lease`).
    pub(crate) fn settle_credit(&mut self, env: &Env<'_>) {
        env.allocated.add(-self.peak_credit);
        self.peak_credit = 0;
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
    fn release_segment_if_unused(&mut self, env: &Env<'_>, seg: SegmentId) -> Option<u64> {
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

    // ----------------------------------------------------------------------------------------
    // Invariants

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
