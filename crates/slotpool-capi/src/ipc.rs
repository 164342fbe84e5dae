//! CUDA IPC of vmm memory (`sp_ipc_*`): the pages under an allocation, exported as POSIX file
//! descriptors of this process, and another process's pages mapped here. The PyTorch shim builds
//! PyTorch's expandable-segment handle (`'e'`) from these, so a receiver running PyTorch's
//! allocator or slotpool opens it.

use std::ffi::{c_int, c_void};

use slotpool_core::{AllocError, DeviceError};

use crate::error::{Error, ffi, sp_status};
use crate::out::{put, required};
use crate::runtime::{DevAlloc, each, runtime};

/// The CUDA backend of `device`, or why there is none.
fn cuda(d: &DevAlloc) -> Result<&slotpool_cuda::CudaDevice, DeviceError> {
    match d {
        DevAlloc::Cuda(a) => Ok(a.device()),
        DevAlloc::Sim(_) => Err(DeviceError::Unavailable(
            "the simulated device cannot share memory between processes".into(),
        )),
    }
}

/// The error of an import or a close: what the backend refused as an argument (a page size, a
/// process or descriptor it cannot reach, memory it did not map) is the caller's bad input.
fn refused(e: DeviceError) -> Error {
    match e {
        DeviceError::InvalidArgument(why) => Error::InvalidArgument(why),
        other => other.into(),
    }
}

/// Exports the physical pages under the live vmm allocation at `ptr`: `*count` receives how many
/// pages cover it, `fds[0..count]` their file descriptors (this process's, kept open while the
/// pages live), `*page_size` their size and `*offset` where the allocation starts in the first.
///
/// # Safety
///
/// `count`, `page_size` and `offset` must be valid for writes; `fds` must be valid for `capacity`
/// writes (it may be NULL when `capacity` is 0); `ptr` is never dereferenced.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_ipc_export(
    ptr: *mut c_void,
    fds: *mut c_int,
    capacity: usize,
    count: *mut usize,
    page_size: *mut usize,
    offset: *mut usize,
) -> sp_status {
    ffi(|| {
        let (o_count, o_page, o_offset) = (
            required(count, "count")?,
            required(page_size, "page_size")?,
            required(offset, "offset")?,
        );
        if ptr.is_null() {
            return Err(Error::null("ptr"));
        }
        if fds.is_null() && capacity != 0 {
            return Err(Error::null("fds"));
        }
        let p = ptr as u64;
        let (_, (pages, exported)) = runtime()?.on_owner(p, |d| {
            let pages = each!(d, a => a.shared_pages(p))?;
            if pages.pages.len() > capacity {
                return Ok((pages, None));
            }
            let dev = cuda(d).map_err(AllocError::from)?;
            let fds = pages
                .pages
                .iter()
                .map(|&page| dev.export_page(page).map_err(AllocError::from))
                .collect::<Result<Vec<c_int>, AllocError>>()?;
            Ok((pages, Some(fds)))
        })?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(o_count, pages.pages.len()) };
        let Some(exported) = exported else {
            return Err(Error::InvalidArgument(format!(
                "fds has room for {capacity} descriptors; the allocation spans {} pages",
                pages.pages.len()
            )));
        };
        for (i, fd) in exported.into_iter().enumerate() {
            // SAFETY: `fds` is valid for `capacity` writes and `i < pages.len() <= capacity`.
            unsafe { fds.add(i).write(fd) };
        }
        // SAFETY: both are non-null and valid for writes by the caller's contract.
        unsafe {
            put(o_page, pages.page_size as usize);
            put(o_offset, pages.offset as usize);
        }
        Ok(())
    })
}

/// Maps the pages that process `pid` exported with [`sp_ipc_export`] (or PyTorch's expandable
/// segments: `fds`, its descriptors, `count` pages of `page_size` bytes in address order) into
/// `device`'s address space; `*base` receives the address of the first page.
///
/// # Safety
///
/// `fds` must be valid for `count` reads; `base` must be valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sp_ipc_open(
    device: c_int,
    pid: c_int,
    fds: *const c_int,
    count: usize,
    page_size: usize,
    base: *mut *mut c_void,
) -> sp_status {
    ffi(|| {
        let o_base = required(base, "base")?;
        if fds.is_null() {
            return Err(Error::null("fds"));
        }
        if count == 0 || count > 1 << 20 {
            return Err(Error::InvalidArgument(format!(
                "count {count}: between 1 and 2^20 pages"
            )));
        }
        // SAFETY: non-null and valid for `count` reads by the caller's contract.
        let fds = unsafe { std::slice::from_raw_parts(fds, count) };
        let dev = cuda(runtime()?.device(device)?)?;
        let p = dev
            .import_pages(pid, fds, page_size as u64)
            .map_err(refused)?;
        // SAFETY: non-null and valid for a write by the caller's contract.
        unsafe { put(o_base, p as *mut c_void) };
        Ok(())
    })
}

/// Unmaps memory that [`sp_ipc_open`] mapped on `device`.
#[unsafe(no_mangle)]
pub extern "C" fn sp_ipc_close(device: c_int, base: *mut c_void) -> sp_status {
    ffi(|| {
        if base.is_null() {
            return Err(Error::null("base"));
        }
        cuda(runtime()?.device(device)?)?
            .close_import(base as u64)
            .map_err(refused)
    })
}
