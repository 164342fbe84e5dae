//! Reading what a pool holds and restoring a checkpoint to the pool it names: the typed readers
//! and the self-describing restore of the C ABI (`sp_pool_live_allocations`,
//! `sp_checkpoint_restore`).

use crate::block::BlockState;
use crate::checkpoint::{Checkpoint, RestoreDelta};
use crate::device::{Device, DevicePtr, StreamId};
use crate::error::{AllocError, AllocResult};
use crate::pool::PoolId;
use crate::sync::lock;

use super::Allocator;

/// One live allocation of a pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LiveAllocation {
    pub addr: DevicePtr,
    /// The block's (rounded) size.
    pub size: u64,
    /// The size asked for.
    pub requested: u64,
    /// The stream it was allocated on.
    pub stream: StreamId,
}

impl<D: Device> Allocator<D> {
    /// Live allocations of `pool` with their sizes and streams, lowest address first. Costs
    /// O(blocks of the pool).
    pub fn live_allocation_list(&self, pool: PoolId) -> AllocResult<Vec<LiveAllocation>> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
        }
        let mut out = Vec::new();
        for cell in self.pool_shards(pool) {
            let s = lock(&cell.shard);
            for (sid, _) in s.segments() {
                out.extend(
                    s.segment_blocks(sid)
                        .filter(|(_, b)| b.state == BlockState::Allocated)
                        .map(|(_, b)| LiveAllocation {
                            addr: b.addr,
                            size: b.size,
                            requested: b.requested,
                            stream: s.stream(),
                        }),
                );
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// [`Allocator::restore`] of the pool `checkpoint` was taken of: the checkpoint says which
    /// pool, and the restore checks once that it belongs to this allocator. The delta is built
    /// in `buffers`' lists (cleared first, their capacity kept): a caller that restores often
    /// hands the last delta back, and a restore of thousands of blocks then allocates, and
    /// page-faults, nothing for its delta.
    pub fn restore_checkpoint(
        &self,
        checkpoint: &Checkpoint,
        keep_live: &[DevicePtr],
        buffers: RestoreDelta,
    ) -> AllocResult<RestoreDelta> {
        self.restore_into(checkpoint.pool(), checkpoint, keep_live, buffers)
    }
}
