//! What a shard borrows from its device while it runs one operation: the backend, the policy, and
//! the device-wide pools of physical pages and events.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::GrowthMode;
use crate::device::{Device, DeviceError, DeviceResult, EventHandle, PageHandle};
use crate::peak::PeakCounter;
use crate::policy::{SMALL_BUFFER, SizePolicy};
use crate::sync::lock;

/// Physical bytes this allocator holds on the device, the most it may hold, and the most it
/// held (exact, device-wide: `max_memory_reserved`).
#[derive(Debug)]
pub struct Budget {
    held: AtomicU64,
    limit: AtomicU64,
    peak: AtomicU64,
}

impl Budget {
    pub fn new(limit: u64) -> Self {
        Budget {
            held: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            peak: AtomicU64::new(0),
        }
    }

    #[inline]
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed).max(self.held())
    }

    pub fn reset_peak(&self) {
        self.peak.store(self.held(), Ordering::Relaxed);
    }

    #[inline]
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::Relaxed)
    }

    pub fn set_limit(&self, limit: u64) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    /// Claim `bytes` if the limit allows; false leaves nothing claimed.
    pub fn try_claim(&self, bytes: u64) -> bool {
        match self.claim(bytes) {
            Some(now) => {
                self.peak.fetch_max(now, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// [`Budget::try_claim`] that leaves the peak alone, for bytes that are held only once a
    /// later step succeeds (then [`Budget::note_peak`]); released on failure, they never count.
    pub fn try_claim_quietly(&self, bytes: u64) -> bool {
        self.claim(bytes).is_some()
    }

    /// Record the bytes held now in the peak.
    pub fn note_peak(&self) {
        self.peak.fetch_max(self.held(), Ordering::Relaxed);
    }

    /// Add `bytes` within the limit; the new count.
    fn claim(&self, bytes: u64) -> Option<u64> {
        let limit = self.limit();
        self.held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                h.checked_add(bytes).filter(|&n| n <= limit)
            })
            .ok()
            .map(|prev| prev + bytes)
    }

    /// Give back `bytes` claimed before. Releasing more than is held is a bug: checked, never
    /// wrapped (the count stops at 0 and the invariant checker reports the mismatch).
    pub fn release(&self, bytes: u64) {
        let r = self
            .held
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |h| {
                Some(h.saturating_sub(bytes))
            });
        debug_assert!(
            r.is_ok_and(|h| h >= bytes),
            "budget released {bytes} bytes of {r:?}"
        );
    }
}

/// Unmapped physical pages, ready to be mapped anywhere on the device. They were unmapped only
/// after the work that last touched them completed, so any stream may use them at once.
///
/// It also holds the *stray runs*: physical runs ([`crate::block::runs`]) that nothing maps and that
/// the driver refused to release; they stay in the device budget until a release succeeds.
#[derive(Debug, Default)]
pub struct PagePool {
    pages: Mutex<Vec<PageHandle>>,
    runs: Mutex<Vec<(PageHandle, u64)>>,
}

impl PagePool {
    pub fn take(&self) -> Option<PageHandle> {
        lock(&self.pages).pop()
    }

    pub fn put(&self, page: PageHandle) {
        lock(&self.pages).push(page);
    }

    pub fn len(&self) -> usize {
        lock(&self.pages).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn drain(&self) -> Vec<PageHandle> {
        std::mem::take(&mut *lock(&self.pages))
    }

    /// Keep a run of `bytes` that the driver refused to release.
    pub fn put_run(&self, run: PageHandle, bytes: u64) {
        lock(&self.runs).push((run, bytes));
    }

    /// Bytes of the stray runs.
    pub fn run_bytes(&self) -> u64 {
        lock(&self.runs).iter().map(|&(_, b)| b).sum()
    }

    pub fn drain_runs(&self) -> Vec<(PageHandle, u64)> {
        std::mem::take(&mut *lock(&self.runs))
    }
}

/// Events are created once and reused: creating one is a driver call.
#[derive(Debug, Default)]
pub struct EventPool {
    events: Mutex<Vec<EventHandle>>,
}

impl EventPool {
    pub fn get(&self, dev: &dyn Device) -> DeviceResult<EventHandle> {
        if let Some(ev) = lock(&self.events).pop() {
            return Ok(ev);
        }
        dev.create_event()
    }

    pub fn put(&self, ev: EventHandle) {
        lock(&self.events).push(ev);
    }

    pub fn drain(&self) -> Vec<EventHandle> {
        std::mem::take(&mut *lock(&self.events))
    }
}

/// What every shard operation on one device shares, fixed when the allocator is made. The
/// [`crate::Allocator`] owns it; an [`Env`] borrows it whole, so that building one per call costs
/// a few words rather than a dozen.
#[derive(Debug)]
pub struct Shared {
    /// The device's page size, read once (asking the backend may take a lock).
    pub page_size: u64,
    pub policy: SizePolicy,
    pub growth: GrowthMode,
    pub budget: Budget,
    /// Allocated bytes on the whole device, for its peak ([`crate::peak`]). On its own cache
    /// line: growth writes it, and the fields around it are read by every call on every thread.
    pub allocated: crossbeam_utils::CachePadded<PeakCounter>,
    pub pages: PagePool,
    pub events: EventPool,
    /// The allocation history (recorded only while enabled).
    pub trace: crate::history::TraceRing,
    /// Size of each new vmm reservation (at least the request).
    pub vmm_reservation: u64,
    /// Idle mapped memory a vmm shard may keep beyond its live bytes, in percent of them (0: none;
    /// physical memory follows live bytes exactly, at the price of remapping pages when the
    /// allocation pattern shifts).
    pub vmm_slack_percent: f64,
    /// Idle bytes a vmm shard keeps on top of the percentage (`Config::vmm_slack_base`).
    pub vmm_slack_base: u64,
    /// `Config::gc_threshold`.
    pub gc_threshold: Option<f64>,
}

/// Borrowed context for one shard operation: the device, what the device's shards share (its
/// fields read through `Deref`), and what depends on the call.
#[derive(Clone, Copy)]
pub struct Env<'a> {
    pub dev: &'a dyn Device,
    pub shared: &'a Shared,
    /// Bytes the shard's pool holds (classic segments and mapped pages) against its own limit.
    pub pool_budget: &'a Budget,
    /// Some stream of this device is capturing: no event query, record or synchronise, no free or
    /// unmap (PyTorch's `captures_underway`).
    pub capture_underway: bool,
}

impl std::ops::Deref for Env<'_> {
    type Target = Shared;

    #[inline]
    fn deref(&self) -> &Shared {
        self.shared
    }
}

impl std::fmt::Debug for Env<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env")
            .field("growth", &self.growth)
            .field("capture_underway", &self.capture_underway)
            .finish_non_exhaustive()
    }
}

impl Env<'_> {
    /// Idle bytes a shard with `live` live bytes may keep mapped (`vmm_slack_percent`, plus
    /// `vmm_slack_base` when it is set).
    pub fn vmm_slack(&self, live: u64) -> u64 {
        if self.vmm_slack_percent <= 0.0 {
            return 0;
        }
        (live as f64 * self.vmm_slack_percent / 100.0) as u64 + self.vmm_slack_base
    }

    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Whether blocks of this size class grow by vmm pages. With pages larger than a small
    /// segment (`vmm_page_mb` above 2), small blocks take classic 2 MiB segments instead, as
    /// PyTorch's expandable segments keep 2 MiB pages for them: one large page per (pool, stream)
    /// for a few small tensors would hold up to a page of idle memory in every small pool.
    #[inline]
    pub fn vmm_for(&self, small: bool) -> bool {
        self.growth == GrowthMode::Vmm && !(small && self.page_size > SMALL_BUFFER)
    }

    /// A physical page for growth: from the device pool, else a new one within the budget.
    pub fn new_page(&self) -> DeviceResult<PageHandle> {
        if let Some(p) = self.pages.take() {
            return Ok(p);
        }
        let ps = self.page_size();
        if !self.budget.try_claim(ps) {
            return Err(DeviceError::OutOfMemory);
        }
        self.dev
            .create_page()
            .inspect_err(|_| self.budget.release(ps))
    }
}
