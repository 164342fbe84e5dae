//! Backend calls counted by kind: the allocator reaches its device through [`Counted`], so that
//! its statistics say how many driver calls it made ([`crate::Allocator::backend_calls`]; the C
//! ABI's `sp_backend_calls_get`, `slotpool_torch.backend_calls()`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::{
    CaptureStatus, Device, DevicePtr, DeviceResult, EventHandle, HostBuffer, PageHandle, StreamId,
};

/// Backend calls made so far, by kind. `map` counts pages mapped one by one (a run of n pages
/// is n maps); a physical run (`crate::block::runs`) counts one `create_page`, one `map`, one
/// `unmap` and one `release_page`, as the driver sees it, and an unmap of several pages in one
/// call ([`Device::unmap_range`]) one `unmap`; `synchronize` counts `synchronize_event` and
/// `synchronize`. The C ABI's `sp_backend_calls` itself (slotpool-abi), so that its fields are
/// written once and reach C unconverted.
pub type BackendCalls = slotpool_abi::sp_backend_calls;

const KINDS: usize = 12;

/// A device whose calls are counted. It forwards every method of [`Device`], defaulted ones
/// included (a default left in place would answer instead of the backend).
pub(crate) struct Counted {
    dev: Arc<dyn Device>,
    counts: [AtomicU64; KINDS],
}

impl std::fmt::Debug for Counted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Counted")
            .field("calls", &self.calls())
            .finish_non_exhaustive()
    }
}

impl Counted {
    pub(crate) fn new(dev: Arc<dyn Device>) -> Self {
        Counted {
            dev,
            counts: Default::default(),
        }
    }

    #[inline]
    fn count(&self, kind: usize, n: u64) {
        self.counts[kind].fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn calls(&self) -> BackendCalls {
        let c = |k: usize| self.counts[k].load(Ordering::Relaxed);
        BackendCalls {
            alloc_segment: c(0),
            free_segment: c(1),
            reserve: c(2),
            release_reservation: c(3),
            create_page: c(4),
            release_page: c(5),
            map: c(6),
            unmap: c(7),
            create_event: c(8),
            record_event: c(9),
            query_event: c(10),
            synchronize: c(11),
        }
    }
}

impl Device for Counted {
    fn page_size(&self) -> u64 {
        self.dev.page_size()
    }
    fn total_memory(&self) -> u64 {
        self.dev.total_memory()
    }
    fn free_memory(&self) -> u64 {
        self.dev.free_memory()
    }
    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.count(0, 1);
        self.dev.alloc_segment(size)
    }
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.count(1, 1);
        self.dev.free_segment(ptr, size)
    }
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.count(2, 1);
        self.dev.reserve(size)
    }
    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.count(3, 1);
        self.dev.release_reservation(ptr, size)
    }
    fn create_page(&self) -> DeviceResult<PageHandle> {
        self.count(4, 1);
        self.dev.create_page()
    }
    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.count(5, 1);
        self.dev.release_page(page)
    }
    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        self.count(6, 1);
        self.dev.map(ptr, page)
    }
    fn map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        self.count(6, pages.len() as u64);
        self.dev.map_run(ptr, pages)
    }
    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        self.count(7, 1);
        self.dev.unmap(ptr)
    }
    fn create_run(&self, pages: usize) -> DeviceResult<PageHandle> {
        self.count(4, 1);
        self.dev.create_run(pages)
    }
    fn map_whole(&self, ptr: DevicePtr, run: PageHandle, pages: usize) -> DeviceResult<()> {
        self.count(6, 1);
        self.dev.map_whole(ptr, run, pages)
    }
    fn unmap_range(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        // A range the backend refuses made no driver call worth counting (the allocator then
        // unmaps page by page, counted there).
        self.dev
            .unmap_range(ptr, size)
            .inspect(|()| self.count(7, 1))
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        self.count(8, 1);
        self.dev.create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.dev.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        self.count(9, 1);
        self.dev.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        self.count(10, 1);
        self.dev.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.count(11, 1);
        self.dev.synchronize_event(event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        self.count(11, 1);
        self.dev.synchronize()
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        self.dev.stream_wait_event(stream, event)
    }
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        self.dev.capture_status(stream)
    }
    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        self.dev.add_peer(peer)
    }
    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.dev.refresh_access(ptr, size)
    }
    fn alloc_host(&self, size: u64) -> DeviceResult<HostBuffer> {
        self.dev.alloc_host(size)
    }
    fn free_host(&self, buf: HostBuffer) -> DeviceResult<()> {
        self.dev.free_host(buf)
    }
    fn copy_to_host(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        self.dev.copy_to_host(dst, offset, src, size)
    }
    fn copy_from_host(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        self.dev.copy_from_host(dst, src, offset, size)
    }
}
