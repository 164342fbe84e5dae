//! Locks. The lock order (a thread takes a lock only while every lock it holds is listed
//! earlier) is code: each lock has a rank in [`rank`], checked where checks are on (see there).
//!
//! 1. `Allocator::reclaim` (OOM, `empty_cache`, checkpoint, restore, pause and resume paths)
//! 2. `Allocator::arenas`, then `Allocator::pools`, then `Allocator::routes`, then
//!    `Allocator::shards`
//! 3. one shard (never two at once, except checkpoint, restore, pause and resume, which lock a
//!    pool's shards in stream order while holding `reclaim`; pause and resume hold `pools` and
//!    `shards` meanwhile, so that no shard of the pool is created under them)
//! 4. `Allocator::segments` (the segment registry; written under a shard's lock)
//! 5. `PagePool` / `EventPool` / the lease list of `PeakCounter` / the trace ring (leaf locks:
//!    nothing is taken under them; plain `std` mutexes, not ranked)
//!
//! A shard leaves `Allocator::shards` only under `reclaim`, the table's lock and its own, and is
//! marked retired there; allocation checks the mark under the shard's lock (see
//! `Allocator::drop_empty_shards`; modelled in `tests/loom_shards.rs`).

pub mod rank;

use rank::{LockKey, LockRank};

/// Whether lock ranks are checked in this build.
pub const CHECKED: bool = cfg!(any(debug_assertions, test, slotpool_lock_ranks));

/// A held lock's guard. Where checks are on it also takes the lock out of the thread's record
/// when dropped (in any order); elsewhere it is the bare guard.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
#[derive(Debug)]
pub struct Ranked<G> {
    guard: G,
    id: u64,
    /// The record is the taking thread's.
    _thread: std::marker::PhantomData<*const ()>,
}

#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
impl<G> Ranked<G> {
    /// Check that this thread may take `rank` now, then take the lock with `take`.
    #[track_caller]
    #[inline]
    fn take(rank: LockRank, key: LockKey, take: impl FnOnce() -> G) -> Self {
        let at = std::panic::Location::caller();
        rank::check(rank, key, at);
        let guard = take();
        Ranked {
            guard,
            id: rank::acquired(rank, key, at),
            _thread: std::marker::PhantomData,
        }
    }
}

#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
impl<G> Drop for Ranked<G> {
    fn drop(&mut self) {
        rank::released(self.id);
    }
}

#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
impl<G: std::ops::Deref> std::ops::Deref for Ranked<G> {
    type Target = G::Target;

    #[inline]
    fn deref(&self) -> &G::Target {
        &self.guard
    }
}

#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
impl<G: std::ops::DerefMut> std::ops::DerefMut for Ranked<G> {
    #[inline]
    fn deref_mut(&mut self) -> &mut G::Target {
        &mut self.guard
    }
}

/// A ranked `std` mutex. Poisoning is ignored: every state machine here is consistent between
/// calls (a panic inside one is a bug the invariant checker reports), so a poisoned lock carries
/// no information worth a second panic.
#[derive(Debug)]
pub struct Mutex<T> {
    inner: std::sync::Mutex<T>,
    #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
    rank: LockRank,
}

/// A locked [`Mutex`].
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub type MutexGuard<'a, T> = Ranked<std::sync::MutexGuard<'a, T>>;
/// A locked [`Mutex`].
#[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
pub type MutexGuard<'a, T> = std::sync::MutexGuard<'a, T>;

impl<T> Mutex<T> {
    /// `value` behind a lock of rank `rank`.
    pub const fn new(rank: LockRank, value: T) -> Self {
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        let _ = rank;
        Mutex {
            inner: std::sync::Mutex::new(value),
            #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
            rank,
        }
    }
}

/// A ranked `std` read-write lock (poisoning ignored, as [`Mutex`]'s).
#[derive(Debug)]
pub struct RwLock<T> {
    inner: std::sync::RwLock<T>,
    #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
    rank: LockRank,
}

/// A [`RwLock`] read.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub type ReadGuard<'a, T> = Ranked<std::sync::RwLockReadGuard<'a, T>>;
/// A [`RwLock`] read.
#[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
pub type ReadGuard<'a, T> = std::sync::RwLockReadGuard<'a, T>;
/// A [`RwLock`] written.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub type WriteGuard<'a, T> = Ranked<std::sync::RwLockWriteGuard<'a, T>>;
/// A [`RwLock`] written.
#[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
pub type WriteGuard<'a, T> = std::sync::RwLockWriteGuard<'a, T>;

impl<T> RwLock<T> {
    /// `value` behind a lock of rank `rank`.
    pub const fn new(rank: LockRank, value: T) -> Self {
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        let _ = rank;
        RwLock {
            inner: std::sync::RwLock::new(value),
            #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
            rank,
        }
    }

    #[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
    pub fn read(&self) -> ReadGuard<'_, T> {
        let take = || self.inner.read().unwrap_or_else(|e| e.into_inner());
        #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
        return Ranked::take(self.rank, (0, 0), take);
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        take()
    }

    #[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
    pub fn write(&self) -> WriteGuard<'_, T> {
        let take = || self.inner.write().unwrap_or_else(|e| e.into_inner());
        #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
        return Ranked::take(self.rank, (0, 0), take);
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        take()
    }
}

/// The lock of one shard ([`rank::SHARD`]): taken twice by every alloc + free pair, almost
/// never contended (one shard per pool and stream). A spin lock that yields its time slice
/// while it waits: unlocking is one release store, where `std::sync::Mutex` needs an atomic swap
/// to learn whether to wake a waiter; the two read-modify-writes saved are about a tenth of a
/// cached pair.
#[derive(Debug)]
pub struct ShardMutex<T> {
    inner: spin::mutex::SpinMutex<T, spin::relax::Yield>,
    #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
    key: LockKey,
}

/// A locked shard.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub type ShardGuard<'a, T> = Ranked<spin::mutex::SpinMutexGuard<'a, T>>;
/// A locked shard.
#[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
pub type ShardGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

impl<T> ShardMutex<T> {
    /// `value` behind a shard lock whose key is `key` (its pool and its stream: the order in
    /// which several are taken at once).
    pub const fn new(value: T, key: LockKey) -> Self {
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        let _ = key;
        ShardMutex {
            inner: spin::mutex::SpinMutex::new(value),
            #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
            key,
        }
    }
}

/// What [`lock`] locks.
pub trait Lock {
    type Guard<'a>
    where
        Self: 'a;
    #[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
    fn acquire(&self) -> Self::Guard<'_>;
}

impl<T> Lock for std::sync::Mutex<T> {
    type Guard<'a>
        = std::sync::MutexGuard<'a, T>
    where
        T: 'a;

    /// A leaf lock (not ranked); poisoning ignored, as [`Mutex`]'s.
    fn acquire(&self) -> std::sync::MutexGuard<'_, T> {
        self.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<T> Lock for Mutex<T> {
    type Guard<'a>
        = MutexGuard<'a, T>
    where
        T: 'a;

    #[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
    fn acquire(&self) -> MutexGuard<'_, T> {
        let take = || self.inner.lock().unwrap_or_else(|e| e.into_inner());
        #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
        return Ranked::take(self.rank, (0, 0), take);
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        take()
    }
}

impl<T> Lock for ShardMutex<T> {
    type Guard<'a>
        = ShardGuard<'a, T>
    where
        T: 'a;

    #[inline]
    #[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
    fn acquire(&self) -> ShardGuard<'_, T> {
        #[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
        return Ranked::take(rank::SHARD, self.key, || self.inner.lock());
        #[cfg(not(any(debug_assertions, test, slotpool_lock_ranks)))]
        self.inner.lock()
    }
}

/// Lock `m` (a ranked lock, a shard's spin lock or a leaf `std` mutex). Inlined: taken twice by
/// every pair (a larger shard once left it out of line, a call per lock).
#[inline]
#[cfg_attr(any(debug_assertions, test, slotpool_lock_ranks), track_caller)]
pub fn lock<L: Lock>(m: &L) -> L::Guard<'_> {
    m.acquire()
}

#[cfg(test)]
mod tests;
