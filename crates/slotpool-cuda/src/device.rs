//! [`CudaDevice`]: the [`Device`] trait over the CUDA driver API.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::ptr;
use std::sync::atomic::AtomicBool;
use std::sync::{Mutex, RwLock};

use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdevice_attribute, CUmemAccessDesc,
    CUmemAllocationGranularity_flags, CUstreamCaptureMode,
};
use slotpool_core::{
    CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostBuffer,
    PageHandle, StreamId,
};

use crate::error::{call, guard, mark_driver_loaded};
use crate::vmm::{access_desc, allocation_prop};

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
    pub(crate) ordinal: i32,
    pub(crate) device: CUdevice,
    /// The retained primary context (`CUcontext` as an address); released on drop.
    ctx: usize,
    name: String,
    driver_version: i32,
    total_memory: u64,
    /// The driver's recommended allocation granularity (the smallest page).
    granularity: u64,
    /// The vmm page: the granularity unless [`CudaDevice::set_page_size`] chose a multiple.
    pub(crate) page_size: u64,
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
        self.vmm_reserve(size)
    }

    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.vmm_release_reservation(ptr, size)
    }

    fn create_page(&self) -> DeviceResult<PageHandle> {
        self.vmm_create_page()
    }

    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.vmm_release_page(page)
    }

    /// `cuMemMap` then `cuMemSetAccess` (read/write for this device and every added peer). If
    /// setting the access fails the page is unmapped again, so that an error leaves nothing mapped.
    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        self.vmm_map_run(ptr, &[page])
    }

    fn map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        self.vmm_map_run(ptr, pages)
    }

    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        self.vmm_unmap(ptr)
    }

    fn create_run(&self, pages: usize) -> DeviceResult<PageHandle> {
        self.vmm_create_run(pages)
    }

    fn map_whole(&self, ptr: DevicePtr, run: PageHandle, pages: usize) -> DeviceResult<()> {
        self.vmm_map_whole(ptr, run, pages)
    }

    fn unmap_range(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        if size == self.page_size {
            return self.vmm_unmap(ptr);
        }
        self.vmm_unmap_range(ptr, size)
    }

    /// Fails with [`DeviceError::InvalidArgument`] when `peer` cannot access this device's memory
    /// (`cuDeviceCanAccessPeer`).
    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        self.vmm_add_peer(peer)
    }

    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.vmm_refresh_access(ptr, size)
    }

    fn create_event(&self) -> DeviceResult<EventHandle> {
        self.event_create()
    }

    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.event_destroy(event)
    }

    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        self.event_record(event, stream)
    }

    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        self.event_query(event)
    }

    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.event_synchronize(event)
    }

    fn synchronize(&self) -> DeviceResult<()> {
        self.ctx_synchronize()
    }

    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        self.stream_wait(stream, event)
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
        self.stream_capture_status(stream)
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
    fn sizes_convert_to_usize() {
        assert_eq!(to_usize(1 << 50, "x"), Ok(1 << 50));
        assert_eq!(to_usize(u64::MAX, "x"), Ok(usize::MAX));
    }
}
