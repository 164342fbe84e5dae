//! slotpool-cuda: the real-GPU backend, [`slotpool_core::Device`] over the CUDA driver API.
//!
//! The driver is reached through [`cudarc`]'s `driver::sys` bindings (CUDA 13.0, loaded at run
//! time with `dlopen`), so this crate builds, and its tests pass, on machines with no GPU and no
//! CUDA toolkit: [`CudaDevice::new`] then returns [`DeviceError::Unavailable`].
//!
//! # Errors, never panics
//!
//! * `libcuda` is looked for first ([`driver_present`]); every symbol the crate uses is then looked
//!   up once, so a missing library or an old driver is an `Unavailable` error, not cudarc's panic.
//! * Every driver call runs under [`guard`] (`catch_unwind`) anyway, and every `CUresult` becomes
//!   a [`DeviceError`] in one place, [`error`]: `CUDA_ERROR_OUT_OF_MEMORY` is
//!   [`DeviceError::OutOfMemory`], the "not allowed during capture" codes are
//!   [`DeviceError::IllegalDuringCapture`], anything else is [`DeviceError::Driver`] with the code
//!   and `"<call>: <CUDA_ERROR_NAME> (<description>)"`.
//!
//! # Context rule
//!
//! A [`CudaDevice`] retains its device's **primary context** (the one the CUDA runtime and PyTorch
//! use) for its lifetime. Every method first checks the calling thread's current context
//! (`cuCtxGetCurrent`); if it is not this device's primary context, it makes it current
//! (`cuCtxSetCurrent`) for the duration of the call and restores the caller's previous context,
//! including "none", before returning. So the backend never changes which device the CUDA runtime
//! thinks is current on a thread, and several devices can be used from one thread. The driver API
//! is thread-safe; the shared mutable state is the peer list of
//! [`add_peer`](slotpool_core::Device::add_peer), behind an `RwLock` read by
//! [`map`](slotpool_core::Device::map), and the CUDA IPC bookkeeping (descriptors of exported
//! pages, ranges mapped from other processes: `ipc.rs`), behind two mutexes that no hot path takes.
//!
//! # Capture rule: what is relaxed
//!
//! While any stream captures a CUDA graph in the default *global* mode, CUDA forbids "potentially
//! unsafe" calls on every thread, and a forbidden call also invalidates the capture. The allocator
//! must still grow memory while a stream captures, so these methods switch the calling thread to
//! `CU_STREAM_CAPTURE_MODE_RELAXED` with `cuThreadExchangeStreamCaptureMode` around the driver
//! call, and restore the previous mode after it:
//!
//! | method | driver calls made in relaxed mode |
//! |---|---|
//! | [`alloc_segment`](slotpool_core::Device::alloc_segment) | `cuMemAlloc_v2` |
//! | [`reserve`](slotpool_core::Device::reserve) | `cuMemAddressReserve` |
//! | [`create_page`](slotpool_core::Device::create_page) | `cuMemCreate` |
//! | [`map`](slotpool_core::Device::map) | `cuMemMap`, `cuMemSetAccess` |
//! | [`create_run`](slotpool_core::Device::create_run) | `cuMemCreate` |
//! | [`map_whole`](slotpool_core::Device::map_whole) | `cuMemMap`, `cuMemSetAccess` |
//! | [`CudaDevice::import_pages`] | `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess` |
//!
//! Nothing else is relaxed: `free_segment` (`cuMemFree_v2`), `unmap`, `unmap_range`,
//! `release_page`, `release_reservation` and the event calls run in the caller's mode, so calling
//! them at an illegal moment surfaces as [`DeviceError::IllegalDuringCapture`]. The allocator defers frees
//! while captures are underway (see [`slotpool_core::Device`]'s contract).
//!
//! Measured on an H200 (driver 580.159, CUDA 13.0, `examples/cuda_probe`, 2026-11-29), each call
//! made on the capturing thread during a global-mode capture, without relaxed mode:
//! `cuMemAlloc_v2`, `cuMemFree_v2` and `cuEventQuery` are **refused and invalidate the capture**;
//! `cuMemUnmap`, `cuMemRelease`, `cuMemAddressFree` and `cuEventDestroy` are allowed and leave it
//! valid. With relaxed mode, growth (all four methods above) succeeded both on the capturing
//! thread and on another thread, and the capture stayed valid. A global-mode capture also makes
//! the refused calls fail on *other* threads (the GPU tests serialise for that reason).
//!
//! # Handles
//!
//! Streams, events, pages and pointers cross the trait as integers: a `CUstream` / `CUevent`
//! address, a `CUmemGenericAllocationHandle`, a `CUdeviceptr`. Stream `0` is the legacy default
//! stream.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("slotpool-cuda stores CUDA handles as u64 and supports 64-bit targets only");

mod device;
pub mod error;
mod host;
mod ipc;
mod streams;
mod vmm;

pub use device::{CudaDevice, driver_present};
pub use error::guard;
pub use slotpool_core::{CaptureStatus, Device, DeviceError, DeviceResult};
