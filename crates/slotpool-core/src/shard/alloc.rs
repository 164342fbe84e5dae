//! Allocation past the quick cache: best fit in the free indexes, splitting, growth.

use crate::live_map::LiveEntry;

use crate::block::{Block, BlockId, BlockState, PageTable, Segment, SegmentKind};
use crate::config::GrowthMode;
use crate::device::DevicePtr;
use crate::env::Env;
use crate::free_index::FreeKey;
use crate::history::TraceAction;
use crate::policy::{self};

use super::{Shard, ShardError};

impl Shard {
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
    pub(super) fn count_handed_out(
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
}
