//! `sp_backend_calls_get`: the driver calls a device's allocator made, by kind.

use std::ffi::c_int;

use slotpool_abi::sp_backend_calls;
use slotpool_core::BackendCalls;

use crate::error::{ffi, sp_status};
use crate::out::{put, required};
use crate::runtime::{each, runtime};

/// Writes the backend calls `device`'s allocator made since it was created. A device slotpool
/// has not used reports zeros.
///
/// # Safety
/// `out` must be NULL (an error) or valid for a write of an `sp_backend_calls`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_backend_calls_get(
    device: c_int,
    out: *mut sp_backend_calls,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let calls = match runtime()?.existing(device)? {
            Some(d) => each!(d, a => a.backend_calls()),
            None => BackendCalls::default(),
        };
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, calls) };
        Ok(())
    })
}
