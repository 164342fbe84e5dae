//! Lock helpers. Lock order (never take a lock listed earlier while holding a later one):
//!
//! 1. `Allocator::reclaim` (OOM, `empty_cache`, checkpoint and restore paths)
//! 2. `Allocator::arenas`, then `Allocator::pools`, then `Allocator::routes`, then
//!    `Allocator::shards`
//! 3. one shard (never two at once, except checkpoint and restore, which lock a pool's shards in
//!    stream order while holding `reclaim`)
//! 4. `Allocator::segments` (the segment registry; written under a shard's lock)
//! 5. `PagePool` / `EventPool` (leaf locks)

use std::sync::{Mutex, MutexGuard};

/// Lock a mutex, ignoring poisoning: every state machine here is consistent between calls (a
/// panic inside one is a bug the invariant checker reports), so a poisoned lock carries no
/// information worth a second panic.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
