//! The segment registry: every segment's address range and its shard, to find the shard of a pointer that the calling thread's cached shard does not own. Written only when segments come and go.

use crate::device::{Device, DevicePtr};
use crate::shard::Shard;
pub(crate) use crate::shard::ShardRef;
use crate::sync::lock;
use std::sync::Arc;

use super::Allocator;
use super::thread_cache::with_cached_shard;

impl<D: Device> Allocator<D> {
    /// Bring the segment registry up to date with a shard's changes (called under its lock).
    #[inline]
    pub(super) fn register_segments(&self, cell: &ShardRef, s: &mut Shard) {
        if s.segments_changed() {
            self.register_segments_now(cell, s);
        }
    }

    #[cold]
    fn register_segments_now(&self, cell: &ShardRef, s: &mut Shard) {
        let mut reg = self.segments.write();
        for (addr, size, added) in s.take_segment_changes() {
            if added {
                reg.insert(addr, (addr + size, Arc::downgrade(cell)));
            } else {
                reg.remove(&addr);
            }
        }
    }

    /// Run `f` on the shard that holds the allocation at `ptr`, locked; `None` if no shard does.
    /// The calling thread's cached shard is tried first, then the segment registry.
    pub(super) fn with_owner<R>(
        &self,
        ptr: DevicePtr,
        mut f: impl FnMut(&ShardRef, &mut Shard) -> R,
    ) -> Option<R> {
        let fast = with_cached_shard!(self, |cell| {
            let mut s = lock(&cell.shard);
            s.lookup(ptr)?;
            Some(f(cell, &mut s))
        });
        if fast.is_some() {
            return fast;
        }
        self.with_registered_owner(ptr, f)
    }

    /// [`Allocator::with_owner`] through the segment registry alone.
    pub(super) fn with_registered_owner<R>(
        &self,
        ptr: DevicePtr,
        mut f: impl FnMut(&ShardRef, &mut Shard) -> R,
    ) -> Option<R> {
        let cell = {
            let reg = self.segments.read();
            let (_, (end, owner)) = reg.range(..=ptr).next_back()?;
            if ptr >= *end {
                return None;
            }
            owner.upgrade()?
        };
        let mut s = lock(&cell.shard);
        s.lookup(ptr)?;
        Some(f(&cell, &mut s))
    }
}
