//! The free index of one size class (small or large) of a shard: free blocks ordered by
//! `(size, address, id)`, so that best fit is PyTorch's `lower_bound` on `(size, ptr)`.
//!
//! Sorted leaves of up to [`LEAF`] keys, each holding sizes of one power of two (a *bin*), and
//! a directory of them in key order: per bin, the range of directory entries its leaves take and
//! the lowest key each leaf may hold (a short binary search), plus a bitmap of the bins that hold
//! anything. The first key at least `size` is in `size`'s own bin or is the first key of the next
//! bin that holds any, which is exactly what one ordered set would give.
//!
//! Leaves live in [`Paged`] storage and the directory in [`Logged`], so that a checkpoint costs
//! nothing here and a restore puts back the leaves changed since it, a pointer each
//! ([`FreeIndex::restore`]), instead of re-indexing block after block. A leaf is logged once per
//! window (512 bytes), the directory once per window too.

use std::cell::Cell;

use crate::block::BlockId;
use crate::device::DevicePtr;
use crate::paged::{Logged, Paged, PagedMark};

/// A free-index key: (size, address, id). Best fit is the first key at or above `(size, 0, 0)`,
/// the lowest address on ties, as PyTorch's `std::set` ordered by (stream, size, ptr).
pub(crate) type FreeKey = (u64, DevicePtr, BlockId);

/// Keys a leaf holds at most.
const LEAF: usize = 21;
/// A leaf this empty merges with its right neighbour (of the same bin) when both fit in
/// [`MERGED_MAX`].
const MERGE_BELOW: usize = LEAF / 4;
const MERGED_MAX: usize = LEAF * 3 / 4;
const BINS: usize = 64;

/// The bin of a block of `size` bytes.
#[inline]
fn bin(size: u64) -> usize {
    63 - size.max(1).leading_zeros() as usize
}

/// Whether `(s1, a1) < (s2, a2)`, as a value rather than a branch (searches choose with it).
#[inline(always)]
fn less(s1: u64, a1: u64, s2: u64, a2: u64) -> bool {
    (s1 < s2) | ((s1 == s2) & (a1 < a2))
}

/// Up to [`LEAF`] keys of one bin in order (free blocks' addresses are unique, so (size,
/// address) orders them and the id rides along).
#[derive(Clone, Debug)]
struct Leaf {
    len: u32,
    keys: [FreeKey; LEAF],
}

impl Default for Leaf {
    fn default() -> Self {
        Leaf {
            len: 0,
            keys: [(0, 0, 0); LEAF],
        }
    }
}

impl Leaf {
    #[inline]
    fn key(&self, at: usize) -> FreeKey {
        self.keys[at]
    }

    /// Where (`s`, `a`) is or would go: the number of keys below it (a binary search that
    /// chooses without branching).
    #[inline]
    fn find(&self, s: u64, a: u64) -> usize {
        let mut base = 0;
        let mut n = self.len as usize;
        if n == 0 {
            return 0;
        }
        while n > 1 {
            let half = n / 2;
            let mid = base + half;
            let k = &self.keys[mid - 1];
            base = if less(k.0, k.1, s, a) { mid } else { base };
            n -= half;
        }
        let k = &self.keys[base];
        base + less(k.0, k.1, s, a) as usize
    }

    #[inline]
    fn holds(&self, at: usize, s: u64, a: u64) -> bool {
        at < self.len as usize && self.keys[at].0 == s && self.keys[at].1 == a
    }

    /// Open a slot at `at` for `key` (the leaf is not full).
    #[inline]
    fn open(&mut self, at: usize, key: FreeKey) {
        let n = self.len as usize;
        self.keys.copy_within(at..n, at + 1);
        self.keys[at] = key;
        self.len += 1;
    }

    /// Close the slot at `at`.
    #[inline]
    fn close(&mut self, at: usize) {
        let n = self.len as usize;
        self.keys.copy_within(at + 1..n, at);
        self.len -= 1;
    }

    /// Append `other`'s keys (they all follow this leaf's).
    fn append(&mut self, other: &Leaf) {
        let (n, m) = (self.len as usize, other.len as usize);
        self.keys[n..n + m].copy_from_slice(&other.keys[..m]);
        self.len += other.len;
    }
}

/// Everything but the leaves, changed only when a leaf comes or goes: logged whole, once per
/// window.
#[derive(Clone, Debug)]
struct Meta {
    /// Bin `b`'s leaves are directory entries `first[b]..first[b + 1]`. A bin that emptied
    /// keeps its last leaf, empty: bins that fill and empty over and over (most of a mixed
    /// workload's) then change no directory.
    first: [u32; BINS + 1],
    /// Bit `b` set when bin `b` holds keys.
    nonempty: u64,
    /// The lowest key each leaf may hold, as (size, address) columns (the first leaf of a bin:
    /// any key of it).
    /// Leaf `leaves[i]` holds the keys of its bin in `[sep[i], sep[i + 1])`.
    sep_size: Vec<u64>,
    sep_addr: Vec<u64>,
    leaves: Vec<u32>,
    /// Leaves not in `leaves`, for reuse.
    vacant: Vec<u32>,
}

impl Default for Meta {
    fn default() -> Self {
        Meta {
            first: [0; BINS + 1],
            nonempty: 0,
            sep_size: Vec::new(),
            sep_addr: Vec::new(),
            leaves: Vec::new(),
            vacant: Vec::new(),
        }
    }
}

impl Meta {
    /// Bin `b`'s directory entries.
    #[inline]
    fn range(&self, b: usize) -> (usize, usize) {
        (self.first[b] as usize, self.first[b + 1] as usize)
    }

    /// The entry among `lo..hi` (not empty) whose leaf holds (`s`, `a`)'s place: the last one
    /// whose separator is at or below it, or the first (a binary search that chooses without
    /// branching).
    #[inline]
    fn locate(&self, lo: usize, hi: usize, s: u64, a: u64) -> usize {
        let (ss, sa) = (&self.sep_size, &self.sep_addr);
        let mut base = lo;
        let mut n = hi - lo;
        while n > 1 {
            let half = n / 2;
            let mid = base + half;
            base = if less(s, a, ss[mid], sa[mid]) {
                base
            } else {
                mid
            };
            n -= half;
        }
        base
    }

    /// Put leaf `id` at directory entry `i` of bin `b`, its keys starting at `sep`.
    fn insert(&mut self, b: usize, i: usize, (s, a): (u64, u64), id: u32) {
        self.sep_size.insert(i, s);
        self.sep_addr.insert(i, a);
        self.leaves.insert(i, id);
        for f in &mut self.first[b + 1..] {
            *f += 1;
        }
    }

    /// Take directory entry `i` of bin `b` away; returns its leaf.
    fn remove(&mut self, b: usize, i: usize) -> u32 {
        self.sep_size.remove(i);
        self.sep_addr.remove(i);
        let id = self.leaves.remove(i);
        for f in &mut self.first[b + 1..] {
            *f -= 1;
        }
        self.vacant.push(id);
        id
    }
}

/// Free blocks of one size class, ordered by [`FreeKey`]. See the module documentation.
#[derive(Clone, Debug)]
pub(crate) struct FreeIndex {
    leaves: Paged<Leaf, 1>,
    meta: Logged<Meta>,
    /// Where [`FreeIndex::first_at_least`] last found its key (directory entry, slot): an
    /// allocation removes the key it found next, and [`FreeIndex::remove`] checks here before
    /// it searches. Checked, never trusted: a stale place simply does not hold the key.
    found: Cell<(u32, u32)>,
}

impl Default for FreeIndex {
    fn default() -> Self {
        FreeIndex {
            leaves: Paged::default(),
            meta: Logged::new(Meta::default()),
            found: Cell::new((u32::MAX, 0)),
        }
    }
}

/// A checkpoint mark's place in a [`FreeIndex`]'s logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IndexMark {
    leaves: PagedMark,
    meta: PagedMark,
}

impl FreeIndex {
    #[inline]
    fn meta(&self) -> &Meta {
        self.meta.get()
    }

    #[inline]
    fn meta_mut(&mut self) -> &mut Meta {
        self.meta.get_mut()
    }

    #[inline]
    fn leaf(&self, id: u32) -> &Leaf {
        self.leaves
            .get(id as usize)
            .expect("a leaf of the directory")
    }

    #[inline]
    fn leaf_mut(&mut self, id: u32) -> &mut Leaf {
        self.leaves
            .get_mut(id as usize)
            .expect("a leaf of the directory")
    }

    /// Keys held (a sum over the leaves: only invariant checks ask).
    pub(crate) fn len(&self) -> usize {
        self.meta()
            .leaves
            .iter()
            .map(|&l| self.leaf(l).len as usize)
            .sum()
    }

    /// A leaf holding `keys`: a vacant one, or a new one.
    fn new_leaf(&mut self, fill: impl FnOnce(&mut Leaf)) -> u32 {
        match self.meta_mut().vacant.pop() {
            Some(id) => {
                let leaf = self.leaf_mut(id);
                leaf.len = 0;
                fill(leaf);
                id
            }
            None => {
                let mut leaf = Leaf::default();
                fill(&mut leaf);
                u32::try_from(self.leaves.push(leaf)).expect("free-index leaves over u32")
            }
        }
    }

    /// Add `key`; false if it was there.
    #[inline]
    pub(crate) fn insert(&mut self, key: FreeKey) -> bool {
        let (s, a, _) = key;
        let b = bin(s);
        let meta = self.meta();
        let (lo, hi) = meta.range(b);
        if lo == hi {
            self.first_of_bin(b, key);
            return true;
        }
        let empty = meta.nonempty & (1 << b) == 0;
        let i = meta.locate(lo, hi, s, a);
        let id = meta.leaves[i];
        let leaf = self.leaf(id);
        let at = leaf.find(s, a);
        if leaf.holds(at, s, a) {
            return false;
        }
        if leaf.len as usize == LEAF {
            self.split(b, i, id, at, key);
        } else {
            self.leaf_mut(id).open(at, key);
        }
        if empty {
            self.meta_mut().nonempty |= 1 << b;
        }
        true
    }

    /// The first key of a bin that never had a leaf: a leaf of its own.
    #[cold]
    #[inline(never)]
    fn first_of_bin(&mut self, b: usize, key: FreeKey) {
        let id = self.new_leaf(|leaf| leaf.open(0, key));
        let i = self.meta().first[b] as usize;
        let meta = self.meta_mut();
        meta.insert(b, i, (key.0, key.1), id);
        meta.nonempty |= 1 << b;
    }

    /// Split full leaf `leaves[i]` = `id` of bin `b` in two halves, with `key` going in at `at`.
    #[cold]
    #[inline(never)]
    fn split(&mut self, b: usize, i: usize, id: u32, at: usize, key: FreeKey) {
        let half = LEAF / 2;
        let upper = {
            let leaf = self.leaf(id);
            let mut upper = Leaf {
                len: (LEAF - half) as u32,
                ..Leaf::default()
            };
            upper.keys[..LEAF - half].copy_from_slice(&leaf.keys[half..]);
            upper
        };
        let sep = (upper.keys[0].0, upper.keys[0].1);
        let r = self.new_leaf(|leaf| leaf.append(&upper));
        self.leaf_mut(id).len = half as u32;
        self.meta_mut().insert(b, i + 1, sep, r);
        if at <= half {
            self.leaf_mut(id).open(at, key);
        } else {
            self.leaf_mut(r).open(at - half, key);
        }
    }

    /// Remove `key`; false if it was not there.
    #[inline]
    pub(crate) fn remove(&mut self, key: &FreeKey) -> bool {
        let &(s, a, block) = key;
        let b = bin(s);
        let meta = self.meta();
        let (i, at) = self.found.get();
        let (i, at) = match meta.leaves.get(i as usize) {
            Some(&id) if self.leaf(id).holds(at as usize, s, a) => (i as usize, at as usize),
            _ => {
                let (lo, hi) = meta.range(b);
                if lo == hi {
                    return false;
                }
                let i = meta.locate(lo, hi, s, a);
                (i, self.leaf(meta.leaves[i]).find(s, a))
            }
        };
        let id = meta.leaves[i];
        let leaf = self.leaf(id);
        if !leaf.holds(at, s, a) || leaf.keys[at].2 != block {
            return false;
        }
        let leaf = self.leaf_mut(id);
        leaf.close(at);
        if leaf.len as usize <= MERGE_BELOW {
            self.shrink(b, i, id);
        }
        true
    }

    /// Leaf `leaves[i]` = `id` of bin `b` is sparse: an empty one goes (its range to its left
    /// neighbour, or for the first leaf of the bin to its right one) unless it is the bin's
    /// last; a sparse one takes in its right neighbour of the same bin if both fit in
    /// [`MERGED_MAX`].
    #[cold]
    #[inline(never)]
    fn shrink(&mut self, b: usize, i: usize, id: u32) {
        let n = self.leaf(id).len as usize;
        let (lo, hi) = self.meta().range(b);
        if n == 0 {
            let meta = self.meta_mut();
            if hi - lo == 1 {
                meta.nonempty &= !(1 << b);
            } else {
                meta.remove(b, i);
            }
            return;
        }
        if i + 1 >= hi {
            return;
        }
        let right = self.meta().leaves[i + 1];
        if n + self.leaf(right).len as usize > MERGED_MAX {
            return;
        }
        let moved = self.leaf(right).clone();
        self.leaf_mut(id).append(&moved);
        self.meta_mut().remove(b, i + 1);
    }

    pub(crate) fn contains(&self, key: &FreeKey) -> bool {
        let &(s, a, block) = key;
        let meta = self.meta();
        let (lo, hi) = meta.range(bin(s));
        if lo == hi {
            return false;
        }
        let leaf = self.leaf(meta.leaves[meta.locate(lo, hi, s, a)]);
        let at = leaf.find(s, a);
        leaf.holds(at, s, a) && leaf.keys[at].2 == block
    }

    /// The first key of at least `size` bytes: the best fit.
    #[inline]
    pub(crate) fn first_at_least(&self, size: u64) -> Option<FreeKey> {
        let meta = self.meta();
        let b = bin(size);
        let (lo, hi) = meta.range(b);
        if lo < hi {
            let i = meta.locate(lo, hi, size, 0);
            let leaf = self.leaf(meta.leaves[i]);
            let at = leaf.find(size, 0);
            if at < leaf.len as usize {
                self.found.set((i as u32, at as u32));
                return Some(leaf.key(at));
            }
            // Every key of the bin's next leaf is at least its separator, above (size, 0).
            if i + 1 < hi {
                self.found.set((i as u32 + 1, 0));
                return Some(self.leaf(meta.leaves[i + 1]).key(0));
            }
        }
        let above = meta.nonempty & !((2u64 << b).wrapping_sub(1));
        if b == BINS - 1 || above == 0 {
            return None;
        }
        let next = meta.first[above.trailing_zeros() as usize];
        self.found.set((next, 0));
        Some(self.leaf(meta.leaves[next as usize]).key(0))
    }

    /// A checkpoint mark: changes from now on are logged (see [`crate::paged`]).
    pub(crate) fn mark(&mut self) -> IndexMark {
        IndexMark {
            leaves: self.leaves.mark(),
            meta: self.meta.mark(),
        }
    }

    /// Back to the index at `m` (`journaled`: later marks are open; see [`Paged::restore`]).
    pub(crate) fn restore(&mut self, m: IndexMark, journaled: bool) {
        self.leaves.restore(m.leaves, journaled);
        self.meta.restore(m.meta, journaled);
    }

    /// Empty, as a change like any other (logged while marks are open): the leaves stay, all
    /// vacant.
    pub(crate) fn clear(&mut self) {
        let n = u32::try_from(self.leaves.len()).expect("free-index leaves over u32");
        *self.meta_mut() = Meta {
            vacant: (0..n).rev().collect(),
            ..Meta::default()
        };
    }

    /// The oldest open mark is now `m`.
    pub(crate) fn forget_before(&mut self, m: IndexMark) {
        self.leaves.forget_before(m.leaves);
        self.meta.forget_before(m.meta);
    }

    /// No mark is open any more.
    pub(crate) fn forget_all(&mut self) {
        self.leaves.forget_all();
        self.meta.forget_all();
    }

    /// Leaves and directories logged for the open marks.
    pub(crate) fn log_len(&self) -> usize {
        self.leaves.log_len() + self.meta.log_len()
    }

    /// Its own consistency (shard invariant 3 relies on it): the bins' ranges tile the
    /// directory and the bitmap marks the bins that hold keys; each leaf the directory names
    /// holds keys of its bin only, sorted, within its separators and above the previous leaf's,
    /// at least one unless it is its bin's only leaf; every leaf is named once or vacant.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.leaves
            .check()
            .map_err(|e| format!("3: free-index leaves: {e}"))?;
        self.meta
            .check()
            .map_err(|e| format!("3: free-index directory: {e}"))?;
        let meta = self.meta();
        let count = meta.leaves.len();
        if meta.sep_size.len() != count
            || meta.sep_addr.len() != count
            || meta.first[0] != 0
            || meta.first[BINS] as usize != count
            || !meta.first.is_sorted()
        {
            return Err("3: the free index's directory is malformed".into());
        }
        let mut named = vec![false; self.leaves.len()];
        let mut prev: Option<(u64, u64)> = None;
        for b in 0..BINS {
            let (lo, hi) = meta.range(b);
            let holds = (lo..hi).any(|i| self.leaf(meta.leaves[i]).len > 0);
            if (meta.nonempty >> b & 1 == 1) != holds {
                return Err(format!(
                    "3: free-index bin {b}'s bit does not match its leaves"
                ));
            }
            for i in lo..hi {
                let id = meta.leaves[i];
                let Some(slot) = named.get_mut(id as usize) else {
                    return Err(format!("3: free-index leaf {id} does not exist"));
                };
                if std::mem::replace(slot, true) {
                    return Err(format!("3: free-index leaf {id} named twice"));
                }
                let leaf = self.leaf(id);
                let n = leaf.len as usize;
                let keys: Vec<(u64, u64)> = leaf.keys[..n].iter().map(|k| (k.0, k.1)).collect();
                let sep = (meta.sep_size[i], meta.sep_addr[i]);
                let upper = (i + 1 < hi).then(|| (meta.sep_size[i + 1], meta.sep_addr[i + 1]));
                if (n == 0 && hi - lo > 1)
                    || n > LEAF
                    || keys.iter().any(|k| bin(k.0) != b)
                    || keys
                        .first()
                        .is_some_and(|&f| (i > lo && f < sep) || prev.is_some_and(|p| p >= f))
                    || keys.last().is_some_and(|&l| upper.is_some_and(|u| l >= u))
                    || !keys.is_sorted()
                {
                    return Err(format!("3: free-index leaf {id} out of order"));
                }
                prev = keys.last().copied().or(prev);
            }
        }
        for &v in &meta.vacant {
            match named.get_mut(v as usize) {
                Some(slot) if !*slot => *slot = true,
                _ => return Err(format!("3: free-index leaf {v} vacant and named")),
            }
        }
        if named.iter().any(|n| !n) {
            return Err("3: a free-index leaf neither named nor vacant".into());
        }
        Ok(())
    }

    /// The largest key.
    #[cfg(test)]
    pub(crate) fn last(&self) -> Option<FreeKey> {
        let meta = self.meta();
        if meta.nonempty == 0 {
            return None;
        }
        let b = 63 - meta.nonempty.leading_zeros() as usize;
        let leaf = self.leaf(meta.leaves[meta.first[b + 1] as usize - 1]);
        Some(leaf.key(leaf.len as usize - 1))
    }

    /// Every key, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = FreeKey> + '_ {
        self.meta().leaves.iter().flat_map(|&id| {
            let leaf = self.leaf(id);
            (0..leaf.len as usize).map(move |at| leaf.key(at))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    proptest! {
        /// Every operation answers as one ordered set of all keys would.
        #[test]
        fn answers_as_one_ordered_set(
            ops in prop::collection::vec(
                (0u8..4, prop::sample::select(vec![512u64, 1000, 1024, 4096, 65536, 1 << 20,
                    (1 << 20) + 512, 3 << 20, 1 << 30, u64::MAX >> 1]), 0u64..8),
                1..200),
        ) {
            let mut index = FreeIndex::default();
            let mut model: BTreeSet<FreeKey> = BTreeSet::new();
            for (op, size, addr) in ops {
                // One free block per address: the id follows from the address.
                let key = (size, addr << 20, addr as usize);
                match op {
                    0 | 1 => prop_assert_eq!(index.insert(key), model.insert(key)),
                    2 => prop_assert_eq!(index.remove(&key), model.remove(&key)),
                    _ => prop_assert_eq!(index.contains(&key), model.contains(&key)),
                }
                prop_assert_eq!(index.len(), model.len());
                prop_assert_eq!(index.check(), Ok(()));
                for want in [1, 512, 600, 1024, 4097, 1 << 20, (1 << 20) + 1, 1 << 30, u64::MAX] {
                    prop_assert_eq!(
                        index.first_at_least(want),
                        model.range((want, 0, 0)..).next().copied()
                    );
                }
                prop_assert_eq!(index.last(), model.last().copied());
                prop_assert!(index.iter().eq(model.iter().copied()));
            }
        }

        /// Thousands of keys (leaves split and merge), with checkpoint marks: a restore to any
        /// open mark, in any order, gives the keys at that mark.
        #[test]
        fn restores_marks_through_splits_and_merges(
            ops in prop::collection::vec((0u8..20, 0u64..64, 0u64..64, any::<usize>()), 1..1500),
        ) {
            let mut index = FreeIndex::default();
            let mut model: BTreeSet<FreeKey> = BTreeSet::new();
            let mut marks: Vec<(IndexMark, BTreeSet<FreeKey>)> = Vec::new();
            for (op, size, addr, k) in ops {
                let key = ((size + 1) * 512, addr << 20, (size * 64 + addr) as usize);
                match op {
                    0..=9 => prop_assert_eq!(index.insert(key), model.insert(key)),
                    10..=16 => prop_assert_eq!(index.remove(&key), model.remove(&key)),
                    17 => marks.push((index.mark(), model.clone())),
                    18 if !marks.is_empty() => {
                        let k = k % marks.len();
                        index.restore(marks[k].0, k + 1 < marks.len());
                        model = marks[k].1.clone();
                    }
                    19 if !marks.is_empty() => {
                        marks.remove(k % marks.len());
                        match marks.first() {
                            Some(&(m, _)) => index.forget_before(m),
                            None => index.forget_all(),
                        }
                    }
                    _ => {
                        index.clear();
                        model.clear();
                    }
                }
                prop_assert_eq!(index.check(), Ok(()));
                prop_assert_eq!(index.len(), model.len());
                prop_assert_eq!(
                    index.first_at_least(size * 512),
                    model.range((size * 512, 0, 0)..).next().copied()
                );
                if marks.is_empty() {
                    prop_assert_eq!(index.log_len(), 0);
                }
            }
            prop_assert!(index.iter().eq(model.iter().copied()));
        }
    }
}
