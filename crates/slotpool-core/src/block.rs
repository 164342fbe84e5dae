//! Blocks and segments: the pieces a shard's memory is cut into.

use crate::device::{DevicePtr, PageHandle, StreamId};

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
#[derive(Clone, Debug)]
pub struct Block {
    pub addr: DevicePtr,
    /// Rounded size.
    pub size: u64,
    /// Size the user asked for (0 when free).
    pub requested: u64,
    pub segment: SegmentId,
    pub prev: Option<BlockId>,
    pub next: Option<BlockId>,
    pub state: BlockState,
    /// Streams other than the shard's own that used this block (`record_stream`).
    pub stream_uses: Vec<StreamId>,
    /// Outstanding events before a `PendingFree` block becomes free.
    pub pending_events: u32,
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
            prev,
            next,
            state: BlockState::Free,
            stream_uses: Vec::new(),
            pending_events: 0,
        }
    }

    pub fn end(&self) -> DevicePtr {
        self.addr + self.size
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
    pub mapped_count: usize,
}

impl PageTable {
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
}

impl Segment {
    pub fn is_vmm(&self) -> bool {
        matches!(self.kind, SegmentKind::Vmm(_))
    }
}
