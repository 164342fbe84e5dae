//! slotpool-sim: a simulated GPU for tests, trace replay and benches.
//!
//! [`SimDevice`] implements [`slotpool_core::Device`] on host memory. Streams and events complete
//! when the test says so, stream capture can be begun and ended, out-of-memory can be injected, and
//! every breach of the `Device` contract is rejected and counted, so allocator tests can assert that
//! [`SimDevice::contract_violations`] and [`SimDevice::capture_violations`] stay 0.
#![forbid(unsafe_code)]

mod bytes;
mod capture;
mod config;
mod faults;
mod host;
pub mod keys;
mod memory;
mod streams;
#[cfg(test)]
mod tests;
mod work;

use std::sync::{Mutex, MutexGuard, PoisonError};

use slotpool_core::{
    CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostBuffer,
    PageHandle, StreamId,
};

pub use bytes::pattern_byte;
pub use config::{Backing, SimConfig};
pub use faults::CallKind;
pub use keys::SimOptions;
pub use memory::{PAGE_POISON, SimAccessError};

use capture::Captures;
use faults::Faults;
use host::HostMemory;
use memory::Memory;
use streams::Streams;
use work::Work;

/// A simulated GPU backed by host memory.
///
/// Invariants (each checked by the unit tests):
///
/// 1. Segments (`alloc_segment`) and reservations (`reserve`) get page-aligned, non-overlapping
///    addresses from 0x7f00_0000_0000 upwards, with at least one unused guard page between any
///    two; addresses, page handles and event handles are never reused, so stale ones are caught.
/// 2. `physical_bytes()` is exactly the sum of live segment sizes plus `page_size` per live page,
///    mapped or not; reservations cost nothing. A physical allocation that would take it past
///    `total_memory()` fails with `OutOfMemory`. `free_memory()` is `total - physical` (0 if
///    `set_capacity` went below the current use).
/// 3. A page is mapped only at page-aligned addresses inside reservations where nothing is
///    mapped; it may be mapped at several such addresses at once (an alias, as CUDA allows), and
///    is released only once mapped nowhere. `mapped_bytes()` is `page_size` per mapping.
/// 4. A call that breaks the `Device` contract fails with `InvalidArgument`, changes nothing, and
///    increments `contract_violations()` (the message is kept in `last_violation()`).
/// 5. Bytes belong to physical objects: a page's bytes appear wherever it is mapped. Fresh segment
///    bytes read as 0, fresh page bytes as [`PAGE_POISON`]. With [`Backing::Accounting`] there are
///    no bytes and every access fails with [`SimAccessError::NoBacking`].
/// 6. Per stream, `completed <= submitted` and `completed` never decreases. An event is complete
///    once its stream's `completed` reaches the `submitted` snapshot of its last record (an event
///    never recorded is complete). `stream_wait_event` queues a wait marker (one unit) whose
///    completion first completes the awaited stream up to the event's snapshot. With
///    auto-completion on, every stream is always fully complete.
/// 7. While any stream captures, `query_event`, `synchronize_event`, `free_segment`, `unmap`,
///    `release_page`, `release_reservation`, and `record_event` / `stream_wait_event` on a
///    capturing stream fail with `IllegalDuringCapture`, change nothing, increment
///    `capture_violations()` and invalidate every capture in progress. Work launched on a capturing
///    stream goes into the graph, not the stream: it is not queued.
/// 8. Every call of a [`CallKind`] is counted in `calls(kind)`, failed ones included. A call
///    chosen by `inject_oom` / `fail_all` fails with `OutOfMemory` and changes nothing (capture
///    rules are checked first).
/// 9. Host buffers (`alloc_host`) hold real bytes (sparse, read as 0 until written) and are
///    never reused; `copy_to_host` / `copy_from_host` copy between them and mapped memory, all
///    or nothing, and are illegal during any capture. `host_buffer_bytes()` is their total size.
/// 10. Work queued by `launch_touching` touches its range until its unit completes. A successful
///     `unmap` or `free_segment` of memory that pending work touches is made (as the driver
///     would make it) and counted in `work_violations()`, the message kept in
///     `last_work_violation()`.
#[derive(Debug)]
pub struct SimDevice {
    state: Mutex<State>,
    /// Runs once after the next device synchronisation (`after_next_synchronize`).
    sync_hook: Mutex<Option<SyncHook>>,
}

/// What `after_next_synchronize` runs.
struct SyncHook(Box<dyn FnOnce() + Send>);

impl std::fmt::Debug for SyncHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SyncHook")
    }
}

/// Everything behind the device's lock.
#[derive(Debug)]
struct State {
    memory: Memory,
    host: HostMemory,
    streams: Streams,
    work: Work,
    captures: Captures,
    faults: Faults,
    contract_violations: u64,
    last_violation: Option<String>,
}

/// When a call is forbidden during capture.
#[derive(Clone, Copy, Debug)]
enum CaptureRule {
    /// Always legal.
    Allowed,
    /// Illegal while any stream captures.
    NoCapture,
    /// Illegal on a capturing stream.
    NotOn(StreamId),
}

impl State {
    /// Runs one `Device` call: counts it, applies the capture rule, injects faults, and counts a
    /// contract violation if `f` reports one.
    fn call<T>(
        &mut self,
        kind: CallKind,
        rule: CaptureRule,
        f: impl FnOnce(&mut State) -> DeviceResult<T>,
    ) -> DeviceResult<T> {
        let fail = self.faults.begin(kind);
        let illegal = match rule {
            CaptureRule::Allowed => false,
            CaptureRule::NoCapture => self.captures.any(),
            CaptureRule::NotOn(stream) => self.captures.status(stream).is_capturing(),
        };
        if illegal {
            return Err(self.captures.violate(kind.name()));
        }
        if fail {
            return Err(DeviceError::OutOfMemory);
        }
        let result = f(self);
        self.checked(result)
    }

    /// Counts a contract violation if `result` is one.
    fn checked<T>(&mut self, result: DeviceResult<T>) -> DeviceResult<T> {
        if let Err(DeviceError::InvalidArgument(why)) = &result {
            self.contract_violations += 1;
            self.last_violation = Some(why.clone());
        }
        result
    }
}

impl Default for SimDevice {
    /// A device with [`SimConfig::default`].
    fn default() -> Self {
        SimDevice::from_valid(SimConfig::default())
    }
}

impl SimDevice {
    /// Builds a device; fails if `config.page_size` is not a power of two.
    pub fn new(config: SimConfig) -> DeviceResult<Self> {
        config.validate()?;
        Ok(SimDevice::from_valid(config))
    }

    /// Builds a device whose addresses all lie `offset` bytes above those of [`SimDevice::new`]'s,
    /// so that several devices of one process never hand out the same pointer (CUDA's unified
    /// addressing gives real devices that guarantee). `offset` must be a multiple of the page size.
    pub fn with_address_offset(config: SimConfig, offset: DevicePtr) -> DeviceResult<Self> {
        config.validate()?;
        if !offset.is_multiple_of(config.page_size) || offset.checked_add(1 << 48).is_none() {
            return Err(DeviceError::InvalidArgument(format!(
                "address offset {offset:#x}: must be a multiple of the page size {:#x} below 2^64 - 2^48",
                config.page_size
            )));
        }
        let dev = SimDevice::from_valid(config);
        dev.lock().memory.next_addr += offset;
        Ok(dev)
    }

    fn from_valid(config: SimConfig) -> Self {
        let state = State {
            memory: Memory::new(&config),
            host: HostMemory::default(),
            streams: Streams::new(config.auto_complete),
            work: Work::default(),
            captures: Captures::default(),
            faults: Faults::default(),
            contract_violations: 0,
            last_violation: None,
        };
        SimDevice {
            state: Mutex::new(state),
            sync_hook: Mutex::new(None),
        }
    }

    /// The state; a poisoned lock is taken anyway (the simulator never panics while holding it).
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    // --- memory accounting ---

    /// Physical bytes in use: live segments plus created pages, mapped or not.
    pub fn physical_bytes(&self) -> u64 {
        self.lock().memory.physical
    }

    /// The highest `physical_bytes()` since creation or the last `reset_peak_physical()`.
    pub fn peak_physical_bytes(&self) -> u64 {
        self.lock().memory.peak
    }

    /// Sets the peak to the current `physical_bytes()`.
    pub fn reset_peak_physical(&self) {
        let mut s = self.lock();
        s.memory.peak = s.memory.physical;
    }

    /// Bytes of pages currently mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.lock().memory.mapped
    }

    /// The peers that may access the page mapped at `ptr` (this device always may), or `None`
    /// when no page is mapped there.
    pub fn page_peers(&self, ptr: DevicePtr) -> Option<Vec<i32>> {
        self.lock().memory.page_peers(ptr)
    }

    /// Changes `total_memory()`; memory already in use stays, later allocations see the new total.
    pub fn set_capacity(&self, bytes: u64) {
        self.lock().memory.total = bytes;
    }

    /// Live segments.
    pub fn segment_count(&self) -> usize {
        self.lock().memory.counts().0
    }

    /// Live reservations.
    pub fn reservation_count(&self) -> usize {
        self.lock().memory.counts().1
    }

    /// Live physical pages, mapped or not.
    pub fn page_count(&self) -> usize {
        self.lock().memory.counts().2
    }

    /// Live physical runs (`create_run`; their pages count in `page_count` too).
    pub fn run_count(&self) -> usize {
        self.lock().memory.run_count()
    }

    /// Whether `unmap_range` takes a range over several mappings (on by default, as the CUDA
    /// driver does if the GPU probe `benches/gpu/vmm_runs.cu` finds so); off, it refuses them as
    /// `Unavailable`, a driver that unmaps one mapping per call.
    pub fn set_span_unmap(&self, on: bool) {
        self.lock().memory.span_unmap = on;
    }

    /// Live pages mapped nowhere (a page mapped at several addresses counts in neither).
    pub fn unmapped_page_count(&self) -> usize {
        self.lock().memory.unmapped_pages()
    }

    /// Host bytes actually allocated to back device memory (64 KiB per chunk ever written).
    pub fn host_bytes(&self) -> u64 {
        self.lock().memory.host_bytes()
    }

    /// Bytes of live pinned host buffers (`alloc_host`).
    pub fn host_buffer_bytes(&self) -> u64 {
        self.lock().host.bytes
    }

    // --- memory access ---

    /// Writes `data` at `ptr`; all of it must lie in live segments or mapped pages.
    pub fn write(&self, ptr: DevicePtr, data: &[u8]) -> Result<(), SimAccessError> {
        self.lock().memory.write(ptr, data)
    }

    /// Reads `len` bytes at `ptr`; all of them must lie in live segments or mapped pages.
    pub fn read(&self, ptr: DevicePtr, len: usize) -> Result<Vec<u8>, SimAccessError> {
        self.lock().memory.read(ptr, len)
    }

    /// Reads `buf.len()` bytes at `ptr` into `buf` (no host allocation); all of them must lie in
    /// live segments or mapped pages, else nothing is written to `buf`.
    pub fn read_into(&self, ptr: DevicePtr, buf: &mut [u8]) -> Result<(), SimAccessError> {
        self.lock().memory.read_into(ptr, buf)
    }

    /// Whether all `len` bytes at `ptr` lie in live segments or mapped pages of a device that
    /// keeps bytes: the error [`read`](Self::read) and friends would give, without the access.
    pub fn check_access(&self, ptr: DevicePtr, len: u64) -> Result<(), SimAccessError> {
        self.lock().memory.check_access(ptr, len)
    }

    /// Writes the pattern for `seed` over `len` bytes at `ptr`: byte `ptr + i` gets
    /// [`pattern_byte`]`(seed, i)`.
    pub fn fill(&self, ptr: DevicePtr, len: u64, seed: u64) -> Result<(), SimAccessError> {
        self.lock().memory.fill(ptr, len, seed)
    }

    /// Checks that `len` bytes at `ptr` hold the pattern `fill(ptr, len, seed)` wrote; reports
    /// the first mismatching address.
    pub fn verify(&self, ptr: DevicePtr, len: u64, seed: u64) -> Result<(), SimAccessError> {
        self.lock().memory.verify(ptr, len, seed)
    }

    // --- faults and counters ---

    /// Makes the `nth` next call of `kind` fail with `OutOfMemory` (1 = the very next call; 0
    /// counts as 1). Several injections may be pending at once.
    pub fn inject_oom(&self, kind: CallKind, nth: u64) {
        self.lock().faults.inject(kind, nth);
    }

    /// Makes every call of `kind` fail with `OutOfMemory` while `on`.
    pub fn fail_all(&self, kind: CallKind, on: bool) {
        self.lock().faults.fail_all(kind, on);
    }

    /// Calls of `kind` so far, failed ones included.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.lock().faults.calls(kind)
    }

    /// Calls rejected with `InvalidArgument` so far.
    pub fn contract_violations(&self) -> u64 {
        self.lock().contract_violations
    }

    /// The message of the latest contract violation.
    pub fn last_violation(&self) -> Option<String> {
        self.lock().last_violation.clone()
    }

    /// Calls rejected with `IllegalDuringCapture` so far.
    pub fn capture_violations(&self) -> u64 {
        self.lock().captures.violations
    }

    /// Successful `synchronize_event` calls so far.
    pub fn synchronizations(&self) -> u64 {
        self.lock().streams.synchronizations
    }

    /// Successful `stream_wait_event` calls so far.
    pub fn stream_waits(&self) -> u64 {
        self.lock().streams.stream_waits
    }

    /// Events created and not destroyed.
    pub fn live_events(&self) -> usize {
        self.lock().streams.live_events()
    }

    // --- streams ---

    /// Queues one unit of work on `stream` (completes at once with auto-completion). On a capturing
    /// stream the work goes into the graph and nothing is queued.
    pub fn launch(&self, stream: StreamId) {
        let mut s = self.lock();
        if !s.captures.status(stream).is_capturing() {
            s.streams.launch(stream);
        }
    }

    /// Queues one unit of work on `stream` that reads and writes `len` bytes at `ptr` until it
    /// completes, as a kernel does: unmapping or freeing that memory before then is a work
    /// violation (invariant 10). On a capturing stream the work goes into the graph and nothing
    /// is queued.
    pub fn launch_touching(&self, stream: StreamId, ptr: DevicePtr, len: u64) {
        let mut s = self.lock();
        if s.captures.status(stream).is_capturing() {
            return;
        }
        s.streams.launch(stream);
        let unit = s.streams.submitted(stream);
        if s.streams.completed(stream) < unit {
            s.work.touch(stream, unit, ptr, len);
        }
    }

    /// Runs `f` once, right after the next successful `synchronize()` returns from the device and
    /// before it returns to its caller, outside the device's lock (so `f` may call the device and
    /// whatever holds it). Tests use it to put another thread's work in the window between a
    /// synchronisation and what its caller does next. A second call replaces a hook not yet run.
    pub fn after_next_synchronize(&self, f: impl FnOnce() + Send + 'static) {
        *self
            .sync_hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(SyncHook(Box::new(f)));
    }

    /// Ranges that queued work still touches, as `(stream, ptr, len)`, oldest first.
    pub fn pending_touches(&self) -> Vec<(StreamId, DevicePtr, u64)> {
        let s = &mut *self.lock();
        s.work.pending(&s.streams)
    }

    /// Successful `unmap` / `free_segment` calls that freed memory queued work still touched.
    pub fn work_violations(&self) -> u64 {
        self.lock().work.violations
    }

    /// The message of the latest work violation.
    pub fn last_work_violation(&self) -> Option<String> {
        self.lock().work.last.clone()
    }

    /// Completes all work queued on `stream` so far (and what its waits need).
    pub fn complete(&self, stream: StreamId) {
        self.lock().streams.complete(stream);
    }

    /// Completes all work queued on every stream.
    pub fn complete_all(&self) {
        self.lock().streams.complete_all();
    }

    /// Units of work queued on `stream` so far (launches and wait markers).
    pub fn submitted(&self, stream: StreamId) -> u64 {
        self.lock().streams.submitted(stream)
    }

    /// Units of work completed on `stream` so far.
    pub fn completed(&self, stream: StreamId) -> u64 {
        self.lock().streams.completed(stream)
    }

    /// Whether work completes the moment it is queued.
    pub fn auto_complete(&self) -> bool {
        self.lock().streams.auto_complete()
    }

    /// Turns auto-completion on (completing everything queued so far) or off.
    pub fn set_auto_complete(&self, on: bool) {
        self.lock().streams.set_auto_complete(on);
    }

    // --- capture ---

    /// Starts capturing `stream`; returns the capture's id (unique, from 1). Fails with
    /// `InvalidArgument` if the stream already captures.
    pub fn begin_capture(&self, stream: StreamId) -> DeviceResult<u64> {
        let mut s = self.lock();
        let result = s.captures.begin(stream);
        s.checked(result)
    }

    /// Ends the capture of `stream` and returns its id. An invalidated capture ends too, but
    /// reports `Driver { code: 901 }` (`cudaErrorStreamCaptureInvalidated`). Fails with
    /// `InvalidArgument` if the stream does not capture.
    pub fn end_capture(&self, stream: StreamId) -> DeviceResult<u64> {
        let mut s = self.lock();
        let result = s.captures.end(stream);
        s.checked(result)
    }
}

impl Device for SimDevice {
    fn page_size(&self) -> u64 {
        self.lock().memory.page_size()
    }

    fn total_memory(&self) -> u64 {
        self.lock().memory.total
    }

    fn free_memory(&self) -> u64 {
        let s = self.lock();
        s.memory.total.saturating_sub(s.memory.physical)
    }

    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
        let rule = CaptureRule::Allowed;
        self.lock().call(CallKind::AllocSegment, rule, |s| {
            s.memory.alloc_segment(size)
        })
    }

    fn free_segment(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::FreeSegment, rule, |s| {
            s.memory.free_segment(ptr, size)?;
            s.work.freed(&s.streams, "free_segment", ptr, size);
            Ok(())
        })
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::Reserve, rule, |s| s.memory.reserve(size))
    }

    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::ReleaseReservation, rule, |s| {
            s.memory.release_reservation(ptr, size)
        })
    }

    fn create_page(&self) -> DeviceResult<PageHandle> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::CreatePage, rule, |s| s.memory.create_page())
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock()
            .call(CallKind::ReleasePage, rule, |s| s.memory.release_page(page))
    }

    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::Map, rule, |s| s.memory.map(ptr, page))
    }

    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::Unmap, rule, |s| {
            s.memory.unmap(ptr)?;
            let page = s.memory.page_size();
            s.work.freed(&s.streams, "unmap", ptr, page);
            Ok(())
        })
    }

    fn create_run(&self, pages: usize) -> DeviceResult<PageHandle> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::CreateRun, rule, |s| s.memory.create_run(pages))
    }

    fn map_whole(&self, ptr: DevicePtr, run: PageHandle, pages: usize) -> DeviceResult<()> {
        let rule = CaptureRule::Allowed;
        self.lock().call(CallKind::MapWhole, rule, |s| {
            s.memory.map_whole(ptr, run, pages)
        })
    }

    fn unmap_range(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::UnmapRange, rule, |s| {
            s.memory.unmap_range(ptr, size)
        })
    }

    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        self.lock().memory.add_peer(peer)
    }

    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.lock().memory.refresh_access(ptr, size)
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let rule = CaptureRule::Allowed;
        self.lock().call(CallKind::CreateEvent, rule, |s| {
            Ok(s.streams.create_event())
        })
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let rule = CaptureRule::Allowed;
        self.lock().call(CallKind::DestroyEvent, rule, |s| {
            s.streams.destroy_event(event)
        })
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let rule = CaptureRule::NotOn(stream);
        self.lock().call(CallKind::RecordEvent, rule, |s| {
            s.streams.record_event(event, stream)
        })
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let rule = CaptureRule::NoCapture;
        self.lock()
            .call(CallKind::QueryEvent, rule, |s| s.streams.query_event(event))
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::SynchronizeEvent, rule, |s| {
            s.streams.synchronize_event(event)
        })
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::SynchronizeEvent, rule, |s| {
            s.streams.complete_all();
            Ok(())
        })?;
        let hook = self
            .sync_hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(SyncHook(f)) = hook {
            f();
        }
        Ok(())
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let rule = CaptureRule::NotOn(stream);
        self.lock().call(CallKind::StreamWaitEvent, rule, |s| {
            s.streams.stream_wait_event(stream, event)
        })
    }

    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        Ok(self.lock().captures.status(stream))
    }

    fn alloc_host(&self, size: u64) -> DeviceResult<HostBuffer> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::AllocHost, rule, |s| s.host.alloc(size))
    }

    fn free_host(&self, buf: HostBuffer) -> DeviceResult<()> {
        let rule = CaptureRule::Allowed;
        self.lock()
            .call(CallKind::FreeHost, rule, |s| s.host.free(buf))
    }

    fn copy_to_host(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::CopyToHost, rule, |s| {
            s.host.copy_to_host(&s.memory, dst, offset, src, size)
        })
    }

    fn copy_from_host(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let rule = CaptureRule::NoCapture;
        self.lock().call(CallKind::CopyFromHost, rule, |s| {
            s.host.copy_from_host(&mut s.memory, dst, src, offset, size)
        })
    }
}
