//! Slot-aliased arenas: mutually exclusive branches (CUDA-graph variants) share one set of
//! addresses, slot by slot.
//!
//! An arena owns one virtual reservation. Slot s is placed at the arena's end the first time any
//! branch asks for it, and keeps that offset: slot s of every branch gets the same address. A slot
//! that a later branch needs larger grows in place when it is the last slot, else it moves to the
//! end (counted in [`ArenaReport::relocations`]; declare sizes up front with
//! [`crate::Allocator::arena_reserve_slot`] to avoid it). Physical pages back `[0, end)` only, so the
//! arena holds the sum over slots of each slot's largest size: the largest branch whenever one
//! branch is at least as large as the others in every slot (as context-parallel variants are).
//!
//! An allocation is identified by its (branch, slot): it is live from `arena_alloc` to
//! `arena_free` of that pair, whatever other branches do with the same slot. Mutual exclusion is
//! the caller's promise; in debug mode the arena refuses (and reports) an allocation that overlaps
//! a live one of another branch.
//!
//! `Arena` is a state machine fed one [`Env`] per call, as a shard is. Every call validates
//! before it changes anything: a refused call changes nothing, and one that fails for lack of
//! memory gives back what it took (outside a capture; during one, pages it mapped stay mapped,
//! since unmapping is illegal then, and serve the arena's next growth). The arena holds a use of
//! its pool and the pool's budget, so the pool lives while the arena does.
//!
//! Its pages are counted in its own [`MemoryStats`] as one large vmm segment of its pool, merged
//! into the device's and the pool's statistics: a slot live in any branch is one allocation of
//! the slot's size (the snapshot shows the same block).

mod api;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::allocator::{BlockSnapshot, SegmentSnapshot};
use crate::block::BlockState;
use crate::device::{DeviceError, DevicePtr, DeviceResult, PageHandle, StreamId};
use crate::env::{Budget, Env};
use crate::error::{AllocError, AllocResult};
use crate::policy::MIN_BLOCK_SIZE;
use crate::pool::PoolId;
use crate::stats::MemoryStats;

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
    /// Live allocations: (branch, slot) pairs allocated and not freed.
    pub live: usize,
    pub overlaps: Vec<Overlap>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    offset: u64,
    size: u64,
}

/// Where a request puts its slot, decided before anything changes.
#[derive(Clone, Copy, Debug)]
struct Plan {
    slot: Slot,
    /// The arena's end once the slot is placed.
    end: u64,
    moved: bool,
}

/// A live allocation's numbers as the statistics count them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    slots: i64,
    bytes: i64,
    requested: i64,
}

/// One arena's state.
#[derive(Debug)]
pub(crate) struct Arena {
    pool: PoolId,
    stream: StreamId,
    /// The budget of the pool (the incarnation) the arena holds a use of.
    pool_budget: Arc<Budget>,
    base: DevicePtr,
    capacity: u64,
    end: u64,
    slots: BTreeMap<u32, Slot>,
    /// Pages mapped at `base`, `base + page`, ... in order.
    pages: Vec<PageHandle>,
    /// Live allocations: (branch, slot) -> requested size.
    live: BTreeMap<(u32, u32), u64>,
    debug: bool,
    relocations: u64,
    overlaps: Vec<Overlap>,
    stats: MemoryStats,
    /// What `stats` counts of the live slots now (see [`Arena::held`]).
    counted: Held,
}

impl Arena {
    /// Validate `size` and round it to the slot granularity.
    fn slot_size(size: u64) -> AllocResult<u64> {
        if size == 0 || size > crate::allocator::MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        Ok(size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)
    }

    /// Where slot `slot` goes to hold `size` (rounded) bytes. Changes nothing.
    fn plan(&self, slot: u32, size: u64) -> AllocResult<Plan> {
        let (offset, moved) = match self.slots.get(&slot) {
            Some(s) if s.size >= size => (s.offset, false),
            Some(s) if s.offset + s.size == self.end => (s.offset, false),
            Some(_) => (self.end, true),
            None => (self.end, false),
        };
        if moved && self.live.keys().any(|&(_, s)| s == slot) {
            return Err(AllocError::InvalidState(format!(
                "slot {slot} must grow but is live in another branch and cannot move"
            )));
        }
        let keep = self.slots.get(&slot).map_or(0, |s| s.size);
        let size = size.max(keep);
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= self.capacity)
            .ok_or_else(|| AllocError::OutOfMemory(Box::default()))?;
        Ok(Plan {
            slot: Slot { offset, size },
            end: self.end.max(end),
            moved,
        })
    }

    fn commit(&mut self, slot: u32, plan: Plan) {
        if plan.moved {
            self.relocations += 1;
        }
        self.slots.insert(slot, plan.slot);
        self.end = plan.end;
    }

    /// The live allocation of another branch that `[offset, offset + len)` overlaps, if any.
    fn clash(&self, branch: u32, offset: u64, len: u64) -> Option<(u32, u32, u64)> {
        self.live.iter().find_map(|(&(b, s), &req)| {
            let o = self.slots[&s].offset;
            (b != branch && o < offset + len && offset < o + req).then_some((b, s, o.max(offset)))
        })
    }

    /// Reserve (place or grow) slot `slot` for `size` bytes; its offset.
    pub(crate) fn reserve_slot(&mut self, env: &Env, slot: u32, size: u64) -> AllocResult<u64> {
        let plan = self.plan(slot, Self::slot_size(size)?)?;
        self.grow(env, plan.end)?;
        self.commit(slot, plan);
        // A slot live in some branch may have grown in place.
        self.recount(env);
        Ok(plan.slot.offset)
    }

    /// Allocate slot `slot` for `branch`.
    pub(crate) fn alloc(
        &mut self,
        env: &Env,
        branch: u32,
        slot: u32,
        size: u64,
    ) -> AllocResult<DevicePtr> {
        let rounded = Self::slot_size(size)?;
        if self.live.contains_key(&(branch, slot)) {
            return Err(AllocError::InvalidState(format!(
                "slot {slot} of branch {branch} is already live"
            )));
        }
        let plan = self.plan(slot, rounded)?;
        if self.debug
            && let Some((b, s, at)) = self.clash(branch, plan.slot.offset, size)
        {
            let ov = Overlap {
                branch,
                slot,
                other_branch: b,
                other_slot: s,
                addr: self.base + at,
            };
            let msg = format!(
                "branch {branch} slot {slot} overlaps live branch {b} slot {s} at {:#x}: \
                 branches are not mutually exclusive",
                ov.addr
            );
            self.overlaps.push(ov);
            return Err(AllocError::InvalidState(msg));
        }
        self.grow(env, plan.end)?;
        self.commit(slot, plan);
        self.live.insert((branch, slot), size);
        self.recount(env);
        Ok(self.base + plan.slot.offset)
    }

    /// Free slot `slot` of `branch`; nothing else.
    pub(crate) fn free(&mut self, env: &Env, branch: u32, slot: u32) -> AllocResult<()> {
        if self.live.remove(&(branch, slot)).is_none() {
            return Err(AllocError::InvalidState(format!(
                "slot {slot} of branch {branch} is not live"
            )));
        }
        self.recount(env);
        Ok(())
    }

    /// The live slots as the statistics count them: a slot live in any branch is one allocation
    /// of the slot's size, requesting the largest size any of its branches asked for.
    fn held(&self) -> Held {
        let mut largest: BTreeMap<u32, u64> = BTreeMap::new();
        for (&(_, s), &req) in &self.live {
            let e = largest.entry(s).or_default();
            *e = (*e).max(req);
        }
        largest.iter().fold(Held::default(), |h, (s, &req)| Held {
            slots: h.slots + 1,
            bytes: h.bytes + self.slots[s].size as i64,
            requested: h.requested + req as i64,
        })
    }

    /// Bring the allocation statistics (and the device-wide allocated counter) to [`Arena::held`].
    fn recount(&mut self, env: &Env) {
        let now = self.held();
        let was = std::mem::replace(&mut self.counted, now);
        let st = &mut self.stats;
        for (s, d) in [
            (&mut st.allocation, now.slots - was.slots),
            (&mut st.active, now.slots - was.slots),
            (&mut st.allocated_bytes, now.bytes - was.bytes),
            (&mut st.active_bytes, now.bytes - was.bytes),
            (&mut st.requested_bytes, now.requested - was.requested),
        ] {
            if d != 0 {
                s.update(false, d);
            }
        }
        if now.bytes != was.bytes {
            env.allocated.add(now.bytes - was.bytes);
        }
    }

    /// Map pages until `[0, end)` is backed. All or nothing, except during a capture (see the
    /// module documentation).
    fn grow(&mut self, env: &Env, end: u64) -> AllocResult<()> {
        let ps = env.page_size();
        let need = end.div_ceil(ps) as usize;
        if need <= self.pages.len() {
            return Ok(());
        }
        let n = need - self.pages.len();
        let bytes = n as u64 * ps;
        if !env.pool_budget.try_claim(bytes) {
            return Err(AllocError::OutOfMemory(Box::default()));
        }
        let mut got: Vec<(PageHandle, bool)> = Vec::with_capacity(n);
        let mut failed = None;
        while got.len() < n {
            match take_page(env) {
                Ok(p) => got.push(p),
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let at = self.base + self.pages.len() as u64 * ps;
        let mut mapped = 0;
        if failed.is_none() {
            let handles: Vec<PageHandle> = got.iter().map(|&(p, _)| p).collect();
            if !env.capture_underway {
                match env.dev.map_run(at, &handles) {
                    Ok(()) => mapped = n,
                    Err(e) => failed = Some(e),
                }
            } else {
                // Unmapping is illegal during a capture: map one by one and keep what mapped.
                for &h in &handles {
                    if let Err(e) = env.dev.map(at + mapped as u64 * ps, h) {
                        failed = Some(e);
                        break;
                    }
                    mapped += 1;
                }
            }
        }
        for &(p, _) in &got[..mapped] {
            self.pages.push(p);
        }
        if mapped > 0 {
            env.budget.note_peak();
            if self.stats.segment.all().current == 0 {
                self.stats.segment.inc(false, 1);
            }
            self.stats
                .reserved_bytes
                .inc(false, (mapped as u64 * ps) as i64);
            self.stats.num_device_alloc += mapped as i64;
        }
        env.pool_budget.release((n - mapped) as u64 * ps);
        for &(p, fresh) in &got[mapped..] {
            give_page(env, p, fresh);
        }
        match failed {
            None => Ok(()),
            Some(DeviceError::OutOfMemory) => Err(AllocError::OutOfMemory(Box::default())),
            Some(e) => Err(AllocError::Device(e)),
        }
    }

    /// Unmap every page, last first, into the device's page pool. On a device error the pages
    /// still mapped stay the arena's.
    fn unmap_all(&mut self, env: &Env) -> DeviceResult<()> {
        let ps = env.page_size();
        while let Some(&page) = self.pages.last() {
            env.dev
                .unmap(self.base + (self.pages.len() as u64 - 1) * ps)?;
            self.pages.pop();
            env.pages.put(page);
            env.pool_budget.release(ps);
            self.stats.reserved_bytes.dec(false, ps as i64);
            self.stats.num_device_free += 1;
            if self.pages.is_empty() {
                self.stats.segment.dec(false, 1);
            }
        }
        Ok(())
    }

    fn report(&self, ps: u64) -> ArenaReport {
        ArenaReport {
            base: self.base,
            size: self.end,
            mapped: self.pages.len() as u64 * ps,
            slots: self.slots.len(),
            relocations: self.relocations,
            live: self.live.len(),
            overlaps: self.overlaps.clone(),
        }
    }

    /// The mapped pages as one vmm segment of the arena's pool: each slot a block (allocated
    /// while live in any branch), the space between and after them free.
    fn snapshot(&self, ps: u64) -> Option<SegmentSnapshot> {
        let size = self.pages.len() as u64 * ps;
        if size == 0 {
            return None;
        }
        let mut requested: BTreeMap<u32, u64> = BTreeMap::new();
        for (&(_, s), &req) in &self.live {
            let e = requested.entry(s).or_default();
            *e = (*e).max(req);
        }
        let mut slots: Vec<(u32, Slot)> = self.slots.iter().map(|(&k, &s)| (k, s)).collect();
        slots.sort_unstable_by_key(|(_, s)| s.offset);
        let mut blocks = Vec::new();
        let mut at = 0;
        let free = |addr: u64, size: u64| BlockSnapshot {
            addr,
            size,
            requested: 0,
            state: BlockState::Free,
        };
        for (k, s) in slots {
            let hi = (s.offset + s.size).min(size);
            if s.offset >= hi {
                continue;
            }
            if s.offset > at {
                blocks.push(free(self.base + at, s.offset - at));
            }
            blocks.push(match requested.get(&k) {
                Some(&req) => BlockSnapshot {
                    addr: self.base + s.offset,
                    size: hi - s.offset,
                    requested: req,
                    state: BlockState::Allocated,
                },
                None => free(self.base + s.offset, hi - s.offset),
            });
            at = hi;
        }
        if at < size {
            blocks.push(free(self.base + at, size - at));
        }
        Some(SegmentSnapshot {
            pool: self.pool,
            stream: self.stream,
            addr: self.base,
            size,
            small: false,
            vmm: true,
            blocks,
        })
    }

    /// The arena's own invariants: slots are disjoint and inside `[0, end)`, every live
    /// allocation's slot exists and holds it, and the statistics match the pages and live slots.
    fn check(&self, ps: u64) -> Result<(), String> {
        let mut ranges: Vec<(u64, u64)> = self
            .slots
            .values()
            .map(|s| (s.offset, s.offset + s.size))
            .collect();
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0)
            || ranges.last().is_some_and(|r| r.1 > self.end)
        {
            return Err("slots overlap or pass the end".into());
        }
        for (&(b, s), &req) in &self.live {
            match self.slots.get(&s) {
                Some(sl)
                    if sl.size >= req && sl.offset + sl.size <= self.pages.len() as u64 * ps => {}
                _ => {
                    return Err(format!(
                        "live branch {b} slot {s} is not backed by its slot"
                    ));
                }
            }
        }
        let st = &self.stats;
        if st.reserved_bytes.all().current != (self.pages.len() as u64 * ps) as i64
            || st.segment.all().current != i64::from(!self.pages.is_empty())
        {
            return Err("reserved bytes or segments differ from the pages".into());
        }
        let h = self.held();
        if h != self.counted
            || st.allocated_bytes.all().current != h.bytes
            || st.allocation.all().current != h.slots
            || st.requested_bytes.all().current != h.requested
        {
            return Err("allocation statistics differ from the live slots".into());
        }
        Ok(())
    }
}

/// A page from the device's pool (`false`), else a new one within the device budget (`true`),
/// not yet in its peak: the caller records the peak once the page is mapped.
fn take_page(env: &Env) -> DeviceResult<(PageHandle, bool)> {
    if let Some(p) = env.pages.take() {
        return Ok((p, false));
    }
    let ps = env.page_size();
    if !env.budget.try_claim_quietly(ps) {
        return Err(DeviceError::OutOfMemory);
    }
    match env.dev.create_page() {
        Ok(p) => Ok((p, true)),
        Err(e) => {
            env.budget.release(ps);
            Err(e)
        }
    }
}

/// Undo [`take_page`]: a new page goes back to the device (outside a capture), any other to the
/// device's pool.
fn give_page(env: &Env, page: PageHandle, fresh: bool) {
    if fresh && !env.capture_underway && env.dev.release_page(page).is_ok() {
        env.budget.release(env.page_size());
    } else {
        env.pages.put(page);
    }
}
