//! Peer access: other devices reading and writing this device's memory.
//!
//! `cudaDeviceEnablePeerAccess` opens `cudaMalloc` memory (classic segments) to a peer, but not
//! memory mapped with `cuMemMap`: each mapping lists the devices that may access it. So a peer is
//! added to the backend's access list (pages mapped from then on include it) and then every page
//! mapped already is given the same access, as PyTorch's expandable segments do.

use crate::allocator::Allocator;
use crate::device::Device;
use crate::error::AllocResult;
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
