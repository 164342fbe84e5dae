//! Allocation, freeing, pointer queries and device-wide settings (caches, peers, limits).

use std::ffi::{c_int, c_void};
use std::ptr;

use crate::error::{Error, ffi, sp_status};
use crate::out::{put, put_opt, required};
use crate::runtime::{each, runtime};

use super::{for_devices, size_arg};

// ------------------------------------------------------------------------------------------------
// Allocation

/// Allocates `size` bytes on `device` for use on `stream`; the pool is chosen by the active routes.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_alloc(
    device: c_int,
    size: usize,
    stream: u64,
    out: *mut *mut c_void,
) -> sp_status {
    // `ffi`: no panic crosses the boundary, and the status and last error are set once.
    ffi(|| {
        // A NULL `out` is an error, and `*out` is NULL after any failure.
        let out = required(out, "out")?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, ptr::null_mut()) };
        // The device's allocator: a bounds-checked slot of the runtime (one device: slot 0).
        let d = runtime()?.device(device)?;
        // `size_t` widened to the core's `u64`, as it is; `Allocator::alloc` checks and rounds
        // it once, serves a quick-cache hit inline and answers in registers (a two-word
        // `AllocResult`); `?` turns a core error into this call's status, out of line.
        let p = each!(d, a => a.alloc(size_arg(size), stream))?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, p as *mut c_void) };
        Ok(())
    })
}

/// Frees a pointer returned by `sp_alloc` / `sp_pool_alloc` / `sp_torch_malloc`.
///
/// # Safety
///
/// Safe to call with any value: `ptr` is never dereferenced; a pointer slotpool does not know is
/// rejected.
#[unsafe(no_mangle)]
pub extern "C" fn sp_free(ptr: *mut c_void) -> sp_status {
    ffi(|| {
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        let p = ptr as u64;
        // The likely owner's `Allocator::free` first (one device: its only one), which asks the
        // thread's cached shard inline, then the registry; an unknown pointer asks the others.
        runtime()?.on_owner(p, |d| each!(d, a => a.free(p)))?;
        Ok(())
    })
}

/// Marks the allocation at `ptr` graph-retained but reusable: a captured graph still references
/// it, but later captures of its pool may reuse the memory (the graphs never run at the same
/// time). The block returns to its pool and stays mapped while the pool is in use; the caller
/// keeps the pointer but must not free it again. `size_out` (may be NULL) receives its size.
///
/// # Safety
///
/// `ptr` is never dereferenced; `size_out` must be NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_mark_reusable(ptr: *mut c_void, size_out: *mut u64) -> sp_status {
    ffi(|| {
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        let p = ptr as u64;
        let (_, size) = runtime()?.on_owner(p, |d| each!(d, a => a.mark_reusable(p)))?;
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(size_out, size) };
        Ok(())
    })
}

/// Notes that the allocation at `ptr` is used on `stream` (`Tensor.record_stream`).
///
/// # Safety
///
/// Safe to call with any value: `ptr` is never dereferenced.
#[unsafe(no_mangle)]
pub extern "C" fn sp_record_stream(ptr: *mut c_void, stream: u64) -> sp_status {
    ffi(|| {
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        let p = ptr as u64;
        runtime()?.on_owner(p, |d| each!(d, a => a.record_stream(p, stream)))?;
        Ok(())
    })
}

/// Describes the live allocation that starts at `ptr`: its base (== `ptr`), rounded size,
/// requested size and device.
///
/// # Safety
///
/// Each out-pointer must be NULL (an error) or valid for a write of its type.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_allocation_info(
    ptr: *mut c_void,
    base: *mut *mut c_void,
    size: *mut usize,
    requested: *mut usize,
    device: *mut c_int,
) -> sp_status {
    ffi(|| {
        let (o_base, o_size, o_req, o_dev) = (
            required(base, "base")?,
            required(size, "size")?,
            required(requested, "requested")?,
            required(device, "device")?,
        );
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        let p = ptr as u64;
        let (dev, (b, s, r)) = runtime()?.on_owner(p, |d| each!(d, a => a.allocation_info(p)))?;
        // SAFETY: all four are non-null and valid for writes by the caller's contract.
        unsafe {
            put(o_base, b as *mut c_void);
            put(o_size, s as usize);
            put(o_req, r as usize);
            put(o_dev, dev as c_int);
        }
        Ok(())
    })
}

/// Describes the segment holding the live allocation that starts at `ptr`: its address range,
/// and whether it is a vmm reservation (`*vmm = 1`) or one classic `cuMemAlloc` allocation
/// (`*vmm = 0`, which `cudaIpcGetMemHandle` can share).
///
/// # Safety
///
/// `base`, `size` and `vmm` must be valid for writes; `ptr` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_segment_info(
    ptr: *mut c_void,
    base: *mut *mut c_void,
    size: *mut usize,
    vmm: *mut c_int,
) -> sp_status {
    ffi(|| {
        let (o_base, o_size, o_vmm) = (
            required(base, "base")?,
            required(size, "size")?,
            required(vmm, "vmm")?,
        );
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        let p = ptr as u64;
        let (_, (b, s, v)) = runtime()?.on_owner(p, |d| each!(d, a => a.segment_info(p)))?;
        // SAFETY: all three are non-null and valid for writes by the caller's contract.
        unsafe {
            put(o_base, b as *mut c_void);
            put(o_size, s as usize);
            put(o_vmm, c_int::from(v));
        }
        Ok(())
    })
}

/// Returns the unused cached memory of `device` (-1: every device) to the backend.
#[unsafe(no_mangle)]
pub extern "C" fn sp_empty_cache(device: c_int) -> sp_status {
    ffi(|| for_devices(runtime()?, device, |d| each!(d, a => a.empty_cache())))
}

/// Gives device `peer` read and write access to `device`'s memory: its vmm pages, mapped now and
/// later (classic segments are `cudaMalloc` memory, which `cudaDeviceEnablePeerAccess` opens).
/// A device not used yet gets it when first used.
#[unsafe(no_mangle)]
pub extern "C" fn sp_enable_peer_access(device: c_int, peer: c_int) -> sp_status {
    ffi(|| runtime()?.enable_peer_access(device, peer))
}

/// Caps the physical memory of `device` at `fraction` (in (0, 1]) of the device.
#[unsafe(no_mangle)]
pub extern "C" fn sp_set_memory_fraction(device: c_int, fraction: f64) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.set_memory_fraction(fraction))?;
        Ok(())
    })
}

/// Caps the physical memory of `device` at `bytes` (0: the device's total memory, i.e. no cap).
#[unsafe(no_mangle)]
pub extern "C" fn sp_set_memory_limit(device: c_int, bytes: u64) -> sp_status {
    ffi(|| {
        // 0 is no cap: the core gives a zero limit that one meaning.
        each!(runtime()?.device(device)?, a => a.set_memory_limit(bytes));
        Ok(())
    })
}

/// Writes the cap on physical memory in force and the device's total memory.
///
/// # Safety
///
/// Each out-pointer must be NULL (an error) or valid for a write of a `uint64_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_memory_limit_get(
    device: c_int,
    limit_bytes: *mut u64,
    total_bytes: *mut u64,
) -> sp_status {
    ffi(|| {
        let (ol, ot) = (
            required(limit_bytes, "limit_bytes")?,
            required(total_bytes, "total_bytes")?,
        );
        let d = runtime()?.device(device)?;
        let limit = each!(d, a => a.memory_limit());
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe {
            put(ol, limit);
            put(ot, d.total_memory());
        }
        Ok(())
    })
}

/// Retires completed cross-stream events of `device` (-1: every device).
#[unsafe(no_mangle)]
pub extern "C" fn sp_process_events(device: c_int) -> sp_status {
    ffi(|| for_devices(runtime()?, device, |d| each!(d, a => a.process_events())))
}

/// Writes the size of the largest cached free block of `device` (`cacheInfo`).
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of a `size_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_largest_free_block(device: c_int, out: *mut usize) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let v = match runtime()?.existing(device)? {
            Some(d) => each!(d, a => a.largest_free_block()),
            None => 0,
        };
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, v as usize) };
        Ok(())
    })
}
