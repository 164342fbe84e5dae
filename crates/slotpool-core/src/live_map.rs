//! The live map: a shard's allocated blocks by address, an open-addressing hash table in
//! [`Paged`] storage, so that a checkpoint restore puts it back a page at a time and reads what
//! changed from the pages it logged (see "Checkpoint / restore" in `docs/design.md`).
//!
//! Linear probing with backward-shift deletion: no tombstones, so a table that churns under a
//! checkpoint neither slows down nor needs rebuilding. Each entry carries the block's size and
//! segment besides its id: a restore's freed / created lists and its vmm page counts come from
//! the entries alone, without reading a block. It also carries a serial, which allocation
//! (which tenant of the address) it is, so that a restore tells an allocation freed and made
//! again at its address from one that stayed.
//!
//! While a mark is open, every insertion and removal is also appended to an op log: a restore
//! reads what changed from the ops since its mark (a few hundred KB written moments ago) instead
//! of comparing the table's pages then and now (twice the table, cold: on a 2-core VM that took
//! 226 us of a 770 us restore at 10,000 live blocks).

use crate::block::{BlockId, SegmentId};
use crate::device::DevicePtr;
use rustc_hash::FxHashMap;

use crate::paged::{Paged, PagedMark};

/// An allocated block as the live map knows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LiveEntry {
    pub addr: DevicePtr,
    pub size: u64,
    pub id: u32,
    pub segment: u32,
    /// Which allocation this is: stamped by [`LiveMap::insert`] from a counter that never goes
    /// back, and carried unchanged by a restore, which brings back the allocation of the
    /// checkpoint itself. Two entries at one address are the same allocation exactly when
    /// their serials agree (address and size alone cannot tell a block freed and allocated
    /// again at the same place from one that stayed live).
    pub serial: u64,
}

/// An empty slot: no allocation starts at the last byte of the address space.
const EMPTY: DevicePtr = DevicePtr::MAX;

impl Default for LiveEntry {
    fn default() -> Self {
        LiveEntry {
            addr: EMPTY,
            size: 0,
            id: 0,
            segment: 0,
            serial: 0,
        }
    }
}

impl LiveEntry {
    pub(crate) fn new(addr: DevicePtr, size: u64, id: BlockId, segment: SegmentId) -> Self {
        debug_assert_ne!(addr, EMPTY);
        LiveEntry {
            addr,
            size,
            id: u32::try_from(id).expect("block id over u32"),
            segment: u32::try_from(segment).expect("segment id over u32"),
            serial: 0,
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.addr == EMPTY
    }

    pub(crate) fn block(&self) -> BlockId {
        self.id as BlockId
    }

    pub(crate) fn segment(&self) -> SegmentId {
        self.segment as SegmentId
    }
}

/// Slots per page: 4 KiB.
const PAGE: usize = 128;
/// Slots of a new table (one page).
const MIN_SLOTS: usize = PAGE;

/// A mark of the live map: its slots, its length and its place in the op log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LiveMark {
    slots: PagedMark,
    /// The length then, restored as it is.
    len: usize,
    /// Op log position, counted from the first op ever logged.
    ops: u64,
}

/// An insertion or a removal, logged while a mark is open.
#[derive(Clone, Copy, Debug)]
struct LiveOp {
    entry: LiveEntry,
    inserted: bool,
    /// For its address's first op since the window's base: how many ops later that address's
    /// last op is (0: it is the only one). [`LATER_OP`] for the last op. Set by
    /// [`LiveMap::log`]; read only for ops since the window's base (it fits in the entry's
    /// padding).
    later: u32,
}

/// [`LiveOp::later`] of an address's last op, when it is not also its first.
const LATER_OP: u32 = u32::MAX;

impl LiveOp {
    fn new(entry: LiveEntry, inserted: bool) -> Self {
        LiveOp {
            entry,
            inserted,
            later: 0,
        }
    }
}

/// See the module documentation.
///
/// Invariants (checked by [`LiveMap::check`]):
/// 1. the table has a power-of-two number of slots, at least one page, whole pages;
/// 2. `len` is the number of occupied slots, at most 3/4 of them;
/// 3. every entry is reachable from its home slot without crossing an empty slot, and no
///    address is in the table twice.
#[derive(Clone, Debug)]
pub(crate) struct LiveMap {
    slots: Paged<LiveEntry, PAGE>,
    len: usize,
    /// The serial of the last insertion ([`LiveEntry::serial`]); not part of any mark.
    serial: u64,
    /// Insertions and removals since the oldest open mark.
    ops: Vec<LiveOp>,
    /// Position of `ops[0]`.
    ops_base: u64,
    /// Per address changed since the newest mark (or restore), the positions of its first and
    /// last op since then: a restore reads only those two, so an address changed over and over
    /// under a checkpoint keeps two ops, not one per change.
    window: FxHashMap<DevicePtr, (u64, u64)>,
    /// Op log position of the newest mark (or restore) the window counts from.
    window_base: u64,
}

impl Default for LiveMap {
    fn default() -> Self {
        let mut slots = Paged::default();
        slots.reserve_pages(8);
        for _ in 0..MIN_SLOTS {
            slots.push(LiveEntry::default());
        }
        LiveMap {
            slots,
            len: 0,
            serial: 0,
            ops: Vec::new(),
            ops_base: 0,
            window: FxHashMap::default(),
            window_base: 0,
        }
    }
}

#[inline]
fn home(addr: DevicePtr, mask: usize) -> usize {
    // Addresses are multiples of 512 and run in steps of it: Fibonacci hashing spreads them.
    ((addr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask
}

impl LiveMap {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots in the table.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    fn slot(&self, i: usize) -> &LiveEntry {
        // The table is whole pages: every slot below the capacity is in one.
        self.slots.at(i)
    }

    /// Where `addr` is, or the empty slot that ends its probe.
    #[inline]
    fn find(&self, addr: DevicePtr) -> (usize, bool) {
        let mask = self.capacity() - 1;
        let mut i = home(addr, mask);
        loop {
            let e = self.slot(i);
            if e.addr == addr {
                return (i, true);
            }
            if e.is_empty() {
                return (i, false);
            }
            i = (i + 1) & mask;
        }
    }

    #[inline]
    pub(crate) fn get(&self, addr: DevicePtr) -> Option<&LiveEntry> {
        if addr == EMPTY {
            return None;
        }
        match self.find(addr) {
            (i, true) => Some(self.slot(i)),
            _ => None,
        }
    }

    /// Add `e`, a new allocation whose address must not be in the map, under a new serial.
    #[inline]
    pub(crate) fn insert(&mut self, mut e: LiveEntry) {
        self.serial += 1;
        e.serial = self.serial;
        if (self.len() + 1) * 4 > self.capacity() * 3 {
            self.grow();
        }
        let (i, found) = self.find(e.addr);
        debug_assert!(!found, "{:#x} is live twice", e.addr);
        *self.slots.at_mut(i) = e;
        self.len += 1;
        if self.slots.logging() {
            self.log(LiveOp::new(e, true));
        }
    }

    /// Take `addr` out; returns its entry.
    #[inline]
    pub(crate) fn remove(&mut self, addr: DevicePtr) -> Option<LiveEntry> {
        if addr == EMPTY {
            return None;
        }
        let (mut hole, true) = self.find(addr) else {
            return None;
        };
        let gone = *self.slot(hole);
        let mask = self.capacity() - 1;
        // Backward shift: move each later entry of the run into the hole if its home allows.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let e = *self.slot(j);
            if e.is_empty() {
                break;
            }
            let h = home(e.addr, mask);
            // `e` may move to `hole` unless its home lies cyclically in (hole, j].
            let stays = if hole <= j {
                hole < h && h <= j
            } else {
                hole < h || h <= j
            };
            if !stays {
                *self.slots.at_mut(hole) = e;
                hole = j;
            }
        }
        *self.slots.at_mut(hole) = LiveEntry::default();
        self.len -= 1;
        if self.slots.logging() {
            self.log(LiveOp::new(gone, false));
        }
        Some(gone)
    }

    /// Append `op`, keeping only the first and the last op of its address since the newest
    /// mark: a second op goes after the first, later ones replace the second. An insertion
    /// that is its address's only op and the log's last one, undone at once, leaves nothing.
    fn log(&mut self, mut op: LiveOp) {
        let end = self.ops_base + self.ops.len() as u64;
        match self.window.get_mut(&op.entry.addr) {
            None => {
                self.window.insert(op.entry.addr, (end, end));
                op.later = 0;
                self.ops.push(op);
            }
            Some(&mut (first, last)) if first == last => {
                if last + 1 == end && !op.inserted && self.ops[self.ops.len() - 1].inserted {
                    self.ops.pop();
                    self.window.remove(&op.entry.addr);
                } else {
                    self.window.insert(op.entry.addr, (first, end));
                    // Under 4G ops: each takes 40 bytes.
                    self.ops[(first - self.ops_base) as usize].later =
                        u32::try_from(end - first).expect("op log under 4G ops");
                    op.later = LATER_OP;
                    self.ops.push(op);
                }
            }
            Some(&mut (_, last)) => {
                op.later = LATER_OP;
                self.ops[(last - self.ops_base) as usize] = op;
            }
        }
    }

    /// Double the table. Under an open mark this is a change like any other: the old pages are
    /// logged and a restore puts the smaller table back.
    #[cold]
    fn grow(&mut self) {
        let entries: Vec<LiveEntry> = self.iter().copied().collect();
        let n = self.capacity();
        for i in 0..n {
            if !self.slot(i).is_empty() {
                *self.slots.at_mut(i) = LiveEntry::default();
            }
        }
        for _ in 0..n {
            self.slots.push(LiveEntry::default());
        }
        // Moving entries changes no membership: nothing goes to the op log.
        for e in entries {
            let (i, _) = self.find(e.addr);
            *self.slots.at_mut(i) = e;
        }
    }

    /// Entries in table order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &LiveEntry> {
        (0..self.capacity())
            .map(|i| self.slot(i))
            .filter(|e| !e.is_empty())
    }

    /// Empty the map (logged like any change while a mark is open).
    pub(crate) fn clear(&mut self) {
        for i in 0..self.capacity() {
            let e = *self.slot(i);
            if !e.is_empty() {
                *self.slots.at_mut(i) = LiveEntry::default();
                if self.slots.logging() {
                    self.log(LiveOp::new(e, false));
                }
            }
        }
        self.len = 0;
    }

    pub(crate) fn mark(&mut self) -> LiveMark {
        self.window.clear();
        self.window_base = self.ops_base + self.ops.len() as u64;
        LiveMark {
            slots: self.slots.mark(),
            len: self.len,
            ops: self.window_base,
        }
    }

    /// Ops logged since `m`, as an index into `ops`.
    fn ops_start(&self, m: LiveMark) -> usize {
        let start = m.ops.checked_sub(self.ops_base).expect("a forgotten mark");
        usize::try_from(start)
            .expect("op log position")
            .min(self.ops.len())
    }

    /// What differs between the map at `m` and now: `freed` gets the allocations live now and
    /// not then, `created` those live then and not now. An address that holds another
    /// allocation now than then (freed and allocated again since, at any size) is in both; one
    /// whose allocation is the same at both ends ([`LiveEntry::serial`]) drops out. Costs the
    /// ops logged since `m`. Since the newest mark (the window) each address has at most two,
    /// the first linked to the last ([`LiveOp::later`]): they are read once, in order, and the
    /// lists come in the order the addresses first changed. The ops between an older mark and
    /// the window go through `ends` (a buffer), each address's first and last there.
    pub(crate) fn changes_since<'a>(
        &'a self,
        m: LiveMark,
        ends: &mut FxHashMap<DevicePtr, (usize, usize)>,
        freed: &mut Vec<LiveEntry>,
        created: &mut Vec<LiveEntry>,
    ) {
        let ops = &self.ops;
        let start = self.ops_start(m);
        // Where the window starts (`m` itself for the newest mark), as an index into `ops`.
        let window = usize::try_from(self.window_base.saturating_sub(self.ops_base))
            .unwrap_or(usize::MAX)
            .clamp(start, ops.len());
        // The first op says what the address held then (a removal: that entry; an insertion:
        // nothing), the last what it holds now. Matched on the two flags, not through options
        // of entries: this runs once per changed address.
        let mut net = |first: &LiveOp, last: &LiveOp| match (first.inserted, last.inserted) {
            (true, true) => freed.push(last.entry),
            (false, false) => created.push(first.entry),
            (false, true) => {
                if first.entry.serial == last.entry.serial {
                    debug_assert_eq!(first.entry, last.entry, "one allocation, two entries");
                } else {
                    freed.push(last.entry);
                    created.push(first.entry);
                }
            }
            (true, false) => {}
        };
        ends.clear();
        for (k, op) in ops.iter().enumerate().take(window).skip(start) {
            ends.entry(op.entry.addr)
                .and_modify(|e| e.1 = k)
                .or_insert((k, k));
        }
        // The window's addresses; one that changed before it too starts from its first op
        // there.
        let in_window = &ops[window..];
        let last_of = |k: usize, op: &'a LiveOp| match op.later {
            LATER_OP => None,
            0 => Some(op),
            later => Some(&in_window[k + later as usize]),
        };
        if ends.is_empty() {
            // A restore to the newest mark: each address's first op links to its last.
            for (k, op) in in_window.iter().enumerate() {
                if let Some(last) = last_of(k, op) {
                    net(op, last);
                }
            }
        } else {
            for (k, op) in in_window.iter().enumerate() {
                if let Some(last) = last_of(k, op) {
                    let first = ends
                        .remove(&op.entry.addr)
                        .map_or(op, |(first, _)| &ops[first]);
                    net(first, last);
                }
            }
        }
        // The addresses that changed before the window only, in the order of their first op.
        for (k, op) in ops.iter().enumerate().take(window).skip(start) {
            if let Some(&(first, last)) = ends.get(&op.entry.addr)
                && first == k
            {
                net(op, &ops[last]);
            }
        }
    }

    /// Back to the map at `m` (`journaled`: later marks are open; see [`Paged::restore`]). A
    /// journaled restore logs its own removals (`freed`) and insertions (`created`), as
    /// [`LiveMap::changes_since`] reported them.
    pub(crate) fn restore(
        &mut self,
        m: LiveMark,
        journaled: bool,
        freed: &[LiveEntry],
        created: &[LiveEntry],
    ) {
        self.slots.restore(m.slots, journaled);
        self.len = m.len;
        if journaled {
            let removed = freed.iter().map(|&entry| LiveOp::new(entry, false));
            let inserted = created.iter().map(|&entry| LiveOp::new(entry, true));
            for op in removed.chain(inserted) {
                self.log(op);
            }
        } else {
            let start = self.ops_start(m);
            self.ops.truncate(start);
            self.window.clear();
            self.window_base = m.ops;
        }
    }

    pub(crate) fn forget_before(&mut self, m: LiveMark) {
        self.slots.forget_before(m.slots);
        let n = self.ops_start(m);
        self.ops.drain(..n);
        self.ops_base += n as u64;
    }

    pub(crate) fn forget_all(&mut self) {
        self.slots.forget_all();
        self.ops_base += self.ops.len() as u64;
        self.ops.clear();
        self.window.clear();
    }

    /// Pages, lengths and ops logged for the open marks.
    pub(crate) fn log_len(&self) -> usize {
        self.slots.log_len() + self.ops.len()
    }

    /// Its invariants (see the type) and its storage's.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.slots.check()?;
        let n = self.capacity();
        if !n.is_power_of_two() || n < MIN_SLOTS || !n.is_multiple_of(PAGE) {
            return Err(format!("live map of {n} slots (1)"));
        }
        let occupied = self.iter().count();
        if occupied != self.len() || self.len() * 4 > n * 3 {
            return Err(format!(
                "live map counts {} entries, holds {occupied} in {n} slots (2)",
                self.len()
            ));
        }
        let mask = n - 1;
        for i in 0..n {
            let e = self.slot(i);
            if e.is_empty() {
                continue;
            }
            let mut k = home(e.addr, mask);
            while k != i {
                if self.slot(k).is_empty() {
                    return Err(format!("{:#x} is cut off from its home slot (3)", e.addr));
                }
                if self.slot(k).addr == e.addr {
                    return Err(format!("{:#x} is in the map twice (3)", e.addr));
                }
                k = (k + 1) & mask;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u64),
        Remove(usize),
        Mark,
        Restore(usize),
        Forget(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0u64..4096, 1u64..4).prop_map(|(k, s)| Op::Insert(k, s)),
            4 => any::<usize>().prop_map(Op::Remove),
            1 => Just(Op::Mark),
            1 => any::<usize>().prop_map(Op::Restore),
            1 => any::<usize>().prop_map(Op::Forget),
        ]
    }

    type Model = BTreeMap<u64, LiveEntry>;

    fn contents(m: &LiveMap) -> Model {
        m.iter().map(|e| (e.addr, *e)).collect()
    }

    proptest! {
        /// Against a `BTreeMap` and a copy of it per mark: lookups, the invariants after every
        /// step, restores to any open mark in any order (the newest, read through the window,
        /// and older ones), and `changes_since` naming exactly the addresses whose allocation
        /// differs (another one, at any size, or one on one side only), each once. Sizes come
        /// from a set of three, so that an address is often freed and allocated again at its
        /// size.
        #[test]
        fn matches_a_map_through_marks_and_restores(ops in prop::collection::vec(op(), 1..400)) {
            let mut m = LiveMap::default();
            let mut model = Model::new();
            let mut marks: Vec<(LiveMark, Model)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(k, s) => {
                        // Addresses 512 apart, in a few segments' worth of range.
                        let addr = (1 << 32) + k * 512;
                        if model.contains_key(&addr) {
                            continue;
                        }
                        m.insert(LiveEntry::new(addr, 512 * s, k as usize, 0));
                        let e = *m.get(addr).expect("just inserted");
                        prop_assert!(model.values().all(|x| x.serial < e.serial));
                        model.insert(addr, e);
                    }
                    Op::Remove(k) => {
                        if model.is_empty() {
                            prop_assert_eq!(m.remove(1 << 32), None);
                            continue;
                        }
                        let addr = *model.keys().nth(k % model.len()).unwrap();
                        prop_assert_eq!(m.remove(addr), model.remove(&addr));
                        prop_assert!(m.get(addr).is_none());
                    }
                    Op::Mark => marks.push((m.mark(), model.clone())),
                    Op::Restore(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        let k = k % marks.len();
                        let (then, now) = (&marks[k].1, &model);
                        let (mut freed, mut created) = (Vec::new(), Vec::new());
                        m.changes_since(
                            marks[k].0,
                            &mut FxHashMap::default(),
                            &mut freed,
                            &mut created,
                        );
                        // In no particular order: each list by address against the model's.
                        freed.sort_by_key(|e| e.addr);
                        created.sort_by_key(|e| e.addr);
                        // Exactly the addresses whose allocation differs (or that exist on one
                        // side), whole entries: a restore brings back the checkpoint's own.
                        let want_freed: Vec<LiveEntry> = now
                            .iter()
                            .filter(|(a, e)| then.get(a) != Some(e))
                            .map(|(_, e)| *e)
                            .collect();
                        let want_created: Vec<LiveEntry> = then
                            .iter()
                            .filter(|(a, e)| now.get(a) != Some(e))
                            .map(|(_, e)| *e)
                            .collect();
                        prop_assert_eq!(&freed, &want_freed);
                        prop_assert_eq!(&created, &want_created);
                        m.restore(marks[k].0, k + 1 < marks.len(), &freed, &created);
                        model = marks[k].1.clone();
                    }
                    Op::Forget(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        marks.remove(k % marks.len());
                        match marks.first() {
                            Some(&(oldest, _)) => m.forget_before(oldest),
                            None => m.forget_all(),
                        }
                    }
                }
                prop_assert_eq!(m.check(), Ok(()));
                prop_assert_eq!(m.len(), model.len());
                prop_assert_eq!(contents(&m), model.clone());
                for (a, e) in &model {
                    prop_assert_eq!(m.get(*a), Some(e));
                }
                if marks.is_empty() {
                    prop_assert_eq!(m.log_len(), 0);
                }
            }
        }
    }

    #[test]
    fn grows_and_keeps_every_entry() {
        let mut m = LiveMap::default();
        for k in 0..10_000u64 {
            m.insert(LiveEntry::new((1 << 40) + k * 512, 512, k as usize, 1));
        }
        assert_eq!(m.check(), Ok(()));
        assert_eq!(m.len(), 10_000);
        assert!(m.capacity() >= 10_000 * 4 / 3);
        for k in (0..10_000u64).step_by(3) {
            assert_eq!(m.remove((1 << 40) + k * 512).map(|e| e.id), Some(k as u32));
        }
        assert_eq!(m.check(), Ok(()));
        assert!(m.get(1 << 40).is_none());
        assert_eq!(m.get((1 << 40) + 512).map(|e| e.id), Some(1));
    }
}
