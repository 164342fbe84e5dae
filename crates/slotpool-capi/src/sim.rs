//! Access to the bytes of simulated device memory (`sp_sim_*`), for tests that check that
//! allocations keep their contents. The simulated device keeps bytes only when initialised with
//! `sim_bytes:1`; CUDA devices are refused (copy with the CUDA runtime there).

use std::ffi::{c_int, c_void};

use slotpool_core::{DevicePtr, MAX_REQUEST};
use slotpool_sim::{SimAccessError, SimDevice};

use crate::error::{Error, Result, ffi, sp_status};
use crate::runtime::{DevAlloc, runtime};

/// The simulated device `device`, or why it cannot be accessed.
fn sim(device: c_int) -> Result<&'static SimDevice> {
    match runtime()?.device(device)? {
        DevAlloc::Sim(a) => Ok(a.device()),
        DevAlloc::Cuda(_) => Err(Error::BackendUnavailable(format!(
            "device {device} is a CUDA device: sp_sim_* access simulated devices only"
        ))),
    }
}

/// Checks a length argument and that all of `[ptr, ptr + n)` is accessible on `d`; returns
/// `ptr`.
fn span(d: &SimDevice, device: c_int, ptr: DevicePtr, n: usize) -> Result<DevicePtr> {
    if n as u64 > MAX_REQUEST {
        return Err(Error::InvalidArgument(format!(
            "length {n}: at most 2^56 bytes"
        )));
    }
    d.check_access(ptr, n as u64)
        .map_err(|e| access(e, device))?;
    Ok(ptr)
}

/// The C ABI's error for a refused access.
fn access(e: SimAccessError, device: c_int) -> Error {
    match e {
        SimAccessError::NoBacking => Error::BackendUnavailable(format!(
            "simulated device {device} keeps no bytes: initialise with the sim_bytes:1 \
             configuration key"
        )),
        SimAccessError::Unmapped { addr } => Error::InvalidArgument(format!(
            "{addr:#x} is not inside mapped memory of device {device}"
        )),
        SimAccessError::Mismatch {
            addr,
            expected,
            found,
        } => Error::InvalidState(format!(
            "byte at {addr:#x} is {found:#04x}, the pattern says {expected:#04x}"
        )),
    }
}

/// Copies `n` host bytes from `src` to device memory at `dst` on simulated device `device`.
///
/// # Safety
///
/// `src` must be valid for `n` reads (it may be NULL when `n` is 0); `dst` is checked, never
/// trusted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_sim_write(
    device: c_int,
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
) -> sp_status {
    ffi(|| {
        let d = sim(device)?;
        let at = span(d, device, dst as DevicePtr, n)?;
        if n == 0 {
            return Ok(());
        }
        if src.is_null() {
            return Err(Error::null("src"));
        }
        // SAFETY: non-null and valid for `n` reads by the caller's contract; `n` <= 2^56.
        let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
        d.write(at, data).map_err(|e| access(e, device))
    })
}

/// Copies `n` bytes of device memory at `src` on simulated device `device` to host memory `dst`.
///
/// # Safety
///
/// `dst` must be valid for `n` writes (it may be NULL when `n` is 0); `src` is checked, never
/// trusted.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_sim_read(
    device: c_int,
    src: *const c_void,
    dst: *mut c_void,
    n: usize,
) -> sp_status {
    ffi(|| {
        let d = sim(device)?;
        let at = span(d, device, src as DevicePtr, n)?;
        if n == 0 {
            return Ok(());
        }
        if dst.is_null() {
            return Err(Error::null("dst"));
        }
        // SAFETY: non-null and valid for `n` writes by the caller's contract; `n` <= 2^56.
        let buf = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
        d.read_into(at, buf).map_err(|e| access(e, device))
    })
}

/// Writes the test pattern of `seed` over `n` bytes of device memory at `dst`.
#[unsafe(no_mangle)]
pub extern "C" fn sp_sim_fill(device: c_int, dst: *mut c_void, n: usize, seed: u64) -> sp_status {
    ffi(|| {
        let d = sim(device)?;
        let at = span(d, device, dst as DevicePtr, n)?;
        d.fill(at, n as u64, seed).map_err(|e| access(e, device))
    })
}

/// Checks that `n` bytes of device memory at `src` hold the pattern `sp_sim_fill` wrote with
/// `seed`; `SP_ERR_INVALID_STATE` names the first byte that differs.
#[unsafe(no_mangle)]
pub extern "C" fn sp_sim_verify(
    device: c_int,
    src: *const c_void,
    n: usize,
    seed: u64,
) -> sp_status {
    ffi(|| {
        let d = sim(device)?;
        let at = span(d, device, src as DevicePtr, n)?;
        d.verify(at, n as u64, seed).map_err(|e| access(e, device))
    })
}
