//! CUDA IPC of vmm memory: pages exported as POSIX file descriptors, and pages of another process
//! mapped here.
//!
//! `cudaIpcGetMemHandle` only shares `cudaMalloc` memory. vmm pages are shared the way PyTorch
//! shares its expandable segments: each physical page (`cuMemCreate` with
//! `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`) is exported once as a file descriptor of the owning
//! process ([`CudaDevice::export_page`]), kept open while the page lives; a receiver duplicates
//! the descriptors into itself with `pidfd_getfd` (the same user, or ptrace permission), imports
//! them, and maps them in order into a reservation of its own ([`CudaDevice::import_pages`]). The
//! memory stays alive while either side maps it.

use std::ffi::{c_int, c_void};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{self, CUmemAllocationHandleType};
use slotpool_core::{DeviceError, DevicePtr, DeviceResult, PageHandle};

use crate::device::{CudaDevice, relaxed, to_usize};
use crate::error::call;

const POSIX_FD: CUmemAllocationHandleType =
    CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

/// The calling thread's last OS error, for messages.
fn os_error(what: &str) -> DeviceError {
    DeviceError::InvalidArgument(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// What [`CudaDevice::import_pages`] made so far (imported handles, a reservation, its mapped
/// pages); dropping it undoes whatever it still holds: a failed import leaves nothing behind, and
/// [`CudaDevice::close_import`] drops the whole range.
struct Imported {
    handles: Vec<sys::CUmemGenericAllocationHandle>,
    base: DevicePtr,
    reserved: usize,
    page: usize,
    mapped: usize,
}

impl Drop for Imported {
    fn drop(&mut self) {
        for j in 0..self.mapped {
            // SAFETY: undoes a `cuMemMap` of `import_pages` that succeeded on exactly this page.
            let _ = call("cuMemUnmap", || unsafe {
                sys::cuMemUnmap(self.base + (j * self.page) as u64, self.page)
            });
        }
        if self.reserved != 0 {
            // SAFETY: the reservation made by `import_pages`, with nothing mapped in it any more.
            let _ = call("cuMemAddressFree", || unsafe {
                sys::cuMemAddressFree(self.base, self.reserved)
            });
        }
        for &h in &self.handles {
            // SAFETY: each handle came from a successful `cuMemImportFromShareableHandle` and is
            // released once; a mapping of it (none is left here) would keep the memory alive.
            let _ = call("cuMemRelease", || unsafe { sys::cuMemRelease(h) });
        }
    }
}

impl CudaDevice {
    /// Whether this device's pages can be shared with other processes: the device supports
    /// POSIX file-descriptor handles, so pages are created exportable.
    pub fn shareable(&self) -> bool {
        self.shareable.load(Ordering::Relaxed)
    }

    /// A file descriptor of this process for `page` (`cuMemExportToShareableHandle`), made once
    /// and kept open until the page is released: receivers duplicate it from this process
    /// whenever they open a handle that names it, so it must outlive the call.
    ///
    /// Errors: [`DeviceError::Unavailable`] when the device's pages are not shareable; the
    /// driver's error otherwise.
    pub fn export_page(&self, page: PageHandle) -> DeviceResult<i32> {
        if !self.shareable() {
            return Err(DeviceError::Unavailable(format!(
                "device {} cannot export memory as POSIX file descriptors",
                self.ordinal()
            )));
        }
        let mut exported = self.exported.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(&fd) = exported.get(&page.0) {
            return Ok(fd);
        }
        let _ctx = self.enter()?;
        let mut fd: c_int = -1;
        // SAFETY: `fd` is a valid out-pointer for an `int`, the form a POSIX descriptor handle
        // takes; `page` is a live page of this device (the caller holds it mapped) and flags
        // must be 0.
        call("cuMemExportToShareableHandle", || unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut c_int).cast::<c_void>(),
                page.0,
                POSIX_FD,
                0,
            )
        })?;
        exported.insert(page.0, fd);
        Ok(fd)
    }

    /// Closes the exported descriptor of `page`, if any (the page is being released).
    pub(crate) fn forget_export(&self, page: PageHandle) {
        let fd = self
            .exported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&page.0);
        if let Some(fd) = fd {
            // SAFETY: the descriptor `export_page` got from the driver, owned by this map alone
            // and just taken out of it: closed once.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }

    /// Closes every exported descriptor (the device is going away).
    pub(crate) fn close_exports(&self) {
        let fds: Vec<c_int> = self
            .exported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drain()
            .map(|(_, fd)| fd)
            .collect();
        for fd in fds {
            // SAFETY: as in `forget_export`: each descriptor was taken out of the map, closed once.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }

    /// Maps the pages that process `pid` exported (`fds`, its descriptors of `page_size`-byte
    /// pages, in address order) into a new reservation of this device, readable and writable
    /// by it and its peers, and returns the reservation's address. The memory stays alive while
    /// it is mapped here, whatever the exporter does; [`CudaDevice::close_import`] unmaps it.
    ///
    /// Needs `pidfd_getfd` (Linux 5.6) and permission to use it on `pid` (the same user, or
    /// ptrace rights). Errors: [`DeviceError::InvalidArgument`] for an empty list, a page size
    /// that is not a multiple of the granularity, or a process or descriptor that cannot be
    /// reached; the driver's error otherwise. A failure leaves nothing mapped or reserved.
    pub fn import_pages(&self, pid: i32, fds: &[i32], page_size: u64) -> DeviceResult<DevicePtr> {
        self.require_vmm("import_pages")?;
        if fds.is_empty() {
            return Err(DeviceError::InvalidArgument("no pages to import".into()));
        }
        if page_size == 0 || !page_size.is_multiple_of(self.granularity()) {
            return Err(DeviceError::InvalidArgument(format!(
                "page size {page_size} is not a positive multiple of the granularity {}",
                self.granularity()
            )));
        }
        let page = to_usize(page_size, "import_pages")?;
        let total = page
            .checked_mul(fds.len())
            .ok_or_else(|| DeviceError::InvalidArgument("import_pages: too many pages".into()))?;
        // SAFETY: `pidfd_open` takes a pid and flags (0) and returns a new descriptor or -1.
        let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if pidfd < 0 {
            return Err(os_error(&format!("pidfd_open({pid})")));
        }
        // SAFETY: a descriptor `pidfd_open` just opened for this call (checked non-negative).
        let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as c_int) };
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let mut made = Imported {
            handles: Vec::with_capacity(fds.len()),
            base: 0,
            reserved: 0,
            page,
            mapped: 0,
        };
        for &remote in fds {
            // SAFETY: `pidfd_getfd` takes a pidfd of this process, a descriptor number of the
            // other process and flags (0); it returns a new descriptor of ours or -1.
            let local =
                unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), remote, 0) };
            if local < 0 {
                return Err(os_error(&format!("pidfd_getfd(pid {pid}, fd {remote})")));
            }
            // SAFETY: a descriptor `pidfd_getfd` just opened in this process (checked non-negative).
            let local = unsafe { OwnedFd::from_raw_fd(local as c_int) };
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is a valid out-pointer; a POSIX descriptor handle is passed as
            // the descriptor's value in the pointer argument, and `local` stays open for the
            // call (the driver takes its own reference to the memory).
            call("cuMemImportFromShareableHandle", || unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut handle,
                    local.as_raw_fd() as usize as *mut c_void,
                    POSIX_FD,
                )
            })?;
            made.handles.push(handle);
        }
        let mut base: sys::CUdeviceptr = 0;
        // Aligned to the granularity: the exporter's page need not be a power of two (PyTorch's
        // large-pool pages are 20 MiB), which the driver requires of an alignment.
        let align = to_usize(self.granularity(), "import_pages")?;
        // SAFETY: `base` is a valid out-pointer; no fixed address (0) and flags must be 0.
        call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut base, total, align, 0, 0)
        })?;
        (made.base, made.reserved) = (base, total);
        for (i, &h) in made.handles.clone().iter().enumerate() {
            // SAFETY: `base + i * page` is page-aligned inside the reservation just made, nothing
            // is mapped there, and `h` is an imported handle of one `page`-byte allocation (the
            // driver refuses a size mismatch); offset and flags must be 0.
            call("cuMemMap", || unsafe {
                sys::cuMemMap(base + (i * page) as u64, page, 0, h, 0)
            })?;
            made.mapped = i + 1;
        }
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: the whole reservation is mapped; `access` is a valid array of initialised
        // descriptors whose length is passed with it.
        call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(base, total, access.as_ptr(), access.len())
        })?;
        drop(access);
        // The mappings hold the memory: the handles are not needed any more.
        for h in std::mem::take(&mut made.handles) {
            // SAFETY: `h` came from `cuMemImportFromShareableHandle` and is released once; its
            // mapping keeps the memory alive until `close_import` unmaps it.
            let _ = call("cuMemRelease", || unsafe { sys::cuMemRelease(h) });
        }
        (made.mapped, made.reserved) = (0, 0);
        self.imported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(base, (fds.len(), page));
        Ok(base)
    }

    /// Unmaps a range that [`CudaDevice::import_pages`] mapped, and frees its reservation.
    /// Errors: [`DeviceError::InvalidArgument`] if `base` is not such a range (nothing changes).
    pub fn close_import(&self, base: DevicePtr) -> DeviceResult<()> {
        let (pages, page) = self
            .imported
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&base)
            .ok_or_else(|| {
                DeviceError::InvalidArgument(format!("{base:#x} is not memory imported here"))
            })?;
        let _ctx = self.enter()?;
        // Undone as it was made: one unmap per mapped page, then the reservation.
        let made = Imported {
            handles: Vec::new(),
            base,
            reserved: pages * page,
            page,
            mapped: pages,
        };
        drop(made);
        Ok(())
    }
}
