//! The C functions for CUDA-graph memory: checkpoint / restore, variant groups, arenas, live-set
//! queries and the invariant check.
//!
//! Checkpoints, restore deltas and variant groups are objects in per-kind registries; the C
//! pointer types are opaque tokens that name them (see [`crate::handle`]), so a handle of another
//! kind, a freed handle or a made-up value is an `SP_ERR_INVALID_ARGUMENT`, never a read through
//! garbage.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, PoisonError};

use slotpool_core::policy::MIN_BLOCK_SIZE;
use slotpool_core::{ArenaId, Checkpoint, DevicePtr, RestoreDelta, VariantGroup};

use crate::error::{Error, Result, ffi, ffi_value, sp_status};
use crate::handle::{Kind, Registry, pointer_of as handle, token_of as tok};
use crate::out::{put, put_opt, required};
use crate::runtime::{DevAlloc, TraceCallback, each, runtime};
use slotpool_abi::{sp_pool_id, sp_trace_event};

use crate::convert::{ToC, ToCore};

/// A checkpoint handle (opaque to C: the pointer is a token, never dereferenced).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct sp_checkpoint {
    _opaque: (),
}

/// A restore delta handle (opaque to C).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct sp_restore_delta {
    _opaque: (),
}

/// A variant group handle (opaque to C).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct sp_variant_group {
    _opaque: (),
}

/// A checkpoint of one pool on one device.
struct CheckpointObj {
    device: c_int,
    cp: Checkpoint,
}

/// A variant group on one device.
struct GroupObj {
    device: c_int,
    group: Mutex<VariantGroup>,
}

static CHECKPOINTS: Registry<CheckpointObj> = Registry::new(Kind::Checkpoint);
static DELTAS: Registry<RestoreDelta> = Registry::new(Kind::Delta);
static GROUPS: Registry<GroupObj> = Registry::new(Kind::VariantGroup);

fn checkpoint(p: *const sp_checkpoint) -> Result<Arc<CheckpointObj>> {
    CHECKPOINTS.get(tok(p), Kind::Checkpoint.name())
}

/// The lists of the last delta freed, for the next restore to fill: CUDA graph trees restore at
/// every branch switch, and lists of thousands of entries allocated afresh each time cost more
/// in page faults than the restore's own work on them.
static SPARE_DELTA: Mutex<Option<RestoreDelta>> = Mutex::new(None);

fn take_spare_delta() -> RestoreDelta {
    SPARE_DELTA
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take()
        .unwrap_or_default()
}

fn keep_spare_delta(d: RestoreDelta) {
    if d.worth_keeping() {
        *SPARE_DELTA.lock().unwrap_or_else(PoisonError::into_inner) = Some(d);
    }
}

fn delta(p: *const sp_restore_delta) -> Result<Arc<RestoreDelta>> {
    DELTAS.get(tok(p), Kind::Delta.name())
}

fn group(p: *const sp_variant_group) -> Result<Arc<GroupObj>> {
    GROUPS.get(tok(p), Kind::VariantGroup.name())
}

/// Pointers from a C array of `n` entries. A length above the most allocations `d`'s device
/// could hold (one per smallest block) is refused before the array is read, and the copy's host
/// memory is reserved fallibly: no length can make the library abort or form an invalid slice.
///
/// # Safety
///
/// `ptrs` must be NULL (with `n` = 0) or point to `n` readable pointers.
unsafe fn ptr_list(
    d: &DevAlloc,
    ptrs: *const *mut c_void,
    n: usize,
    what: &str,
) -> Result<Vec<DevicePtr>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if ptrs.is_null() {
        return Err(Error::null(what));
    }
    let most = d.total_memory() / MIN_BLOCK_SIZE;
    if n as u64 > most {
        return Err(Error::InvalidArgument(format!(
            "{what} has {n} entries; the device ({} bytes) cannot hold more than {most} \
             allocations",
            d.total_memory()
        )));
    }
    let mut out = Vec::new();
    out.try_reserve_exact(n).map_err(|_| {
        Error::OutOfMemory(format!("host memory for a copy of {what} ({n} entries)"))
    })?;
    // SAFETY: non-null, and `n` readable elements by the caller's contract; `n` is at most
    // 2^56 / 512 entries, so the slice is well under isize::MAX bytes.
    let s = unsafe { std::slice::from_raw_parts(ptrs, n) };
    out.extend(s.iter().map(|&p| p as DevicePtr));
    Ok(out)
}

/// Hands `delta` to the caller through `out` (may be NULL: not wanted).
///
/// # Safety
///
/// `out` must be NULL or valid for a write.
unsafe fn deliver(delta: RestoreDelta, out: *mut *mut sp_restore_delta) -> Result<()> {
    // Registered only when wanted: nobody would ever free an unwanted handle.
    if out.is_null() {
        keep_spare_delta(delta);
    } else {
        let t = DELTAS.insert(delta)?;
        // SAFETY: valid for a write by the caller's contract.
        unsafe { put_opt(out, handle(t)) };
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Checkpoint / restore

/// Takes a checkpoint of pool `id`.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_checkpoint_take(
    device: c_int,
    id: sp_pool_id,
    out: *mut *mut sp_checkpoint,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, std::ptr::null_mut()) };
        let cp = each!(runtime()?.device(device)?, a => a.checkpoint(id.core()))?;
        let t = CHECKPOINTS.insert(CheckpointObj { device, cp })?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, handle(t)) };
        Ok(())
    })
}

/// Frees a checkpoint (NULL is accepted).
///
/// # Safety
///
/// None for `cp`: any value is checked against the registry, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_checkpoint_free(cp: *mut sp_checkpoint) -> sp_status {
    ffi(|| CHECKPOINTS.remove(tok(cp), Kind::Checkpoint.name()))
}

/// Returns the pool `cp` was taken of, on its device, to checkpoint `cp`, keeping
/// `keep_live[0..n_keep]` live at their addresses. The device and pool come from the checkpoint;
/// the core checks once that the checkpoint belongs to that device's allocator.
///
/// # Safety
///
/// `cp` may be any value (checked, never dereferenced); `keep_live` NULL (with `n_keep` 0) or
/// `n_keep` readable pointers; `delta_out` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_checkpoint_restore(
    cp: *const sp_checkpoint,
    keep_live: *const *mut c_void,
    n_keep: usize,
    delta_out: *mut *mut sp_restore_delta,
) -> sp_status {
    ffi(|| {
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(delta_out, std::ptr::null_mut()) };
        let c = checkpoint(cp)?;
        let d = runtime()?.device(c.device)?;
        // SAFETY: forwarded from the caller's contract.
        let keep = unsafe { ptr_list(d, keep_live, n_keep, "keep_live") }?;
        let delta = each!(d, a => a.restore_checkpoint(&c.cp, &keep, take_spare_delta()))?;
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { deliver(delta, delta_out) }
    })
}

/// Writes the device and pool checkpoint `cp` was taken of (either out-pointer may be NULL).
///
/// # Safety
///
/// `cp` may be any value (checked, never dereferenced); `device` and `pool` each NULL or valid
/// for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_checkpoint_info(
    cp: *const sp_checkpoint,
    device: *mut c_int,
    pool: *mut sp_pool_id,
) -> sp_status {
    ffi(|| {
        let c = checkpoint(cp)?;
        // SAFETY: each NULL or valid for a write by the caller's contract.
        unsafe {
            put_opt(device, c.device);
            put_opt(pool, c.cp.pool().c());
        }
        Ok(())
    })
}

/// Allocations a restore freed (0 for an invalid handle, with the reason in the last error).
#[unsafe(no_mangle)]
pub extern "C" fn sp_delta_freed_count(d: *const sp_restore_delta) -> usize {
    ffi_value(0, || Ok(delta(d)?.freed.len()))
}

/// Allocations a restore re-created (0 for an invalid handle, with the reason in the last
/// error).
#[unsafe(no_mangle)]
pub extern "C" fn sp_delta_created_count(d: *const sp_restore_delta) -> usize {
    ffi_value(0, || Ok(delta(d)?.created.len()))
}

/// Writes entry `i` of a delta's freed (or created) list.
///
/// # Safety
///
/// `ptr` and `size` must each be NULL (an error) or valid for a write.
unsafe fn delta_entry(
    d: *const sp_restore_delta,
    i: usize,
    freed: bool,
    ptr: *mut *mut c_void,
    size: *mut usize,
) -> Result<()> {
    let d = delta(d)?;
    let ptr = required(ptr, "ptr")?;
    let size = required(size, "size")?;
    let list = if freed { &d.freed } else { &d.created };
    let &(p, s) = list
        .get(i)
        .ok_or_else(|| Error::InvalidArgument(format!("index {i} of {} entries", list.len())))?;
    // SAFETY: non-null, and valid for writes by the caller's contract.
    unsafe {
        put(ptr, p as *mut c_void);
        put(size, s as usize);
    }
    Ok(())
}

/// Entry `i` of the allocations a restore freed.
///
/// # Safety
///
/// `ptr` and `size` must be NULL (an error) or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_delta_freed(
    d: *const sp_restore_delta,
    i: usize,
    ptr: *mut *mut c_void,
    size: *mut usize,
) -> sp_status {
    // SAFETY: the out-pointers as this function's contract says.
    ffi(|| unsafe { delta_entry(d, i, true, ptr, size) })
}

/// Entry `i` of the allocations a restore re-created (the caller owns them).
///
/// # Safety
///
/// `ptr` and `size` must be NULL (an error) or valid for writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_delta_created(
    d: *const sp_restore_delta,
    i: usize,
    ptr: *mut *mut c_void,
    size: *mut usize,
) -> sp_status {
    // SAFETY: the out-pointers as this function's contract says.
    ffi(|| unsafe { delta_entry(d, i, false, ptr, size) })
}

/// Writes the first `min(cap, total)` entries of a delta's freed list (`created` 0) or
/// re-created list (`created` non-zero): pointers to `ptrs`, sizes to `sizes` (may be NULL), and
/// the list's length to `*total` (`SP_OK` also when it is above `cap`). One call for what
/// `sp_delta_freed` / `sp_delta_created` read an entry at a time: a restore's caller reads
/// thousands of entries.
///
/// # Safety
///
/// `ptrs` must be NULL with `cap` 0, else valid for `cap` writes; `sizes` NULL or valid for `cap`
/// writes; `total` NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_delta_entries(
    d: *const sp_restore_delta,
    created: c_int,
    ptrs: *mut *mut c_void,
    sizes: *mut usize,
    cap: usize,
    total: *mut usize,
) -> sp_status {
    ffi(|| {
        let d = delta(d)?;
        let total = required(total, "total")?;
        if cap > 0 && ptrs.is_null() {
            return Err(Error::InvalidArgument(format!(
                "ptrs is NULL with cap {cap}"
            )));
        }
        let list = if created != 0 { &d.created } else { &d.freed };
        for (i, &(p, s)) in list.iter().take(cap).enumerate() {
            // SAFETY: `ptrs` is non-null and valid for `cap` > `i` writes, `sizes` NULL or the
            // same, by the caller's contract.
            unsafe {
                ptrs.add(i).write(p as *mut c_void);
                if !sizes.is_null() {
                    sizes.add(i).write(s as usize);
                }
            }
        }
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(total, list.len()) };
        Ok(())
    })
}

/// Frees a delta (NULL is accepted).
///
/// # Safety
///
/// None for `d`: any value is checked against the registry, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_delta_free(d: *mut sp_restore_delta) -> sp_status {
    ffi(|| {
        // Its lists serve the next restore, unless a call still reads them.
        if let Some(delta) = DELTAS.take(tok(d), Kind::Delta.name())?
            && let Ok(delta) = Arc::try_unwrap(delta)
        {
            keep_spare_delta(delta);
        }
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// Variant groups

/// Starts a variant group of `count` variants on pool `id` (created if new): checkpoints it.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_variant_group_create(
    device: c_int,
    id: sp_pool_id,
    count: usize,
    out: *mut *mut sp_variant_group,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, std::ptr::null_mut()) };
        let group = each!(runtime()?.device(device)?, a => a.variant_group(id.core(), count))?;
        let t = GROUPS.insert(GroupObj {
            device,
            group: Mutex::new(group),
        })?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, handle(t)) };
        Ok(())
    })
}

/// Begins variant `k`: the pool returns to the group's checkpoint. `delta_out` (may be NULL)
/// receives what earlier variants left live and is now freed.
///
/// # Safety
///
/// `g` may be any value (checked, never dereferenced); `delta_out` NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_variant_begin(
    g: *const sp_variant_group,
    k: usize,
    delta_out: *mut *mut sp_restore_delta,
) -> sp_status {
    ffi(|| {
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(delta_out, std::ptr::null_mut()) };
        let g = group(g)?;
        let mut group = g.group.lock().unwrap_or_else(PoisonError::into_inner);
        let delta = each!(runtime()?.device(g.device)?, a => a.begin_variant(&mut group, k))?;
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { deliver(delta, delta_out) }
    })
}

/// Ends the variant being captured.
///
/// # Safety
///
/// None for `g`: any value is checked against the registry, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_variant_end(g: *const sp_variant_group) -> sp_status {
    ffi(|| {
        let g = group(g)?;
        let mut group = g.group.lock().unwrap_or_else(PoisonError::into_inner);
        each!(runtime()?.device(g.device)?, a => a.end_variant(&mut group))?;
        Ok(())
    })
}

/// Frees a variant group (NULL is accepted); the pool and its memory stay.
///
/// # Safety
///
/// None for `g`: any value is checked against the registry, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_variant_group_free(g: *mut sp_variant_group) -> sp_status {
    ffi(|| GROUPS.remove(tok(g), Kind::VariantGroup.name()))
}

// ------------------------------------------------------------------------------------------------
// Arenas

/// Creates an arena in pool `id` for work on `stream`; it holds a use of the pool until destroyed.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_arena_create(
    device: c_int,
    id: sp_pool_id,
    stream: u64,
    out: *mut u64,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let ar = each!(runtime()?.device(device)?, a => a.arena_create(id.core(), stream))?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, ar.0) };
        Ok(())
    })
}

/// Allocates slot `slot` of branch `branch`: the same address in every branch. A refused or
/// failed call changes nothing.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_arena_alloc(
    device: c_int,
    arena: u64,
    branch: u32,
    slot: u32,
    size: usize,
    out: *mut *mut c_void,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, std::ptr::null_mut()) };
        let p = each!(runtime()?.device(device)?, a =>
            a.arena_alloc(ArenaId(arena), branch, slot, size as u64))?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, p as *mut c_void) };
        Ok(())
    })
}

/// Frees slot `slot` of branch `branch`, and only that allocation.
#[unsafe(no_mangle)]
pub extern "C" fn sp_arena_free(device: c_int, arena: u64, branch: u32, slot: u32) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.arena_free(ArenaId(arena), branch, slot))?;
        Ok(())
    })
}

/// Turns the arena's overlap check on (non-zero) or off.
#[unsafe(no_mangle)]
pub extern "C" fn sp_arena_set_debug(device: c_int, arena: u64, on: c_int) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.arena_set_debug(ArenaId(arena), on != 0))?;
        Ok(())
    })
}

/// Destroys an arena (refused while any (branch, slot) is live) and gives back its use of the pool.
#[unsafe(no_mangle)]
pub extern "C" fn sp_arena_destroy(device: c_int, arena: u64) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.arena_destroy(ArenaId(arena)))?;
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// Live sets and invariants

/// SP_OK iff the live allocations of pool `id` are exactly `ptrs[0..n]`
/// (`checkPoolLiveAllocations`); else SP_ERR_INVALID_STATE naming the difference.
///
/// # Safety
///
/// `ptrs` must be NULL (with `n` 0) or `n` readable pointers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_verify_live(
    device: c_int,
    id: sp_pool_id,
    ptrs: *const *mut c_void,
    n: usize,
) -> sp_status {
    ffi(|| {
        let d = runtime()?.device(device)?;
        // SAFETY: forwarded from the caller's contract.
        let list = unsafe { ptr_list(d, ptrs, n, "ptrs") }?;
        each!(d, a => a.verify_live(id.core(), &list))?;
        Ok(())
    })
}

/// Number of live allocations of pool `id`.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_live_count(
    device: c_int,
    id: sp_pool_id,
    out: *mut usize,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        let n = each!(runtime()?.device(device)?, a => a.live_allocations(id.core()))?.len();
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, n) };
        Ok(())
    })
}

/// Waits for the cross-stream events of pool `id`'s pending frees; writes how many are still
/// pending (may be NULL).
///
/// # Safety
///
/// `left` must be NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_drain_pending_frees(
    device: c_int,
    id: sp_pool_id,
    left: *mut usize,
) -> sp_status {
    ffi(|| {
        let n = each!(runtime()?.device(device)?, a => a.drain_pending_frees(id.core()))?;
        // SAFETY: NULL or valid for a write by the caller's contract.
        unsafe { put_opt(left, n) };
        Ok(())
    })
}

/// Checks every invariant of `device`'s allocator; SP_ERR_INVALID_STATE names the first broken
/// one. Costs O(blocks): for tests.
#[unsafe(no_mangle)]
pub extern "C" fn sp_check_invariants(device: c_int) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.check_invariants())
            .map_err(|e| Error::InvalidState(format!("invariant broken: {e}")))?;
        Ok(())
    })
}

// ------------------------------------------------------------------------------------------------
// History

/// Records `device`'s allocator events into a ring of `max_entries` (0 stops recording; the
/// entries stay until `sp_clear_history`). They appear in `sp_snapshot_json`'s `device_traces`.
/// `device` -1: every device, including those first used later (as PyTorch's
/// `_record_memory_history` does, without creating an allocator for a device nobody uses).
#[unsafe(no_mangle)]
pub extern "C" fn sp_record_history(device: c_int, max_entries: usize) -> sp_status {
    ffi(|| {
        let rt = runtime()?;
        if device == -1 {
            rt.record_history_all(max_entries);
        } else {
            each!(rt.device(device)?, a => a.record_history(max_entries));
        }
        Ok(())
    })
}

/// Hands every allocator event of every device, present and future, to `callback` as it
/// happens, with `user_data` (PyTorch's `attachAllocatorTraceTracker`; NCCL registers segments
/// through it). NULL stops; a new callback replaces the old one.
///
/// # Safety
///
/// `callback` may be called from any thread that calls slotpool, until it is replaced or the
/// library shuts down, with an event valid only for the call: it must be safe to call so, with
/// `user_data`. It runs under an allocator lock: it must not call slotpool (or allocate through
/// it), and must not unwind.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_set_trace_callback(
    callback: Option<unsafe extern "C" fn(*const sp_trace_event, *mut c_void)>,
    user_data: *mut c_void,
) -> sp_status {
    ffi(|| {
        runtime()?.set_trace_callback(callback.map(|callback| TraceCallback {
            callback,
            user_data: user_data as usize,
        }));
        Ok(())
    })
}

/// Forgets `device`'s recorded history (-1: every device).
#[unsafe(no_mangle)]
pub extern "C" fn sp_clear_history(device: c_int) -> sp_status {
    ffi(|| {
        let rt = runtime()?;
        if device == -1 {
            rt.created()
                .for_each(|(_, d)| each!(d, a => a.clear_history()));
        } else {
            each!(rt.device(device)?, a => a.clear_history());
        }
        Ok(())
    })
}
