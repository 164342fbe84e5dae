//! [`CudaDevice`]: the [`Device`] trait over the CUDA driver API.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdevice_attribute, CUevent, CUevent_flags, CUmemAccess_flags,
    CUmemAccessDesc, CUmemAllocationGranularity_flags, CUmemAllocationProp, CUmemAllocationType,
    CUmemLocationType, CUresult, CUstream, CUstreamCaptureMode, CUstreamCaptureStatus,
};
use slotpool_core::{
    CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostBuffer,
    PageHandle, StreamId,
};

use crate::error::{call, error_from, guard, mark_driver_loaded};

/// Page size assumed when the device has no VMM support (VMM methods then fail anyway).
const FALLBACK_PAGE_SIZE: u64 = 2 << 20;

/// Every driver symbol this crate calls. [`CudaDevice::new`] looks them all up before the first
/// call, so that an old driver is reported as [`DeviceError::Unavailable`] rather than by a
/// cudarc "Missing symbol" panic in the middle of an allocation.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuMemGetInfo_v2",
    "cuMemGetAllocationGranularity",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemSetAccess",
    "cuMemUnmap",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuCtxSynchronize",
    "cuStreamWaitEvent",
    "cuStreamGetCaptureInfo_v3",
    "cuThreadExchangeStreamCaptureMode",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
];

/// Whether a CUDA driver library (`libcuda.so*`) can be loaded in this process. Never panics.
pub fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on the candidate names and drops (dlcloses)
    // each library it opened; it has no preconditions.
    guard(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

/// One CUDA device, driven through its primary context. See the crate documentation for the
/// context and capture-mode rules.
///
/// All handles are stored as integers, so the type is `Send + Sync` without `unsafe impl`: the
/// driver API is thread-safe, and a primary context may be made current on any thread.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: i32,
    device: CUdevice,
    /// The retained primary context (`CUcontext` as an address); released on drop.
    ctx: usize,
    name: String,
    driver_version: i32,
    total_memory: u64,
    /// The driver's recommended allocation granularity (the smallest page).
    granularity: u64,
    /// The vmm page: the granularity unless [`CudaDevice::set_page_size`] chose a multiple.
    page_size: u64,
    vmm: bool,
    /// Access descriptors for `cuMemSetAccess`: this device first, then the peers of
    /// [`Device::add_peer`].
    pub(crate) access: RwLock<Vec<CUmemAccessDesc>>,
    /// Pages are made exportable as POSIX file descriptors (the device supports it), so that
    /// other processes can map them (`ipc.rs`).
    /// Cleared if the driver refuses to make such pages after all (`create_page`).
    pub(crate) shareable: AtomicBool,
    /// File descriptors of exported pages, by page handle: kept open while the page lives, since
    /// a receiver duplicates them (`pidfd_getfd`) whenever it opens the handle; closed by
    /// [`Device::release_page`].
    pub(crate) exported: Mutex<HashMap<u64, c_int>>,
    /// Ranges mapped from other processes' pages (`ipc.rs`): address -> (pages, page bytes).
    pub(crate) imported: Mutex<HashMap<u64, (usize, usize)>>,
    /// Live pinned host buffers (`host.rs`): host address -> bytes.
    pub(crate) host: Mutex<HashMap<u64, usize>>,
}

/// Restores the calling thread's previous context when dropped (see [`CudaDevice::enter`]).
#[must_use]
pub(crate) struct ContextScope {
    /// `Some(previous context)` when [`CudaDevice::enter`] switched contexts.
    restore: Option<usize>,
}

impl Drop for ContextScope {
    fn drop(&mut self) {
        if let Some(prev) = self.restore {
            // A failed restore cannot be reported from `drop`; it only happens when the driver
            // is being torn down, and the operation it follows has already taken effect.
            // SAFETY: `prev` is the context that was current on this thread a moment ago (or
            // null, which unbinds); `cuCtxSetCurrent` accepts either.
            let _ = call("cuCtxSetCurrent", || unsafe {
                sys::cuCtxSetCurrent(prev as CUcontext)
            });
        }
    }
}

/// Puts the calling thread's capture mode back when dropped (see [`relaxed`]).
#[must_use]
pub(crate) struct RelaxedScope {
    previous: CUstreamCaptureMode,
}

impl Drop for RelaxedScope {
    fn drop(&mut self) {
        let mut mode = self.previous;
        // SAFETY: `mode` is a valid, initialised in/out pointer for the duration of the call.
        let _ = call("cuThreadExchangeStreamCaptureMode", || unsafe {
            sys::cuThreadExchangeStreamCaptureMode(&mut mode)
        });
    }
}

/// Switches the calling thread's stream-capture interaction mode to relaxed until the returned
/// scope is dropped, so that calls CUDA forbids during a global-mode capture on another stream
/// (`cuMemAlloc`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemAddressReserve`) neither fail
/// nor invalidate that capture.
pub(crate) fn relaxed() -> DeviceResult<RelaxedScope> {
    let mut mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a valid, initialised in/out pointer for the duration of the call.
    call("cuThreadExchangeStreamCaptureMode", || unsafe {
        sys::cuThreadExchangeStreamCaptureMode(&mut mode)
    })?;
    Ok(RelaxedScope { previous: mode })
}

pub(crate) fn to_usize(bytes: u64, what: &str) -> DeviceResult<usize> {
    usize::try_from(bytes).map_err(|_| {
        DeviceError::InvalidArgument(format!("{what}: {bytes} bytes do not fit in usize"))
    })
}

fn stream_of(stream: StreamId) -> CUstream {
    stream as usize as CUstream
}

fn event_of(event: EventHandle) -> CUevent {
    event.0 as usize as CUevent
}

/// Maps an error from device discovery (`cuInit`, `cuDeviceGet`, ...) to `Unavailable`.
fn unavailable(err: DeviceError) -> DeviceError {
    match err {
        DeviceError::Unavailable(why) => DeviceError::Unavailable(why),
        other => DeviceError::Unavailable(other.to_string()),
    }
}

impl CudaDevice {
    /// Opens device `ordinal`: loads the driver, `cuInit`, retains the primary context and reads
    /// the total memory, the VMM support and the VMM page granularity (recommended granularity
    /// of pinned device memory).
    ///
    /// Returns [`DeviceError::Unavailable`] when `libcuda` is missing, lacks a symbol this crate
    /// uses, or has no device `ordinal`. Never panics.
    pub fn new(ordinal: i32) -> DeviceResult<CudaDevice> {
        if !driver_present() {
            return Err(DeviceError::Unavailable(
                "libcuda.so not found (no NVIDIA driver on this machine, or not on the loader path)"
                    .to_string(),
            ));
        }
        check_symbols()?;
        mark_driver_loaded();

        // SAFETY: `cuInit` takes flags that must be 0 and has no other precondition.
        call("cuInit", || unsafe { sys::cuInit(0) }).map_err(unavailable)?;
        let mut driver_version: c_int = 0;
        // SAFETY: `driver_version` is a valid out-pointer for the duration of the call.
        call("cuDriverGetVersion", || unsafe {
            sys::cuDriverGetVersion(&mut driver_version)
        })
        .map_err(unavailable)?;
        let mut device: CUdevice = 0;
        // SAFETY: `device` is a valid out-pointer; an out-of-range ordinal is reported as an error.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut device, ordinal)
        })
        .map_err(unavailable)?;

        let name = device_name(device)?;
        let mut total: usize = 0;
        // SAFETY: `total` is a valid out-pointer and `device` a valid device handle.
        call("cuDeviceTotalMem_v2", || unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, device)
        })?;
        let vmm = device_attribute(
            device,
            CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )? != 0;
        let shareable = vmm
            && device_attribute(
                device,
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )? != 0;

        let mut ctx: CUcontext = ptr::null_mut();
        // SAFETY: `ctx` is a valid out-pointer and `device` a valid device handle. The reference
        // taken here is released exactly once, by `Drop for CudaDevice`.
        call("cuDevicePrimaryCtxRetain", || unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, device)
        })?;

        let mut this = CudaDevice {
            ordinal,
            device,
            ctx: ctx as usize,
            name,
            driver_version,
            total_memory: total as u64,
            granularity: FALLBACK_PAGE_SIZE,
            page_size: FALLBACK_PAGE_SIZE,
            vmm,
            access: RwLock::new(vec![access_desc(device)]),
            shareable: AtomicBool::new(shareable),
            exported: Mutex::new(HashMap::new()),
            imported: Mutex::new(HashMap::new()),
            host: Mutex::new(HashMap::new()),
        };
        // From here on an early return drops `this`, which releases the primary context.
        if vmm {
            let granularity = {
                let _ctx = this.enter()?;
                let prop = allocation_prop(device, shareable);
                let mut granularity: usize = 0;
                // SAFETY: `granularity` is a valid out-pointer and `prop` a fully initialised
                // property struct that outlives the call.
                call("cuMemGetAllocationGranularity", || unsafe {
                    sys::cuMemGetAllocationGranularity(
                        &mut granularity,
                        &prop,
                        CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
                    )
                })?;
                granularity as u64
            };
            if granularity == 0 {
                return Err(DeviceError::Driver {
                    code: 0,
                    what: "cuMemGetAllocationGranularity returned 0".to_string(),
                });
            }
            this.granularity = granularity;
            this.page_size = granularity;
        }
        Ok(this)
    }

    /// Makes vmm pages `bytes` large: each page is one `cuMemCreate` + `cuMemMap` +
    /// `cuMemSetAccess`, whose cost hardly depends on the size, so larger pages make growth
    /// cheaper per byte. Set it before the allocator is built on this device. `bytes` must be a
    /// positive multiple of the allocation granularity (2 MiB on current GPUs); otherwise
    /// [`DeviceError::InvalidArgument`] and nothing changes.
    pub fn set_page_size(&mut self, bytes: u64) -> DeviceResult<()> {
        if bytes == 0 || !bytes.is_multiple_of(self.granularity) {
            return Err(DeviceError::InvalidArgument(format!(
                "vmm page size {bytes} is not a positive multiple of the granularity {}",
                self.granularity
            )));
        }
        self.page_size = bytes;
        Ok(())
    }

    /// The driver's allocation granularity (the smallest vmm page).
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The device ordinal this was opened with.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device name (`cuDeviceGetName`), e.g. `"NVIDIA H200"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The driver's CUDA version (`cuDriverGetVersion`), e.g. `13000` for CUDA 13.0.
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Whether the device supports virtual memory management (`cuMemCreate` and friends). When it
    /// does not, [`Device::reserve`], [`Device::create_page`] and [`Device::map`] return
    /// [`DeviceError::Unavailable`] and only classic growth works.
    pub fn vmm_supported(&self) -> bool {
        self.vmm
    }

    /// Makes this device's primary context current on the calling thread and leaves it there,
    /// for callers that drive CUDA directly next to the allocator (tests, benches). The
    /// [`Device`] methods do not need it.
    pub fn make_current(&self) -> DeviceResult<()> {
        // SAFETY: `self.ctx` is the primary context retained in `new` and not yet released.
        call("cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(self.ctx as CUcontext)
        })
    }

    /// Creates a non-blocking stream on this device (`cuStreamCreate`), for tests and benches.
    pub fn create_stream(&self) -> DeviceResult<StreamId> {
        let _ctx = self.enter()?;
        let mut stream: CUstream = ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer; flag 1 is `CU_STREAM_NON_BLOCKING`.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        })?;
        Ok(stream as usize as StreamId)
    }

    /// Destroys a stream made by [`CudaDevice::create_stream`] (`cuStreamDestroy_v2`).
    pub fn destroy_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the driver validates the handle; the caller passes a stream it created.
        call("cuStreamDestroy_v2", || unsafe {
            sys::cuStreamDestroy_v2(stream_of(stream))
        })
    }

    /// Blocks until all work queued on `stream` has completed (`cuStreamSynchronize`).
    pub fn synchronize_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the driver validates the handle; 0 is the legacy default stream.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream_of(stream))
        })
    }

    /// Makes the primary context current on this thread if it is not; the returned scope puts the
    /// previous context (possibly none) back when dropped.
    pub(crate) fn enter(&self) -> DeviceResult<ContextScope> {
        let mut current: CUcontext = ptr::null_mut();
        // SAFETY: `current` is a valid out-pointer for the duration of the call.
        call("cuCtxGetCurrent", || unsafe {
            sys::cuCtxGetCurrent(&mut current)
        })?;
        if current as usize == self.ctx {
            return Ok(ContextScope { restore: None });
        }
        // SAFETY: `self.ctx` is the primary context retained in `new` and not yet released.
        call("cuCtxSetCurrent", || unsafe {
            sys::cuCtxSetCurrent(self.ctx as CUcontext)
        })?;
        Ok(ContextScope {
            restore: Some(current as usize),
        })
    }

    pub(crate) fn require_vmm(&self, what: &'static str) -> DeviceResult<()> {
        if self.vmm {
            Ok(())
        } else {
            Err(DeviceError::Unavailable(format!(
                "{what}: device {} has no virtual memory management support",
                self.ordinal
            )))
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        self.close_exports();
        // Errors are ignored: at process exit the driver may already be deinitialised.
        // SAFETY: releases the one reference retained in `new`, exactly once.
        let _ = call("cuDevicePrimaryCtxRelease_v2", || unsafe {
            sys::cuDevicePrimaryCtxRelease_v2(self.device)
        });
    }
}

/// Fails with `Unavailable` naming the first symbol of [`SYMBOLS`] that the driver lacks.
fn check_symbols() -> DeviceResult<()> {
    // SAFETY: `culib` loads the driver library once (it was just found by `is_culib_present`);
    // `get` only looks symbols up by name, and nothing here calls or dereferences them.
    let missing = guard(|| unsafe {
        let lib = sys::culib();
        SYMBOLS
            .iter()
            .copied()
            .find(|name| lib.get::<*const c_void>(name.as_bytes()).is_err())
    })?;
    match missing {
        None => Ok(()),
        Some(name) => Err(DeviceError::Unavailable(format!(
            "the CUDA driver lacks {name} (driver too old for CUDA 13.0 bindings?)"
        ))),
    }
}

fn device_name(device: CUdevice) -> DeviceResult<String> {
    let mut buf = [0 as c_char; 256];
    // SAFETY: `buf` is writable for `buf.len()` bytes; the driver writes a NUL-terminated name of
    // at most that length.
    call("cuDeviceGetName", || unsafe {
        sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as c_int, device)
    })?;
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

fn device_attribute(device: CUdevice, attribute: CUdevice_attribute) -> DeviceResult<c_int> {
    let mut value: c_int = 0;
    // SAFETY: `value` is a valid out-pointer and `device` a valid device handle.
    call("cuDeviceGetAttribute", || unsafe {
        sys::cuDeviceGetAttribute(&mut value, attribute, device)
    })?;
    Ok(value)
}

/// Pinned device memory located on `device`; `shareable`: exportable as a POSIX file descriptor.
fn allocation_prop(device: CUdevice, shareable: bool) -> CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is a C struct of integers, enums whose value 0 is valid
    // (`*_INVALID`, `CU_MEM_HANDLE_TYPE_NONE`) and a raw pointer; all-zero is its documented
    // "empty" state, and every field we need is set below.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    if shareable {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    prop
}

/// Read/write access for `device`.
fn access_desc(device: CUdevice) -> CUmemAccessDesc {
    // SAFETY: `CUmemAccessDesc` is a C struct of an `i32` and enums whose value 0 is valid
    // (`CU_MEM_LOCATION_TYPE_INVALID`, `CU_MEM_ACCESS_FLAGS_PROT_NONE`); every field is set below.
    let mut desc: CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc
}

impl Device for CudaDevice {
    fn page_size(&self) -> u64 {
        self.page_size
    }

    fn total_memory(&self) -> u64 {
        self.total_memory
    }

    /// Free memory as the driver sees it; 0 if the driver cannot say (the conservative answer).
    fn free_memory(&self) -> u64 {
        let query = || -> DeviceResult<u64> {
            let _ctx = self.enter()?;
            let (mut free, mut total): (usize, usize) = (0, 0);
            // SAFETY: both are valid out-pointers for the duration of the call.
            call("cuMemGetInfo_v2", || unsafe {
                sys::cuMemGetInfo_v2(&mut free, &mut total)
            })?;
            Ok(free as u64)
        };
        query().unwrap_or(0)
    }

    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
        let bytes = to_usize(size, "alloc_segment")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the driver validates `bytes`.
        call("cuMemAlloc_v2", || unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes)
        })?;
        Ok(ptr)
    }

    fn free_segment(&self, ptr: DevicePtr, _size: u64) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `ptr` came from `alloc_segment` and is freed once; the
        // driver rejects anything else with an error rather than undefined behaviour.
        call("cuMemFree_v2", || unsafe { sys::cuMemFree_v2(ptr) })
    }

    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.require_vmm("reserve")?;
        let bytes = to_usize(size, "reserve")?;
        let alignment = to_usize(self.page_size, "reserve")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; no fixed address is requested (0) and flags must be 0.
        call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, bytes, alignment, 0, 0)
        })?;
        Ok(ptr)
    }

    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let bytes = to_usize(size, "release_reservation")?;
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `ptr..ptr+size` is a whole reservation with nothing
        // mapped in it; the driver reports anything else as an error.
        call("cuMemAddressFree", || unsafe {
            sys::cuMemAddressFree(ptr, bytes)
        })
    }

    fn create_page(&self) -> DeviceResult<PageHandle> {
        self.require_vmm("create_page")?;
        let bytes = to_usize(self.page_size, "create_page")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let shareable = self.shareable.load(Ordering::Relaxed);
        let create = |shareable: bool| {
            let prop = allocation_prop(self.device, shareable);
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is a valid out-pointer, `prop` is fully initialised and outlives
            // the call, `bytes` is a multiple of the allocation granularity, and flags must be 0.
            call("cuMemCreate", || unsafe {
                sys::cuMemCreate(&mut handle, bytes, &prop, 0)
            })
            .map(|()| PageHandle(handle))
        };
        match create(shareable) {
            // A driver (or container) that advertises POSIX handles but will not make them:
            // plain pages from now on, as before CUDA IPC of vmm memory, if those work.
            Err(err)
                if shareable
                    && !matches!(
                        err,
                        DeviceError::OutOfMemory | DeviceError::IllegalDuringCapture(_)
                    ) =>
            {
                let page = create(false).map_err(|_| err)?;
                self.shareable.store(false, Ordering::Relaxed);
                Ok(page)
            }
            made => made,
        }
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.forget_export(page);
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `page` came from `create_page` and is released once; the
        // driver validates the handle.
        call("cuMemRelease", || unsafe { sys::cuMemRelease(page.0) })
    }

    /// `cuMemMap` then `cuMemSetAccess` (read/write for this device and every added peer). If
    /// setting the access fails the page is unmapped again, so that an error leaves nothing mapped.
    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        self.map_run(ptr, &[page])
    }

    fn map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        self.require_vmm("map")?;
        if pages.is_empty() {
            return Ok(());
        }
        let bytes = to_usize(self.page_size, "map")?;
        let total = bytes
            .checked_mul(pages.len())
            .ok_or_else(|| DeviceError::InvalidArgument("map: run too long".into()))?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let unmap_first = |n: usize| {
            for j in 0..n {
                // SAFETY: undoes a `cuMemMap` below that succeeded on exactly this page.
                let _ = call("cuMemUnmap", || unsafe {
                    sys::cuMemUnmap(ptr + (j * bytes) as u64, bytes)
                });
            }
        };
        for (i, page) in pages.iter().enumerate() {
            // SAFETY: by the trait contract `ptr + i * bytes` is a page-aligned, unmapped address
            // inside a reservation and `page` a live page of exactly `bytes` (it may be mapped at
            // other addresses too: CUDA maps one allocation handle at any number of virtual
            // addresses, all showing the same memory); offset and flags must be 0.
            if let Err(err) = call("cuMemMap", || unsafe {
                sys::cuMemMap(ptr + (i * bytes) as u64, bytes, 0, page.0, 0)
            }) {
                unmap_first(i);
                return Err(err);
            }
        }
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `access` holds `access.len()` initialised descriptors and stays borrowed (and
        // so alive and unchanged) for the duration of the call; `ptr..ptr+total` was just mapped,
        // page by page, and one call may cover several mappings.
        let set = call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, total, access.as_ptr(), access.len())
        });
        drop(access);
        if let Err(err) = set {
            unmap_first(pages.len());
            return Err(err);
        }
        Ok(())
    }

    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        let bytes = to_usize(self.page_size, "unmap")?;
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract exactly one page is mapped at `ptr` and no pending work
        // touches it; the driver rejects unmapped ranges with an error.
        call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, bytes) })
    }

    /// Fails with [`DeviceError::InvalidArgument`] when `peer` cannot access this device's memory
    /// (`cuDeviceCanAccessPeer`).
    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        if peer == self.ordinal {
            return Ok(());
        }
        let mut peer_device: CUdevice = 0;
        // SAFETY: `peer_device` is a valid out-pointer; a bad ordinal is reported as an error.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut peer_device, peer)
        })?;
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer and both device handles come from `cuDeviceGet`.
        call("cuDeviceCanAccessPeer", || unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, peer_device, self.device)
        })?;
        if can == 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "device {peer} cannot access the memory of device {}",
                self.ordinal
            )));
        }
        let mut access = self.access.write().unwrap_or_else(PoisonError::into_inner);
        if !access.iter().any(|d| d.location.id == peer_device) {
            access.push(access_desc(peer_device));
        }
        Ok(())
    }

    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.require_vmm("refresh_access")?;
        let len = to_usize(size, "refresh_access")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `access` holds `access.len()` initialised descriptors and stays borrowed for the
        // call; by the trait contract every page of `ptr..ptr+len` is mapped (the driver rejects
        // anything else with an error).
        call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, len, access.as_ptr(), access.len())
        })
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        let _ctx = self.enter()?;
        let mut event: CUevent = ptr::null_mut();
        let flags = CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: `event` is a valid out-pointer and `flags` a valid flag set.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        Ok(EventHandle(event as usize as u64))
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `event` came from `create_event` and is destroyed once.
        call("cuEventDestroy_v2", || unsafe {
            sys::cuEventDestroy_v2(event_of(event))
        })
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; the driver validates the stream handle.
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event_of(event), stream_of(stream))
        })
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; `cuEventQuery` never blocks.
        let rc = guard(|| unsafe { sys::cuEventQuery(event_of(event)) })?;
        match rc {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(error_from("cuEventQuery", other)),
        }
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`.
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event_of(event))
        })
    }

    fn synchronize(&self) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: no arguments; the primary context is current (`enter`).
        call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; the driver validates the stream; flags 0.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream_of(stream), event_of(event), 0)
        })
    }

    fn alloc_host(&self, size: u64) -> DeviceResult<HostBuffer> {
        self.host_alloc(size)
    }

    fn free_host(&self, buf: HostBuffer) -> DeviceResult<()> {
        self.host_free(buf)
    }

    fn copy_to_host(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        self.host_copy_to(dst, offset, src, size)
    }

    fn copy_from_host(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        self.host_copy_from(dst, src, offset, size)
    }

    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        let _ctx = self.enter()?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: `status` and `id` are valid out-pointers; the other outputs are optional and
        // passed as null, which the driver documents as "not requested".
        call("cuStreamGetCaptureInfo_v3", || unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream_of(stream),
                &mut status,
                &mut id,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        })?;
        Ok(match status {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active(id),
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync + 'static>() {}

    #[test]
    fn cuda_device_is_send_sync() {
        assert_send_sync::<CudaDevice>();
    }

    #[test]
    fn new_without_driver_is_unavailable_not_a_panic() {
        let result = std::panic::catch_unwind(|| CudaDevice::new(0));
        let result = result.expect("CudaDevice::new panicked");
        if driver_present() {
            // A machine with a driver: any outcome is fine as long as it did not panic.
            return;
        }
        match result {
            Err(DeviceError::Unavailable(why)) => {
                assert!(why.contains("libcuda.so not found"), "{why}")
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }

    #[test]
    fn new_with_any_ordinal_without_driver_is_unavailable() {
        if driver_present() {
            return;
        }
        for ordinal in [-1, 0, 1, 7, i32::MAX] {
            assert!(matches!(
                CudaDevice::new(ordinal),
                Err(DeviceError::Unavailable(_))
            ));
        }
    }

    #[test]
    fn access_and_allocation_descriptors() {
        let prop = allocation_prop(3, false);
        assert_eq!(
            prop.requestedHandleTypes,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        );
        assert_eq!(
            allocation_prop(3, true).requestedHandleTypes,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        );
        assert_eq!(
            prop.type_,
            CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        );
        assert_eq!(
            prop.location.type_,
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        );
        assert_eq!(prop.location.id, 3);
        assert!(prop.win32HandleMetaData.is_null());
        let desc = access_desc(5);
        assert_eq!(desc.location.id, 5);
        assert_eq!(
            desc.flags,
            CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        );
    }

    #[test]
    fn sizes_convert_to_usize() {
        assert_eq!(to_usize(1 << 50, "x"), Ok(1 << 50));
        assert_eq!(to_usize(u64::MAX, "x"), Ok(usize::MAX));
    }

    #[test]
    fn handles_round_trip_through_integers() {
        assert_eq!(stream_of(0), ptr::null_mut());
        assert_eq!(stream_of(0x1234) as usize, 0x1234);
        assert_eq!(event_of(EventHandle(0xdead_beef)) as usize, 0xdead_beef);
    }
}
