//! `sp_pool_pause`, `sp_pool_resume`, `sp_pool_pause_info`: a pool's physical memory given back
//! to the driver and taken again at the same addresses (core's `pause.rs`).

use std::ffi::c_int;

use slotpool_core::PauseMode;

use crate::error::{Error, ffi, sp_status};
use crate::out::put_opt;
use crate::runtime::{each, runtime};
use slotpool_abi::sp_pool_id;

use crate::convert::ToCore;

/// `sp_pool_pause` flag: copy the pool's contents to pinned host memory first.
pub const SP_PAUSE_BACKUP: u32 = 1;

/// The pause mode for `flags`; unknown bits are an error.
fn mode_of(flags: u32) -> Result<PauseMode, Error> {
    match flags {
        0 => Ok(PauseMode::Discard),
        SP_PAUSE_BACKUP => Ok(PauseMode::Backup),
        other => Err(Error::InvalidArgument(format!(
            "pause flags {other:#x}: expected 0 (discard) or SP_PAUSE_BACKUP (1)"
        ))),
    }
}

/// Gives every physical page of pool `id` back to the driver, keeping its addresses, blocks and
/// statistics; with `SP_PAUSE_BACKUP` in `flags` the contents are copied to pinned host memory
/// first. Synchronises the device.
#[unsafe(no_mangle)]
pub extern "C" fn sp_pool_pause(device: c_int, id: sp_pool_id, flags: u32) -> sp_status {
    ffi(|| {
        let mode = mode_of(flags)?;
        each!(runtime()?.device(device)?, a => a.pause_pool(id.core(), mode))?;
        Ok(())
    })
}

/// Maps new physical memory at every paused address of pool `id` and copies the backup back.
#[unsafe(no_mangle)]
pub extern "C" fn sp_pool_resume(device: c_int, id: sp_pool_id) -> sp_status {
    ffi(|| {
        each!(runtime()?.device(device)?, a => a.resume_pool(id.core()))?;
        Ok(())
    })
}

/// Writes whether pool `id` is paused (1 or 0), the bytes it gave back, and the pinned host bytes
/// that hold its backup.
///
/// # Safety
///
/// Each out-pointer must be NULL (not wanted) or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_pool_pause_info(
    device: c_int,
    id: sp_pool_id,
    paused: *mut c_int,
    paused_bytes: *mut u64,
    host_bytes: *mut u64,
) -> sp_status {
    ffi(|| {
        let st = each!(runtime()?.device(device)?, a => a.pool_pause_state(id.core()))?;
        // SAFETY: each is NULL or valid for a write by the caller's contract.
        unsafe {
            put_opt(paused, c_int::from(st.is_paused()));
            put_opt(paused_bytes, st.paused_bytes);
            put_opt(host_bytes, st.host_bytes);
        }
        Ok(())
    })
}
