//! Pinned host buffers and the copies between them and device memory, for the backups of paused
//! pools (`Device::alloc_host` and friends, delegated here from `device.rs`).
//!
//! A [`HostBuffer`] is the buffer's host address; the device keeps the size of every live buffer
//! so that an unknown handle or a copy past the end is refused before the driver sees it.

use std::ffi::c_void;

use cudarc::driver::sys;
use slotpool_core::{DeviceError, DevicePtr, DeviceResult, HostBuffer};

use crate::device::{CudaDevice, to_usize};
use crate::error::call;

/// `CU_MEMHOSTALLOC_PORTABLE`: the buffer is pinned for every context, not only the current one.
const PORTABLE: std::ffi::c_uint = 0x01;

impl CudaDevice {
    pub(crate) fn host_alloc(&self, size: u64) -> DeviceResult<HostBuffer> {
        let bytes = to_usize(size, "alloc_host")?;
        if bytes == 0 {
            return Err(DeviceError::InvalidArgument("alloc_host: size 0".into()));
        }
        let _ctx = self.enter()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; the driver validates `bytes` and the flags.
        call("cuMemHostAlloc", || unsafe {
            sys::cuMemHostAlloc(&mut p, bytes, PORTABLE)
        })?;
        let addr = p as u64;
        self.host
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr, bytes);
        Ok(HostBuffer(addr))
    }

    pub(crate) fn host_free(&self, buf: HostBuffer) -> DeviceResult<()> {
        let mut host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        if !host.contains_key(&buf.0) {
            return Err(DeviceError::InvalidArgument(format!(
                "free_host: {:#x} is not a live host buffer",
                buf.0
            )));
        }
        let _ctx = self.enter()?;
        // SAFETY: `buf.0` is the address `cuMemHostAlloc` returned (checked above), freed once:
        // it leaves the table in the same critical section.
        call("cuMemFreeHost", || unsafe {
            sys::cuMemFreeHost(buf.0 as usize as *mut c_void)
        })?;
        host.remove(&buf.0);
        Ok(())
    }

    /// The host address of `size` bytes at `offset` in `buf`, checked against its size.
    fn host_range(
        &self,
        call: &str,
        buf: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<usize> {
        let host = self.host.lock().unwrap_or_else(|e| e.into_inner());
        let len = host.get(&buf.0).copied().ok_or_else(|| {
            DeviceError::InvalidArgument(format!("{call}: {:#x} is not a live host buffer", buf.0))
        })?;
        match offset.checked_add(size) {
            Some(end) if end <= len as u64 => Ok(buf.0 as usize + to_usize(offset, call)?),
            _ => Err(DeviceError::InvalidArgument(format!(
                "{call}: {size} bytes at offset {offset} overrun a host buffer of {len}"
            ))),
        }
    }

    pub(crate) fn host_copy_to(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        let at = self.host_range("copy_to_host", dst, offset, size)?;
        let bytes = to_usize(size, "copy_to_host")?;
        let _ctx = self.enter()?;
        // SAFETY: `[at, at + bytes)` lies inside a live pinned buffer (checked above); the
        // driver validates the device range and returns once the copy is done.
        call("cuMemcpyDtoH_v2", || unsafe {
            sys::cuMemcpyDtoH_v2(at as *mut c_void, src, bytes)
        })
    }

    pub(crate) fn host_copy_from(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        let at = self.host_range("copy_from_host", src, offset, size)?;
        let bytes = to_usize(size, "copy_from_host")?;
        let _ctx = self.enter()?;
        // SAFETY: `[at, at + bytes)` lies inside a live pinned buffer (checked above); the
        // driver validates the device range.
        call("cuMemcpyHtoD_v2", || unsafe {
            sys::cuMemcpyHtoD_v2(dst, at as *const c_void, bytes)
        })?;
        // A copy from pinned memory may return before the DMA lands: finish it before the pool
        // is handed back.
        // SAFETY: no arguments; the primary context is current (`enter`).
        call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }
}
