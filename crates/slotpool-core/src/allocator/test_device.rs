//! A device for the allocator's unit tests: it always has memory, and its events are always
//! complete.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::StreamId;
use crate::device::{CaptureStatus, Device, DevicePtr, DeviceResult, EventHandle, PageHandle};

/// A device that always has memory and whose events are always complete.
#[derive(Debug)]
pub(crate) struct Dev {
    next: AtomicU64,
    handles: AtomicU64,
}

impl Dev {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Dev {
            next: AtomicU64::new(1 << 32),
            handles: AtomicU64::new(1),
        })
    }

    fn bump(&self, size: u64) -> DevicePtr {
        self.next
            .fetch_add(size.next_multiple_of(2 << 20), Ordering::Relaxed)
    }

    fn handle(&self) -> u64 {
        self.handles.fetch_add(1, Ordering::Relaxed)
    }
}

impl Device for Dev {
    fn page_size(&self) -> u64 {
        2 << 20
    }
    fn total_memory(&self) -> u64 {
        1 << 40
    }
    fn free_memory(&self) -> u64 {
        1 << 40
    }
    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
        Ok(self.bump(size))
    }
    fn free_segment(&self, _: DevicePtr, _: u64) -> DeviceResult<()> {
        Ok(())
    }
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        Ok(self.bump(size))
    }
    fn release_reservation(&self, _: DevicePtr, _: u64) -> DeviceResult<()> {
        Ok(())
    }
    fn create_page(&self) -> DeviceResult<PageHandle> {
        Ok(PageHandle(self.handle()))
    }
    fn release_page(&self, _: PageHandle) -> DeviceResult<()> {
        Ok(())
    }
    fn map(&self, _: DevicePtr, _: PageHandle) -> DeviceResult<()> {
        Ok(())
    }
    fn unmap(&self, _: DevicePtr) -> DeviceResult<()> {
        Ok(())
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        Ok(EventHandle(self.handle()))
    }
    fn destroy_event(&self, _: EventHandle) -> DeviceResult<()> {
        Ok(())
    }
    fn record_event(&self, _: EventHandle, _: StreamId) -> DeviceResult<()> {
        Ok(())
    }
    fn query_event(&self, _: EventHandle) -> DeviceResult<bool> {
        Ok(true)
    }
    fn synchronize_event(&self, _: EventHandle) -> DeviceResult<()> {
        Ok(())
    }
    fn synchronize(&self) -> DeviceResult<()> {
        Ok(())
    }
    fn stream_wait_event(&self, _: StreamId, _: EventHandle) -> DeviceResult<()> {
        Ok(())
    }
    fn capture_status(&self, _: StreamId) -> DeviceResult<CaptureStatus> {
        Ok(CaptureStatus::None)
    }
}
