//! The interposed allocation functions (with [`crate::copies`], the only symbols this library
//! exports).
//!
//! | function | served from slotpool as | passes through when |
//! | --- | --- | --- |
//! | `cudaMalloc` | `sp_alloc(current device, size, stream 0)` | size 0; slotpool off; device or context not slotpool's |
//! | `cudaFree` | `sp_free` | NULL (passed through: it initialises the context); not slotpool's pointer |
//! | `cudaMallocAsync[_ptsz]` | `sp_alloc(stream's device, size, stream)` | as `cudaMalloc` |
//! | `cudaFreeAsync[_ptsz]` | `sp_record_stream(ptr, stream)` + `sp_free` | NULL; not slotpool's pointer |
//! | `cuMemAlloc_v2` | `sp_alloc(context's device, size, stream 0)` | as `cudaMalloc`, and when the current context is not the device's primary context |
//! | `cuMemFree_v2` | `sp_free` | 0; not slotpool's pointer |
//!
//! A NULL out-pointer returns `cudaErrorInvalidValue` / `CUDA_ERROR_INVALID_VALUE` (1); slotpool
//! out of memory returns `cudaErrorMemoryAllocation` / `CUDA_ERROR_OUT_OF_MEMORY` (2); any other
//! slotpool failure passes the call through. A panic never crosses the boundary: an allocation
//! that panicked returns 2, a free that panicked passes through.
//!
//! A free of a pointer that is not a live slotpool allocation but starts memory slotpool holds (a
//! double free, on the cuda backend) returns `cudaErrorInvalidValue` instead of reaching the real
//! free, which could release a whole slotpool segment (see `Slotpool::holds_segment_start`).
//!
//! Frees never start slotpool: before the first allocation call no pointer can be slotpool's.

// The exported names are CUDA's.
#![allow(non_snake_case)]

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::codes::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS,
    is_default_stream, per_thread_stream,
};
use crate::real::{self, DevicePtr, Stream};
use crate::report;
use crate::slotpool::{self, Slotpool};

// ------------------------------------------------------------------------------------------------
// Helpers

/// Runs `body`; if it panics, runs `on_panic`; if that panics too, returns `last_resort`.
#[inline(always)]
fn guard(
    body: impl FnOnce() -> c_int,
    on_panic: impl FnOnce() -> c_int,
    last_resort: c_int,
) -> c_int {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(rc) => rc,
        Err(_) => {
            report::panic_caught();
            catch_unwind(AssertUnwindSafe(on_panic)).unwrap_or(last_resort)
        }
    }
}

/// Most devices whose primary context is remembered (more are passed through on the cuda backend).
const MAX_DEVICES: usize = 64;
/// `CUcontext` of each device's primary context, 0 until first needed.
static PRIMARY: [AtomicUsize; MAX_DEVICES] = [const { AtomicUsize::new(0) }; MAX_DEVICES];
/// One more than the highest device whose primary context is in [`PRIMARY`].
static PRIMARY_END: AtomicUsize = AtomicUsize::new(0);

/// The primary context of `device` (retained once for the life of the process, as slotpool's
/// CUDA backend does anyway).
fn primary_context(device: c_int) -> Option<usize> {
    let slot = PRIMARY.get(usize::try_from(device).ok()?)?;
    let known = slot.load(Ordering::Acquire);
    if known != 0 {
        return Some(known);
    }
    let retain = real::cu_device_primary_ctx_retain()?;
    let mut ctx: real::Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; `device` is the CUdevice the driver returned for the current
    // context (a CUdevice is the device ordinal).
    if unsafe { retain(&mut ctx, device) } != CUDA_SUCCESS || ctx.is_null() {
        return None;
    }
    match slot.compare_exchange(0, ctx as usize, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {
            PRIMARY_END.fetch_max(device as usize + 1, Ordering::AcqRel);
            Some(ctx as usize)
        }
        Err(other) => {
            // Another thread retained it first: give back our extra reference.
            if let Some(release) = real::cu_device_primary_ctx_release() {
                // SAFETY: balances the successful retain above.
                unsafe { release(device) };
            }
            Some(other)
        }
    }
}

/// On the cuda backend, slotpool's memory belongs to each device's primary context (the one the
/// runtime uses). True if the calling thread's current context is that one, or none (the runtime
/// will make it current).
fn primary_context_current(device: c_int) -> bool {
    if real::cu_ctx_get_current().is_none() {
        // The driver is not visible to us; the runtime always uses the primary context.
        return true;
    }
    current_context().is_some_and(|c| c == 0 || primary_context(device) == Some(c))
}

/// The calling thread's current context, 0 for none; `None` if the driver is not visible or
/// the call failed.
#[inline]
fn current_context() -> Option<usize> {
    let get_current = real::cu_ctx_get_current()?;
    let mut current: real::Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    (unsafe { get_current(&mut current) } == CUDA_SUCCESS).then_some(current as usize)
}

/// The device whose primary context is `ctx`, if slotpool has seen it.
#[inline]
fn primary_device_of(ctx: usize) -> Option<c_int> {
    let end = PRIMARY_END.load(Ordering::Acquire);
    PRIMARY[..end.min(MAX_DEVICES)]
        .iter()
        .position(|slot| slot.load(Ordering::Relaxed) == ctx)
        .and_then(|d| c_int::try_from(d).ok())
}

/// The device whose primary context is current on this thread, if it is one slotpool has
/// already seen: one `cuCtxGetCurrent` (14 ns on the H200 host) where `cudaGetDevice` and
/// `cuCtxGetCurrent` together cost 74 ns (`benches/gpu/runtime_calls.cu`). With a primary
/// context current, the runtime's current device is that context's device. `None`: ask the slow
/// way (no context yet, a device not seen yet, or a context of the program's own).
#[inline]
fn current_primary_device() -> Option<c_int> {
    current_context()
        .filter(|&c| c != 0)
        .and_then(primary_device_of)
}

/// The device of created stream `stream`, if the stream belongs to a primary context slotpool
/// has seen and the thread's current context is that one or none (what the slow way checks
/// too): `cuStreamGetCtx` and `cuCtxGetCurrent` where `cudaStreamGetDevice` and
/// `cuCtxGetCurrent` cost 88 ns. `None`: ask the slow way.
#[inline]
fn stream_primary_device(stream: u64) -> Option<c_int> {
    let get_ctx = real::cu_stream_get_ctx()?;
    let mut ctx: real::Context = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver checks the stream handle.
    if unsafe { get_ctx(stream as usize as Stream, &mut ctx) } != CUDA_SUCCESS || ctx.is_null() {
        return None;
    }
    let device = primary_device_of(ctx as usize)?;
    let current = current_context()?;
    (current == 0 || current == ctx as usize).then_some(device)
}

/// The device a runtime-API allocation on `stream` is for: the stream's device for a created
/// stream, else the current device. `None`: pass through. On the simulated backend an unknown
/// device is device 0 (there may be no driver at all).
pub(crate) fn runtime_device(sp: &Slotpool, stream: u64) -> Option<c_int> {
    if !sp.sim {
        let fast = if is_default_stream(stream) {
            current_primary_device()
        } else {
            stream_primary_device(stream)
        };
        if let Some(device) = fast {
            return Some(device);
        }
    }
    let mut device: c_int = 0;
    let known = if is_default_stream(stream) {
        // SAFETY: a valid out-pointer.
        real::cuda_get_device().is_some_and(|f| unsafe { f(&mut device) } == CUDA_SUCCESS)
    } else {
        // SAFETY: a valid out-pointer; the driver checks the stream handle.
        real::cuda_stream_get_device()
            .is_some_and(|f| unsafe { f(stream as usize as Stream, &mut device) } == CUDA_SUCCESS)
    };
    if sp.sim {
        Some(if known { device } else { 0 })
    } else if known && primary_context_current(device) {
        Some(device)
    } else {
        None
    }
}

/// The device of the current context, for a driver-API allocation. `None`: pass through.
fn driver_device(sp: &Slotpool) -> Option<c_int> {
    if !sp.sim
        && let Some(device) = current_primary_device()
    {
        return Some(device);
    }
    let mut device: c_int = 0;
    // SAFETY: a valid out-pointer.
    let known =
        real::cu_ctx_get_device().is_some_and(|f| unsafe { f(&mut device) } == CUDA_SUCCESS);
    if sp.sim {
        Some(if known { device } else { 0 })
    } else if known && primary_context_current(device) {
        Some(device)
    } else {
        None
    }
}

/// A runtime-API allocation: NULL check, then slotpool, else `real`.
///
/// # Safety
///
/// `dev_ptr` must be NULL or valid for a write of a pointer.
#[inline(always)]
unsafe fn runtime_alloc(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: u64,
    real: impl FnOnce() -> c_int,
) -> c_int {
    if dev_ptr.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if size != 0
        && let Some(sp) = slotpool::get_or_start()
        && let Some(device) = runtime_device(sp, stream)
        // SAFETY: `dev_ptr` is non-null and writable (caller's contract).
        && let Some(rc) = unsafe { sp.alloc(device, size, stream, dev_ptr) }
    {
        return rc;
    }
    report::passed_alloc();
    real()
}

/// A free: NULL goes to `real` uncounted, slotpool's live allocations to `serve`, the start of
/// other memory slotpool holds (a double free) is refused with `cudaErrorInvalidValue`, as the
/// real library refuses a double free, and anything else goes to `real`.
#[inline(always)]
fn free_with(
    ptr: usize,
    serve: impl FnOnce(&Slotpool) -> Option<c_int>,
    real: impl FnOnce() -> c_int,
) -> c_int {
    if ptr == 0 {
        return real();
    }
    if let Some(sp) = slotpool::get() {
        if let Some(rc) = serve(sp) {
            return rc;
        }
        if sp.holds_segment_start(ptr) {
            report::refused_free();
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    report::passed_free();
    real()
}

/// With `SLOTPOOL_PRELOAD_SYNC_FREE=1`, waits for the device as the real free would, then frees;
/// an error of the wait (a failed earlier launch) is returned, as the real free returns it.
fn synchronized_free(
    sp: &Slotpool,
    ptr: usize,
    sync: Option<unsafe extern "C" fn() -> c_int>,
) -> Option<c_int> {
    let waited = match (sp.sync_free, sync) {
        // SAFETY: a CUDA function without arguments.
        (true, Some(f)) => unsafe { f() },
        _ => CUDA_SUCCESS,
    };
    let rc = sp.free(ptr)?;
    Some(if rc == CUDA_SUCCESS { waited } else { rc })
}

// ------------------------------------------------------------------------------------------------
// Pass-through calls (the real function, or an error if the process has none)

/// # Safety
///
/// As `cudaMalloc`.
unsafe fn real_malloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    // SAFETY: the caller's arguments, unchanged, to the real function of the same prototype.
    real::cuda_malloc().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(dev_ptr, size) })
}

/// # Safety
///
/// As `cudaFree`.
unsafe fn real_free(ptr: *mut c_void) -> c_int {
    match real::cuda_free() {
        // SAFETY: the caller's argument, unchanged, to the real function of the same prototype.
        Some(f) => unsafe { f(ptr) },
        // No runtime in the process: cudaFree(NULL) is documented as a no-op.
        None if ptr.is_null() => CUDA_SUCCESS,
        None => CUDA_ERROR_NOT_INITIALIZED,
    }
}

// ------------------------------------------------------------------------------------------------
// Runtime API

/// `cudaErrorPeerAccessAlreadyEnabled`: a repeated grant, still a grant.
const PEER_ACCESS_ALREADY_ENABLED: c_int = 704;

/// Interposed `cudaDeviceEnablePeerAccess`: the real call decides; when it grants (or had
/// granted) the current device access to `peer_device`'s memory, slotpool's vmm pages on
/// `peer_device` are opened to the current device as well, which the real call cannot do for
/// them. The real call's answer is returned either way.
///
/// # Safety
///
/// As CUDA's `cudaDeviceEnablePeerAccess` (no pointers).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDeviceEnablePeerAccess(peer_device: c_int, flags: u32) -> c_int {
    let Some(real_fn) = real::cuda_device_enable_peer_access() else {
        return CUDA_ERROR_NOT_INITIALIZED;
    };
    // SAFETY: the caller's arguments, unchanged, to the real function of the same prototype.
    let rc = unsafe { real_fn(peer_device, flags) };
    if rc == CUDA_SUCCESS || rc == PEER_ACCESS_ALREADY_ENABLED {
        guard(
            || {
                extend_peer_access(peer_device);
                rc
            },
            || rc,
            rc,
        )
    } else {
        rc
    }
}

/// Opens `peer_device`'s slotpool pages to the current device (the CUDA backend only: the
/// simulated devices are not the real ones).
fn extend_peer_access(peer_device: c_int) {
    let Some(sp) = slotpool::get_or_start().filter(|sp| !sp.sim) else {
        return;
    };
    let mut current: c_int = -1;
    let got = real::cuda_get_device().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| {
        // SAFETY: a valid out-pointer.
        unsafe { f(&mut current) }
    });
    if got != CUDA_SUCCESS || sp.enable_peer_access(peer_device, current) != Some(0) {
        report::peer_refused();
    }
}

/// Interposed `cudaMalloc`: `size` bytes on the current device, served by slotpool for the legacy
/// default stream.
///
/// # Safety
///
/// As CUDA's `cudaMalloc`: `dev_ptr` must be NULL (an error) or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMalloc(dev_ptr: *mut *mut c_void, size: usize) -> c_int {
    guard(
        // SAFETY: the caller's contract; the pass-through gets the caller's arguments.
        || unsafe { runtime_alloc(dev_ptr, size, 0, || real_malloc(dev_ptr, size)) },
        || CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_OUT_OF_MEMORY,
    )
}

/// Interposed `cudaFree`: slotpool's pointers return to its cache; others, and NULL (which
/// initialises the CUDA context), go to the real `cudaFree`.
///
/// # Safety
///
/// As CUDA's `cudaFree`: `ptr` is never dereferenced here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaFree(ptr: *mut c_void) -> c_int {
    let real = || {
        // SAFETY: the caller's argument, unchanged, to the real cudaFree.
        unsafe { real_free(ptr) }
    };
    let addr = ptr as usize;
    guard(
        || {
            free_with(
                addr,
                |sp| synchronized_free(sp, addr, real::cuda_device_synchronize()),
                real,
            )
        },
        real,
        CUDA_ERROR_INVALID_VALUE,
    )
}

/// Interposed `cudaMallocAsync`: `size` bytes for use on `stream`, on the stream's device.
///
/// # Safety
///
/// As CUDA's `cudaMallocAsync`: `dev_ptr` must be NULL (an error) or valid for a write of a
/// pointer; `stream` is passed to CUDA only.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMallocAsync(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: Stream,
) -> c_int {
    // SAFETY: the caller's contract; the pass-through gets the caller's arguments.
    unsafe {
        malloc_async(dev_ptr, size, stream as usize as u64, || {
            real::cuda_malloc_async()
                .map_or(CUDA_ERROR_NOT_INITIALIZED, |f| f(dev_ptr, size, stream))
        })
    }
}

/// The body of both `cudaMallocAsync` entry points: slotpool serves `size` bytes for
/// `sp_stream`, else `real` answers.
///
/// # Safety
///
/// `dev_ptr` must be NULL or valid for a write of a pointer.
unsafe fn malloc_async(
    dev_ptr: *mut *mut c_void,
    size: usize,
    sp_stream: u64,
    real: impl Fn() -> c_int,
) -> c_int {
    guard(
        // SAFETY: the caller's contract (`dev_ptr`).
        || unsafe { runtime_alloc(dev_ptr, size, sp_stream, &real) },
        || CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_OUT_OF_MEMORY,
    )
}

/// Interposed `cudaFreeAsync`: slotpool's pointers are freed in the order of `stream`; others go
/// to the real `cudaFreeAsync`.
///
/// # Safety
///
/// As CUDA's `cudaFreeAsync`: `ptr` is never dereferenced here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaFreeAsync(ptr: *mut c_void, stream: Stream) -> c_int {
    let real = || {
        real::cuda_free_async().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| {
            // SAFETY: the caller's arguments, unchanged, to the real cudaFreeAsync.
            unsafe { f(ptr, stream) }
        })
    };
    free_async(ptr as usize, stream as usize as u64, real)
}

/// The body of both `cudaFreeAsync` entry points: slotpool's pointers are freed in the order of
/// `sp_stream`, others go to `real`.
fn free_async(addr: usize, sp_stream: u64, real: impl Fn() -> c_int) -> c_int {
    guard(
        || free_with(addr, |sp| sp.free_on_stream(addr, sp_stream), &real),
        &real,
        CUDA_ERROR_INVALID_VALUE,
    )
}

/// Interposed `cudaMallocAsync_ptsz` (`cudaMallocAsync` of a program built with
/// `--default-stream per-thread`): stream 0 is the calling thread's default stream.
///
/// # Safety
///
/// As [`cudaMallocAsync`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMallocAsync_ptsz(
    dev_ptr: *mut *mut c_void,
    size: usize,
    stream: Stream,
) -> c_int {
    // SAFETY: the caller's contract; the pass-through gets the caller's arguments.
    unsafe {
        malloc_async(
            dev_ptr,
            size,
            per_thread_stream(stream as usize as u64),
            || {
                real::cuda_malloc_async_ptsz()
                    .map_or(CUDA_ERROR_NOT_INITIALIZED, |f| f(dev_ptr, size, stream))
            },
        )
    }
}

/// Interposed `cudaFreeAsync_ptsz`: as [`cudaFreeAsync`], stream 0 being the per-thread stream.
///
/// # Safety
///
/// As [`cudaFreeAsync`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaFreeAsync_ptsz(ptr: *mut c_void, stream: Stream) -> c_int {
    let real = || {
        real::cuda_free_async_ptsz().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| {
            // SAFETY: the caller's arguments, unchanged, to the real function.
            unsafe { f(ptr, stream) }
        })
    };
    free_async(
        ptr as usize,
        per_thread_stream(stream as usize as u64),
        real,
    )
}

// ------------------------------------------------------------------------------------------------
// Driver API (best effort: callers that take entry points from cuGetProcAddress bypass these)

/// Interposed `cuMemAlloc_v2`: `bytesize` bytes on the current context's device, served by
/// slotpool when that context is the device's primary context.
///
/// # Safety
///
/// As CUDA's `cuMemAlloc_v2`: `dptr` must be NULL (an error) or valid for a write of a
/// `CUdeviceptr`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevicePtr, bytesize: usize) -> c_int {
    guard(
        || {
            if dptr.is_null() {
                return CUDA_ERROR_INVALID_VALUE;
            }
            if bytesize != 0
                && let Some(sp) = slotpool::get_or_start()
                && let Some(device) = driver_device(sp)
            {
                let mut p: *mut c_void = std::ptr::null_mut();
                // SAFETY: `p` is a valid out-pointer.
                if let Some(rc) = unsafe { sp.alloc(device, bytesize, 0, &mut p) } {
                    // SAFETY: `dptr` is non-null and writable (caller's contract).
                    unsafe { dptr.write(p as usize as DevicePtr) };
                    return rc;
                }
            }
            report::passed_alloc();
            // SAFETY: the caller's arguments, unchanged, to the real function.
            real::cu_mem_alloc()
                .map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe { f(dptr, bytesize) })
        },
        || CUDA_ERROR_OUT_OF_MEMORY,
        CUDA_ERROR_OUT_OF_MEMORY,
    )
}

/// Interposed `cuMemFree_v2`: slotpool's pointers return to its cache; others go to the real
/// `cuMemFree_v2`.
///
/// # Safety
///
/// As CUDA's `cuMemFree_v2`: `dptr` is never dereferenced here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemFree_v2(dptr: DevicePtr) -> c_int {
    let real = || {
        real::cu_mem_free().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| {
            // SAFETY: the caller's argument, unchanged, to the real function.
            unsafe { f(dptr) }
        })
    };
    let addr = dptr as usize;
    guard(
        || {
            free_with(
                addr,
                |sp| synchronized_free(sp, addr, real::cu_ctx_synchronize()),
                real,
            )
        },
        real,
        CUDA_ERROR_INVALID_VALUE,
    )
}
