//! The block slab: a shard's blocks by id, in [`Paged`] storage, so that a checkpoint restore
//! puts the blocks back a page (64 blocks) at a time, by pointer, instead of block by block
//! (see "Checkpoint / restore" in `docs/design.md`).
//!
//! Vacant ids wait in a stack that is paged and logged too: a restore brings back which ids
//! were vacant with the blocks, so ids are reused at once, checkpoint or not.

use crate::block::{Block, BlockId};
use crate::paged::{Paged, PagedMark};

/// Blocks per page: 4 KiB.
const PAGE: usize = 64;
/// Vacant ids per page of the stack.
const VACANT_PAGE: usize = 1024;

/// A mark of the slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SlabMark {
    slots: PagedMark,
    vacant: PagedMark,
    /// The number of blocks then: a plain value, restored as it is (a logged value cost every
    /// insert and removal a check).
    len: usize,
}

/// See the module documentation.
///
/// Invariants (checked by [`BlockSlab::check`]):
/// 1. `len` is the number of occupied slots;
/// 2. `vacant[..top()]` are exactly the vacant slots, each once (so the stack's height follows
///    from the lengths).
#[derive(Clone, Debug)]
pub struct BlockSlab {
    slots: Paged<Option<Block>, PAGE>,
    /// A stack of vacant ids, `[..top()]`; entries above it are stale.
    vacant: Paged<u32, VACANT_PAGE>,
    len: usize,
}

impl Default for BlockSlab {
    fn default() -> Self {
        let mut slots = Paged::default();
        // A shard is often made by one thread for another: its first small allocations would
        // share cache lines with the next shard's (see `Shard::new`).
        slots.reserve_pages(8);
        BlockSlab {
            slots,
            vacant: Paged::default(),
            len: 0,
        }
    }
}

impl BlockSlab {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Blocks the slab holds before its page table reallocates.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.slots.capacity()
    }

    /// Slots, vacant or not (the slab's memory grows with this).
    #[cfg(test)]
    pub fn capacity_ids(&self) -> usize {
        self.slots.len()
    }

    #[inline]
    pub fn insert(&mut self, b: Block) -> BlockId {
        let top = self.top();
        let id = if top > 0 {
            let id = *self.vacant.at(top - 1) as usize;
            *self.slots.at_mut(id) = Some(b);
            id
        } else {
            self.slots.push(Some(b))
        };
        self.len += 1;
        id
    }

    #[inline]
    pub fn remove(&mut self, id: BlockId) -> Block {
        let b = self
            .slots
            .at_mut(id)
            .take()
            .expect("remove of a vacant slot");
        let top = self.top();
        let v = u32::try_from(id).expect("block id over u32");
        if top < self.vacant.len() {
            *self.vacant.at_mut(top) = v;
        } else {
            self.vacant.push(v);
        }
        self.len -= 1;
        b
    }

    /// The height of the vacant stack: one id for each vacant slot.
    #[inline]
    fn top(&self) -> usize {
        self.slots.len() - self.len
    }

    #[inline]
    pub fn get(&self, id: BlockId) -> Option<&Block> {
        self.slots.get(id)?.as_ref()
    }

    /// `self[id]`, inlined: for the quick cache's round trip only (inlining `Index` everywhere
    /// made the large-block paths longer).
    #[inline(always)]
    pub(crate) fn hot(&self, id: BlockId) -> &Block {
        // An id of a block in use is below the length.
        self.slots.at(id).as_ref().expect("vacant slot")
    }

    /// `&mut self[id]`, inlined: see [`BlockSlab::hot`].
    #[inline(always)]
    pub(crate) fn hot_mut(&mut self, id: BlockId) -> &mut Block {
        self.slots.at_mut(id).as_mut().expect("vacant slot")
    }

    pub fn contains(&self, id: BlockId) -> bool {
        self.get(id).is_some()
    }

    pub fn iter(&self) -> impl Iterator<Item = (BlockId, &Block)> {
        (0..self.slots.len()).filter_map(|id| self.get(id).map(|b| (id, b)))
    }

    pub(crate) fn mark(&mut self) -> SlabMark {
        SlabMark {
            slots: self.slots.mark(),
            vacant: self.vacant.mark(),
            len: self.len,
        }
    }

    /// Back to the slab at `m` (`journaled`: later marks are open; see [`Paged::restore`]).
    pub(crate) fn restore(&mut self, m: SlabMark, journaled: bool) {
        self.slots.restore(m.slots, journaled);
        self.vacant.restore(m.vacant, journaled);
        self.len = m.len;
    }

    pub(crate) fn forget_before(&mut self, m: SlabMark) {
        self.slots.forget_before(m.slots);
        self.vacant.forget_before(m.vacant);
    }

    pub(crate) fn forget_all(&mut self) {
        self.slots.forget_all();
        self.vacant.forget_all();
    }

    /// Pages logged for the open marks.
    pub(crate) fn log_len(&self) -> usize {
        self.slots.log_len() + self.vacant.log_len()
    }

    /// Its invariants (see the type) and its storage's.
    pub(crate) fn check(&self) -> Result<(), String> {
        self.slots.check()?;
        self.vacant.check()?;
        let occupied = self.iter().count();
        if occupied != self.len {
            return Err(format!(
                "slab counts {} blocks, holds {occupied} (1)",
                self.len
            ));
        }
        let top = self.top();
        if top > self.vacant.len() {
            return Err(format!(
                "{top} vacant slots, {} ids on the stack (2)",
                self.vacant.len()
            ));
        }
        let mut stacked = vec![false; self.slots.len()];
        for k in 0..top {
            let id = *self.vacant.get(k).expect("stack slot") as usize;
            if id >= stacked.len() || self.contains(id) || std::mem::replace(&mut stacked[id], true)
            {
                return Err(format!("vacant stack names id {id} wrongly (2)"));
            }
        }
        Ok(())
    }
}

impl std::ops::Index<BlockId> for BlockSlab {
    type Output = Block;
    #[inline]
    fn index(&self, id: BlockId) -> &Block {
        self.hot(id)
    }
}

impl std::ops::IndexMut<BlockId> for BlockSlab {
    #[inline]
    fn index_mut(&mut self, id: BlockId) -> &mut Block {
        self.hot_mut(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64),
        Remove(usize),
        Set(usize, u64),
        Mark,
        Restore(usize),
        Forget(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            5 => any::<u64>().prop_map(Op::Insert),
            3 => any::<usize>().prop_map(Op::Remove),
            3 => (any::<usize>(), any::<u64>()).prop_map(|(i, v)| Op::Set(i, v)),
            1 => Just(Op::Mark),
            1 => any::<usize>().prop_map(Op::Restore),
            1 => any::<usize>().prop_map(Op::Forget),
        ]
    }

    /// Occupied ids and the address of each block (what the test writes).
    type Contents = Vec<(BlockId, u64)>;

    fn contents(s: &BlockSlab) -> Contents {
        s.iter().map(|(id, b)| (id, b.addr)).collect()
    }

    proptest! {
        /// Against a copy of the contents per mark: every restore, to any open mark in any
        /// order, gives the blocks and ids of that mark, the vacant stack stays exact, and
        /// vacant ids are reused before the slab grows.
        #[test]
        fn restores_blocks_and_vacant_ids(ops in prop::collection::vec(op(), 1..300)) {
            let mut s = BlockSlab::default();
            let mut marks: Vec<(SlabMark, Contents, usize)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(a) => {
                        let had_vacant = s.capacity_ids() > s.len();
                        let before = s.capacity_ids();
                        let id = s.insert(Block::free(a, 512, 0, None, None));
                        prop_assert_eq!(s[id].addr, a);
                        prop_assert_eq!(s.capacity_ids(), before + usize::from(!had_vacant));
                    }
                    Op::Remove(k) => {
                        let ids: Vec<BlockId> = s.iter().map(|(id, _)| id).collect();
                        if ids.is_empty() {
                            continue;
                        }
                        let id = ids[k % ids.len()];
                        s.remove(id);
                        prop_assert!(!s.contains(id));
                    }
                    Op::Set(k, a) => {
                        let ids: Vec<BlockId> = s.iter().map(|(id, _)| id).collect();
                        if ids.is_empty() {
                            continue;
                        }
                        s[ids[k % ids.len()]].addr = a;
                    }
                    Op::Mark => marks.push((s.mark(), contents(&s), s.capacity_ids())),
                    Op::Restore(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        let k = k % marks.len();
                        s.restore(marks[k].0, k + 1 < marks.len());
                        prop_assert_eq!(&contents(&s), &marks[k].1);
                        prop_assert_eq!(s.capacity_ids(), marks[k].2);
                    }
                    Op::Forget(k) => {
                        if marks.is_empty() {
                            continue;
                        }
                        marks.remove(k % marks.len());
                        match marks.first() {
                            Some(&(oldest, _, _)) => s.forget_before(oldest),
                            None => s.forget_all(),
                        }
                    }
                }
                prop_assert_eq!(s.check(), Ok(()));
                if marks.is_empty() {
                    prop_assert_eq!(s.log_len(), 0);
                }
            }
        }
    }
}
