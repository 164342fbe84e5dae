//! The `Device` trait: everything the allocator needs from a GPU.
//!
//! This is slotpool's "hal" layer, in wgpu's sense: backends (`slotpool-sim`, `slotpool-cuda`)
//! implement it with as little policy as possible, and `slotpool-core` enforces every invariant one
//! layer up. All methods take `&self`: a backend is shared by every shard of a device and must be
//! internally synchronised (the CUDA driver is). Errors are values; a backend never panics.

use std::fmt;

/// An opaque stream handle (a `cudaStream_t` / `CUstream` as an integer). `0` is the legacy default
/// stream.
pub type StreamId = u64;

/// A device address.
pub type DevicePtr = u64;

/// An opaque physical page handle (a `CUmemGenericAllocationHandle` on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHandle(pub u64);

/// An opaque event handle (a `CUevent` on CUDA).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventHandle(pub u64);

/// An opaque pinned host buffer handle (a `cuMemHostAlloc` allocation on CUDA), holding the
/// contents of paused pools that asked for a backup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HostBuffer(pub u64);

/// Whether a stream is capturing into a CUDA graph, and into which one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing: every backend call is legal.
    None,
    /// Capturing; the value is the capture's unique id (`cudaStreamGetCaptureInfo`'s `id_out`).
    Active(u64),
    /// The capture was invalidated by an illegal call and must be ended.
    Invalidated,
}

impl CaptureStatus {
    /// True while the stream is capturing (active or invalidated).
    pub fn is_capturing(self) -> bool {
        !matches!(self, CaptureStatus::None)
    }
}

/// An error reported by a backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceError {
    /// The backend has no memory for this request (`CUDA_ERROR_OUT_OF_MEMORY`).
    OutOfMemory,
    /// The call is not permitted while a stream capture is underway.
    IllegalDuringCapture(&'static str),
    /// An argument was rejected (unknown handle, misaligned address, ...).
    InvalidArgument(String),
    /// The backend is not available (no driver, no device).
    Unavailable(String),
    /// Any other driver error, with its code and name.
    Driver { code: i32, what: String },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::OutOfMemory => write!(f, "device out of memory"),
            DeviceError::IllegalDuringCapture(call) => {
                write!(f, "{call} is not permitted during stream capture")
            }
            DeviceError::InvalidArgument(why) => write!(f, "invalid argument: {why}"),
            DeviceError::Unavailable(why) => write!(f, "device unavailable: {why}"),
            DeviceError::Driver { code, what } => write!(f, "driver error {code}: {what}"),
        }
    }
}

impl std::error::Error for DeviceError {}

/// Result of a backend call.
pub type DeviceResult<T> = Result<T, DeviceError>;

/// What the allocator needs from one GPU.
///
/// Contract (the backend may rely on the allocator for these, and must check none of them for
/// correctness, though the simulated device checks all of them to catch allocator bugs):
///
/// 1. `free_segment` only receives addresses returned by `alloc_segment`, once each.
/// 2. `map` only maps a page into a reserved range, at a multiple of [`Device::page_size`], where
///    nothing is mapped; `unmap` only unmaps what `map` mapped. A page may be mapped at several
///    addresses at once (an alias: its bytes are the same at each, see `slotpool_core::alias`);
///    `release_page` only releases a page that is mapped nowhere. A physical run
///    ([`Device::create_run`]) is only mapped whole, at one place, and unmapped whole.
/// 3. Events are destroyed only when no longer recorded-and-awaited.
/// 4. During capture of any stream, the allocator calls no `query_event`, `synchronize_event` or
///    `record_event` on a capturing stream, and calls `alloc_segment` / `map` only through a backend
///    that switches the capture mode to relaxed (the CUDA backend does).
pub trait Device: Send + Sync + 'static {
    /// Granularity of physical pages for vmm growth (2 MiB on every current NVIDIA GPU).
    fn page_size(&self) -> u64;

    /// Total device memory in bytes (`cuDeviceTotalMem`).
    fn total_memory(&self) -> u64;

    /// Free device memory in bytes as the driver sees it (`cuMemGetInfo`).
    fn free_memory(&self) -> u64;

    /// Allocate one segment of `size` bytes (`cuMemAlloc`). Classic growth.
    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr>;

    /// Free a segment returned by [`Device::alloc_segment`] (`cuMemFree`).
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()>;

    /// Reserve a virtual address range of `size` bytes, a multiple of the page size
    /// (`cuMemAddressReserve`). No physical memory is used.
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr>;

    /// Release a reserved range; nothing may be mapped in it (`cuMemAddressFree`).
    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()>;

    /// Create one physical page of [`Device::page_size`] bytes (`cuMemCreate`).
    fn create_page(&self) -> DeviceResult<PageHandle>;

    /// Release a physical page that is not mapped anywhere (`cuMemRelease`).
    fn release_page(&self, page: PageHandle) -> DeviceResult<()>;

    /// Map `page` at `ptr` and make it accessible (`cuMemMap` + `cuMemSetAccess`).
    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()>;

    /// Map `pages` at consecutive page addresses from `ptr` and make them accessible, all or
    /// nothing: on error none of them stays mapped. The CUDA backend sets access once for the
    /// whole run; `cuMemSetAccess` costs per call, not per byte (23 us, 115 us while a kernel
    /// runs, on the H200), so growth by n pages costs one access call, not n.
    fn map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        let ps = self.page_size();
        for (i, &page) in pages.iter().enumerate() {
            if let Err(e) = self.map(ptr + i as u64 * ps, page) {
                for j in 0..i {
                    let _ = self.unmap(ptr + j as u64 * ps);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Unmap the page mapped at `ptr` (`cuMemUnmap`). The caller guarantees that no pending work
    /// can touch it.
    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()>;

    /// Create one physical allocation of `pages` pages (`cuMemCreate` of `pages` times the page
    /// size): a *physical run* (`slotpool_core::block::runs`), mapped whole with
    /// [`Device::map_whole`], unmapped whole with [`Device::unmap_range`] and given back with
    /// [`Device::release_page`]. Backends without runs refuse it ([`DeviceError::Unavailable`]):
    /// the allocator then maps page by page.
    fn create_run(&self, pages: usize) -> DeviceResult<PageHandle> {
        let _ = pages;
        Err(DeviceError::Unavailable(
            "this backend has no physical runs".into(),
        ))
    }

    /// Map the whole run `run` of `pages` pages at `ptr` as one mapping and make it accessible
    /// (`cuMemMap` at offset 0 + one `cuMemSetAccess`); on error nothing stays mapped. The
    /// addresses are page slots of one reservation where nothing is mapped.
    fn map_whole(&self, ptr: DevicePtr, run: PageHandle, pages: usize) -> DeviceResult<()> {
        let _ = (ptr, run, pages);
        Err(DeviceError::Unavailable(
            "this backend has no physical runs".into(),
        ))
    }

    /// Unmap the whole mappings that cover exactly `[ptr, ptr + size)` (a run, or pages mapped
    /// one by one next to each other) in one driver call (`cuMemUnmap` over the range); all or
    /// nothing. A backend that cannot unmap several mappings at once refuses a range of several
    /// (the default: only one page, through [`Device::unmap`]); the allocator then unmaps page by
    /// page. A range that is one run is always accepted by a backend that makes runs. The caller
    /// guarantees that no pending work can touch the range.
    fn unmap_range(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        if size == self.page_size() {
            return self.unmap(ptr);
        }
        Err(DeviceError::Unavailable(
            "this backend unmaps one mapping per call".into(),
        ))
    }

    /// Create an event (timing disabled).
    fn create_event(&self) -> DeviceResult<EventHandle>;

    /// Destroy an event.
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()>;

    /// Record `event` on `stream`: it completes once all work queued on `stream` so far has.
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()>;

    /// Whether `event` has completed (`cuEventQuery`); never blocks.
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool>;

    /// Block the host until `event` completes (`cuEventSynchronize`).
    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()>;

    /// Block the host until all work queued on the device so far has completed
    /// (`cuCtxSynchronize`). Used by `empty_cache` and the OOM path instead of recording events
    /// on streams that the program may have destroyed since.
    fn synchronize(&self) -> DeviceResult<()>;

    /// Make future work on `stream` wait for `event` (`cuStreamWaitEvent`).
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()>;

    /// Whether `stream` is capturing, and into which capture (`cuStreamGetCaptureInfo`).
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus>;

    /// Give device `peer` read/write access to the pages mapped from now on, as
    /// `cudaDeviceEnablePeerAccess` does for `cudaMalloc` memory. Adding this device itself, or a
    /// peer twice, does nothing. Backends without peers refuse it.
    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        let _ = peer;
        Err(DeviceError::Unavailable(
            "this backend has no peer access".into(),
        ))
    }

    /// Give every added peer access to `size` bytes of pages mapped at `ptr` before it was added
    /// (`cuMemSetAccess`). Every page of the range is mapped.
    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let _ = (ptr, size);
        Err(DeviceError::Unavailable(
            "this backend has no peer access".into(),
        ))
    }

    /// Allocate `size` bytes of pinned (page-locked) host memory (`cuMemHostAlloc`), for the
    /// backups of paused pools. Backends without host memory refuse it.
    fn alloc_host(&self, size: u64) -> DeviceResult<HostBuffer> {
        let _ = size;
        Err(DeviceError::Unavailable(
            "this backend has no pinned host memory".into(),
        ))
    }

    /// Free a buffer returned by [`Device::alloc_host`] (`cuMemFreeHost`).
    fn free_host(&self, buf: HostBuffer) -> DeviceResult<()> {
        let _ = buf;
        Err(DeviceError::Unavailable(
            "this backend has no pinned host memory".into(),
        ))
    }

    /// Copy `size` bytes of mapped device memory at `src` to `dst` at byte `offset`
    /// (`cuMemcpyDtoH`), returning once the copy is done. The range may span several pages.
    fn copy_to_host(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        let _ = (dst, offset, src, size);
        Err(DeviceError::Unavailable(
            "this backend has no pinned host memory".into(),
        ))
    }

    /// Copy `size` bytes of `src` at byte `offset` to mapped device memory at `dst`
    /// (`cuMemcpyHtoD`), returning once the copy is done.
    fn copy_from_host(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let _ = (dst, src, offset, size);
        Err(DeviceError::Unavailable(
            "this backend has no pinned host memory".into(),
        ))
    }
}
