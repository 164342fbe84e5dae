//! Page aliasing: one physical page mapped at several page slots of a vmm reservation.
//!
//! A slot keeps its mapping when its blocks are freed, and an idle physical page that another
//! slot needs is mapped there too (one `map`) instead of being moved (an `unmap` and a `map`). A
//! training loop's next iteration then finds most slots it needs mapped to idle pages already,
//! and makes no driver call. The rule that keeps this safe: a physical page backs at most one
//! *occupied* slot (live blocks over it, or graph-retained), so no two live allocations ever
//! share a physical byte. A slot whose page backs another occupied slot is *stale*: before it
//! takes live bytes it is unmapped and mapped to a page of its own, and the pair is remembered
//! as a conflict so that the two slots are not given the same page again.

use rustc_hash::{FxHashMap, FxHashSet};

use super::PageTable;
use crate::device::PageHandle;

/// Most conflicts a page table remembers; past it, it forgets them all and learns again.
const CONFLICTS_MAX: usize = 1 << 16;

/// The aliasing state of one vmm reservation (a part of [`PageTable`]).
#[derive(Clone, Debug, Default)]
pub struct Aliases {
    /// Every physical page of the reservation and the slots where it is mapped (at least one).
    pub slots: FxHashMap<PageHandle, Vec<u32>>,
    /// Bit p set when the page mapped at slot p is mapped at another slot too.
    pub shared_bits: Vec<u64>,
    /// Pairs of slots found occupied at the same time (`pair_key`).
    conflicts: FxHashSet<u64>,
}

fn pair_key(a: usize, b: usize) -> u64 {
    let (lo, hi) = if a < b { (a, b) } else { (b, a) };
    ((lo as u64) << 32) | hi as u64
}

impl PageTable {
    /// Physical pages of the reservation (each counted once, however many slots map it).
    pub fn phys_count(&self) -> usize {
        self.alias.slots.len()
    }

    /// Whether slot `p` has live blocks over it or is graph-retained: its page must back it alone.
    #[inline]
    pub fn occupied(&self, p: usize) -> bool {
        self.live.get(p).is_some_and(|&l| l > 0) || self.is_retained(p)
    }

    /// Whether the page mapped at `p` is mapped at another slot too.
    #[inline]
    pub fn is_shared(&self, p: usize) -> bool {
        self.alias
            .shared_bits
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }

    /// Whether any slot of [first, end) maps a page that another slot maps too.
    #[inline]
    pub fn any_shared(&self, first: usize, end: usize) -> bool {
        if first >= end {
            return false;
        }
        let bits = &self.alias.shared_bits;
        (first / 64..end.div_ceil(64)).any(|w| {
            let lo = first.max(w * 64) - w * 64;
            let hi = end.min(w * 64 + 64) - w * 64;
            let mask = if hi - lo == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - lo)) - 1) << lo
            };
            bits.get(w).is_some_and(|&b| b & mask != 0)
        })
    }

    fn set_shared(&mut self, p: usize, on: bool) {
        let (w, b) = (p / 64, 1u64 << (p % 64));
        if self.alias.shared_bits.len() <= w {
            self.alias.shared_bits.resize(w + 1, 0);
        }
        if on {
            self.alias.shared_bits[w] |= b;
        } else {
            self.alias.shared_bits[w] &= !b;
        }
    }

    /// Record that `page` is now mapped at slot `p` (which had nothing mapped). Returns whether
    /// the page is new to the reservation.
    pub fn add_mapping(&mut self, p: usize, page: PageHandle) -> bool {
        self.cover(p);
        debug_assert!(self.handle[p].is_none(), "slot {p} mapped twice");
        self.handle[p] = Some(page);
        self.mapped_count += 1;
        let slots = self.alias.slots.entry(page).or_default();
        slots.push(p as u32);
        let fresh = slots.len() == 1;
        if slots.len() >= 2 {
            let all: Vec<u32> = slots.clone();
            for s in all {
                self.set_shared(s as usize, true);
            }
        }
        fresh
    }

    /// Forget the mapping of slot `p` (the caller unmapped it): the slot is neither idle nor
    /// retained after. Returns the page and whether it is mapped nowhere else in the reservation
    /// now (it left the reservation).
    pub fn remove_mapping(&mut self, p: usize) -> Option<(PageHandle, bool)> {
        let page = self.handle.get_mut(p)?.take()?;
        self.mapped_count -= 1;
        self.set_idle(p, false);
        self.set_retained(p, false);
        self.set_shared(p, false);
        let slots = self.alias.slots.get_mut(&page)?;
        slots.retain(|&s| s as usize != p);
        let last = slots.is_empty();
        if last {
            self.alias.slots.remove(&page);
        } else if slots.len() == 1 {
            let s = slots[0] as usize;
            self.set_shared(s, false);
        }
        Some((page, last))
    }

    /// The slots where `page` is mapped.
    pub fn slots_of(&self, page: PageHandle) -> &[u32] {
        self.alias.slots.get(&page).map_or(&[], Vec::as_slice)
    }

    /// An occupied slot other than `p` where `page` is mapped, if any.
    pub fn busy_alias(&self, p: usize, page: PageHandle) -> Option<usize> {
        self.slots_of(page)
            .iter()
            .map(|&s| s as usize)
            .find(|&s| s != p && self.occupied(s))
    }

    /// Whether `page` backs no occupied slot.
    pub fn page_idle(&self, page: PageHandle) -> bool {
        self.slots_of(page)
            .iter()
            .all(|&s| !self.occupied(s as usize))
    }

    /// Whether slot `p` shows its page in a snapshot: each physical page once, at its occupied
    /// slot, or at its lowest slot while idle, so that a snapshot's segments add up to the
    /// reserved bytes.
    pub fn shows_page(&self, p: usize) -> bool {
        let Some(h) = self.handle.get(p).copied().flatten() else {
            return false;
        };
        if !self.is_shared(p) || self.occupied(p) {
            return true;
        }
        let slots = self.slots_of(h);
        !slots.iter().any(|&s| self.occupied(s as usize))
            && slots.iter().min().is_some_and(|&s| s as usize == p)
    }

    /// Remember that slots `a` and `b` were needed at the same time.
    pub fn learn_conflict(&mut self, a: usize, b: usize) {
        if self.alias.conflicts.len() >= CONFLICTS_MAX {
            self.alias.conflicts.clear();
        }
        self.alias.conflicts.insert(pair_key(a, b));
    }

    /// Whether slot `p` was ever found needed while a slot where `page` is mapped was.
    pub fn conflicts_with(&self, p: usize, page: PageHandle) -> bool {
        !self.alias.conflicts.is_empty()
            && self
                .slots_of(page)
                .iter()
                .any(|&s| self.alias.conflicts.contains(&pair_key(p, s as usize)))
    }

    /// Check the aliasing state against the mappings: every mapped slot is listed once under its
    /// page, the shared bits say which pages are mapped more than once, and no page backs two
    /// occupied slots.
    pub fn check_aliases(&self) -> Result<(), String> {
        let mut listed = 0;
        for (&page, slots) in &self.alias.slots {
            if slots.is_empty() {
                return Err(format!("11: page {} is listed with no slot", page.0));
            }
            let mut occupied = 0;
            for &s in slots {
                let s = s as usize;
                listed += 1;
                if self.handle.get(s).copied().flatten() != Some(page) {
                    return Err(format!(
                        "11: page {} lists slot {s}, which maps {:?}",
                        page.0,
                        self.handle.get(s)
                    ));
                }
                if self.is_shared(s) != (slots.len() >= 2) {
                    return Err(format!("11: slot {s}'s shared bit is wrong"));
                }
                occupied += usize::from(self.occupied(s));
            }
            if occupied > 1 {
                return Err(format!(
                    "11: page {} backs {occupied} occupied slots {slots:?}",
                    page.0
                ));
            }
        }
        if listed != self.mapped_count {
            return Err(format!(
                "11: {listed} slots listed under pages, {} mapped",
                self.mapped_count
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_shared_bits_and_conflicts() {
        let mut pt = PageTable::default();
        let (a, b) = (PageHandle(1), PageHandle(2));
        assert!(pt.add_mapping(3, a));
        assert!(!pt.is_shared(3));
        assert!(!pt.add_mapping(70, a));
        assert!(pt.is_shared(3) && pt.is_shared(70));
        assert!(pt.any_shared(0, 4) && !pt.any_shared(4, 70) && pt.any_shared(64, 71));
        assert!(pt.add_mapping(5, b));
        assert_eq!(pt.phys_count(), 2);
        pt.check_aliases().unwrap();
        pt.live[70] = 1;
        assert_eq!(pt.busy_alias(3, a), Some(70));
        assert!(!pt.page_idle(a) && pt.page_idle(b));
        pt.live[3] = 1;
        assert!(pt.check_aliases().unwrap_err().starts_with("11:"));
        pt.live[3] = 0;
        pt.learn_conflict(70, 3);
        assert!(pt.conflicts_with(3, a) && !pt.conflicts_with(3, b));
        assert_eq!(pt.remove_mapping(3), Some((a, false)));
        assert!(!pt.is_shared(70));
        assert_eq!(pt.remove_mapping(70), Some((a, true)));
        assert_eq!(pt.phys_count(), 1);
        assert_eq!(pt.mapped_count, 1);
        pt.check_aliases().unwrap();
    }
}
