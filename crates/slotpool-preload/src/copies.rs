//! Copies and fills of simulated device memory: `cudaMemcpy`, `cudaMemcpyAsync`, `cudaMemset`
//! and `cudaMemsetAsync`.
//!
//! On the simulated backend (`SLOTPOOL_BACKEND=sim`) the memory slotpool hands out is the
//! simulator's, which no CUDA library can reach. A CUDA program fills and reads its buffers with
//! these four calls, so they are what makes an unchanged program run on the simulated device:
//! with `sim_bytes:1` in `SLOTPOOL_CONF` the simulator keeps the bytes, and a copy or fill whose
//! device side starts in simulated memory is served from them (`sp_sim_write` / `sp_sim_read`)
//! instead of reaching the real runtime. A program can then check, through CUDA's own calls,
//! that every allocation keeps its bytes while others are freed and the cache is emptied.
//!
//! Everything else passes through unchanged: every call on the cuda backend (one load of the
//! process state, then the real function), a host-to-host copy, a pointer outside simulated
//! memory, a zero-byte call, and every call while the simulator keeps no bytes. A served call
//! whose range runs out of simulated memory returns `cudaErrorInvalidValue`. The simulated
//! device runs no stream work, so an asynchronous copy is complete when it returns, which is
//! one of the orders CUDA allows.

// The exported names are CUDA's.
#![allow(non_snake_case)]

use std::ffi::{c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::codes::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED, CUDA_SUCCESS, SP_OK};
use crate::real::{self, Stream};
use crate::slotpool::{self, Slotpool};

/// `cudaMemcpyKind`.
const HOST_TO_HOST: c_int = 0;
const HOST_TO_DEVICE: c_int = 1;
const DEVICE_TO_HOST: c_int = 2;
const DEVICE_TO_DEVICE: c_int = 3;
/// `cudaMemcpyDefault`: the kind follows from the pointers (unified addressing).
const DEFAULT: c_int = 4;

/// Bytes moved at a time by a device-to-device copy or a fill.
const STEP: usize = 1 << 20;

/// slotpool, when it serves on the simulated backend and a copy of simulated memory may be
/// served; with the device of `stream` (0: the current device).
fn sim(stream: u64) -> Option<(&'static Slotpool, c_int)> {
    let sp = slotpool::get().filter(|sp| sp.sim)?;
    Some((sp, crate::hooks::runtime_device(sp, stream)?))
}

/// True if the byte at `ptr` is simulated device memory with bytes kept.
fn is_sim(sp: &Slotpool, device: c_int, ptr: usize) -> bool {
    let mut byte = 0u8;
    // SAFETY: `byte` is valid for one write; slotpool checks `ptr`.
    let status = unsafe { sp.sim_read(device, ptr, (&raw mut byte).cast(), 1) };
    status == Some(SP_OK)
}

/// A status of `sp_sim_*` on a range whose first byte is simulated memory, as CUDA's.
fn cuda_status(status: Option<c_int>) -> c_int {
    if status == Some(SP_OK) {
        CUDA_SUCCESS
    } else {
        CUDA_ERROR_INVALID_VALUE
    }
}

/// Serves a copy of `n` bytes from `src` to `dst` of `kind` on `device`, or `None` to pass it
/// through.
///
/// # Safety
///
/// Host-side pointers must be valid for `n` bytes, as for `cudaMemcpy`.
unsafe fn serve_copy(
    sp: &Slotpool,
    device: c_int,
    dst: usize,
    src: usize,
    n: usize,
    kind: c_int,
) -> Option<c_int> {
    if n == 0 || kind == HOST_TO_HOST {
        return None;
    }
    let kind = if kind == DEFAULT {
        match (is_sim(sp, device, dst), is_sim(sp, device, src)) {
            (true, true) => DEVICE_TO_DEVICE,
            (true, false) => HOST_TO_DEVICE,
            (false, true) => DEVICE_TO_HOST,
            (false, false) => return None,
        }
    } else {
        kind
    };
    match kind {
        HOST_TO_DEVICE if is_sim(sp, device, dst) => {
            // SAFETY: `src` is host memory valid for `n` reads (the caller's contract).
            Some(cuda_status(unsafe {
                sp.sim_write(device, dst, src as *const c_void, n)
            }))
        }
        DEVICE_TO_HOST if is_sim(sp, device, src) => {
            // SAFETY: `dst` is host memory valid for `n` writes (the caller's contract).
            Some(cuda_status(unsafe {
                sp.sim_read(device, src, dst as *mut c_void, n)
            }))
        }
        DEVICE_TO_DEVICE if is_sim(sp, device, dst) && is_sim(sp, device, src) => {
            let mut buf = vec![0u8; n.min(STEP)];
            let mut done = 0;
            while done < n {
                let len = buf.len().min(n - done);
                let chunk = &mut buf[..len];
                // SAFETY: `chunk` is host memory of `len` bytes; slotpool checks the device side.
                let status = unsafe {
                    match sp.sim_read(device, src + done, chunk.as_mut_ptr().cast(), len) {
                        Some(SP_OK) => sp.sim_write(device, dst + done, chunk.as_ptr().cast(), len),
                        other => other,
                    }
                };
                if status != Some(SP_OK) {
                    return Some(CUDA_ERROR_INVALID_VALUE);
                }
                done += len;
            }
            Some(CUDA_SUCCESS)
        }
        _ => None,
    }
}

/// Serves a fill of `n` bytes at `dst` with the low byte of `value`, or `None` to pass it
/// through.
fn serve_fill(sp: &Slotpool, device: c_int, dst: usize, value: c_int, n: usize) -> Option<c_int> {
    if n == 0 || !is_sim(sp, device, dst) {
        return None;
    }
    let buf = vec![value as u8; n.min(STEP)];
    let mut done = 0;
    while done < n {
        let len = buf.len().min(n - done);
        // SAFETY: `buf` holds at least `len` bytes; slotpool checks the device side.
        let status = unsafe { sp.sim_write(device, dst + done, buf.as_ptr().cast(), len) };
        if status != Some(SP_OK) {
            return Some(CUDA_ERROR_INVALID_VALUE);
        }
        done += len;
    }
    Some(CUDA_SUCCESS)
}

/// Runs `serve`, else (`None`, or a panic) `real`.
#[inline(always)]
fn served_or(serve: impl FnOnce() -> Option<c_int>, real: impl FnOnce() -> c_int) -> c_int {
    match catch_unwind(AssertUnwindSafe(serve)) {
        Ok(Some(rc)) => rc,
        Ok(None) => real(),
        Err(_) => {
            crate::report::panic_caught();
            real()
        }
    }
}

/// Interposed `cudaMemcpy`: served on simulated memory (see the module documentation), else the
/// real `cudaMemcpy`.
///
/// # Safety
///
/// As CUDA's `cudaMemcpy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemcpy(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
) -> c_int {
    served_or(
        || {
            let (sp, device) = sim(0)?;
            // SAFETY: the caller's contract (as cudaMemcpy).
            unsafe { serve_copy(sp, device, dst as usize, src as usize, count, kind) }
        },
        || {
            // SAFETY: the caller's arguments, unchanged, to the real function.
            real::cuda_memcpy().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
                f(dst, src, count, kind)
            })
        },
    )
}

/// Interposed `cudaMemcpyAsync`: as [`cudaMemcpy`], on `stream`'s device.
///
/// # Safety
///
/// As CUDA's `cudaMemcpyAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemcpyAsync(
    dst: *mut c_void,
    src: *const c_void,
    count: usize,
    kind: c_int,
    stream: Stream,
) -> c_int {
    served_or(
        || {
            let (sp, device) = sim(stream as usize as u64)?;
            // SAFETY: the caller's contract (as cudaMemcpyAsync).
            unsafe { serve_copy(sp, device, dst as usize, src as usize, count, kind) }
        },
        || {
            // SAFETY: the caller's arguments, unchanged, to the real function.
            real::cuda_memcpy_async().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
                f(dst, src, count, kind, stream)
            })
        },
    )
}

/// Interposed `cudaMemset`: served on simulated memory, else the real `cudaMemset`.
///
/// # Safety
///
/// As CUDA's `cudaMemset`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemset(dst: *mut c_void, value: c_int, count: usize) -> c_int {
    served_or(
        || {
            let (sp, device) = sim(0)?;
            serve_fill(sp, device, dst as usize, value, count)
        },
        || {
            // SAFETY: the caller's arguments, unchanged, to the real function.
            real::cuda_memset().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
                f(dst, value, count)
            })
        },
    )
}

/// Interposed `cudaMemsetAsync`: as [`cudaMemset`], on `stream`'s device.
///
/// # Safety
///
/// As CUDA's `cudaMemsetAsync`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaMemsetAsync(
    dst: *mut c_void,
    value: c_int,
    count: usize,
    stream: Stream,
) -> c_int {
    served_or(
        || {
            let (sp, device) = sim(stream as usize as u64)?;
            serve_fill(sp, device, dst as usize, value, count)
        },
        || {
            // SAFETY: the caller's arguments, unchanged, to the real function.
            real::cuda_memset_async().map_or(CUDA_ERROR_NOT_INITIALIZED, |f| unsafe {
                f(dst, value, count, stream)
            })
        },
    )
}
