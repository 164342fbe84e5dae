//! Blocks and segments: the pieces a shard's memory is cut into.

pub mod alias;
pub mod runs;

use crate::device::{DevicePtr, PageHandle, StreamId};

/// Largest request accepted (2^56 bytes); anything above is a caller bug, not an OOM.
pub const MAX_REQUEST: u64 = 1 << 56;

/// Index of a block in its shard's slab.
pub type BlockId = usize;
/// Index of a segment in its shard's slab.
pub type SegmentId = usize;

/// Life cycle of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum BlockState {
    /// In the free index; may be handed out.
    Free,
    /// Handed out to the user.
    Allocated,
    /// Freed by the user, but other streams used it: waits for their events (or for the capture
    /// to end) before it becomes `Free`.
    PendingFree,
    /// Freed by the user and kept whole, unmerged, in its shard's quick cache for the next
    /// request of exactly its size (see `Shard::quick`); merged back as `Free` before the shard
    /// grows, releases memory or is checkpointed.
    Cached,
}

/// A piece of a segment, free or allocated. Free neighbours are always merged.
///
/// 64 bytes, one cache line (`#[repr(align(64))]`, asserted in a test): a restore reads and
/// writes tens of thousands of slab slots, so links are 32-bit and stream uses a boxed slice.
#[derive(Clone, Debug)]
#[repr(align(64))]
pub struct Block {
    pub addr: DevicePtr,
    /// Rounded size.
    pub size: u64,
    /// Size the user asked for (0 when free).
    pub requested: u64,
    pub segment: SegmentId,
    prev: Link,
    next: Link,
    /// Outstanding events before a `PendingFree` block becomes free.
    pub pending_events: u32,
    pub state: BlockState,
    /// Streams other than the shard's own that used this block (`record_stream`).
    pub stream_uses: StreamUses,
}

impl Block {
    /// A free block of `segment` covering [addr, addr + size), linked to `prev` and `next`.
    pub fn free(
        addr: DevicePtr,
        size: u64,
        segment: SegmentId,
        prev: Option<BlockId>,
        next: Option<BlockId>,
    ) -> Block {
        Block {
            addr,
            size,
            requested: 0,
            segment,
            prev: Link::new(prev),
            next: Link::new(next),
            state: BlockState::Free,
            stream_uses: StreamUses::default(),
            pending_events: 0,
        }
    }

    pub fn end(&self) -> DevicePtr {
        self.addr + self.size
    }

    /// The block before this one in its segment.
    #[inline]
    pub fn prev(&self) -> Option<BlockId> {
        self.prev.get()
    }

    /// The block after this one in its segment.
    #[inline]
    pub fn next(&self) -> Option<BlockId> {
        self.next.get()
    }

    /// Whether the block shares its segment with others (PyTorch's `is_split`).
    #[inline]
    pub fn is_split(&self) -> bool {
        self.prev().is_some() || self.next().is_some()
    }

    #[inline]
    pub fn set_prev(&mut self, id: Option<BlockId>) {
        self.prev = Link::new(id);
    }

    #[inline]
    pub fn set_next(&mut self, id: Option<BlockId>) {
        self.next = Link::new(id);
    }
}

/// A block id in 32 bits, `u32::MAX` for none (a shard never holds 4 billion blocks: that would
/// be 256 GB of slab).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Link(u32);

impl Link {
    #[inline]
    fn new(id: Option<BlockId>) -> Link {
        Link(id.map_or(u32::MAX, |id| {
            u32::try_from(id).expect("block id over 32 bits")
        }))
    }

    #[inline]
    fn get(self) -> Option<BlockId> {
        (self.0 != u32::MAX).then_some(self.0 as BlockId)
    }
}

/// Streams other than the owner's that used a block: almost always none, so a boxed slice
/// (16 bytes, rebuilt on the rare `record_stream`) where a `Vec` would take 24.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct StreamUses(Option<Box<[StreamId]>>);

impl StreamUses {
    pub fn from_slice(s: &[StreamId]) -> StreamUses {
        StreamUses((!s.is_empty()).then(|| s.into()))
    }

    pub fn as_slice(&self) -> &[StreamId] {
        self.0.as_deref().unwrap_or(&[])
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    pub fn contains(&self, s: &StreamId) -> bool {
        self.as_slice().contains(s)
    }

    pub fn push(&mut self, s: StreamId) {
        let mut v = self.take();
        v.push(s);
        self.0 = Some(v.into_boxed_slice());
    }

    pub fn clear(&mut self) {
        self.0 = None;
    }

    /// The streams, leaving none.
    pub fn take(&mut self) -> Vec<StreamId> {
        self.0.take().map(Vec::from).unwrap_or_default()
    }
}

impl std::fmt::Debug for StreamUses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// Physical pages of one vmm reservation, indexed by page number from the reservation start.
///
/// `live[p]` counts the non-free blocks that overlap page p; a mapped page with `live == 0` is
/// *idle*: wholly inside free blocks, and may be unmapped once the stream's work that last
/// touched it is complete (`idle_epoch[p]` below the shard's safe epoch).
///
/// A page is *graph-retained* (bit in `retained_bits`) when a captured graph may touch it: it
/// backed an allocation made during a capture, or an allocation a restore took back while its
/// owner still held it. While the pool is in use a retained page stays mapped at its address,
/// idle or not. (Memory that was live when a capture began, such as a static input, is its
/// owner's to keep alive, as with PyTorch's default pool.)
#[derive(Clone, Debug, Default)]
pub struct PageTable {
    pub handle: Vec<Option<PageHandle>>,
    pub live: Vec<u32>,
    pub idle_epoch: Vec<u64>,
    /// Bit p set when page p is mapped and idle.
    pub idle_bits: Vec<u64>,
    /// Bit p set when page p is mapped and graph-retained.
    pub retained_bits: Vec<u64>,
    pub idle_count: usize,
    /// Slots with a page mapped (a page mapped at several slots counts at each).
    pub mapped_count: usize,
    /// Which slots each physical page is mapped at ([`crate::alias`]; boxed: a segment's kind
    /// stays small).
    pub alias: Box<alias::Aliases>,
    /// Which slots one physical allocation backs together ([`runs`]).
    pub runs: Box<runs::Runs>,
}

/// The bits of word `w` of a page bitmap that fall in pages [first, end).
#[inline]
fn word_mask(w: usize, first: usize, end: usize) -> u64 {
    let lo = first.max(w * 64) - w * 64;
    let hi = end.min(w * 64 + 64) - w * 64;
    if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    }
}

impl PageTable {
    /// Whether page `p` has a physical page mapped.
    #[inline]
    pub fn is_mapped(&self, p: usize) -> bool {
        self.handle.get(p).is_some_and(|h| h.is_some())
    }

    /// Make sure the per-page arrays cover page `p`.
    #[inline]
    pub fn cover(&mut self, p: usize) {
        if p >= self.handle.len() {
            self.grow_to(p);
        }
    }

    #[cold]
    fn grow_to(&mut self, p: usize) {
        let n = (p + 1).next_power_of_two().max(64);
        self.handle.resize(n, None);
        self.live.resize(n, 0);
        self.idle_epoch.resize(n, 0);
        self.idle_bits.resize(n.div_ceil(64), 0);
        self.retained_bits.resize(n.div_ceil(64), 0);
    }

    pub fn set_retained(&mut self, p: usize, retained: bool) {
        let (w, b) = (p / 64, 1u64 << (p % 64));
        if retained {
            self.retained_bits[w] |= b;
        } else {
            self.retained_bits[w] &= !b;
        }
    }

    pub fn is_retained(&self, p: usize) -> bool {
        self.retained_bits
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }

    pub fn set_idle(&mut self, p: usize, idle: bool) {
        let (w, b) = (p / 64, 1u64 << (p % 64));
        let was = self.idle_bits[w] & b != 0;
        if idle && !was {
            self.idle_bits[w] |= b;
            self.idle_count += 1;
        } else if !idle && was {
            self.idle_bits[w] &= !b;
            self.idle_count -= 1;
        }
    }

    /// One more non-free block over each page of [first, end): none of them is idle after.
    /// (Page by page this was the hot loop of a large vmm pair: a 64 MiB block spans 32 pages.)
    pub fn add_live(&mut self, first: usize, end: usize) {
        for l in &mut self.live[first..end] {
            *l += 1;
        }
        for w in first / 64..end.div_ceil(64) {
            let mask = word_mask(w, first, end);
            self.idle_count -= (self.idle_bits[w] & mask).count_ones() as usize;
            self.idle_bits[w] &= !mask;
        }
    }

    /// One non-free block fewer over each page of [first, end): mapped pages left with none fall
    /// idle in `epoch`.
    pub fn drop_live(&mut self, first: usize, end: usize, epoch: u64) {
        let pages = self.live[first..end]
            .iter_mut()
            .zip(&self.handle[first..end])
            .zip(&mut self.idle_epoch[first..end]);
        for (p, ((l, h), e)) in (first..).zip(pages) {
            *l -= 1;
            if *l == 0 && h.is_some() {
                *e = epoch;
                // A page with a live block over it was not idle: its bit is clear.
                self.idle_bits[p / 64] |= 1 << (p % 64);
                self.idle_count += 1;
            }
        }
    }

    pub fn is_idle(&self, p: usize) -> bool {
        self.idle_bits
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }

    /// Idle pages in descending order.
    pub fn idle_pages_rev(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle_bits
            .iter()
            .enumerate()
            .rev()
            .flat_map(|(w, &bits)| {
                let mut bits = bits;
                std::iter::from_fn(move || {
                    if bits == 0 {
                        return None;
                    }
                    let b = 63 - bits.leading_zeros() as usize;
                    bits &= !(1u64 << b);
                    Some(w * 64 + b)
                })
            })
    }

    /// Idle pages in ascending order.
    pub fn idle_pages(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle_bits.iter().enumerate().flat_map(|(w, &bits)| {
            let mut bits = bits;
            std::iter::from_fn(move || {
                if bits == 0 {
                    return None;
                }
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                Some(w * 64 + b)
            })
        })
    }
}

/// How a segment got its memory.
#[derive(Clone, Debug)]
pub enum SegmentKind {
    /// One `alloc_segment` call: all bytes physical.
    Classic,
    /// A virtual reservation with pages mapped on demand.
    Vmm(PageTable),
}

/// One range of device addresses obtained from the backend.
#[derive(Clone, Debug)]
pub struct Segment {
    pub addr: DevicePtr,
    pub size: u64,
    /// Serves the small (<= 1 MiB) requests.
    pub small: bool,
    /// The block at the lowest address.
    pub first: BlockId,
    pub kind: SegmentKind,
    /// Classic segments: a captured graph may touch this segment (see [`PageTable`]); kept while
    /// the pool is in use. vmm segments track this per page.
    pub retained: bool,
    /// vmm segments: the free block that ends the reservation, kept here instead of in the
    /// shard's free index. It is the largest free block by far, and a same-size alloc/free loop
    /// splits and re-merges it every time: out of the B-tree, that costs no index update.
    pub free_tail: Option<BlockId>,
    /// Classic segments: the shard's free-index search count when the segment last became one
    /// free block; its age for garbage collection is the count now minus this (PyTorch's
    /// `gc_count`).
    pub freed_at: u64,
}

impl Segment {
    pub fn is_vmm(&self) -> bool {
        matches!(self.kind, SegmentKind::Vmm(_))
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;

    #[test]
    fn a_block_and_its_slab_slot_fill_one_cache_line() {
        assert_eq!(size_of::<Block>(), 64);
        assert_eq!(size_of::<Option<Block>>(), 64);
    }

    #[test]
    fn links_and_stream_uses_round_trip() {
        let mut b = Block::free(0, 512, 3, None, Some(7));
        assert_eq!((b.prev(), b.next()), (None, Some(7)));
        b.set_prev(Some(u32::MAX as usize - 1));
        assert_eq!(b.prev(), Some(u32::MAX as usize - 1));
        assert!(b.stream_uses.is_empty());
        b.stream_uses.push(5);
        b.stream_uses.push(9);
        assert!(b.stream_uses.contains(&9) && b.stream_uses.len() == 2);
        assert_eq!(format!("{:?}", b.stream_uses), "[5, 9]");
        assert_eq!(b.stream_uses.take(), vec![5, 9]);
        assert!(b.stream_uses.is_empty());
    }

    /// `add_live` / `drop_live` against the page-by-page rule they replace, over ranges that
    /// start and end inside and across bitmap words, with some pages unmapped.
    #[test]
    fn range_live_counts_match_page_by_page() {
        fn reference(pt: &mut PageTable, first: usize, end: usize, delta: i32, epoch: u64) {
            for p in first..end {
                if delta > 0 {
                    pt.live[p] += 1;
                    if pt.live[p] == 1 {
                        pt.set_idle(p, false);
                    }
                } else {
                    pt.live[p] -= 1;
                    if pt.live[p] == 0 && pt.handle[p].is_some() {
                        pt.set_idle(p, true);
                        pt.idle_epoch[p] = epoch;
                    }
                }
            }
        }
        let mut fast = PageTable::default();
        fast.cover(199);
        for p in 0..200 {
            if p % 7 != 3 {
                fast.handle[p] = Some(PageHandle(p as u64));
                fast.set_idle(p, true);
            }
        }
        let mut slow = fast.clone();
        let mut held: Vec<(usize, usize)> = Vec::new();
        let mut x = 12345u64;
        for step in 0..2000u64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let take = held.is_empty() || !(x >> 40).is_multiple_of(3);
            if take {
                let first = (x >> 8) as usize % 190;
                let end = (first + 1 + (x >> 20) as usize % 130).min(200);
                fast.add_live(first, end);
                reference(&mut slow, first, end, 1, step);
                held.push((first, end));
            } else {
                let (first, end) = held.swap_remove((x >> 30) as usize % held.len());
                fast.drop_live(first, end, step);
                reference(&mut slow, first, end, -1, step);
            }
            assert_eq!(fast.live, slow.live, "step {step}");
            assert_eq!(fast.idle_bits, slow.idle_bits, "step {step}");
            assert_eq!(fast.idle_epoch, slow.idle_epoch, "step {step}");
            assert_eq!(fast.idle_count, slow.idle_count, "step {step}");
        }
    }
}
