//! Slot-aliased arenas: mutually exclusive branches (CUDA-graph variants) share one set of
//! addresses, slot by slot.
//!
//! An arena owns one virtual reservation. Slot s is placed at the arena's end the first time any
//! branch asks for it, and keeps that offset: slot s of every branch gets the same address. A slot
//! that a later branch needs larger grows in place when it is the last slot, else it moves to the
//! end (counted in [`ArenaReport::relocations`]; declare sizes up front with
//! [`Allocator::arena_reserve_slot`] to avoid it). Physical pages back `[0, end)` only, so the
//! arena holds the sum over slots of each slot's largest size: the largest branch whenever one
//! branch is at least as large as the others in every slot (as context-parallel variants are).
//!
//! Mutual exclusion is the caller's promise. In debug mode the arena records which branch holds
//! each live range and refuses (and reports) an allocation that overlaps another branch's.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use crate::allocator::Allocator;
use crate::device::{Device, DevicePtr, DeviceResult, PageHandle, StreamId};
use crate::error::{AllocError, AllocResult};
use crate::policy::MIN_BLOCK_SIZE;
use crate::pool::PoolId;
use crate::sync::lock;

/// An arena's id, unique per allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArenaId(pub u64);

/// Two branches used overlapping ranges at the same time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Overlap {
    pub branch: u32,
    pub slot: u32,
    pub other_branch: u32,
    pub other_slot: u32,
    pub addr: DevicePtr,
}

/// What an arena holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ArenaReport {
    pub base: DevicePtr,
    /// Bytes of address space in use (`[0, end)`).
    pub size: u64,
    /// Physical bytes mapped.
    pub mapped: u64,
    pub slots: usize,
    pub relocations: u64,
    pub live: usize,
    pub overlaps: Vec<Overlap>,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    offset: u64,
    size: u64,
}

/// One arena's state.
#[derive(Debug)]
pub(crate) struct Arena {
    pool: PoolId,
    stream: StreamId,
    base: DevicePtr,
    capacity: u64,
    end: u64,
    slots: BTreeMap<u32, Slot>,
    pages: Vec<PageHandle>,
    /// Live allocations: offset -> (end, branch, slot).
    live: BTreeMap<u64, (u64, u32, u32)>,
    debug: bool,
    relocations: u64,
    overlaps: Vec<Overlap>,
}

impl<D: Device> Allocator<D> {
    /// Create an arena in `pool` (created if new) for work on `stream`. It reserves address
    /// space only; pages are mapped as slots are placed.
    pub fn arena_create(&self, pool: PoolId, stream: StreamId) -> AllocResult<ArenaId> {
        if !pool.is_default() && !lock(&self.pools).contains_key(&pool) {
            self.create_or_incref_pool(pool, Default::default())?;
        }
        // A pause refuses pools with arenas, and a paused pool takes no arena (`pause.rs`).
        if lock(&self.pools)
            .get(&pool)
            .is_some_and(|e| e.paused.is_some())
        {
            return Err(AllocError::PoolPaused(pool));
        }
        let capacity = self.shared.vmm_reservation;
        let base = self.dev.reserve(capacity)?;
        let id = self.next_arena.fetch_add(1, Ordering::Relaxed);
        lock(&self.arenas).insert(
            id,
            Arena {
                pool,
                stream,
                base,
                capacity,
                end: 0,
                slots: BTreeMap::new(),
                pages: Vec::new(),
                live: BTreeMap::new(),
                debug: false,
                relocations: 0,
                overlaps: Vec::new(),
            },
        );
        Ok(ArenaId(id))
    }

    /// Turn the overlap check on or off.
    pub fn arena_set_debug(&self, arena: ArenaId, on: bool) -> AllocResult<()> {
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        a.debug = on;
        Ok(())
    }

    /// Declare slot `slot`'s size before any branch uses it, so that it never moves.
    pub fn arena_reserve_slot(&self, arena: ArenaId, slot: u32, size: u64) -> AllocResult<u64> {
        self.place_slot(arena, slot, size)
    }

    /// Allocate slot `slot` for `branch`: the same address for every branch.
    pub fn arena_alloc(
        &self,
        arena: ArenaId,
        branch: u32,
        slot: u32,
        size: u64,
    ) -> AllocResult<DevicePtr> {
        if size == 0 || size > crate::allocator::MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let offset = self.place_slot(arena, slot, size)?;
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        let end = offset + size;
        if a.live.values().any(|&(_, b, s)| b == branch && s == slot) {
            return Err(AllocError::InvalidState(format!(
                "slot {slot} of branch {branch} is already live"
            )));
        }
        if a.debug {
            let clash = a
                .live
                .range(..end)
                .rev()
                .find(|&(&o, &(e, b, _))| e > offset && o < end && b != branch)
                .map(|(&o, &(_, b, s))| (o, b, s));
            if let Some((o, b, s)) = clash {
                let ov = Overlap {
                    branch,
                    slot,
                    other_branch: b,
                    other_slot: s,
                    addr: a.base + o.max(offset),
                };
                a.overlaps.push(ov.clone());
                return Err(AllocError::InvalidState(format!(
                    "branch {branch} slot {slot} overlaps live branch {b} slot {s} at {:#x}: \
                     branches are not mutually exclusive",
                    ov.addr
                )));
            }
        }
        a.live.insert(offset, (end, branch, slot));
        Ok(a.base + offset)
    }

    /// Free slot `slot` of `branch`.
    pub fn arena_free(&self, arena: ArenaId, branch: u32, slot: u32) -> AllocResult<()> {
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        let key = a
            .live
            .iter()
            .find(|(_, (_, b, s))| *b == branch && *s == slot)
            .map(|(&o, _)| o)
            .ok_or_else(|| {
                AllocError::InvalidState(format!("slot {slot} of branch {branch} is not live"))
            })?;
        a.live.remove(&key);
        Ok(())
    }

    /// What the arena holds.
    pub fn arena_report(&self, arena: ArenaId) -> AllocResult<ArenaReport> {
        let arenas = lock(&self.arenas);
        let a = arenas.get(&arena.0).ok_or_else(|| unknown_arena(arena))?;
        Ok(ArenaReport {
            base: a.base,
            size: a.end,
            mapped: a.pages.len() as u64 * self.shared.page_size,
            slots: a.slots.len(),
            relocations: a.relocations,
            live: a.live.len(),
            overlaps: a.overlaps.clone(),
        })
    }

    /// Destroy an arena: its pages and reservation go back. Refused while slots are live.
    pub fn arena_destroy(&self, arena: ArenaId) -> AllocResult<()> {
        let mut arenas = lock(&self.arenas);
        let a = arenas.get(&arena.0).ok_or_else(|| unknown_arena(arena))?;
        if !a.live.is_empty() {
            return Err(AllocError::InvalidState(format!(
                "arena {} has {} live slots",
                arena.0,
                a.live.len()
            )));
        }
        if self.capture_underway() {
            return Err(AllocError::InvalidState(
                "cannot unmap during a capture".into(),
            ));
        }
        let a = arenas
            .remove(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        let ps = self.shared.page_size;
        for (i, &page) in a.pages.iter().enumerate() {
            self.dev.unmap(a.base + i as u64 * ps)?;
            self.shared.pages.put(page);
        }
        self.arena_budget(a.pool, |b| b.release(a.pages.len() as u64 * ps));
        self.dev.release_reservation(a.base, a.capacity)?;
        Ok(())
    }

    fn arena_budget(&self, pool: PoolId, f: impl FnOnce(&crate::env::Budget)) {
        if let Some(e) = lock(&self.pools).get(&pool) {
            f(&e.budget);
        }
    }

    /// The offset of `slot`, placing or growing it as needed.
    fn place_slot(&self, arena: ArenaId, slot: u32, size: u64) -> AllocResult<u64> {
        let size = size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE;
        let mut arenas = lock(&self.arenas);
        let a = arenas
            .get_mut(&arena.0)
            .ok_or_else(|| unknown_arena(arena))?;
        let (offset, new_end, moved) = match a.slots.get(&slot) {
            Some(s) if s.size >= size => return Ok(s.offset),
            Some(s) if s.offset + s.size == a.end => (s.offset, s.offset + size, false),
            Some(_) => (a.end, a.end + size, true),
            None => (a.end, a.end + size, false),
        };
        if moved && a.live.values().any(|&(_, _, s)| s == slot) {
            return Err(AllocError::InvalidState(format!(
                "slot {slot} must grow but is live in another branch and cannot move"
            )));
        }
        if new_end > a.capacity {
            return Err(AllocError::OutOfMemory(Box::default()));
        }
        let ps = self.shared.page_size;
        let need = new_end.div_ceil(ps) as usize;
        let pool = a.pool;
        while a.pages.len() < need {
            let budget = lock(&self.pools).get(&pool).map(|e| e.budget.clone());
            let Some(budget) = budget else {
                return Err(AllocError::UnknownPool(pool));
            };
            if !budget.try_claim(ps) {
                return Err(AllocError::OutOfMemory(Box::default()));
            }
            let page = match self.shared.pages.take() {
                Some(p) => Ok(p),
                None => {
                    if self.shared.budget.try_claim(ps) {
                        self.dev
                            .create_page()
                            .inspect_err(|_| self.shared.budget.release(ps))
                    } else {
                        Err(crate::device::DeviceError::OutOfMemory)
                    }
                }
            };
            let page = match page {
                Ok(p) => p,
                Err(e) => {
                    budget.release(ps);
                    return Err(match e {
                        crate::device::DeviceError::OutOfMemory => {
                            AllocError::OutOfMemory(Box::default())
                        }
                        other => AllocError::Device(other),
                    });
                }
            };
            if let Err(e) = self.dev.map(a.base + a.pages.len() as u64 * ps, page) {
                self.shared.pages.put(page);
                budget.release(ps);
                return Err(AllocError::Device(e));
            }
            a.pages.push(page);
        }
        if moved {
            a.relocations += 1;
        }
        a.slots.insert(slot, Slot { offset, size });
        a.end = a.end.max(new_end);
        Ok(offset)
    }

    /// Physical bytes held by arenas, per pool (part of `held_bytes`).
    /// Give every added peer access to the arenas' pages (see `peer.rs`); under the arenas'
    /// lock, which their mapping and unmapping take.
    pub(crate) fn refresh_arena_access(&self) -> DeviceResult<()> {
        let ps = self.shared.page_size;
        for a in lock(&self.arenas).values() {
            if !a.pages.is_empty() {
                self.dev.refresh_access(a.base, a.pages.len() as u64 * ps)?;
            }
        }
        Ok(())
    }

    pub(crate) fn arena_bytes(&self) -> Vec<(PoolId, u64)> {
        let ps = self.shared.page_size;
        lock(&self.arenas)
            .values()
            .map(|a| (a.pool, a.pages.len() as u64 * ps))
            .collect()
    }

    /// The stream an arena was made for.
    pub fn arena_stream(&self, arena: ArenaId) -> AllocResult<StreamId> {
        lock(&self.arenas)
            .get(&arena.0)
            .map(|a| a.stream)
            .ok_or_else(|| unknown_arena(arena))
    }
}

fn unknown_arena(arena: ArenaId) -> AllocError {
    AllocError::InvalidArgument(format!("unknown arena {}", arena.0))
}
