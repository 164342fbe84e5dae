//! Pools and routes: creating, counting, releasing, allocating from and routing to a pool, and
//! reading what a pool holds.

use std::ffi::{c_char, c_int, c_void};
use std::ptr;

use slotpool_abi::{sp_allocation, sp_pool_id, sp_pool_options, sp_route_kind};

use crate::convert::{ToC, ToCore, route_filter};
use crate::error::{Error, ffi, sp_status};
use crate::out::{put, put_opt, required};
use crate::runtime::{each, runtime};

use super::{options_arg, size_arg, str_arg};

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
            each!(runtime()?.device(device)?, a => a.create_or_incref_pool(id.core(), options))?;
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
        unsafe { put(out, id.c()) };
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
        let n = each!(runtime()?.device(device)?, a => a.release_pool(id.core()))?;
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
        let n = each!(runtime()?.device(device)?, a => a.pool_use_count(id.core()))?;
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
        each!(runtime()?.device(device)?, a => a.set_pool_options(id.core(), options))?;
        Ok(())
    })
}

/// Returns the unused cached memory of pool `id` to the backend (even while the pool is in use).
#[unsafe(no_mangle)]
pub extern "C" fn sp_pool_empty_cache(device: c_int, id: sp_pool_id) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.empty_pool_cache(id.core()))?;
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
        let pool = id.core();
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
        let filter = route_filter(kind, arg)?;
        each!(runtime()?.device(device)?, a => a.begin_allocate_to_pool(id.core(), filter))?;
        Ok(())
    })
}

/// Removes the newest route to pool `id` (its use count is unchanged).
#[unsafe(no_mangle)]
pub extern "C" fn sp_end_allocate_to_pool(device: c_int, id: sp_pool_id) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.end_allocate_to_pool(id.core()))?;
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// Reading a pool

/// Writes the options pool `id` has now (as creation or `sp_pool_set_options` set them).
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write of an `sp_pool_options`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_options_get(
    device: c_int,
    id: sp_pool_id,
    out: *mut sp_pool_options,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let options = each!(runtime()?.device(device)?, a => a.pool_options(id.core()))?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(out, options.c()) };
        Ok(())
    })
}

/// Writes pool `id`'s live allocations, lowest address first: the first `min(cap, total)` to
/// `out` and the total to `*total` (`SP_OK` also when the total is above `cap`).
///
/// # Safety
///
/// `out` must be NULL with `cap` 0, else valid for `cap` writes of an `sp_allocation`; `total`
/// NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_live_allocations(
    device: c_int,
    id: sp_pool_id,
    out: *mut sp_allocation,
    cap: usize,
    total: *mut usize,
) -> sp_status {
    ffi(|| {
        let total = required(total, "total")?;
        if cap > 0 && out.is_null() {
            return Err(Error::InvalidArgument(format!(
                "out is NULL with cap {cap}"
            )));
        }
        let live = each!(runtime()?.device(device)?, a => a.live_allocation_list(id.core()))?;
        for (i, l) in live.iter().take(cap).enumerate() {
            let a = sp_allocation {
                ptr: l.addr as *mut c_void,
                size: l.size,
                requested_size: l.requested,
                stream: l.stream,
            };
            // SAFETY: `out` is non-null and valid for `cap` > `i` writes by the caller's
            // contract.
            unsafe { out.add(i).write(a) };
        }
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(total, live.len()) };
        Ok(())
    })
}
