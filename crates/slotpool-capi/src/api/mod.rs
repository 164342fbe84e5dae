//! The exported `sp_*` functions of `include/slotpool.h`, by concern: the library itself (here),
//! [`alloc`] (allocation and device-wide settings), [`pools`] (pools, routes and their readers),
//! [`stats`] (statistics and the JSON snapshot), [`config`] (the configuration in effect) and
//! [`torch`] (`CUDAPluggableAllocator`'s two functions). Each body runs under [`ffi`]: panics
//! are caught, errors become status codes and the thread's last-error message.
//!
//! Conventions (documented per function in `slotpool.h`):
//!
//! * Out-pointers are required unless a function says "may be NULL"; a NULL one fails with
//!   `SP_ERR_INVALID_ARGUMENT` before anything changes.
//! * Device pointers are never dereferenced here: a pointer slotpool does not know (a host pointer,
//!   a random address, one already freed) fails with `SP_ERR_UNKNOWN_POINTER`.
//! * Any call but the library-level queries initialises the library from the environment if
//!   `sp_init` was not called, and fails with `SP_ERR_SHUTDOWN` after `sp_shutdown`.

use std::ffi::{CStr, c_char, c_int};
use std::panic::catch_unwind;

use slotpool_abi::sp_pool_options;
use slotpool_core::PoolOptions;

use crate::convert::ToCore;
use crate::error::{Error, Result, ffi, last_error_ptr, sp_status};
use crate::out::{put, required};
use crate::runtime::{self, DevAlloc, Runtime, runtime};

pub mod alloc;
pub mod config;
pub mod pools;
pub mod stats;
pub mod torch;

pub use alloc::*;
pub use config::*;
pub use pools::*;
pub use stats::*;
pub use torch::*;

// ------------------------------------------------------------------------------------------------
// Helpers

/// A required C string argument as UTF-8.
///
/// # Safety
///
/// `p` must be NULL or point to a NUL-terminated string that stays valid for `'a`.
unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(Error::null(what));
    }
    // SAFETY: `p` is non-null and, by the caller's contract, a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Error::InvalidArgument(format!("{what} is not valid UTF-8")))
}

/// An optional C string argument (NULL gives `None`).
///
/// # Safety
///
/// As [`str_arg`].
unsafe fn opt_str_arg<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        Ok(None)
    } else {
        // SAFETY: forwarded from the caller.
        unsafe { str_arg(p, what) }.map(Some)
    }
}

/// Pool options from an optional pointer (NULL: the defaults).
///
/// # Safety
///
/// `p` must be NULL or point to a readable `sp_pool_options`.
unsafe fn options_arg(p: *const sp_pool_options) -> PoolOptions {
    // SAFETY: `p` is NULL or valid for reads, by the caller's contract.
    match unsafe { p.as_ref() } {
        Some(o) => o.core(),
        None => PoolOptions::default(),
    }
}

/// Runs `f` on `device`'s allocator if it exists, or on every created allocator for `device ==
/// -1`. A device never used has nothing to do.
fn for_devices(rt: &Runtime, device: c_int, f: impl Fn(&DevAlloc)) -> Result<()> {
    if device == -1 {
        rt.created().for_each(|(_, d)| f(d));
    } else if let Some(d) = rt.existing(device)? {
        f(d);
    }
    Ok(())
}

/// `device` as an index for the snapshot (`-1`: every device), checked.
pub(crate) fn device_filter(rt: &Runtime, device: c_int) -> Result<Option<usize>> {
    if device == -1 {
        return Ok(None);
    }
    rt.existing(device)?;
    Ok(Some(device as usize))
}

/// Size of a request as `u64` (always lossless on the 64-bit targets slotpool supports).
#[inline]
fn size_arg(size: usize) -> u64 {
    size as u64
}

const fn parse_version(s: &str) -> c_int {
    let b = s.as_bytes();
    let mut i = 0;
    let mut v: c_int = 0;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as c_int;
        i += 1;
    }
    v
}

const VERSION: [c_int; 3] = [
    parse_version(env!("CARGO_PKG_VERSION_MAJOR")),
    parse_version(env!("CARGO_PKG_VERSION_MINOR")),
    parse_version(env!("CARGO_PKG_VERSION_PATCH")),
];

/// Features this build supports, for `sp_has_feature`.
pub const FEATURES: &[(&str, bool)] = &[
    ("cuda", true),
    ("sim", true),
    ("vmm", true),
    ("pools", true),
    ("routes", true),
    ("statistics", true),
    ("snapshot", true),
    ("torch_pluggable", true),
    ("checkpoint", true),
    ("arenas", true),
    ("variant_groups", true),
    ("traces", true),
    ("vmm_ipc", true),
    ("pause", true),
    ("sim_bytes", true),
];

// ------------------------------------------------------------------------------------------------
// Library

/// Writes the library version (`SP_VERSION_MAJOR` etc. of the header it was built with).
///
/// # Safety
///
/// Each pointer must be NULL (an error) or valid for a write of an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_version(
    major: *mut c_int,
    minor: *mut c_int,
    patch: *mut c_int,
) -> sp_status {
    ffi(|| {
        let (ma, mi, pa) = (
            required(major, "major")?,
            required(minor, "minor")?,
            required(patch, "patch")?,
        );
        // SAFETY: non-null and, by the caller's contract, valid for writes.
        unsafe {
            put(ma, VERSION[0]);
            put(mi, VERSION[1]);
            put(pa, VERSION[2]);
        }
        Ok(())
    })
}

/// 1 if this build supports the feature `name` (`"cuda"`, `"sim"`, `"vmm"`, `"checkpoint"`, ...),
/// else 0 (also for NULL or unknown names). Never initialises the library.
///
/// # Safety
///
/// `name` must be NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_has_feature(name: *const c_char) -> c_int {
    // SAFETY: `name` is NULL or NUL-terminated by the caller's contract.
    let Ok(Some(name)) = (unsafe { opt_str_arg(name, "name") }) else {
        return 0;
    };
    c_int::from(FEATURES.iter().any(|&(n, on)| on && n == name))
}

/// This thread's last error message: that of the latest call on this thread that failed, or `""`
/// once a later call succeeded. Never NULL. Valid until the next `sp_*` call on this thread.
#[unsafe(no_mangle)]
pub extern "C" fn sp_last_error_message() -> *const c_char {
    catch_unwind(last_error_ptr).unwrap_or(c"".as_ptr())
}

/// Initialises the library with `backend` (`"cuda"`, `"sim"`, `"auto"`; NULL: `SLOTPOOL_BACKEND`,
/// else `"auto"`) and the configuration `conf` (NULL or `key:value,...`) applied over
/// `SLOTPOOL_CONF`.
///
/// # Safety
///
/// `backend` and `conf` must each be NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_init(backend: *const c_char, conf: *const c_char) -> sp_status {
    ffi(|| {
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let backend = unsafe { opt_str_arg(backend, "backend") }?;
        // SAFETY: as above.
        let conf = unsafe { opt_str_arg(conf, "conf") }?;
        runtime::init(backend, conf, false).map(|_| ())
    })
}

/// Shuts the library down: every later call fails with `SP_ERR_SHUTDOWN`.
#[unsafe(no_mangle)]
pub extern "C" fn sp_shutdown() -> sp_status {
    ffi(runtime::shutdown)
}

/// Writes 1 if the library is initialised, 0 if not; never initialises it.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_is_initialized(out: *mut c_int) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let v = runtime::is_initialized()?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, c_int::from(v)) };
        Ok(())
    })
}

/// Writes the name of the backend in use (`"cuda"` or `"sim"`), a static string.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_backend_name(out: *mut *const c_char) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let name = match runtime()?.kind {
            runtime::BackendKind::Sim => c"sim",
            runtime::BackendKind::Cuda => c"cuda",
        };
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, name.as_ptr()) };
        Ok(())
    })
}

/// Writes the number of devices of the backend.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of an `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_device_count(out: *mut c_int) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let n = runtime()?.device_count();
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, c_int::try_from(n).unwrap_or(c_int::MAX)) };
        Ok(())
    })
}

/// Frees a string returned by slotpool (`sp_snapshot_json`). NULL is accepted.
///
/// # Safety
///
/// `s` must be NULL or a string returned by slotpool and not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_string_free(s: *mut c_char) -> sp_status {
    ffi(|| {
        // SAFETY: `s` is NULL or was returned by `libc::malloc` in `sp_snapshot_json` and not
        // freed yet, by the caller's contract; `free(NULL)` does nothing.
        unsafe { libc::free(s.cast()) };
        Ok(())
    })
}
