//! [`ModelTarget`]: a toy allocator to drive [`crate::replay()`] with, not slotpool's allocator.
//!
//! One virtual address range, best-fit over free ranges with neighbour merging, sizes rounded to
//! 512 B, the top of the range shrinking when its last block falls free. Two ways to count
//! reserved memory:
//!
//! - [`ModelMode::Vmm`]: 2 MiB pages are mapped only while a live block touches them (physical
//!   memory follows live bytes; remapping is free: the lower bound of any allocator that maps
//!   pages under live bytes).
//! - [`ModelMode::Classic`]: the high-water mark of the used address range, rounded up to 2 MiB
//!   (nothing is ever given back).

use std::collections::{BTreeMap, BTreeSet};

use rustc_hash::FxHashMap;

use crate::replay::ReplayTarget;

/// Granularity of physical mapping in the model.
pub const PAGE: u64 = 2 << 20;
/// Allocation granularity (PyTorch's `kMinBlockSize`).
pub const ROUND: u64 = 512;
/// Where the model's address range starts (any non-zero page-aligned value).
const BASE: u64 = 0x7f00_0000_0000;

/// How [`ModelTarget`] counts reserved memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelMode {
    /// Mapped 2 MiB pages under live blocks.
    Vmm,
    /// High-water mark of the address range.
    Classic,
}

/// A toy best-fit allocator over one address range; see the module docs.
#[derive(Debug, Clone)]
pub struct ModelTarget {
    mode: ModelMode,
    /// Reserved bytes above which an allocation fails (out of memory).
    limit: Option<u64>,
    /// Free ranges by (size, addr) for best fit, and by addr for merging.
    free_by_size: BTreeSet<(u64, u64)>,
    free_by_addr: BTreeMap<u64, u64>,
    /// Live blocks: pointer -> rounded size.
    live: FxHashMap<u64, u64>,
    /// End of the used range.
    top: u64,
    /// Highest `top` ever.
    high_water: u64,
    /// Live blocks touching each page (index = (addr - BASE) / PAGE).
    page_refs: Vec<u32>,
    mapped_pages: u64,
    allocated: u64,
}

impl ModelTarget {
    pub fn new(mode: ModelMode) -> Self {
        ModelTarget {
            mode,
            limit: None,
            free_by_size: BTreeSet::new(),
            free_by_addr: BTreeMap::new(),
            live: FxHashMap::default(),
            top: BASE,
            high_water: BASE,
            page_refs: Vec::new(),
            mapped_pages: 0,
            allocated: 0,
        }
    }

    /// Fail allocations that would take reserved memory above `limit` bytes.
    pub fn with_limit(mut self, limit: u64) -> Self {
        self.limit = Some(limit);
        self
    }

    /// Number of live allocations.
    pub fn live_blocks(&self) -> usize {
        self.live.len()
    }

    fn reserved(&self) -> u64 {
        match self.mode {
            ModelMode::Vmm => self.mapped_pages * PAGE,
            ModelMode::Classic => (self.high_water - BASE).div_ceil(PAGE) * PAGE,
        }
    }

    fn pages(addr: u64, size: u64) -> std::ops::Range<usize> {
        let first = (addr - BASE) / PAGE;
        let last = (addr + size - 1 - BASE) / PAGE;
        first as usize..last as usize + 1
    }

    fn map(&mut self, addr: u64, size: u64) {
        let pages = Self::pages(addr, size);
        if self.page_refs.len() < pages.end {
            self.page_refs.resize(pages.end, 0);
        }
        for r in &mut self.page_refs[pages] {
            if *r == 0 {
                self.mapped_pages += 1;
            }
            *r += 1;
        }
    }

    fn unmap(&mut self, addr: u64, size: u64) {
        for r in &mut self.page_refs[Self::pages(addr, size)] {
            *r -= 1;
            if *r == 0 {
                self.mapped_pages -= 1;
            }
        }
    }

    fn remove_free(&mut self, addr: u64, size: u64) {
        self.free_by_addr.remove(&addr);
        self.free_by_size.remove(&(size, addr));
    }

    fn insert_free(&mut self, mut addr: u64, mut size: u64) {
        if let Some((&prev, &prev_size)) = self.free_by_addr.range(..addr).next_back()
            && prev + prev_size == addr
        {
            self.remove_free(prev, prev_size);
            addr = prev;
            size += prev_size;
        }
        if let Some(&next_size) = self.free_by_addr.get(&(addr + size)) {
            self.remove_free(addr + size, next_size);
            size += next_size;
        }
        if addr + size == self.top {
            self.top = addr;
        } else {
            self.free_by_addr.insert(addr, size);
            self.free_by_size.insert((size, addr));
        }
    }
}

impl ReplayTarget for ModelTarget {
    fn alloc(&mut self, size: u64, _stream: u64) -> Result<u64, String> {
        let rounded = size
            .max(1)
            .checked_next_multiple_of(ROUND)
            .filter(|r| *r <= u64::MAX - self.top)
            .ok_or_else(|| format!("absurd size {size}"))?;
        let (saved_top, saved_high_water) = (self.top, self.high_water);
        let addr = match self.free_by_size.range((rounded, 0)..).next().copied() {
            Some((free_size, addr)) => {
                self.remove_free(addr, free_size);
                if free_size > rounded {
                    self.free_by_addr
                        .insert(addr + rounded, free_size - rounded);
                    self.free_by_size
                        .insert((free_size - rounded, addr + rounded));
                }
                addr
            }
            None => {
                let addr = self.top;
                self.top += rounded;
                self.high_water = self.high_water.max(self.top);
                addr
            }
        };
        self.map(addr, rounded);
        if let Some(limit) = self.limit
            && self.reserved() > limit
        {
            let reserved = self.reserved();
            self.unmap(addr, rounded);
            if addr == saved_top {
                self.top = saved_top;
            } else {
                self.insert_free(addr, rounded);
            }
            self.high_water = saved_high_water;
            return Err(format!(
                "out of memory: {rounded} bytes would take reserved to {reserved} (limit {limit})"
            ));
        }
        self.live.insert(addr, rounded);
        self.allocated += rounded;
        Ok(addr)
    }

    fn free(&mut self, ptr: u64) -> Result<(), String> {
        let size = self
            .live
            .remove(&ptr)
            .ok_or_else(|| format!("free of unknown pointer {ptr:#x}"))?;
        self.allocated -= size;
        self.unmap(ptr, size);
        self.insert_free(ptr, size);
        Ok(())
    }

    fn sample(&self) -> (u64, u64) {
        (self.allocated, self.reserved())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_reuses_and_merges() {
        let mut m = ModelTarget::new(ModelMode::Vmm);
        let a = m.alloc(1000, 0).unwrap();
        let b = m.alloc(4096, 0).unwrap();
        let c = m.alloc(100, 0).unwrap();
        assert_eq!(b, a + 1024);
        assert_eq!(c, b + 4096);
        assert_eq!(m.sample(), (1024 + 4096 + 512, PAGE));
        m.free(b).unwrap();
        // Best fit: the 4096 hole takes a 3000-byte request.
        let d = m.alloc(3000, 0).unwrap();
        assert_eq!(d, b);
        m.free(d).unwrap();
        m.free(a).unwrap();
        // a and b merged into one 5120-byte hole.
        assert_eq!(m.alloc(5120, 0).unwrap(), a);
        assert!(m.free(0xdead).is_err());
    }

    #[test]
    fn vmm_unmaps_and_classic_keeps_high_water() {
        for mode in [ModelMode::Vmm, ModelMode::Classic] {
            let mut m = ModelTarget::new(mode);
            let a = m.alloc(3 * PAGE, 0).unwrap();
            let b = m.alloc(PAGE, 0).unwrap();
            assert_eq!(m.sample(), (4 * PAGE, 4 * PAGE));
            m.free(a).unwrap();
            let expect = if mode == ModelMode::Vmm {
                PAGE
            } else {
                4 * PAGE
            };
            assert_eq!(m.sample(), (PAGE, expect));
            m.free(b).unwrap();
            assert_eq!(m.sample().0, 0);
            assert_eq!(m.top, BASE);
        }
    }

    #[test]
    fn limit_fails_cleanly() {
        let mut m = ModelTarget::new(ModelMode::Vmm).with_limit(2 * PAGE);
        let a = m.alloc(PAGE, 0).unwrap();
        let err = m.alloc(2 * PAGE, 0).unwrap_err();
        assert!(err.contains("out of memory"), "{err}");
        assert_eq!(m.sample(), (PAGE, PAGE));
        let b = m.alloc(PAGE, 0).unwrap();
        assert_eq!(b, a + PAGE);
        assert!(m.alloc(u64::MAX, 0).is_err());
    }
}
