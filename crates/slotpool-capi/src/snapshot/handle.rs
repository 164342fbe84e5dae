//! The `sp_snapshot` handle: a snapshot copied out of the core's report into C structs, read
//! with `sp_snapshot_segment` / `_block` / `_trace`. Handles follow the checkpoint rules
//! ([`crate::handle`]): a handle of another kind, a freed or made-up one is
//! `SP_ERR_INVALID_ARGUMENT`, and the `_count` functions return 0 for it.

use std::ffi::c_int;

use slotpool_abi::{sp_block_view, sp_segment_view, sp_trace_event};

use crate::convert::{ToC, trace_event};
use crate::error::{Error, Result, ffi, ffi_value, sp_status};
use crate::handle::{Kind, Registry, pointer_of, token_of};
use crate::out::{put, required};
use crate::runtime::runtime;

/// A snapshot handle (opaque to C: the pointer is a token, never dereferenced).
#[allow(non_camel_case_types)]
#[derive(Debug)]
pub struct sp_snapshot {
    _opaque: (),
}

/// What a snapshot handle holds: every segment, the blocks of all of them (segment `i`'s are
/// `blocks[first[i]..first[i] + segments[i].block_count]`), and the events.
struct SnapshotObj {
    segments: Vec<sp_segment_view>,
    first: Vec<usize>,
    blocks: Vec<sp_block_view>,
    traces: Vec<sp_trace_event>,
}

static SNAPSHOTS: Registry<SnapshotObj> = Registry::new(Kind::Snapshot);

impl SnapshotObj {
    fn new(taken: super::Taken) -> SnapshotObj {
        let mut obj = SnapshotObj {
            segments: Vec::with_capacity(taken.segments.len()),
            first: Vec::with_capacity(taken.segments.len()),
            blocks: Vec::new(),
            traces: Vec::new(),
        };
        for (device, seg) in &taken.segments {
            obj.first.push(obj.blocks.len());
            obj.blocks.extend(seg.blocks.iter().map(|b| sp_block_view {
                address: b.addr,
                size: b.size,
                requested_size: b.requested,
                state: b.state.c(),
            }));
            obj.segments.push(sp_segment_view {
                device: *device as c_int,
                is_large: c_int::from(!seg.small),
                is_expandable: c_int::from(seg.vmm),
                reserved0: 0,
                address: seg.addr,
                total_size: seg.size,
                stream: seg.stream,
                pool: seg.pool.c(),
                block_count: seg.blocks.len(),
            });
        }
        for (device, entries) in &taken.traces {
            obj.traces
                .extend(entries.iter().map(|e| trace_event(*device as c_int, e)));
        }
        obj
    }
}

/// `what[i]`, or an error naming the range.
fn at<'a, T>(what: &str, items: &'a [T], i: usize) -> Result<&'a T> {
    items.get(i).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{what} {i} of {} ({what}s 0..{})",
            items.len(),
            items.len()
        ))
    })
}

/// Takes a snapshot of `device` (-1: every device in use); `with_traces` non-zero also copies
/// the recorded history. Segments come in the order `sp_snapshot_json` lists them.
///
/// # Safety
///
/// `out` must be NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_take(
    device: c_int,
    with_traces: c_int,
    out: *mut *mut sp_snapshot,
) -> sp_status {
    ffi(|| {
        let out = required(out, "out")?;
        // SAFETY: an out-pointer the C caller guarantees valid for a write.
        unsafe { put(out, std::ptr::null_mut()) };
        let rt = runtime()?;
        let taken = super::take(rt, crate::api::device_filter(rt, device)?, with_traces != 0);
        let t = SNAPSHOTS.insert(SnapshotObj::new(taken))?;
        // SAFETY: as above.
        unsafe { put(out, pointer_of(t)) };
        Ok(())
    })
}

/// Frees a snapshot (NULL is accepted).
///
/// # Safety
///
/// None for `s`: any value is checked against the registry, never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_free(s: *mut sp_snapshot) -> sp_status {
    ffi(|| SNAPSHOTS.remove(token_of(s), Kind::Snapshot.name()))
}

/// Segments of a snapshot (0 for an invalid handle, with the reason in the last error).
#[unsafe(no_mangle)]
pub extern "C" fn sp_snapshot_segment_count(s: *const sp_snapshot) -> usize {
    ffi_value(0, || Ok(SNAPSHOTS.get_ptr(s)?.segments.len()))
}

/// Writes segment `i` of a snapshot.
///
/// # Safety
///
/// `s` may be any value (checked); `out` NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_segment(
    s: *const sp_snapshot,
    i: usize,
    out: *mut sp_segment_view,
) -> sp_status {
    ffi(|| {
        let snap = SNAPSHOTS.get_ptr(s)?;
        let out = required(out, "out")?;
        let seg = *at("segment", &snap.segments, i)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(out, seg) };
        Ok(())
    })
}

/// Writes block `j` of segment `segment` of a snapshot.
///
/// # Safety
///
/// `s` may be any value (checked); `out` NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_block(
    s: *const sp_snapshot,
    segment: usize,
    j: usize,
    out: *mut sp_block_view,
) -> sp_status {
    ffi(|| {
        let snap = SNAPSHOTS.get_ptr(s)?;
        let out = required(out, "out")?;
        let seg = at("segment", &snap.segments, segment)?;
        let first = snap.first[segment];
        let blocks = &snap.blocks[first..first + seg.block_count];
        let b = *at("block", blocks, j)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(out, b) };
        Ok(())
    })
}

/// Recorded events of a snapshot (0 for an invalid handle, with the reason in the last error,
/// and for one taken without traces).
#[unsafe(no_mangle)]
pub extern "C" fn sp_snapshot_trace_count(s: *const sp_snapshot) -> usize {
    ffi_value(0, || Ok(SNAPSHOTS.get_ptr(s)?.traces.len()))
}

/// Writes event `i` of a snapshot: by device ascending, oldest first within a device.
///
/// # Safety
///
/// `s` may be any value (checked); `out` NULL (an error) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_snapshot_trace(
    s: *const sp_snapshot,
    i: usize,
    out: *mut sp_trace_event,
) -> sp_status {
    ffi(|| {
        let snap = SNAPSHOTS.get_ptr(s)?;
        let out = required(out, "out")?;
        let e = *at("event", &snap.traces, i)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(out, e) };
        Ok(())
    })
}
