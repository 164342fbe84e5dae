//! Lock helpers. Lock order (never take a lock listed earlier while holding a later one):
//!
//! 1. `Allocator::reclaim` (OOM, `empty_cache`, checkpoint, restore, pause and resume paths)
//! 2. `Allocator::arenas`, then `Allocator::pools`, then `Allocator::routes`, then
//!    `Allocator::shards`
//! 3. one shard (never two at once, except checkpoint, restore, pause and resume, which lock a
//!    pool's shards in stream order while holding `reclaim`; pause and resume hold `pools` and
//!    `shards` meanwhile, so that no shard of the pool is created under them)
//! 4. `Allocator::segments` (the segment registry; written under a shard's lock)
//! 5. `PagePool` / `EventPool` / the lease list of `PeakCounter` (leaf locks)

use std::sync::{Mutex, MutexGuard};

/// The lock of one shard: taken twice by every alloc + free pair, almost never contended (one
/// shard per pool and stream). A spin lock that yields its time slice while it waits: unlocking
/// is one release store, where `std::sync::Mutex` needs an atomic swap to learn whether to wake a
/// waiter; the two read-modify-writes saved are about a tenth of a cached pair.
pub type ShardMutex<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;
/// A locked shard.
pub type ShardGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

/// What [`lock`] locks.
pub trait Lock {
    type Guard<'a>
    where
        Self: 'a;
    fn acquire(&self) -> Self::Guard<'_>;
}

impl<T> Lock for Mutex<T> {
    type Guard<'a>
        = MutexGuard<'a, T>
    where
        T: 'a;

    /// Ignores poisoning: every state machine here is consistent between calls (a panic inside
    /// one is a bug the invariant checker reports), so a poisoned lock carries no information
    /// worth a second panic.
    fn acquire(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T> Lock for ShardMutex<T> {
    type Guard<'a>
        = ShardGuard<'a, T>
    where
        T: 'a;

    #[inline]
    fn acquire(&self) -> ShardGuard<'_, T> {
        self.lock()
    }
}

/// Lock `m` (a `std` mutex or a shard's spin lock). Inlined: taken twice by every pair (a
/// larger shard once left it out of line, a call per lock).
#[inline]
pub fn lock<L: Lock>(m: &L) -> L::Guard<'_> {
    m.acquire()
}
