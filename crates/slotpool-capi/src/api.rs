//! The exported `sp_*` functions of `include/slotpool.h`. Each body runs under [`ffi`]: panics
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

use std::ffi::{CStr, c_char, c_int, c_void};
use std::panic::catch_unwind;
use std::ptr::{self, NonNull};

use slotpool_core::{MemoryStats, PoolId, PoolOptions};

use crate::error::{Error, Result, ffi, last_error_ptr, sp_status};
use crate::out::{put, put_opt, required};
use crate::runtime::{self, DevAlloc, Runtime, each, runtime};
use crate::snapshot::snapshot_json;
use crate::types::{sp_memory_stats, sp_pool_id, sp_pool_options, sp_route_kind};

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
        Some(o) => o.into(),
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
fn device_filter(rt: &Runtime, device: c_int) -> Result<Option<usize>> {
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

// ------------------------------------------------------------------------------------------------
// Pools and routes

/// Creates pool `id` with `opts` (NULL: defaults) and use count 1, or adds one use to it
/// (`opts` is then ignored). Writes the new use count to `use_count` (may be NULL).
///
/// # Safety
///
/// `opts` must be NULL or point to a readable `sp_pool_options`; `use_count` NULL or valid for a
/// write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_create_or_incref(
    device: c_int,
    id: sp_pool_id,
    opts: *const sp_pool_options,
    use_count: *mut u64,
) -> sp_status {
    ffi(|| {
        // SAFETY: NULL or readable by the caller's contract.
        let options = unsafe { options_arg(opts) };
        let n =
            each!(runtime()?.device(device)?, a => a.create_or_incref_pool(id.into(), options))?;
        // SAFETY: NULL or valid for writes by the caller's contract.
        unsafe { put_opt(use_count, n) };
        Ok(())
    })
}

/// The pool named `name`: created with `opts` (NULL: defaults) and use count 1 if new, else given
/// one more use. Writes its id.
///
/// # Safety
///
/// `name` must be NULL (an error) or NUL-terminated; `opts` NULL or readable; `out` NULL (an
/// error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_named(
    device: c_int,
    name: *const c_char,
    opts: *const sp_pool_options,
    out: *mut sp_pool_id,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: NULL or NUL-terminated by the caller's contract.
        let name = unsafe { str_arg(name, "name") }?;
        // SAFETY: NULL or readable by the caller's contract.
        let options = unsafe { options_arg(opts) };
        let id = each!(runtime()?.device(device)?, a => a.named_pool(name, options))?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, id.into()) };
        Ok(())
    })
}

/// Drops one use of pool `id` (`releasePool`); writes the remaining count to `remaining` (may be
/// NULL).
///
/// # Safety
///
/// `remaining` must be NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_release(
    device: c_int,
    id: sp_pool_id,
    remaining: *mut u64,
) -> sp_status {
    ffi(|| {
        let n = each!(runtime()?.device(device)?, a => a.release_pool(id.into()))?;
        // SAFETY: NULL or valid for writes by the caller's contract.
        unsafe { put_opt(remaining, n) };
        Ok(())
    })
}

/// Writes the use count of pool `id`.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_use_count(
    device: c_int,
    id: sp_pool_id,
    out: *mut u64,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let n = each!(runtime()?.device(device)?, a => a.pool_use_count(id.into()))?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, n) };
        Ok(())
    })
}

/// Replaces the options of pool `id`.
///
/// # Safety
///
/// `opts` must be NULL (an error) or point to a readable `sp_pool_options`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_set_options(
    device: c_int,
    id: sp_pool_id,
    opts: *const sp_pool_options,
) -> sp_status {
    ffi(|| {
        if opts.is_null() {
            return Err(Error::null("opts"));
        }
        // SAFETY: non-null and readable by the caller's contract.
        let options = unsafe { options_arg(opts) };
        each!(runtime()?.device(device)?, a => a.set_pool_options(id.into(), options))?;
        Ok(())
    })
}

/// Returns the unused cached memory of pool `id` to the backend (even while the pool is in use).
#[unsafe(no_mangle)]
pub extern "C" fn sp_pool_empty_cache(device: c_int, id: sp_pool_id) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.empty_pool_cache(id.into()))?;
        Ok(())
    })
}

/// Allocates `size` bytes from pool `id` for use on `stream`, ignoring routes.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of a pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_alloc(
    device: c_int,
    id: sp_pool_id,
    size: usize,
    stream: u64,
    out: *mut *mut c_void,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, ptr::null_mut()) };
        let pool = PoolId::from(id);
        let d = runtime()?.device(device)?;
        let p = each!(d, a => a.alloc_in(pool, size_arg(size), stream))?;
        // SAFETY: as above.
        unsafe { put(out, p as *mut c_void) };
        Ok(())
    })
}

/// Routes allocations that match (`kind`, `arg`) to pool `id` until `sp_end_allocate_to_pool`
/// (`beginAllocateToPool`); the pool gains a use (created if new).
#[unsafe(no_mangle)]
pub extern "C" fn sp_begin_allocate_to_pool(
    device: c_int,
    id: sp_pool_id,
    kind: sp_route_kind,
    arg: u64,
) -> sp_status {
    ffi(|| {
        let filter = kind.filter(arg)?;
        each!(runtime()?.device(device)?, a => a.begin_allocate_to_pool(id.into(), filter))?;
        Ok(())
    })
}

/// Removes the newest route to pool `id` (its use count is unchanged).
#[unsafe(no_mangle)]
pub extern "C" fn sp_end_allocate_to_pool(device: c_int, id: sp_pool_id) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.end_allocate_to_pool(id.into()))?;
        Ok(())
    })
}

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
        unsafe { put(out, (&stats).into()) };
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
        let stats = each!(runtime()?.device(device)?, a => a.pool_stats(id.into()))?;
        // SAFETY: non-null and valid for writes by the caller's contract.
        unsafe { put(out, (&stats).into()) };
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

// ------------------------------------------------------------------------------------------------
// torch.cuda.memory.CUDAPluggableAllocator

/// `CUDAPluggableAllocator`'s alloc function: `size` bytes on `device` for `stream`. Returns NULL
/// for `size == 0` and on any error (the reason goes to `sp_last_error_message` and to the log).
///
/// # Safety
///
/// Safe to call with any values: `stream` is used as an opaque handle.
#[unsafe(no_mangle)]
pub extern "C" fn sp_torch_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    if size == 0 {
        return ptr::null_mut();
    }
    let mut out: *mut c_void = ptr::null_mut();
    let status = ffi(|| {
        let size = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("negative size {size}")))?;
        let d = runtime()?.device(device)?;
        let p = each!(d, a => a.alloc(size_arg(size), stream as u64))?;
        out = p as *mut c_void;
        Ok(())
    });
    if status != sp_status::SP_OK {
        tracing::warn!(size, device, ?status, "sp_torch_malloc failed");
    }
    out
}

/// `CUDAPluggableAllocator`'s free function. NULL is ignored; errors are logged.
///
/// # Safety
///
/// Safe to call with any values: `ptr` is never dereferenced.
#[unsafe(no_mangle)]
pub extern "C" fn sp_torch_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    let _ = (size, device, stream);
    if ptr.is_null() {
        return;
    }
    let status = sp_free(ptr);
    if status != sp_status::SP_OK {
        tracing::warn!(ptr = ptr as u64, ?status, "sp_torch_free failed");
    }
}
