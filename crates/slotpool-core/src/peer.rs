//! Peer access: other devices reading and writing this device's memory.
//!
//! `cudaDeviceEnablePeerAccess` opens `cudaMalloc` memory (classic segments) to a peer, but not
//! memory mapped with `cuMemMap`: each mapping lists the devices that may access it. So a peer is
//! added to the backend's access list (pages mapped from then on include it) and then every page
//! mapped already is given the same access, as PyTorch's expandable segments do.

use crate::allocator::Allocator;
use crate::block::SegmentKind;
use crate::device::{Device, DevicePtr};
use crate::error::AllocResult;
use crate::shard::Shard;
use crate::sync::lock;

impl<D: Device> Allocator<D> {
    /// Give device `peer` access to this device's vmm pages, mapped now and later. Pages are
    /// mapped and unmapped under their shard's lock (or the arenas' lock), which each pass holds,
    /// and the peer joins the access list before the passes: no page misses it.
    pub fn enable_peer_access(&self, peer: i32) -> AllocResult<()> {
        self.dev.add_peer(peer)?;
        for cell in self.all_shards().values() {
            let s = lock(&cell.shard);
            for (addr, size) in s.mapped_runs(self.shared.page_size) {
                self.dev.refresh_access(addr, size)?;
            }
        }
        self.refresh_arena_access()?;
        Ok(())
    }
}

impl Shard {
    /// The runs of consecutive mapped pages of this shard's vmm segments: (address, bytes).
    pub(crate) fn mapped_runs(&self, page_size: u64) -> Vec<(DevicePtr, u64)> {
        let mut runs = Vec::new();
        for (_, seg) in self.segments() {
            let SegmentKind::Vmm(pt) = &seg.kind else {
                continue;
            };
            let mut first = 0u64;
            for run in pt.handle.chunk_by(|a, b| a.is_some() == b.is_some()) {
                let len = run.len() as u64;
                if run[0].is_some() {
                    runs.push((seg.addr + first * page_size, len * page_size));
                }
                first += len;
            }
        }
        runs
    }
}
