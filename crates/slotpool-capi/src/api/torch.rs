//! `torch.cuda.memory.CUDAPluggableAllocator`'s alloc and free functions.

use std::ffi::{c_int, c_void};
use std::ptr;

use crate::error::{Error, ffi, sp_status};
use crate::runtime::{each, runtime};

use super::{size_arg, sp_free};

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
