//! What [`crate::Allocator::snapshot`] reports: segments and their blocks, as PyTorch's
//! `memory_snapshot()` lists them.

use crate::block::BlockState;
use crate::device::{DevicePtr, StreamId};
use crate::pool::PoolId;

/// One block of a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BlockSnapshot {
    pub addr: DevicePtr,
    /// Rounded size (clipped to the segment's mapped run for vmm free blocks).
    pub size: u64,
    /// Size the user asked for (0 when free).
    pub requested: u64,
    pub state: BlockState,
}

/// One segment as [`crate::Allocator::snapshot`] reports it: a classic segment, or one contiguous mapped
/// run of a vmm reservation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentSnapshot {
    pub pool: PoolId,
    pub stream: StreamId,
    pub addr: DevicePtr,
    pub size: u64,
    /// Serves small (<= 1 MiB) requests.
    pub small: bool,
    /// Part of a vmm reservation (PyTorch's `is_expandable`).
    pub vmm: bool,
    /// Its pool is paused: the run's pages are given back and mapped again by the resume.
    pub paused: bool,
    /// Blocks in address order, tiling `[addr, addr + size)`.
    pub blocks: Vec<BlockSnapshot>,
}
