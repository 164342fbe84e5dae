//! Lock ranks: the lock order of [`crate::sync`] as code.
//!
//! Every lock of the allocator has a [`LockRank`]. A thread may take a lock only while every lock
//! it holds ranks lower, so no two threads can each hold a lock that the other waits for. One
//! exception is declared, not switched off: a rank may allow several of its locks at once
//! ([`LockRank::several_under`]), taken in increasing key order within one group while another
//! lock is held (a pool's shards in stream order under `reclaim`).
//!
//! Where checks are on (debug builds, the crate's own tests, and any build with
//! `--cfg slotpool_lock_ranks`), each thread keeps a record of the locks it holds and every
//! acquisition is checked against it before it waits: a wrong order panics, naming both locks
//! and where each was taken. Elsewhere no record is kept and a lock costs what the bare lock
//! costs.

/// A lock's place in the lock order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockRank {
    /// A lock may be taken only while every lock held has a lower `order`.
    pub order: u8,
    /// The lock, for messages.
    pub name: &'static str,
    /// Several locks of this rank may be held at once while this lock is held, each group's in
    /// increasing key order ([`LockKey`]).
    pub several_under: Option<&'static LockRank>,
}

/// A lock's key within its rank: (group, order). Where a rank allows several locks at once,
/// those held together must share the group and be taken in increasing order (a shard's key is
/// its pool and its stream). Other locks have `(0, 0)`.
pub type LockKey = (u128, u64);

/// `Allocator::reclaim`: the out-of-memory, `empty_cache`, checkpoint, restore, pause and
/// resume paths.
pub const RECLAIM: LockRank = LockRank {
    order: 1,
    name: "Allocator::reclaim",
    several_under: None,
};
/// `Allocator::arenas`.
pub const ARENAS: LockRank = LockRank {
    order: 2,
    name: "Allocator::arenas",
    several_under: None,
};
/// `Allocator::pools`.
pub const POOLS: LockRank = LockRank {
    order: 3,
    name: "Allocator::pools",
    several_under: None,
};
/// `Allocator::routes`.
pub const ROUTES: LockRank = LockRank {
    order: 4,
    name: "Allocator::routes",
    several_under: None,
};
/// `Allocator::shards`, the shard table.
pub const SHARDS: LockRank = LockRank {
    order: 5,
    name: "Allocator::shards",
    several_under: None,
};
/// One shard's lock. Several only under `reclaim`: checkpoint, restore, pause and resume lock a
/// pool's shards in stream order.
pub const SHARD: LockRank = LockRank {
    order: 6,
    name: "a shard",
    several_under: Some(&RECLAIM),
};
/// `Allocator::segments`, the segment registry (written under a shard's lock).
pub const SEGMENTS: LockRank = LockRank {
    order: 7,
    name: "Allocator::segments",
    several_under: None,
};

/// Every rank, lowest first.
pub const ALL: [LockRank; 7] = [RECLAIM, ARENAS, POOLS, ROUTES, SHARDS, SHARD, SEGMENTS];

/// One lock a thread holds.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Held {
    pub id: u64,
    pub rank: LockRank,
    pub key: LockKey,
    pub at: &'static std::panic::Location<'static>,
}

/// The lock of `held` that forbids taking a lock of `rank` with `key` now, if any.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub(crate) fn conflict(held: &[Held], rank: LockRank, key: LockKey) -> Option<&Held> {
    held.iter().find(|h| {
        if h.rank.order < rank.order {
            return false;
        }
        let several = h.rank == rank
            && rank
                .several_under
                .is_some_and(|under| held.iter().any(|o| o.rank == *under))
            && h.key.0 == key.0
            && h.key.1 < key.1;
        !several
    })
}

/// The message of a conflict.
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub(crate) fn message(taking: LockRank, at: &std::panic::Location<'_>, holding: &Held) -> String {
    let mut m = format!(
        "lock order: taking {} (rank {}) at {at} while holding {} (rank {}, taken at {})",
        taking.name, taking.order, holding.rank.name, holding.rank.order, holding.at
    );
    if let Some(under) = taking.several_under.filter(|_| taking == holding.rank) {
        m.push_str(&format!(
            "; several locks of {} are held at once only under {}, one group's in increasing order",
            taking.name, under.name
        ));
    }
    m
}

#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
mod record {
    use std::cell::{Cell, RefCell};
    use std::panic::Location;

    use super::{Held, LockKey, LockRank, conflict, message};

    thread_local! {
        static HELD: RefCell<Vec<Held>> = const { RefCell::new(Vec::new()) };
        static NEXT: Cell<u64> = const { Cell::new(0) };
    }

    /// Check that this thread may take a lock of `rank` with `key` now; panics otherwise (a
    /// thread being torn down is not checked).
    pub(crate) fn check(rank: LockRank, key: LockKey, at: &'static Location<'static>) {
        let bad = HELD
            .try_with(|h| conflict(&h.borrow(), rank, key).map(|c| message(rank, at, c)))
            .ok()
            .flatten();
        if let Some(m) = bad {
            panic!("{m}");
        }
    }

    /// Record that this thread took a lock of `rank`; the id to give to [`released`].
    pub(crate) fn acquired(rank: LockRank, key: LockKey, at: &'static Location<'static>) -> u64 {
        let id = NEXT
            .try_with(|n| n.replace(n.get() + 1))
            .unwrap_or(u64::MAX);
        let _ = HELD.try_with(|h| h.borrow_mut().push(Held { id, rank, key, at }));
        id
    }

    /// Record that this thread let lock `id` go (in any order).
    pub(crate) fn released(id: u64) {
        let _ = HELD.try_with(|h| {
            let mut h = h.borrow_mut();
            if let Some(k) = h.iter().rposition(|e| e.id == id) {
                h.remove(k);
            }
        });
    }

    /// The ranks this thread holds, in the order taken.
    #[cfg(test)]
    pub(crate) fn held() -> Vec<LockRank> {
        HELD.try_with(|h| h.borrow().iter().map(|e| e.rank).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
pub(crate) use record::held;
#[cfg(any(debug_assertions, test, slotpool_lock_ranks))]
pub(crate) use record::{acquired, check, released};
