//! Freeing: blocks back to the free indexes, merged with free neighbours; cross-stream uses wait on events.

use crate::block::{BlockId, BlockState, StreamUses};
use crate::device::{DevicePtr, StreamId};
use crate::env::Env;
use crate::history::TraceAction;
use crate::policy::{self};

use super::{QUICK_MAX, QUICK_PROBE_EVERY, Shard, ShardError};

impl Shard {
    /// The user frees block `id`. It becomes free at once unless other streams used it.
    pub fn free(&mut self, env: &Env<'_>, ptr: DevicePtr) -> Result<(), ShardError> {
        // One look at the block and one at its segment: this is half of every pair.
        let id = self
            .live
            .get(ptr)
            .ok_or(ShardError::UnknownPointer)?
            .block();
        let journaling = self.journaling();
        // For a change: every free changes the block's state (a refused one may log its page
        // unchanged, which changes nothing).
        let b = self.blocks.hot_mut(id);
        if b.state != BlockState::Allocated {
            return Err(ShardError::UnknownPointer);
        }
        let (size, requested, seg, uses_empty, split) = (
            b.size,
            b.requested,
            b.segment,
            b.stream_uses.is_empty(),
            b.is_split(),
        );
        // Whether the block goes to the quick cache (freed on its own stream alone, small, the
        // cache on and room in it, no capture and no checkpoint), decided while the block is at
        // hand: it is marked cached here, and `cache_block` does the rest without a second look.
        let cache = uses_empty && {
            if self.quick_credit <= 0 {
                self.quick_credit -= 1;
                if self.quick_credit <= -QUICK_PROBE_EVERY {
                    self.quick_credit = 1;
                }
            }
            self.quick_credit > 0
                && self.quick.len() < QUICK_MAX
                && policy::is_small(size)
                && !self.quick_off
                && !env.capture_underway
                && !journaling
        };
        if cache {
            b.state = BlockState::Cached;
            b.requested = 0;
        }
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
        if cache {
            self.cache_block(env, (id, ptr, size, requested), split, small, vmm);
            return Ok(());
        }
        if uses_empty {
            self.live.remove(ptr);
            self.free_block(env, id);
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
    pub(super) fn merge_free(&mut self, env: &Env<'_>, id: BlockId) {
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
}
