//! The simulated address space: segments, reservations, physical pages, their accounting, and
//! access to their bytes.

use std::collections::{BTreeMap, HashMap};

use slotpool_core::{DeviceError, DevicePtr, DeviceResult, PageHandle};

use crate::bytes::{Store, pattern_into};
use crate::config::{Backing, SimConfig};

mod runs;

/// The first address handed out.
const BASE: DevicePtr = 0x7f00_0000_0000;
/// What never-written segment bytes read as.
const SEGMENT_FILL: u8 = 0x00;
/// What never-written page bytes read as, so that reads of uninitialised memory stand out.
pub const PAGE_POISON: u8 = 0xA5;
/// `fill` and `verify` work through this many bytes at a time.
const STEP: usize = 64 << 10;

/// An error of the test-facing memory access API ([`SimDevice::read`](crate::SimDevice::read)
/// and friends).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SimAccessError {
    /// The device was built with [`Backing::Accounting`]: it has no bytes to access.
    #[error("the simulated device has no bytes (Backing::Accounting)")]
    NoBacking,
    /// `addr` is inside neither a live segment nor a mapped page.
    #[error("address {addr:#x} is not inside a live segment or a mapped page")]
    Unmapped {
        /// The first inaccessible address.
        addr: DevicePtr,
    },
    /// `verify` found a byte that differs from the pattern.
    #[error("byte at {addr:#x} is {found:#04x}, the pattern says {expected:#04x}")]
    Mismatch {
        /// The first mismatching address.
        addr: DevicePtr,
        /// The pattern's byte.
        expected: u8,
        /// The byte found.
        found: u8,
    },
}

/// One range of the address space.
#[derive(Debug)]
enum Range {
    /// A `alloc_segment` segment: physical from the start.
    Segment { size: u64, bytes: Store },
    /// A `reserve` range: virtual; page base address -> the page mapped there.
    Reservation {
        size: u64,
        mapped: BTreeMap<DevicePtr, PageHandle>,
    },
}

impl Range {
    fn size(&self) -> u64 {
        match self {
            Range::Segment { size, .. } | Range::Reservation { size, .. } => *size,
        }
    }
}

/// A physical page from `create_page`. It may be mapped at several addresses at once (CUDA maps
/// one allocation handle at any number of virtual addresses): its bytes are the same at each.
#[derive(Debug)]
struct Page {
    mapped_at: Vec<DevicePtr>,
    bytes: Store,
    /// The physical run this page is part of (`runs.rs`): mapped, unmapped and released only
    /// with its run.
    run: Option<PageHandle>,
}

/// Where some bytes of an access live: a segment (by start) or a page.
#[derive(Clone, Copy, Debug)]
enum Target {
    Segment(DevicePtr),
    Page(PageHandle),
}

/// A contiguous part of an access: `len` bytes at offset `off` of `target`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    target: Target,
    off: u64,
    len: u64,
}

/// All address-space and physical-memory state.
#[derive(Debug)]
pub(crate) struct Memory {
    page_size: u64,
    pub(crate) total: u64,
    backing: Backing,
    /// Where the next range may start (before alignment).
    pub(crate) next_addr: DevicePtr,
    /// Start address -> range. Ranges never overlap.
    ranges: BTreeMap<DevicePtr, Range>,
    pages: HashMap<PageHandle, Page>,
    next_page: u64,
    pub(crate) physical: u64,
    pub(crate) peak: u64,
    pub(crate) mapped: u64,
    /// Devices given access to pages mapped from now on (`add_peer`).
    peers: Vec<i32>,
    /// Mapped page address -> the peers that may access it (this device always may).
    access: HashMap<DevicePtr, Vec<i32>>,
    /// Physical runs by handle (`runs.rs`).
    runs: HashMap<PageHandle, runs::SimRun>,
    /// Whether `unmap_range` takes a range over several mappings (as the CUDA driver may).
    pub(crate) span_unmap: bool,
}

/// An `InvalidArgument` error.
fn invalid<T>(why: String) -> DeviceResult<T> {
    Err(DeviceError::InvalidArgument(why))
}

impl Memory {
    pub(crate) fn new(config: &SimConfig) -> Self {
        Memory {
            page_size: config.page_size,
            total: config.total_memory,
            backing: config.backing,
            next_addr: BASE,
            ranges: BTreeMap::new(),
            pages: HashMap::new(),
            next_page: 1,
            physical: 0,
            peak: 0,
            mapped: 0,
            peers: Vec::new(),
            access: HashMap::new(),
            runs: HashMap::new(),
            span_unmap: true,
        }
    }

    pub(crate) fn add_peer(&mut self, peer: i32) -> DeviceResult<()> {
        if peer < 0 {
            return invalid(format!("add_peer({peer}): not a device"));
        }
        if !self.peers.contains(&peer) {
            self.peers.push(peer);
        }
        Ok(())
    }

    /// Every page of [ptr, ptr + size) must be mapped, as `cuMemSetAccess` requires.
    pub(crate) fn refresh_access(&mut self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = format!("refresh_access({ptr:#x}, {size})");
        if !ptr.is_multiple_of(self.page_size) || !size.is_multiple_of(self.page_size) {
            return invalid(format!("{call}: not whole pages"));
        }
        let pages: Vec<DevicePtr> = (0..size / self.page_size)
            .map(|i| ptr + i * self.page_size)
            .collect();
        if let Some(p) = pages.iter().find(|p| !self.access.contains_key(p)) {
            return invalid(format!("{call}: no page is mapped at {p:#x}"));
        }
        for p in pages {
            self.access.insert(p, self.peers.clone());
        }
        Ok(())
    }

    /// The peers that may access the page mapped at `ptr` (None: no page there).
    pub(crate) fn page_peers(&self, ptr: DevicePtr) -> Option<Vec<i32>> {
        let base = ptr - ptr % self.page_size;
        self.access.get(&base).cloned()
    }

    pub(crate) fn page_size(&self) -> u64 {
        self.page_size
    }

    /// (live segments, live reservations, live pages).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        let segments = self
            .ranges
            .values()
            .filter(|r| matches!(r, Range::Segment { .. }))
            .count();
        (segments, self.ranges.len() - segments, self.pages.len())
    }

    /// Live pages mapped nowhere.
    pub(crate) fn unmapped_pages(&self) -> usize {
        self.pages
            .values()
            .filter(|p| p.mapped_at.is_empty())
            .count()
    }

    /// Host bytes held by all stores.
    pub(crate) fn host_bytes(&self) -> u64 {
        let segments = self.ranges.values().map(|r| match r {
            Range::Segment { bytes, .. } => bytes.host_bytes(),
            Range::Reservation { .. } => 0,
        });
        let pages = self.pages.values().map(|p| p.bytes.host_bytes());
        segments.chain(pages).sum()
    }

    /// Charges `size` physical bytes, or fails if the device is full.
    fn charge(&mut self, size: u64) -> DeviceResult<()> {
        match self.physical.checked_add(size) {
            Some(after) if after <= self.total => {
                self.physical = after;
                self.peak = self.peak.max(after);
                Ok(())
            }
            _ => Err(DeviceError::OutOfMemory),
        }
    }

    /// Picks the address of a new range of `size` bytes: page-aligned, after every earlier range,
    /// with a guard page after it. Addresses are never reused.
    fn place(&mut self, size: u64) -> DeviceResult<DevicePtr> {
        let mask = self.page_size - 1;
        let align = |x: u64| x.checked_add(mask).map(|x| x & !mask);
        let start = align(self.next_addr).ok_or(DeviceError::OutOfMemory)?;
        let next = align(size)
            .and_then(|s| start.checked_add(s))
            .and_then(|end| end.checked_add(self.page_size))
            .ok_or(DeviceError::OutOfMemory)?;
        self.next_addr = next;
        Ok(start)
    }

    /// The range containing `addr`, with its start.
    fn range_at(&self, addr: DevicePtr) -> Option<(DevicePtr, &Range)> {
        let (&start, range) = self.ranges.range(..=addr).next_back()?;
        (addr - start < range.size()).then_some((start, range))
    }

    pub(crate) fn alloc_segment(&mut self, size: u64) -> DeviceResult<DevicePtr> {
        if size == 0 {
            return invalid("alloc_segment(0): size must be positive".into());
        }
        self.charge(size)?;
        let start = match self.place(size) {
            Ok(start) => start,
            Err(e) => {
                self.physical -= size;
                return Err(e);
            }
        };
        let bytes = Store::new(SEGMENT_FILL);
        self.ranges.insert(start, Range::Segment { size, bytes });
        Ok(start)
    }

    pub(crate) fn free_segment(&mut self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = format!("free_segment({ptr:#x}, {size})");
        match self.ranges.get(&ptr) {
            Some(Range::Segment { size: live, .. }) if *live == size => {}
            Some(Range::Segment { size: live, .. }) => {
                return invalid(format!("{call}: the segment there has size {live}"));
            }
            Some(Range::Reservation { .. }) => {
                return invalid(format!("{call}: that is a reservation, not a segment"));
            }
            None => return invalid(format!("{call}: no live segment starts there")),
        }
        self.ranges.remove(&ptr);
        self.physical -= size;
        Ok(())
    }

    pub(crate) fn reserve(&mut self, size: u64) -> DeviceResult<DevicePtr> {
        if size == 0 || !size.is_multiple_of(self.page_size) {
            return invalid(format!(
                "reserve({size}): size must be a positive multiple of the page size {}",
                self.page_size
            ));
        }
        let start = self.place(size)?;
        let mapped = BTreeMap::new();
        self.ranges
            .insert(start, Range::Reservation { size, mapped });
        Ok(start)
    }

    pub(crate) fn release_reservation(&mut self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = format!("release_reservation({ptr:#x}, {size})");
        match self.ranges.get(&ptr) {
            Some(Range::Reservation { size: live, mapped }) if *live == size => {
                if let Some((at, page)) = mapped.iter().next() {
                    return invalid(format!(
                        "{call}: {} page(s) still mapped, e.g. page {} at {at:#x}",
                        mapped.len(),
                        page.0
                    ));
                }
            }
            Some(Range::Reservation { size: live, .. }) => {
                return invalid(format!("{call}: the reservation there has size {live}"));
            }
            Some(Range::Segment { .. }) => {
                return invalid(format!("{call}: that is a segment, not a reservation"));
            }
            None => return invalid(format!("{call}: no reservation starts there")),
        }
        self.ranges.remove(&ptr);
        Ok(())
    }

    pub(crate) fn create_page(&mut self) -> DeviceResult<PageHandle> {
        self.charge(self.page_size)?;
        let handle = PageHandle(self.next_page);
        self.next_page += 1;
        let page = Page {
            mapped_at: Vec::new(),
            bytes: Store::new(PAGE_POISON),
            run: None,
        };
        self.pages.insert(handle, page);
        Ok(handle)
    }

    /// Why `page` is not a live page.
    fn dead_page(&self, call: &str, page: PageHandle) -> String {
        if (1..self.next_page).contains(&page.0) {
            format!("{call}: page {} was already released", page.0)
        } else {
            format!("{call}: page {} was never created", page.0)
        }
    }

    pub(crate) fn release_page(&mut self, page: PageHandle) -> DeviceResult<()> {
        let call = format!("release_page({})", page.0);
        if self.runs.contains_key(&page) {
            return self.release_run(page);
        }
        match self.pages.get(&page) {
            None => return invalid(self.dead_page(&call, page)),
            Some(Page { run: Some(r), .. }) => {
                return invalid(format!("{call}: the page is part of run {}", r.0));
            }
            Some(Page { mapped_at, .. }) if !mapped_at.is_empty() => {
                return invalid(format!(
                    "{call}: the page is still mapped at {:#x}",
                    mapped_at[0]
                ));
            }
            Some(_) => {}
        }
        self.pages.remove(&page);
        self.physical -= self.page_size;
        Ok(())
    }

    pub(crate) fn map(&mut self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        let call = format!("map({ptr:#x}, page {})", page.0);
        match self.pages.get(&page) {
            None => return invalid(self.dead_page(&call, page)),
            Some(Page { run: Some(r), .. }) => {
                return invalid(format!("{call}: the page is part of run {}", r.0));
            }
            Some(_) => {}
        }
        if !ptr.is_multiple_of(self.page_size) {
            return invalid(format!("{call}: address is not page-aligned"));
        }
        let Some((start, Range::Reservation { .. })) = self.range_at(ptr) else {
            return invalid(format!("{call}: address is not inside a reservation"));
        };
        let Some(Range::Reservation { mapped, .. }) = self.ranges.get_mut(&start) else {
            return invalid(format!("{call}: reservation vanished"));
        };
        if let Some(other) = mapped.get(&ptr) {
            return invalid(format!("{call}: page {} is already mapped there", other.0));
        }
        mapped.insert(ptr, page);
        if let Some(p) = self.pages.get_mut(&page) {
            p.mapped_at.push(ptr);
        }
        self.access.insert(ptr, self.peers.clone());
        self.mapped += self.page_size;
        Ok(())
    }

    pub(crate) fn unmap(&mut self, ptr: DevicePtr) -> DeviceResult<()> {
        let call = format!("unmap({ptr:#x})");
        let Some((start, Range::Reservation { .. })) = self.range_at(ptr) else {
            return invalid(format!("{call}: address is not inside a reservation"));
        };
        let Some(Range::Reservation { mapped, .. }) = self.ranges.get_mut(&start) else {
            return invalid(format!("{call}: reservation vanished"));
        };
        match mapped.get(&ptr) {
            None => return invalid(format!("{call}: no page is mapped at that address")),
            Some(page) if self.pages.get(page).is_some_and(|p| p.run.is_some()) => {
                return invalid(format!(
                    "{call}: the page is part of a run's mapping, unmapped only whole"
                ));
            }
            Some(_) => {}
        }
        let Some(page) = mapped.remove(&ptr) else {
            return invalid(format!("{call}: no page is mapped at that address"));
        };
        if let Some(p) = self.pages.get_mut(&page) {
            p.mapped_at.retain(|&at| at != ptr);
        }
        self.access.remove(&ptr);
        self.mapped -= self.page_size;
        Ok(())
    }

    /// Splits `len` bytes at `ptr` into pieces of segments and pages; all or nothing.
    fn pieces(&self, ptr: DevicePtr, len: u64) -> Result<Vec<Piece>, SimAccessError> {
        if self.backing == Backing::Accounting {
            return Err(SimAccessError::NoBacking);
        }
        let mut pieces = Vec::new();
        let (mut addr, mut left) = (ptr, len);
        while left > 0 {
            let unmapped = SimAccessError::Unmapped { addr };
            let (target, off, avail) = match self.range_at(addr).ok_or(unmapped.clone())? {
                (start, Range::Segment { size, .. }) => {
                    (Target::Segment(start), addr - start, start + size - addr)
                }
                (start, Range::Reservation { mapped, .. }) => {
                    let base = addr - (addr - start) % self.page_size;
                    let page = *mapped.get(&base).ok_or(unmapped)?;
                    (
                        Target::Page(page),
                        addr - base,
                        base + self.page_size - addr,
                    )
                }
            };
            let len = left.min(avail);
            pieces.push(Piece { target, off, len });
            addr += len;
            left -= len;
        }
        Ok(pieces)
    }

    /// How the memory is backed.
    pub(crate) fn backing(&self) -> Backing {
        self.backing
    }

    /// Whether all `len` bytes at `ptr` lie in live segments or mapped pages.
    pub(crate) fn accessible(&self, ptr: DevicePtr, len: u64) -> Result<(), SimAccessError> {
        self.pieces(ptr, len).map(|_| ())
    }

    fn store(&self, target: Target) -> Option<&Store> {
        match target {
            Target::Segment(start) => match self.ranges.get(&start) {
                Some(Range::Segment { bytes, .. }) => Some(bytes),
                _ => None,
            },
            Target::Page(page) => self.pages.get(&page).map(|p| &p.bytes),
        }
    }

    fn store_mut(&mut self, target: Target) -> Option<&mut Store> {
        match target {
            Target::Segment(start) => match self.ranges.get_mut(&start) {
                Some(Range::Segment { bytes, .. }) => Some(bytes),
                _ => None,
            },
            Target::Page(page) => self.pages.get_mut(&page).map(|p| &mut p.bytes),
        }
    }

    pub(crate) fn write(&mut self, ptr: DevicePtr, data: &[u8]) -> Result<(), SimAccessError> {
        let mut done = 0;
        for piece in self.pieces(ptr, data.len() as u64)? {
            let len = piece.len as usize;
            if let Some(store) = self.store_mut(piece.target) {
                store.write_from(piece.off, &data[done..done + len]);
            }
            done += len;
        }
        Ok(())
    }

    pub(crate) fn read(&self, ptr: DevicePtr, len: usize) -> Result<Vec<u8>, SimAccessError> {
        self.check_access(ptr, len as u64)?;
        let mut out = vec![0; len];
        self.read_into(ptr, &mut out)?;
        Ok(out)
    }

    pub(crate) fn read_into(&self, ptr: DevicePtr, out: &mut [u8]) -> Result<(), SimAccessError> {
        let mut done = 0;
        for piece in self.pieces(ptr, out.len() as u64)? {
            let len = piece.len as usize;
            if let Some(store) = self.store(piece.target) {
                store.read_into(piece.off, &mut out[done..done + len]);
            }
            done += len;
        }
        Ok(())
    }

    pub(crate) fn check_access(&self, ptr: DevicePtr, len: u64) -> Result<(), SimAccessError> {
        self.pieces(ptr, len).map(|_| ())
    }

    pub(crate) fn fill(
        &mut self,
        ptr: DevicePtr,
        len: u64,
        seed: u64,
    ) -> Result<(), SimAccessError> {
        let mut buf = vec![0; STEP];
        let mut done = 0;
        for piece in self.pieces(ptr, len)? {
            let Some(store) = self.store_mut(piece.target) else {
                continue;
            };
            for at in (0..piece.len).step_by(STEP) {
                let buf = &mut buf[..STEP.min((piece.len - at) as usize)];
                pattern_into(seed, done + at, buf);
                store.write_from(piece.off + at, buf);
            }
            done += piece.len;
        }
        Ok(())
    }

    pub(crate) fn verify(&self, ptr: DevicePtr, len: u64, seed: u64) -> Result<(), SimAccessError> {
        let (mut found, mut expected) = (vec![0; STEP], vec![0; STEP]);
        let mut done = 0;
        for piece in self.pieces(ptr, len)? {
            let Some(store) = self.store(piece.target) else {
                continue;
            };
            for at in (0..piece.len).step_by(STEP) {
                let n = STEP.min((piece.len - at) as usize);
                store.read_into(piece.off + at, &mut found[..n]);
                pattern_into(seed, done + at, &mut expected[..n]);
                if found[..n] == expected[..n] {
                    continue;
                }
                if let Some(i) = (0..n).find(|&i| found[i] != expected[i]) {
                    return Err(SimAccessError::Mismatch {
                        addr: ptr + done + at + i as u64,
                        expected: expected[i],
                        found: found[i],
                    });
                }
            }
            done += piece.len;
        }
        Ok(())
    }
}
