//! The quick cache (shard invariant 9): blocks freed on the shard's stream and kept whole, handed out again to a request of exactly their size.

use crate::block::{BlockId, BlockState};
use crate::device::DevicePtr;
use crate::env::Env;
use crate::history::TraceAction;

use super::{QUICK_CREDIT_MAX, Shard};

impl Shard {
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
    #[inline(always)]
    pub(super) fn quick_hit(
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

    /// The user freed block `id` at `addr`, of `size` bytes for `requested` (no other stream
    /// used it; `split`: it has neighbours; its segment is `small` / `vmm`), and
    /// [`Shard::free`] marked it cached: keep it whole in the quick cache.
    #[inline(always)]
    pub(super) fn cache_block(
        &mut self,
        env: &Env<'_>,
        (id, addr, size, requested): (BlockId, DevicePtr, u64, u64),
        split: bool,
        small: bool,
        vmm: bool,
    ) {
        debug_assert_eq!(self.blocks[id].state, BlockState::Cached);
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
    pub(super) fn uncache(&mut self, env: &Env<'_>, id: BlockId) {
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
}
