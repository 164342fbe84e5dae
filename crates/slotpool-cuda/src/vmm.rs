//! Virtual memory management over the driver: reservations, physical pages and runs, mappings
//! and access (`Device::reserve` and friends, delegated here from `device.rs`).
//!
//! A physical run (`Device::create_run`) is one `cuMemCreate` of several pages, mapped whole at
//! offset 0 with one `cuMemMap` and one `cuMemSetAccess`, and unmapped with one `cuMemUnmap` over
//! its whole mapping (the driver cannot unmap part of a mapping). `unmap_range` over several
//! mappings next to each other is one `cuMemUnmap` where the driver takes it
//! (`benches/gpu/vmm_runs.cu` probes it); refused, nothing was unmapped and the allocator goes
//! page by page.

use std::ffi::c_int;
use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use cudarc::driver::sys::{
    self, CUdevice, CUmemAccess_flags, CUmemAccessDesc, CUmemAllocationProp, CUmemAllocationType,
    CUmemLocationType,
};
use slotpool_core::{Device, DeviceError, DevicePtr, DeviceResult, PageHandle};

use crate::device::{CudaDevice, relaxed, to_usize};
use crate::error::call;

/// Pinned device memory located on `device`; `shareable`: exportable as a POSIX file descriptor.
pub(crate) fn allocation_prop(device: CUdevice, shareable: bool) -> CUmemAllocationProp {
    // SAFETY: `CUmemAllocationProp` is a C struct of integers, enums whose value 0 is valid
    // (`*_INVALID`, `CU_MEM_HANDLE_TYPE_NONE`) and a raw pointer; all-zero is its documented
    // "empty" state, and every field we need is set below.
    let mut prop: CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    if shareable {
        prop.requestedHandleTypes =
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    }
    prop
}

/// Read/write access for `device`.
pub(crate) fn access_desc(device: CUdevice) -> CUmemAccessDesc {
    // SAFETY: `CUmemAccessDesc` is a C struct of an `i32` and enums whose value 0 is valid
    // (`CU_MEM_LOCATION_TYPE_INVALID`, `CU_MEM_ACCESS_FLAGS_PROT_NONE`); every field is set below.
    let mut desc: CUmemAccessDesc = unsafe { std::mem::zeroed() };
    desc.location.type_ = CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc
}

impl CudaDevice {
    pub(crate) fn vmm_reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        self.require_vmm("reserve")?;
        let bytes = to_usize(size, "reserve")?;
        let alignment = to_usize(self.page_size, "reserve")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; no fixed address is requested (0) and flags must be 0.
        call("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, bytes, alignment, 0, 0)
        })?;
        Ok(ptr)
    }

    pub(crate) fn vmm_release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let bytes = to_usize(size, "release_reservation")?;
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `ptr..ptr+size` is a whole reservation with nothing
        // mapped in it; the driver reports anything else as an error.
        call("cuMemAddressFree", || unsafe {
            sys::cuMemAddressFree(ptr, bytes)
        })
    }

    pub(crate) fn vmm_create_page(&self) -> DeviceResult<PageHandle> {
        self.require_vmm("create_page")?;
        let bytes = to_usize(self.page_size, "create_page")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let shareable = self.shareable.load(Ordering::Relaxed);
        let create = |shareable: bool| {
            let prop = allocation_prop(self.device, shareable);
            let mut handle: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: `handle` is a valid out-pointer, `prop` is fully initialised and outlives
            // the call, `bytes` is a multiple of the allocation granularity, and flags must be 0.
            call("cuMemCreate", || unsafe {
                sys::cuMemCreate(&mut handle, bytes, &prop, 0)
            })
            .map(|()| PageHandle(handle))
        };
        match create(shareable) {
            // A driver (or container) that advertises POSIX handles but will not make them:
            // plain pages from now on, as before CUDA IPC of vmm memory, if those work.
            Err(err)
                if shareable
                    && !matches!(
                        err,
                        DeviceError::OutOfMemory | DeviceError::IllegalDuringCapture(_)
                    ) =>
            {
                let page = create(false).map_err(|_| err)?;
                self.shareable.store(false, Ordering::Relaxed);
                Ok(page)
            }
            made => made,
        }
    }

    pub(crate) fn vmm_release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.forget_export(page);
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `page` came from `create_page` and is released once; the
        // driver validates the handle.
        call("cuMemRelease", || unsafe { sys::cuMemRelease(page.0) })
    }

    pub(crate) fn vmm_map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        self.require_vmm("map")?;
        if pages.is_empty() {
            return Ok(());
        }
        let bytes = to_usize(self.page_size, "map")?;
        let total = bytes
            .checked_mul(pages.len())
            .ok_or_else(|| DeviceError::InvalidArgument("map: run too long".into()))?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let unmap_first = |n: usize| {
            for j in 0..n {
                // SAFETY: undoes a `cuMemMap` below that succeeded on exactly this page.
                let _ = call("cuMemUnmap", || unsafe {
                    sys::cuMemUnmap(ptr + (j * bytes) as u64, bytes)
                });
            }
        };
        for (i, page) in pages.iter().enumerate() {
            // SAFETY: by the trait contract `ptr + i * bytes` is a page-aligned, unmapped address
            // inside a reservation and `page` a live page of exactly `bytes` (it may be mapped at
            // other addresses too: CUDA maps one allocation handle at any number of virtual
            // addresses, all showing the same memory); offset and flags must be 0.
            if let Err(err) = call("cuMemMap", || unsafe {
                sys::cuMemMap(ptr + (i * bytes) as u64, bytes, 0, page.0, 0)
            }) {
                unmap_first(i);
                return Err(err);
            }
        }
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `access` holds `access.len()` initialised descriptors and stays borrowed (and
        // so alive and unchanged) for the duration of the call; `ptr..ptr+total` was just mapped,
        // page by page, and one call may cover several mappings.
        let set = call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, total, access.as_ptr(), access.len())
        });
        drop(access);
        if let Err(err) = set {
            unmap_first(pages.len());
            return Err(err);
        }
        Ok(())
    }

    pub(crate) fn vmm_unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        let bytes = to_usize(self.page_size, "unmap")?;
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract exactly one page is mapped at `ptr` and no pending work
        // touches it; the driver rejects unmapped ranges with an error.
        call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, bytes) })
    }

    pub(crate) fn vmm_add_peer(&self, peer: i32) -> DeviceResult<()> {
        if peer == self.ordinal {
            return Ok(());
        }
        let mut peer_device: CUdevice = 0;
        // SAFETY: `peer_device` is a valid out-pointer; a bad ordinal is reported as an error.
        call("cuDeviceGet", || unsafe {
            sys::cuDeviceGet(&mut peer_device, peer)
        })?;
        let mut can: c_int = 0;
        // SAFETY: `can` is a valid out-pointer and both device handles come from `cuDeviceGet`.
        call("cuDeviceCanAccessPeer", || unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, peer_device, self.device)
        })?;
        if can == 0 {
            return Err(DeviceError::InvalidArgument(format!(
                "device {peer} cannot access the memory of device {}",
                self.ordinal
            )));
        }
        let mut access = self.access.write().unwrap_or_else(PoisonError::into_inner);
        if !access.iter().any(|d| d.location.id == peer_device) {
            access.push(access_desc(peer_device));
        }
        Ok(())
    }

    pub(crate) fn vmm_refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.require_vmm("refresh_access")?;
        let len = to_usize(size, "refresh_access")?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `access` holds `access.len()` initialised descriptors and stays borrowed for the
        // call; by the trait contract every page of `ptr..ptr+len` is mapped (the driver rejects
        // anything else with an error).
        call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, len, access.as_ptr(), access.len())
        })
    }

    pub(crate) fn vmm_create_run(&self, pages: usize) -> DeviceResult<PageHandle> {
        self.require_vmm("create_run")?;
        let bytes = to_usize(self.page_size(), "create_run")?
            .checked_mul(pages)
            .filter(|&b| b > 0)
            .ok_or_else(|| DeviceError::InvalidArgument(format!("create_run: {pages} pages")))?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        // Not exportable: CUDA IPC shares pages one by one, and a run is not shared.
        let prop = allocation_prop(self.device, false);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `handle` is a valid out-pointer, `prop` is fully initialised and outlives the
        // call, `bytes` is a multiple of the page size (itself of the granularity); flags 0.
        call("cuMemCreate", || unsafe {
            sys::cuMemCreate(&mut handle, bytes, &prop, 0)
        })?;
        Ok(PageHandle(handle))
    }

    pub(crate) fn vmm_map_whole(
        &self,
        ptr: DevicePtr,
        run: PageHandle,
        pages: usize,
    ) -> DeviceResult<()> {
        self.require_vmm("map_whole")?;
        let total = to_usize(self.page_size(), "map_whole")?
            .checked_mul(pages)
            .ok_or_else(|| DeviceError::InvalidArgument("map_whole: run too long".into()))?;
        let _ctx = self.enter()?;
        let _mode = relaxed()?;
        // SAFETY: by the trait contract `ptr..ptr+total` is page slots of one reservation where
        // nothing is mapped and `run` a live run of exactly `total` bytes; offset and flags 0.
        call("cuMemMap", || unsafe {
            sys::cuMemMap(ptr, total, 0, run.0, 0)
        })?;
        let access = self.access.read().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: `access` holds `access.len()` initialised descriptors and stays borrowed for the
        // call; `ptr..ptr+total` was just mapped.
        let set = call("cuMemSetAccess", || unsafe {
            sys::cuMemSetAccess(ptr, total, access.as_ptr(), access.len())
        });
        drop(access);
        if let Err(err) = set {
            // SAFETY: undoes the `cuMemMap` above, over exactly its range.
            let _ = call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, total) });
            return Err(err);
        }
        Ok(())
    }

    /// One `cuMemUnmap` over `[ptr, ptr + size)`. A driver that refuses a range over several
    /// mappings checks it before it unmaps anything, so a refusal changed nothing: it is
    /// reported as `Unavailable`, and the allocator unmaps page by page. A run is one mapping
    /// and always goes.
    pub(crate) fn vmm_unmap_range(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        let bytes = to_usize(size, "unmap_range")?;
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `ptr..ptr+bytes` is whole mappings of a reservation
        // that no pending work touches; the driver rejects anything else with an error.
        match call("cuMemUnmap", || unsafe { sys::cuMemUnmap(ptr, bytes) }) {
            Err(DeviceError::Driver { code, what }) if size > self.page_size() => {
                Err(DeviceError::Unavailable(format!(
                    "cuMemUnmap over several mappings refused ({code}: {what})"
                )))
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_and_allocation_descriptors() {
        let prop = allocation_prop(3, false);
        assert_eq!(
            prop.requestedHandleTypes,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        );
        assert_eq!(
            allocation_prop(3, true).requestedHandleTypes,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        );
        assert_eq!(
            prop.type_,
            CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED
        );
        assert_eq!(
            prop.location.type_,
            CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE
        );
        assert_eq!(prop.location.id, 3);
        assert!(prop.win32HandleMetaData.is_null());
        let desc = access_desc(5);
        assert_eq!(desc.location.id, 5);
        assert_eq!(
            desc.flags,
            CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        );
    }
}
