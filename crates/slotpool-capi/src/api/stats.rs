//! Statistics, peaks and the JSON snapshot.

use std::ffi::{c_char, c_int};
use std::ptr::{self, NonNull};

use slotpool_abi::{sp_memory_stats, sp_pool_id};
use slotpool_core::MemoryStats;

use crate::convert::{ToC, ToCore};
use crate::error::{Error, ffi, sp_status};
use crate::out::{put, put_opt, required};
use crate::runtime::{each, runtime};
use crate::snapshot::snapshot_json;

use super::{device_filter, for_devices};

// ------------------------------------------------------------------------------------------------
// Statistics and snapshots

/// Writes the statistics of `device` (`torch.cuda.memory_stats`).
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of an `sp_memory_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_memory_stats_get(
    device: c_int,
    out: *mut sp_memory_stats,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let rt = runtime()?;
        let stats = match rt.existing(device)? {
            Some(d) => each!(d, a => a.stats()),
            None => {
                let m = rt.config.policy.max_split_size;
                MemoryStats {
                    max_split_size: if m == u64::MAX { -1 } else { m as i64 },
                    ..MemoryStats::default()
                }
            }
        };
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, stats.c()) };
        Ok(())
    })
}

/// Writes the device-wide peaks of `device` since the last reset: allocated bytes and reserved
/// (physical) bytes, both exact. A device slotpool has not used reports zeros.
///
/// # Safety
///
/// Each out-pointer must be NULL (that value is not wanted) or valid for a write of a `u64`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_memory_peaks(
    device: c_int,
    allocated_peak: *mut u64,
    reserved_peak: *mut u64,
) -> sp_status {
    ffi(|| {
        let (a, r) = match runtime()?.existing(device)? {
            Some(d) => {
                let st = each!(d, a => a.stats());
                (
                    st.allocated_bytes.all().peak as u64,
                    st.reserved_bytes.all().peak as u64,
                )
            }
            None => (0, 0),
        };
        // SAFETY: each NULL or valid for a write by the caller's contract.
        unsafe {
            put_opt(allocated_peak, a);
            put_opt(reserved_peak, r);
        }
        Ok(())
    })
}

/// Writes the statistics of pool `id` on `device`.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of an `sp_memory_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_stats_get(
    device: c_int,
    id: sp_pool_id,
    out: *mut sp_memory_stats,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let stats = each!(runtime()?.device(device)?, a => a.pool_stats(id.core()))?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, stats.c()) };
        Ok(())
    })
}

/// Sets every peak of `device` (-1: every device) to its current value.
#[unsafe(no_mangle)]
pub extern "C" fn sp_reset_peak_stats(device: c_int) -> sp_status {
    ffi(|| for_devices(runtime()?, device, |d| each!(d, a => a.reset_peak_stats())))
}

/// Zeroes the totals and event counters of `device` (-1: every device).
#[unsafe(no_mangle)]
pub extern "C" fn sp_reset_accumulated_stats(device: c_int) -> sp_status {
    ffi(|| {
        for_devices(
            runtime()?,
            device,
            |d| each!(d, a => a.reset_accumulated_stats()),
        )
    })
}

/// Writes a JSON snapshot of `device` (-1: every device) in PyTorch's `_snapshot()` shape: a
/// NUL-terminated string to free with `sp_string_free`, and its length without the NUL to `len`
/// (may be NULL).
///
/// # Safety
///
/// `out_json` must be NULL (an error) or valid for a write of a pointer; `len` NULL or valid for a
/// write of a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_json(
    device: c_int,
    out_json: *mut *mut c_char,
    len: *mut usize,
) -> sp_status {
    ffi(|| {
        let out = required(out_json, "out_json")?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, ptr::null_mut()) };
        let rt = runtime()?;
        let text = snapshot_json(rt, device_filter(rt, device)?);
        // SAFETY: `malloc` has no preconditions; the result is checked for NULL.
        let buf = unsafe { libc::malloc(text.len() + 1) }.cast::<c_char>();
        let buf = NonNull::new(buf).ok_or_else(|| {
            Error::OutOfMemory(format!(
                "host allocation of {} bytes failed",
                text.len() + 1
            ))
        })?;
        // SAFETY: `buf` holds `text.len() + 1` bytes and does not overlap `text`.
        unsafe {
            ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), buf.as_ptr(), text.len());
            buf.as_ptr().add(text.len()).write(0);
            put(out, buf.as_ptr());
        }
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(len, text.len()) };
        Ok(())
    })
}
