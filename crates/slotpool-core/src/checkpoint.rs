//! Transactional checkpoint / restore of a pool.
//!
//! A checkpoint costs O(segments) per shard of the pool: it places a *mark* in each shard, in
//! each of the structures that hold its state. Those structures keep themselves in pages that
//! journal themselves (`paged.rs`): while a mark is open, the first change to a page in a
//! window moves the page into a log and carries on in a copy. The block slab
//! (`block_slab.rs`), the live map (`live_map.rs`) and the free indexes are such
//! structures; a mark also keeps each segment's first block and free tail, and the block
//! statistics' current values. A restore moves the logged pages back, a pointer each, so it costs
//! the pages changed since the checkpoint, not the blocks the pool holds. While a mark is alive
//! segments are never released (so the checkpointed topology always exists).
//!
//! A restore is a transaction: it first plans every shard (what it frees and re-creates, read
//! from the live map's logged pages) and validates the caller's `keep_live` set against the
//! plan; any mismatch fails with a [`RestoreDiff`] and changes nothing. A restore to a
//! checkpoint with later checkpoints alive is logged like any change, so every live checkpoint
//! stays restorable, in any order (CUDA graph trees switch paths back and forth).

use std::sync::{Arc, Weak};

use crate::device::{DevicePtr, StreamId};
use crate::pool::PoolId;

pub use crate::error::RestoreDiff;

/// Keeps a checkpoint's marks alive; shards hold weak references to it.
#[derive(Debug)]
pub struct CheckpointToken {
    pub(crate) id: u64,
}

/// What holds a checkpoint's marks: a shard, behind its lock. A dropped [`Checkpoint`] has its
/// shards forget its mark at once.
pub(crate) trait MarkHolder: Send + Sync {
    /// Forget the mark of checkpoint `token` (locks the shard).
    fn forget_mark(&self, token: u64);
}

/// A pool's state at one moment: segments, how they are split, and which blocks are live.
/// Dropping it ends the logging it needs: its shards forget its mark at once (each locked in
/// turn, so it must not be dropped while one of its pool's shards is locked).
#[derive(Debug)]
pub struct Checkpoint {
    pub(crate) allocator: u64,
    pub(crate) pool: PoolId,
    /// The shards marked: (stream, shard).
    pub(crate) marks: Vec<(StreamId, Weak<dyn MarkHolder>)>,
    pub(crate) token: Arc<CheckpointToken>,
    /// Blocks live when it was taken.
    pub live_blocks: usize,
}

impl Checkpoint {
    /// The pool it belongs to.
    pub fn pool(&self) -> PoolId {
        self.pool
    }
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        // Without this, a shard would log every change (and keep its quick cache off) until
        // its next checkpoint, restore or cache release noticed the mark was dead.
        for (_, shard) in &self.marks {
            if let Some(cell) = shard.upgrade() {
                cell.forget_mark(self.token.id);
            }
        }
    }
}

/// What a restore did. Its lists are in no particular order (a restore reads them from the
/// changes it logged, and ordering ten thousand of them cost a third of the restore).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDelta {
    /// Allocations live before the restore that it freed: (address, size).
    pub freed: Vec<(DevicePtr, u64)>,
    /// Allocations of the checkpoint that were not live and that the restore re-created; the
    /// caller owns them: (address, size).
    pub created: Vec<(DevicePtr, u64)>,
}

/// Entries a restore's buffer keeps room for from one restore to the next: a restore of more
/// changes gives its buffers back (a million changes grow them to tens of MB).
pub(crate) const RESTORE_BUFFER_KEEP: usize = 1 << 20;

impl RestoreDelta {
    /// Both lists by address, for a caller that wants them so.
    pub fn sort_by_address(&mut self) {
        self.freed.sort_unstable();
        self.created.sort_unstable();
    }

    /// Whether its lists are small enough to keep for a later restore to fill
    /// ([`crate::Allocator::restore_checkpoint`]): room for at most a million entries each.
    pub fn worth_keeping(&self) -> bool {
        self.freed.capacity().max(self.created.capacity()) <= RESTORE_BUFFER_KEEP
    }
}
