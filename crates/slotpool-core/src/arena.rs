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
//! the largest size its branches asked for, rounded (the snapshot shows the same block).

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::block::BlockState;
use crate::device::{DeviceError, DevicePtr, DeviceResult, PageHandle, StreamId};
use crate::env::{Budget, Env};
use crate::error::{AllocError, AllocResult};
use crate::policy::MIN_BLOCK_SIZE;
use crate::pool::PoolId;
use crate::snapshot::{BlockSnapshot, SegmentSnapshot};
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

/// Live slots as the statistics count them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Held {
    slots: i64,
    bytes: i64,
    requested: i64,
}

impl Held {
    fn plus(self, o: Held, sign: i64) -> Held {
        Held {
            slots: self.slots + sign * o.slots,
            bytes: self.bytes + sign * o.bytes,
            requested: self.requested + sign * o.requested,
        }
    }
}

/// Live allocations by slot, then branch: their requested sizes.
#[derive(Debug, Default)]
struct Live {
    by_slot: BTreeMap<u32, BTreeMap<u32, u64>>,
    len: usize,
}

impl Live {
    fn contains(&self, branch: u32, slot: u32) -> bool {
        self.by_slot
            .get(&slot)
            .is_some_and(|b| b.contains_key(&branch))
    }

    fn insert(&mut self, branch: u32, slot: u32, requested: u64) {
        if self
            .by_slot
            .entry(slot)
            .or_default()
            .insert(branch, requested)
            .is_none()
        {
            self.len += 1;
        }
    }

    fn remove(&mut self, branch: u32, slot: u32) -> Option<u64> {
        let branches = self.by_slot.get_mut(&slot)?;
        let req = branches.remove(&branch)?;
        if branches.is_empty() {
            self.by_slot.remove(&slot);
        }
        self.len -= 1;
        Some(req)
    }

    /// The branches holding `slot` live, with their requested sizes.
    fn branches(&self, slot: u32) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.by_slot
            .get(&slot)
            .into_iter()
            .flat_map(|b| b.iter().map(|(&b, &r)| (b, r)))
    }

    /// The largest size any branch holding `slot` asked for (`None`: not live).
    fn largest(&self, slot: u32) -> Option<u64> {
        self.branches(slot).map(|(_, r)| r).max()
    }

    /// Every live (branch, slot) with its requested size.
    fn iter(&self) -> impl Iterator<Item = ((u32, u32), u64)> + '_ {
        self.by_slot
            .iter()
            .flat_map(|(&s, b)| b.iter().map(move |(&b, &r)| ((b, s), r)))
    }
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
    /// Slot ids by offset (slots are disjoint ranges).
    by_offset: BTreeMap<u64, u32>,
    /// Pages mapped at `base`, `base + page`, ... in order.
    pages: Vec<PageHandle>,
    live: Live,
    debug: bool,
    relocations: u64,
    overlaps: Vec<Overlap>,
    stats: MemoryStats,
    /// What `stats` counts of the live slots now (the sum of [`Arena::slot_held`]).
    counted: Held,
}

impl Arena {
    /// An empty arena of `pool` for work on `stream`, over the reservation `[base, base +
    /// capacity)`; it holds a use of the pool, whose budget is `pool_budget`.
    pub(crate) fn new(
        pool: PoolId,
        stream: StreamId,
        pool_budget: Arc<Budget>,
        base: DevicePtr,
        capacity: u64,
    ) -> Self {
        Arena {
            pool,
            stream,
            pool_budget,
            base,
            capacity,
            end: 0,
            slots: BTreeMap::new(),
            pages: Vec::new(),
            by_offset: BTreeMap::new(),
            live: Live::default(),
            debug: false,
            relocations: 0,
            overlaps: Vec::new(),
            stats: MemoryStats::default(),
            counted: Held::default(),
        }
    }

    pub(crate) fn pool(&self) -> PoolId {
        self.pool
    }

    pub(crate) fn stream(&self) -> StreamId {
        self.stream
    }

    /// The budget of the pool the arena holds a use of.
    pub(crate) fn pool_budget(&self) -> &Arc<Budget> {
        &self.pool_budget
    }

    /// Turn the overlap check on or off.
    pub(crate) fn set_debug(&mut self, on: bool) {
        self.debug = on;
    }

    /// Live (branch, slot) allocations.
    pub(crate) fn live_count(&self) -> usize {
        self.live.len
    }

    /// The reservation: (base, capacity).
    pub(crate) fn reservation(&self) -> (DevicePtr, u64) {
        (self.base, self.capacity)
    }

    /// The mapped pages' range: (base, bytes).
    pub(crate) fn mapped(&self, ps: u64) -> (DevicePtr, u64) {
        (self.base, self.pages.len() as u64 * ps)
    }

    pub(crate) fn stats(&self) -> &MemoryStats {
        &self.stats
    }

    pub(crate) fn stats_mut(&mut self) -> &mut MemoryStats {
        &mut self.stats
    }

    /// Bytes the live slots count as allocated.
    pub(crate) fn counted_bytes(&self) -> i64 {
        self.counted.bytes
    }

    /// The arena's pages, slots and live allocations as text (debug-mode overlap reports are
    /// left out: recording one is what a refused overlapping call does).
    pub(crate) fn dump(&self, id: u64, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(
            out,
            "arena {id} pool {} stream {} at {:#x}: end {} pages {} relocations {} {:?}",
            self.pool,
            self.stream,
            self.base,
            self.end,
            self.pages.len(),
            self.relocations,
            self.stats
        );
        for (s, sl) in &self.slots {
            let _ = writeln!(out, " slot {s} {:#x}+{}", self.base + sl.offset, sl.size);
        }
        for ((b, s), req) in self.live.iter() {
            let _ = writeln!(out, " live branch {b} slot {s} req={req}");
        }
    }

    /// Validate `size` and round it to the slot granularity.
    fn slot_size(size: u64) -> AllocResult<u64> {
        if size == 0 || size > crate::block::MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        Ok(round(size))
    }

    /// Where slot `slot` goes to hold `size` (rounded) bytes. Changes nothing.
    fn plan(&self, slot: u32, size: u64) -> AllocResult<Plan> {
        let (offset, moved) = match self.slots.get(&slot) {
            Some(s) if s.size >= size => (s.offset, false),
            Some(s) if s.offset + s.size == self.end => (s.offset, false),
            Some(_) => (self.end, true),
            None => (self.end, false),
        };
        if moved && self.live.largest(slot).is_some() {
            return Err(AllocError::InvalidState(Box::new(format!(
                "slot {slot} must grow but is live and cannot move"
            ))));
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
        if let Some(old) = self.slots.insert(slot, plan.slot) {
            self.by_offset.remove(&old.offset);
        }
        self.by_offset.insert(plan.slot.offset, slot);
        self.end = plan.end;
    }

    /// The live allocation of another branch that `[offset, offset + len)` overlaps, if any:
    /// (branch, slot, first address shared).
    fn clash(&self, branch: u32, offset: u64, len: u64) -> Option<(u32, u32, u64)> {
        // Slots are disjoint, so their ends grow with their offsets: walk down from the last slot
        // that starts before the range ends until one ends before it starts.
        for (&o, &s) in self.by_offset.range(..offset + len).rev() {
            if o + self.slots[&s].size <= offset {
                break;
            }
            if let Some((b, _)) = self
                .live
                .branches(s)
                .find(|&(b, req)| b != branch && offset < o + req)
            {
                return Some((b, s, o.max(offset)));
            }
        }
        None
    }

    /// Reserve (place or grow) slot `slot` for `size` bytes; its offset.
    pub(crate) fn reserve_slot(&mut self, env: &Env, slot: u32, size: u64) -> AllocResult<u64> {
        let plan = self.plan(slot, Self::slot_size(size)?)?;
        self.grow(env, plan.end)?;
        // A slot live in some branch may grow in place.
        let was = self.slot_held(slot);
        self.commit(slot, plan);
        self.account(env, was, slot);
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
        if self.live.contains(branch, slot) {
            return Err(AllocError::InvalidState(Box::new(format!(
                "slot {slot} of branch {branch} is already live"
            ))));
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
            return Err(AllocError::InvalidState(Box::new(msg)));
        }
        self.grow(env, plan.end)?;
        let was = self.slot_held(slot);
        self.commit(slot, plan);
        self.live.insert(branch, slot, size);
        self.account(env, was, slot);
        Ok(self.base + plan.slot.offset)
    }

    /// Free slot `slot` of `branch`; nothing else.
    pub(crate) fn free(&mut self, env: &Env, branch: u32, slot: u32) -> AllocResult<()> {
        let was = self.slot_held(slot);
        if self.live.remove(branch, slot).is_none() {
            return Err(AllocError::InvalidState(Box::new(format!(
                "slot {slot} of branch {branch} is not live"
            ))));
        }
        self.account(env, was, slot);
        Ok(())
    }

    /// What the statistics count of `slot`: while it is live in any branch, one allocation of
    /// the largest size any of its branches asked for (rounded as slots are).
    fn slot_held(&self, slot: u32) -> Held {
        match self.live.largest(slot) {
            Some(req) => Held {
                slots: 1,
                bytes: round(req) as i64,
                requested: req as i64,
            },
            None => Held::default(),
        }
    }

    /// Count the change of `slot` from `was` (its [`Arena::slot_held`] before the call) in the
    /// allocation statistics and the device-wide allocated counter.
    fn account(&mut self, env: &Env, was: Held, slot: u32) {
        let d = self.slot_held(slot).plus(was, -1);
        self.counted = self.counted.plus(d, 1);
        let st = &mut self.stats;
        for (s, d) in [
            (&mut st.allocation, d.slots),
            (&mut st.active, d.slots),
            (&mut st.allocated_bytes, d.bytes),
            (&mut st.active_bytes, d.bytes),
            (&mut st.requested_bytes, d.requested),
        ] {
            if d != 0 {
                s.update(false, d);
            }
        }
        if d.bytes != 0 {
            env.allocated.add(d.bytes);
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
            Some(e) => Err(AllocError::Device(Box::new(e))),
        }
    }

    /// Unmap every page, last first, into the device's page pool. On a device error the pages
    /// still mapped stay the arena's.
    pub(crate) fn unmap_all(&mut self, env: &Env) -> DeviceResult<()> {
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

    pub(crate) fn report(&self, ps: u64) -> ArenaReport {
        ArenaReport {
            base: self.base,
            size: self.end,
            mapped: self.pages.len() as u64 * ps,
            slots: self.slots.len(),
            relocations: self.relocations,
            live: self.live.len,
            overlaps: self.overlaps.clone(),
        }
    }

    /// The mapped pages as one vmm segment of the arena's pool: each slot a block (allocated
    /// while live in any branch), the space between and after them free.
    pub(crate) fn snapshot(&self, ps: u64) -> Option<SegmentSnapshot> {
        let size = self.pages.len() as u64 * ps;
        if size == 0 {
            return None;
        }
        let mut blocks = Vec::new();
        let mut at = 0;
        let free = |addr: u64, size: u64| BlockSnapshot {
            addr,
            size,
            requested: 0,
            state: BlockState::Free,
        };
        for (&k, &s) in self.by_offset.values().map(|k| (k, &self.slots[k])) {
            let hi = (s.offset + s.size).min(size);
            if s.offset >= hi {
                continue;
            }
            if s.offset > at {
                blocks.push(free(self.base + at, s.offset - at));
            }
            at = s.offset;
            if let Some(req) = self.live.largest(k) {
                let used = round(req).min(hi - at);
                blocks.push(BlockSnapshot {
                    addr: self.base + at,
                    size: used,
                    requested: req,
                    state: BlockState::Allocated,
                });
                at += used;
            }
            if at < hi {
                blocks.push(free(self.base + at, hi - at));
            }
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
            // A pause refuses pools with arena pages, so arena pages are never paused.
            paused: false,
            blocks,
        })
    }

    /// The arena's own invariants: slots are disjoint and inside `[0, end)`, every live
    /// allocation's slot exists and holds it, and the statistics match the pages and live slots.
    pub(crate) fn check(&self, ps: u64) -> Result<(), String> {
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
        if self.by_offset.len() != self.slots.len()
            || self
                .by_offset
                .iter()
                .any(|(o, s)| self.slots.get(s).is_none_or(|sl| sl.offset != *o))
        {
            return Err("the offset index differs from the slots".into());
        }
        for ((b, s), req) in self.live.iter() {
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
        let h = self
            .live
            .by_slot
            .keys()
            .fold(Held::default(), |h, &s| h.plus(self.slot_held(s), 1));
        if self.live.iter().count() != self.live.len
            || h != self.counted
            || st.allocated_bytes.all().current != h.bytes
            || st.allocation.all().current != h.slots
            || st.requested_bytes.all().current != h.requested
        {
            return Err("allocation statistics differ from the live slots".into());
        }
        Ok(())
    }
}

/// `size` rounded up to the slot granularity.
fn round(size: u64) -> u64 {
    size.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
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
