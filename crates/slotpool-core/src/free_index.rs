//! The free index of one size class (small or large) of a shard: free blocks ordered by
//! `(size, address, id)`, so that best fit is PyTorch's `lower_bound` on `(size, ptr)`.
//!
//! One ordered set per power of two of the size (`bins[b]` holds sizes in `[2^b, 2^(b+1))`) and
//! a bitmap of the bins that hold anything. Each set is small, so an insert or a removal walks
//! one or two B-tree levels instead of three or four, and the order across bins is the order of
//! their sizes: the first key at least `size` is in `size`'s own bin or is the first key of the
//! next bin that holds any, which is exactly the one whole set would give.

use std::collections::BTreeSet;

use crate::block::BlockId;
use crate::device::DevicePtr;

/// A free-index key: (size, address, id). Best fit is the first key at or above `(size, 0, 0)`,
/// the lowest address on ties, as PyTorch's `std::set` ordered by (stream, size, ptr).
pub(crate) type FreeKey = (u64, DevicePtr, BlockId);

/// Free blocks of one size class, ordered by [`FreeKey`]. See the module documentation.
#[derive(Clone, Debug, Default)]
pub(crate) struct FreeIndex {
    bins: Vec<BTreeSet<FreeKey>>,
    /// Bit `b` set when `bins[b]` is not empty.
    nonempty: u64,
    len: usize,
}

/// The bin of a block of `size` bytes (`size > 0`).
#[inline]
fn bin(size: u64) -> usize {
    63 - size.max(1).leading_zeros() as usize
}

impl FreeIndex {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    #[inline]
    fn bin_mut(&mut self, b: usize) -> &mut BTreeSet<FreeKey> {
        if b >= self.bins.len() {
            self.bins.resize_with(b + 1, BTreeSet::new);
        }
        &mut self.bins[b]
    }

    /// Add `key`; false if it was there.
    #[inline]
    pub(crate) fn insert(&mut self, key: FreeKey) -> bool {
        let b = bin(key.0);
        let added = self.bin_mut(b).insert(key);
        if added {
            self.nonempty |= 1 << b;
            self.len += 1;
        }
        added
    }

    /// Remove `key`; false if it was not there.
    #[inline]
    pub(crate) fn remove(&mut self, key: &FreeKey) -> bool {
        let b = bin(key.0);
        let Some(set) = self.bins.get_mut(b) else {
            return false;
        };
        let removed = set.remove(key);
        if removed {
            self.len -= 1;
            if set.is_empty() {
                self.nonempty &= !(1 << b);
            }
        }
        removed
    }

    pub(crate) fn contains(&self, key: &FreeKey) -> bool {
        self.bins.get(bin(key.0)).is_some_and(|s| s.contains(key))
    }

    /// The first key of at least `size` bytes: the best fit.
    #[inline]
    pub(crate) fn first_at_least(&self, size: u64) -> Option<FreeKey> {
        let b = bin(size);
        if self.nonempty & (1 << b) != 0
            && let Some(&k) = self.bins[b].range((size, 0, 0)..).next()
        {
            return Some(k);
        }
        let above = self.nonempty & !((2u64 << b).wrapping_sub(1));
        if b == 63 || above == 0 {
            return None;
        }
        self.bins[above.trailing_zeros() as usize].first().copied()
    }

    /// An index of `keys`, sorted: each bin in one bulk build.
    pub(crate) fn from_sorted(keys: &[FreeKey]) -> Self {
        debug_assert!(keys.is_sorted());
        let mut index = FreeIndex::default();
        let mut rest = keys;
        while let Some(&(size, ..)) = rest.first() {
            let b = bin(size);
            let end = if b == 63 {
                rest.len()
            } else {
                rest.partition_point(|k| k.0 < (2u64 << b))
            };
            let (run, tail) = rest.split_at(end);
            *index.bin_mut(b) = run.iter().copied().collect();
            index.nonempty |= 1 << b;
            index.len += run.len();
            rest = tail;
        }
        index
    }

    /// Its own consistency (shard invariant 3 relies on it): every key sits in the bin of its
    /// size, the bitmap marks exactly the non-empty bins, and `len` counts every key.
    pub(crate) fn check(&self) -> Result<(), String> {
        let mut len = 0;
        for (b, set) in self.bins.iter().enumerate() {
            if let Some(k) = set.iter().find(|k| bin(k.0) != b) {
                return Err(format!("3: free-index key {k:?} in bin {b}"));
            }
            if (self.nonempty >> b & 1 == 1) == set.is_empty() {
                return Err(format!(
                    "3: free-index bin {b}'s bit does not match its contents"
                ));
            }
            len += set.len();
        }
        if self.bins.len() < 64 && self.nonempty >> self.bins.len() != 0 {
            return Err("3: free-index bitmap names a bin that does not exist".into());
        }
        if len != self.len {
            return Err(format!(
                "3: free index counts {} keys, holds {len}",
                self.len
            ));
        }
        Ok(())
    }

    /// The largest key.
    pub(crate) fn last(&self) -> Option<FreeKey> {
        if self.nonempty == 0 {
            return None;
        }
        self.bins[63 - self.nonempty.leading_zeros() as usize]
            .last()
            .copied()
    }

    /// Every key, in order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = &FreeKey> {
        self.bins.iter().flatten()
    }
}

impl IntoIterator for FreeIndex {
    type Item = FreeKey;
    type IntoIter = std::iter::Flatten<std::vec::IntoIter<BTreeSet<FreeKey>>>;

    /// Every key, in order.
    fn into_iter(self) -> Self::IntoIter {
        self.bins.into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every operation answers as one ordered set of all keys would.
        #[test]
        fn answers_as_one_ordered_set(
            ops in prop::collection::vec(
                (0u8..4, prop::sample::select(vec![512u64, 1000, 1024, 4096, 65536, 1 << 20,
                    (1 << 20) + 512, 3 << 20, 1 << 30, u64::MAX >> 1]), 0u64..8, 0usize..4),
                1..200),
        ) {
            let mut index = FreeIndex::default();
            let mut model: BTreeSet<FreeKey> = BTreeSet::new();
            for (op, size, addr, id) in ops {
                let key = (size, addr << 20, id);
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
                prop_assert!(index.iter().copied().eq(model.iter().copied()));
            }
            let sorted: Vec<FreeKey> = model.iter().copied().collect();
            let rebuilt = FreeIndex::from_sorted(&sorted);
            prop_assert_eq!(rebuilt.len(), model.len());
            prop_assert_eq!(rebuilt.check(), Ok(()));
            prop_assert!(rebuilt.iter().copied().eq(model.iter().copied()));
            prop_assert!(index.into_iter().eq(model.into_iter()));
        }
    }
}
