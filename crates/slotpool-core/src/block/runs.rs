//! Physical runs: one physical allocation backing several consecutive page slots of a vmm
//! reservation, mapped with one call and unmapped with one call.
//!
//! A resume maps a paused pool back as runs (`Shard::map_runs`, `shard/runs.rs`) instead of a
//! page per slot:
//! on the H200 a page costs one `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` (about 33 us at 4
//! MiB), a run of any length costs the same three calls. The driver's rules shape the rest:
//!
//! - a run is mapped whole at offset 0 (`cuMemMap` may take an offset into the allocation on
//!   recent drivers, HIP's may not; nothing here needs it), at one place: its pages are never
//!   aliases (`crate::alias`) of other slots, nor given to other reservations;
//! - `cuMemUnmap` must cover whole mappings, so a run is unmapped and released as a unit: an
//!   empty-cache or a release frees a run only when every slot of it is idle and safe
//!   (`Shard::release_idle_runs`); a run with live or graph-retained slots stays, every byte
//!   of it counted in `reserved_bytes`;
//! - a pause unmaps each run with one call and releases it with one call, and unmaps a stretch
//!   of pages mapped one by one with one call too where the backend can
//!   ([`Device::unmap_range`]).
//!
//! In the page table a run slot holds a *tag* in place of a page handle ([`slot_tag`], unique in
//! its reservation), so that the per-slot machinery (live counts, idle bits, aliases, snapshots)
//! sees one page per slot; [`Runs`] says which slots form which run and holds the run's handle
//! (shard invariant 12, [`PageTable::check_runs`]). The shard's side, creating, mapping and
//! releasing runs, is `shard/runs.rs`.
//!
//! [`Device::unmap_range`]: crate::device::Device::unmap_range

use std::collections::BTreeMap;

use crate::block::PageTable;
use crate::device::PageHandle;

/// The most bytes one run of a resume takes. Larger runs cost no more driver calls, but a run
/// goes back to the driver only whole: past this, an empty-cache after a resume could keep
/// gigabytes for one live block.
pub const RUN_MAX_BYTES: u64 = 2 << 30;

/// The bit that marks a tag: page handles of the CUDA driver and of the simulated device are
/// below 2^63.
const TAG: u64 = 1 << 63;

/// What the page table holds at slot `p` of a run.
pub fn slot_tag(p: usize) -> PageHandle {
    PageHandle(TAG | p as u64)
}

/// Whether `h` is a run slot's tag rather than a page.
pub fn is_tag(h: PageHandle) -> bool {
    h.0 & TAG != 0
}

/// One physical allocation of `pages` pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PhysRun {
    pub handle: PageHandle,
    pub pages: usize,
}

/// The runs of one reservation (a part of [`PageTable`]).
#[derive(Clone, Debug, Default)]
pub struct Runs {
    /// First slot -> run. Runs never overlap.
    by_first: BTreeMap<usize, PhysRun>,
    /// Bit p set when slot p belongs to a run.
    bits: Vec<u64>,
}

impl PageTable {
    /// Whether slot `p` belongs to a run.
    #[inline]
    pub fn in_run(&self, p: usize) -> bool {
        self.runs
            .bits
            .get(p / 64)
            .is_some_and(|w| w & (1 << (p % 64)) != 0)
    }

    /// Whether any slot of [first, end) belongs to a run.
    pub fn any_in_run(&self, first: usize, end: usize) -> bool {
        !self.runs.by_first.is_empty() && (first..end).any(|p| self.in_run(p))
    }

    /// The run slot `p` belongs to, with its first slot.
    pub fn run_of(&self, p: usize) -> Option<(usize, PhysRun)> {
        if !self.in_run(p) {
            return None;
        }
        let (&first, &run) = self.runs.by_first.range(..=p).next_back()?;
        (first + run.pages > p).then_some((first, run))
    }

    /// Every run, by first slot.
    pub fn runs(&self) -> impl Iterator<Item = (usize, PhysRun)> + '_ {
        self.runs.by_first.iter().map(|(&f, &r)| (f, r))
    }

    /// Physical allocations behind this reservation's slots (a run counts once).
    pub fn run_count(&self) -> usize {
        self.runs.by_first.len()
    }

    fn set_run_bits(&mut self, first: usize, pages: usize, on: bool) {
        let words = (first + pages).div_ceil(64);
        if self.runs.bits.len() < words {
            self.runs.bits.resize(words, 0);
        }
        for p in first..first + pages {
            let (w, b) = (p / 64, 1u64 << (p % 64));
            if on {
                self.runs.bits[w] |= b;
            } else {
                self.runs.bits[w] &= !b;
            }
        }
    }

    /// Record `run`, just mapped at slots [first, first + run.pages), where nothing was mapped.
    pub fn add_run(&mut self, first: usize, run: PhysRun) {
        self.cover(first + run.pages - 1);
        for p in first..first + run.pages {
            self.add_mapping(p, slot_tag(p));
        }
        self.set_run_bits(first, run.pages, true);
        self.runs.by_first.insert(first, run);
    }

    /// Forget the run that starts at slot `first` (the caller unmapped it): its slots are
    /// unmapped, neither idle nor retained.
    pub fn remove_run(&mut self, first: usize) -> Option<PhysRun> {
        let run = self.runs.by_first.remove(&first)?;
        self.set_run_bits(first, run.pages, false);
        for p in first..first + run.pages {
            self.remove_mapping(p);
        }
        Some(run)
    }

    /// Shard invariant 12: runs lie inside the reservation's `slots`, do not overlap, and their
    /// slots (exactly the run bits) are mapped to their own tags, alone; no other slot holds a
    /// tag.
    pub fn check_runs(&self, slots: usize) -> Result<(), String> {
        let mut end = 0;
        let mut in_runs = 0;
        for (first, run) in self.runs() {
            if run.pages == 0 || first < end || first + run.pages > slots {
                return Err(format!(
                    "12: run at slot {first} of {} pages overlaps or leaves the reservation",
                    run.pages
                ));
            }
            if is_tag(run.handle) {
                return Err(format!("12: run at slot {first} has a tag for a handle"));
            }
            for p in first..first + run.pages {
                if self.handle.get(p).copied().flatten() != Some(slot_tag(p)) || !self.in_run(p) {
                    return Err(format!("12: slot {p} of the run at {first} is not its tag"));
                }
                if self.is_shared(p) {
                    return Err(format!("12: run slot {p} is an alias"));
                }
            }
            end = first + run.pages;
            in_runs += run.pages;
        }
        let bits: usize = self.runs.bits.iter().map(|w| w.count_ones() as usize).sum();
        if bits != in_runs {
            return Err(format!("12: {bits} run bits for {in_runs} run slots"));
        }
        for (p, h) in self.handle.iter().enumerate() {
            if h.is_some_and(is_tag) && !self.in_run(p) {
                return Err(format!("12: slot {p} holds a tag outside any run"));
            }
        }
        Ok(())
    }
}
