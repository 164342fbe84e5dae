//! A restore's vmm page work: the live counts of the pages under the blocks it frees and
//! re-creates, the graph-retained marks of the pages it takes back, and the idle bits of every
//! page whose count moved, settled once per page at the end.
//!
//! The lists come in the order their addresses changed, which jumps from page to page, so the
//! per-block step is kept to an add and an unconditional bit set: a restore of 10,000 blocks
//! runs it 10,000 times. Which pages changed is a bitmap per segment (a page per bit, no test,
//! no list), read a word at a time when the restore settles the pages.

use crate::block::{PageTable, SegmentId, SegmentKind};
use crate::live_map::LiveEntry;

use super::Shard;

/// The vmm page size of a restore, and the pages under a block.
#[derive(Clone, Copy, Debug)]
pub(super) struct PageGeom {
    page_size: u64,
    /// `log2(page_size)` when it is a power of two (a shift instead of two divisions a block).
    shift: Option<u32>,
}

impl PageGeom {
    pub(super) fn new(page_size: u64) -> Self {
        PageGeom {
            page_size,
            shift: page_size
                .is_power_of_two()
                .then(|| page_size.trailing_zeros()),
        }
    }

    /// Pages under [addr, addr+size) of a segment at `seg_addr` (`Shard::page_range`).
    #[inline]
    pub(super) fn range(&self, seg_addr: u64, addr: u64, size: u64) -> (usize, usize) {
        let (from, to) = (addr - seg_addr, addr + size - seg_addr);
        match self.shift {
            Some(s) => (
                (from >> s) as usize,
                ((to + self.page_size - 1) >> s) as usize,
            ),
            None => (
                (from / self.page_size) as usize,
                to.div_ceil(self.page_size) as usize,
            ),
        }
    }
}

/// Buffers of a restore's page work, kept from one restore to the next (empty between them).
#[derive(Debug, Default)]
pub(crate) struct PageWork {
    /// The vmm segments whose pages changed, each once.
    segments: Vec<SegmentId>,
    /// By segment id: whether it is in `segments`.
    listed: Vec<bool>,
    /// By segment id: bit p set when page p's live count changed.
    changed: Vec<Vec<u64>>,
}

impl PageWork {
    /// Whether nothing is left over from a restore (the state between restores).
    #[cfg(test)]
    pub(super) fn is_clear(&self) -> bool {
        self.segments.is_empty()
            && self.listed.iter().all(|&l| !l)
            && self.changed.iter().flatten().all(|&w| w == 0)
    }
}

/// The live counts of one run of `list`'s blocks in one vmm segment (at `base`) move by `d`,
/// and their pages are marked in `changed`; stops at the end of the run or at a block past
/// the page table, and returns how many blocks it counted. The restore's hot loop.
#[inline]
fn count_run(
    geom: PageGeom,
    base: u64,
    seg: SegmentId,
    list: &[LiveEntry],
    live: &mut [u32],
    changed: &mut [u64],
    d: i32,
) -> usize {
    let mut n = 0;
    for e in list {
        if e.segment() != seg {
            break;
        }
        let (first, end) = geom.range(base, e.addr, e.size);
        if end > live.len() {
            break;
        }
        // Most blocks lie on one page; `changed` covers the table (one bit per page).
        for p in first..end {
            live[p] = live[p].wrapping_add_signed(d);
            changed[p / 64] |= 1 << (p % 64);
        }
        n += 1;
    }
    n
}

impl Shard {
    /// `pages_live` for a restore, over a list of live blocks in any order: adds `d` to the
    /// live counts of their vmm pages and marks those pages in `w`, leaving the idle bits to
    /// [`Shard::settle_pages`]. With `retain` (the first list counted: the blocks the restore
    /// takes back), their pages are marked graph-retained (classic segments: the whole
    /// segment).
    pub(super) fn count_pages(
        &mut self,
        geom: PageGeom,
        w: &mut PageWork,
        list: &[LiveEntry],
        d: i32,
        retain: bool,
    ) {
        debug_assert!(
            !retain || w.segments.is_empty(),
            "retained pages are the first list's"
        );
        let mut i = 0;
        while i < list.len() {
            let seg = list[i].segment();
            let segment = &mut self.segments[seg];
            let base = segment.addr;
            let SegmentKind::Vmm(pt) = &mut segment.kind else {
                segment.retained |= retain;
                i += list[i..].iter().take_while(|e| e.segment() == seg).count();
                continue;
            };
            // The table covers every page a block of the list lies on (live now or at the
            // checkpoint, and tables never shrink); a block past it grows it first.
            let (_, end) = geom.range(base, list[i].addr, list[i].size);
            pt.cover(end.saturating_sub(1));
            if w.listed.len() <= seg {
                w.listed.resize(seg + 1, false);
                w.changed.resize_with(seg + 1, Vec::new);
            }
            if !w.listed[seg] {
                w.listed[seg] = true;
                w.segments.push(seg);
            }
            let changed = &mut w.changed[seg];
            let words = pt.live.len().div_ceil(64);
            if changed.len() < words {
                changed.resize(words, 0);
            }
            let n = count_run(geom, base, seg, &list[i..], &mut pt.live, changed, d);
            assert!(n > 0, "the table covers the run's first block");
            i += n;
        }
        if retain {
            for &seg in &w.segments {
                if let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind {
                    retain_mapped(pt, &w.changed[seg]);
                }
            }
        }
    }

    /// Idle bits of the pages whose live counts changed. Pages that fall idle remember the
    /// current epoch, as with `pages_live`. The counts end where one block at a time would
    /// leave them; a page idle before the restore has no block to take out (it stays idle or
    /// turns live). Leaves `w` clear for the next restore.
    pub(super) fn settle_pages(&mut self, w: &mut PageWork) {
        let epoch = self.epoch;
        for seg in w.segments.drain(..) {
            w.listed[seg] = false;
            let changed = &mut w.changed[seg];
            // Only vmm segments are listed (`count_pages`).
            if let SegmentKind::Vmm(pt) = &mut self.segments[seg].kind {
                for_each_one(changed, |p| {
                    let idle = pt.live[p] == 0 && pt.handle[p].is_some();
                    if idle != pt.is_idle(p) {
                        pt.set_idle(p, idle);
                        if idle {
                            pt.idle_epoch[p] = epoch;
                        }
                    }
                });
            }
            changed.fill(0);
        }
    }
}

/// Calls `f` with each page whose bit is set in `words`, in order.
#[inline]
fn for_each_one(words: &[u64], mut f: impl FnMut(usize)) {
    for (k, &word) in words.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            f(k * 64 + bits.trailing_zeros() as usize);
            bits &= bits - 1;
        }
    }
}

/// Marks graph-retained each mapped page of `pt` whose bit is set in `pages`.
fn retain_mapped(pt: &mut PageTable, pages: &[u64]) {
    for_each_one(pages, |p| {
        if pt.handle[p].is_some() {
            pt.set_retained(p, true);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_ranges_by_shift_and_by_division_agree() {
        let (pow2, other) = (PageGeom::new(1 << 21), PageGeom::new(3 << 20));
        assert!(pow2.shift.is_some() && other.shift.is_none());
        // [base + 2 MiB - 512, +1 KiB) spans pages 0 and 1 of 2 MiB, page 0 of 3 MiB.
        let base = 1 << 40;
        assert_eq!(pow2.range(base, base + (1 << 21) - 512, 1024), (0, 2));
        assert_eq!(other.range(base, base + (1 << 21) - 512, 1024), (0, 1));
        assert_eq!(pow2.range(base, base + (5 << 21), 1 << 21), (5, 6));
        assert_eq!(other.range(base, base + (3 << 20), 1), (1, 2));
    }

    #[test]
    fn each_set_bit_is_one_page_in_order() {
        let mut pages = Vec::new();
        for_each_one(&[0b1001, 0, 1 << 63 | 1], |p| pages.push(p));
        assert_eq!(pages, [0, 3, 128, 191]);
        for_each_one(&[], |_| panic!("no bits, no pages"));
    }

    #[test]
    fn a_run_stops_at_its_segment_and_at_the_table_end() {
        let geom = PageGeom::new(1 << 21);
        let base = 1 << 40;
        let e = |page: u64, seg: usize| LiveEntry::new(base + (page << 21), 512, 0, seg);
        let list = [e(0, 3), e(0, 3), e(70, 3), e(1, 4)];
        let mut live = vec![0u32; 128];
        let mut changed = vec![0u64; 2];
        assert_eq!(
            count_run(geom, base, 3, &list, &mut live, &mut changed, 1),
            3
        );
        assert_eq!((live[0], live[70], live[1]), (2, 1, 0));
        assert_eq!(changed, [1, 1 << 6]);
        // Page 70 lies past a table of 64 pages: the run stops before it.
        let mut short = vec![0u32; 64];
        assert_eq!(
            count_run(geom, base, 3, &list, &mut short, &mut changed, -1),
            2
        );
        assert_eq!(short[0], (-2i32) as u32);
    }
}
