//! Physical runs of the simulated device: one physical allocation of several pages
//! (`cuMemCreate` of several pages), mapped whole at offset 0 and unmapped whole, as the CUDA
//! driver requires of one allocation's mapping. Inside, a run is pages of the page model, so that
//! byte access needs nothing new; those pages refuse `map`, `unmap` and `release_page` on their
//! own (contract violations).

use slotpool_core::{DeviceError, DevicePtr, DeviceResult, PageHandle};

use super::{Memory, PAGE_POISON, Page, Range, invalid};
use crate::bytes::Store;

/// One run: its pages in order, and where it is mapped.
#[derive(Debug)]
pub(super) struct SimRun {
    pages: Vec<PageHandle>,
    at: Option<DevicePtr>,
}

impl Memory {
    pub(crate) fn create_run(&mut self, n: usize) -> DeviceResult<PageHandle> {
        if n == 0 {
            return invalid("create_run(0): a run has at least one page".into());
        }
        self.charge(n as u64 * self.page_size)?;
        let handle = PageHandle(self.next_page);
        self.next_page += 1;
        let mut pages = Vec::with_capacity(n);
        for _ in 0..n {
            let h = PageHandle(self.next_page);
            self.next_page += 1;
            let page = Page {
                mapped_at: Vec::new(),
                bytes: Store::new(PAGE_POISON),
                run: Some(handle),
            };
            self.pages.insert(h, page);
            pages.push(h);
        }
        self.runs.insert(handle, SimRun { pages, at: None });
        Ok(handle)
    }

    pub(crate) fn map_whole(
        &mut self,
        ptr: DevicePtr,
        run: PageHandle,
        n: usize,
    ) -> DeviceResult<()> {
        let call = format!("map_whole({ptr:#x}, run {}, {n} pages)", run.0);
        let ps = self.page_size;
        let Some(r) = self.runs.get(&run) else {
            return invalid(self.dead_page(&call, run));
        };
        if r.pages.len() != n {
            return invalid(format!("{call}: the run has {} pages", r.pages.len()));
        }
        if let Some(at) = r.at {
            return invalid(format!("{call}: the run is mapped at {at:#x} already"));
        }
        if !ptr.is_multiple_of(ps) {
            return invalid(format!("{call}: address is not page-aligned"));
        }
        let end = ptr + n as u64 * ps;
        let Some((start, Range::Reservation { size, mapped })) = self.range_at(ptr) else {
            return invalid(format!("{call}: address is not inside a reservation"));
        };
        if end > start + size {
            return invalid(format!("{call}: the run leaves its reservation"));
        }
        if let Some((at, _)) = mapped.range(ptr..end).next() {
            return invalid(format!("{call}: a page is mapped at {at:#x} already"));
        }
        let pages = r.pages.clone();
        let Some(Range::Reservation { mapped, .. }) = self.ranges.get_mut(&start) else {
            return invalid(format!("{call}: reservation vanished"));
        };
        for (i, &h) in pages.iter().enumerate() {
            mapped.insert(ptr + i as u64 * ps, h);
        }
        for (i, h) in pages.iter().enumerate() {
            let at = ptr + i as u64 * ps;
            if let Some(p) = self.pages.get_mut(h) {
                p.mapped_at.push(at);
            }
            self.access.insert(at, self.peers.clone());
        }
        self.mapped += n as u64 * ps;
        if let Some(r) = self.runs.get_mut(&run) {
            r.at = Some(ptr);
        }
        Ok(())
    }

    /// Unmaps the whole mappings covering exactly `[ptr, ptr + size)`; all or nothing. Without
    /// `span_unmap` a range of more than one mapping is refused as `Unavailable` (a driver that
    /// unmaps one mapping per call), which is no contract violation.
    pub(crate) fn unmap_range(&mut self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let call = format!("unmap_range({ptr:#x}, {size})");
        let ps = self.page_size;
        if size == 0 || !ptr.is_multiple_of(ps) || !size.is_multiple_of(ps) {
            return invalid(format!("{call}: not a whole number of pages"));
        }
        let end = ptr + size;
        let Some((
            start,
            Range::Reservation {
                size: rsize,
                mapped,
            },
        )) = self.range_at(ptr)
        else {
            return invalid(format!("{call}: address is not inside a reservation"));
        };
        if end > start + rsize {
            return invalid(format!("{call}: the range leaves its reservation"));
        }
        // Walk the mappings: single pages, or whole runs starting and ending inside the range.
        let mut addr = ptr;
        let mut mappings = 0;
        let mut runs = Vec::new();
        while addr < end {
            let Some(h) = mapped.get(&addr) else {
                return invalid(format!("{call}: nothing is mapped at {addr:#x}"));
            };
            let step = match self.pages.get(h).and_then(|p| p.run) {
                None => ps,
                Some(run) => {
                    let r = &self.runs[&run];
                    let len = r.pages.len() as u64 * ps;
                    if r.at != Some(addr) || addr + len > end {
                        return invalid(format!(
                            "{call}: the range cuts run {}'s mapping, which is unmapped only whole",
                            run.0
                        ));
                    }
                    runs.push(run);
                    len
                }
            };
            mappings += 1;
            addr += step;
        }
        if mappings > 1 && !self.span_unmap {
            return Err(DeviceError::Unavailable(format!(
                "{call}: this device unmaps one mapping per call"
            )));
        }
        let Some(Range::Reservation { mapped, .. }) = self.ranges.get_mut(&start) else {
            return invalid(format!("{call}: reservation vanished"));
        };
        let gone: Vec<(DevicePtr, PageHandle)> =
            mapped.range(ptr..end).map(|(&a, &h)| (a, h)).collect();
        for &(a, _) in &gone {
            mapped.remove(&a);
        }
        for (a, h) in gone {
            if let Some(p) = self.pages.get_mut(&h) {
                p.mapped_at.retain(|&at| at != a);
            }
            self.access.remove(&a);
            self.mapped -= ps;
        }
        for run in runs {
            if let Some(r) = self.runs.get_mut(&run) {
                r.at = None;
            }
        }
        Ok(())
    }

    /// `release_page` of a run: it must be mapped nowhere.
    pub(super) fn release_run(&mut self, run: PageHandle) -> DeviceResult<()> {
        let r = &self.runs[&run];
        if let Some(at) = r.at {
            return invalid(format!(
                "release_page({}): the run is still mapped at {at:#x}",
                run.0
            ));
        }
        let n = r.pages.len() as u64;
        if let Some(r) = self.runs.remove(&run) {
            for h in r.pages {
                self.pages.remove(&h);
            }
        }
        self.physical -= n * self.page_size;
        Ok(())
    }

    /// Live physical runs.
    pub(crate) fn run_count(&self) -> usize {
        self.runs.len()
    }
}
