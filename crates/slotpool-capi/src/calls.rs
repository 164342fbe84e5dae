//! `sp_backend_calls_get`: the driver calls a device's allocator made, by kind.

use std::ffi::c_int;

use slotpool_core::BackendCalls;

use crate::error::{ffi, sp_status};
use crate::out::{put, required};
use crate::runtime::{each, runtime};

/// The backend calls a device's allocator made so far, by kind (`sp_backend_calls` in C).
/// `map` counts pages: a run of n pages mapped at once is n.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_backend_calls {
    pub alloc_segment: u64,
    pub free_segment: u64,
    pub reserve: u64,
    pub release_reservation: u64,
    pub create_page: u64,
    pub release_page: u64,
    pub map: u64,
    pub unmap: u64,
    pub create_event: u64,
    pub record_event: u64,
    pub query_event: u64,
    pub synchronize: u64,
}

const _: () = assert!(size_of::<sp_backend_calls>() == 12 * 8);

impl From<BackendCalls> for sp_backend_calls {
    fn from(c: BackendCalls) -> Self {
        sp_backend_calls {
            alloc_segment: c.alloc_segment,
            free_segment: c.free_segment,
            reserve: c.reserve,
            release_reservation: c.release_reservation,
            create_page: c.create_page,
            release_page: c.release_page,
            map: c.map,
            unmap: c.unmap,
            create_event: c.create_event,
            record_event: c.record_event,
            query_event: c.query_event,
            synchronize: c.synchronize,
        }
    }
}

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
        unsafe { put(out, calls.into()) };
        Ok(())
    })
}
