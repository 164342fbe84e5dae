//! The real CUDA functions beneath the interposer.
//!
//! Each is looked up once, on first use, with `dlsym(RTLD_NEXT, name)`: the next definition after
//! this library in the process's global scope, i.e. the application's own `libcudart.so.13` (or
//! `libcuda.so.1` for the driver API). `RTLD_NEXT` misses libraries opened with `RTLD_LOCAL`
//! (cudart opens libcuda that way; Python extensions are usually opened that way), so a miss falls
//! back to `dlopen(soname, RTLD_NOLOAD | RTLD_LAZY)` + `dlsym` on that handle: this finds a
//! library already loaded, and never loads one. A definition inside this library itself is never
//! taken. The answer, found or not, is cached for the life of the process.
//!
//! This library has no `DT_NEEDED` entry on either CUDA library, so it never pins a copy of its
//! own and always forwards to the application's.

use std::ffi::{CStr, c_int, c_void};
use std::sync::OnceLock;

/// `cudaStream_t` / `CUstream`: an opaque pointer.
pub type Stream = *mut c_void;
/// `CUdeviceptr` (64-bit).
pub type DevicePtr = u64;
/// `CUcontext`: an opaque pointer.
pub type Context = *mut c_void;
/// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`: the start of the driver allocation holding a pointer.
pub const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;

/// Which CUDA library a symbol belongs to: decides the fallback of a failed `RTLD_NEXT`.
#[derive(Clone, Copy, Debug)]
enum Lib {
    /// The runtime API, `libcudart.so.13`.
    Runtime,
    /// The driver API, `libcuda.so.1`.
    Driver,
}

impl Lib {
    fn soname(self) -> &'static CStr {
        match self {
            Lib::Runtime => c"libcudart.so.13",
            Lib::Driver => c"libcuda.so.1",
        }
    }
}

/// The load address of this library (`dli_fbase`), to recognise our own definitions.
fn own_base() -> *mut c_void {
    static BASE: OnceLock<usize> = OnceLock::new();
    *BASE.get_or_init(|| {
        crate::slotpool::dl_info(own_base as *const () as usize).map_or(0, |i| i.base)
    }) as *mut c_void
}

/// The address of `name` in the real library, or null.
fn lookup(lib: Lib, name: &CStr) -> *mut c_void {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT is a valid pseudo-handle in a shared object.
    let mut p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if p.is_null() || is_own(p) {
        // SAFETY: a NUL-terminated soname; RTLD_NOLOAD only returns a library already loaded.
        let handle =
            unsafe { libc::dlopen(lib.soname().as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
        p = if handle.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: `handle` is a live handle from dlopen (never closed: the reference it holds
            // keeps the library loaded, which it is anyway); `name` is NUL-terminated.
            unsafe { libc::dlsym(handle, name.as_ptr()) }
        };
    }
    if p.is_null() || is_own(p) {
        std::ptr::null_mut()
    } else {
        p
    }
}

/// True if `p` lies in this library (a lookup found our own interposer).
fn is_own(p: *mut c_void) -> bool {
    let own = own_base();
    !own.is_null() && crate::slotpool::dl_info(p as usize).is_some_and(|i| i.base == own as usize)
}

/// Defines `fn $getter() -> Option<$ty>`: the real function, looked up once.
macro_rules! real_fns {
    ($( $(#[$meta:meta])* fn $getter:ident: $lib:ident $name:literal => $ty:ty; )*) => {$(
        $(#[$meta])*
        #[inline]
        pub fn $getter() -> Option<$ty> {
            static CELL: OnceLock<Option<$ty>> = OnceLock::new();
            *CELL.get_or_init(|| {
                let p = lookup(Lib::$lib, $name);
                // SAFETY: `p` is the address of the C function `$name` of the CUDA library, whose
                // prototype (from cuda_runtime_api.h / cuda.h) is `$ty`; a data pointer and a
                // function pointer have the same size and representation on the targets that
                // have CUDA.
                (!p.is_null()).then(|| unsafe { std::mem::transmute::<*mut c_void, $ty>(p) })
            })
        }
    )*};
}

real_fns! {
    /// `cudaError_t cudaMalloc(void** devPtr, size_t size)`.
    fn cuda_malloc: Runtime c"cudaMalloc" =>
        unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
    /// `cudaError_t cudaFree(void* devPtr)`.
    fn cuda_free: Runtime c"cudaFree" => unsafe extern "C" fn(*mut c_void) -> c_int;
    /// `cudaError_t cudaMallocAsync(void** devPtr, size_t size, cudaStream_t hStream)`.
    fn cuda_malloc_async: Runtime c"cudaMallocAsync" =>
        unsafe extern "C" fn(*mut *mut c_void, usize, Stream) -> c_int;
    /// `cudaError_t cudaFreeAsync(void* devPtr, cudaStream_t hStream)`.
    fn cuda_free_async: Runtime c"cudaFreeAsync" =>
        unsafe extern "C" fn(*mut c_void, Stream) -> c_int;
    /// `cudaMallocAsync` of a program built with `--default-stream per-thread`.
    fn cuda_malloc_async_ptsz: Runtime c"cudaMallocAsync_ptsz" =>
        unsafe extern "C" fn(*mut *mut c_void, usize, Stream) -> c_int;
    /// `cudaFreeAsync` of a program built with `--default-stream per-thread`.
    fn cuda_free_async_ptsz: Runtime c"cudaFreeAsync_ptsz" =>
        unsafe extern "C" fn(*mut c_void, Stream) -> c_int;
    /// `cudaError_t cudaGetDevice(int* device)`.
    fn cuda_get_device: Runtime c"cudaGetDevice" => unsafe extern "C" fn(*mut c_int) -> c_int;
    /// `cudaError_t cudaStreamGetDevice(cudaStream_t hStream, int* device)`.
    fn cuda_stream_get_device: Runtime c"cudaStreamGetDevice" =>
        unsafe extern "C" fn(Stream, *mut c_int) -> c_int;
    /// `cudaError_t cudaDeviceEnablePeerAccess(int peerDevice, unsigned int flags)`.
    fn cuda_device_enable_peer_access: Runtime c"cudaDeviceEnablePeerAccess" =>
        unsafe extern "C" fn(c_int, u32) -> c_int;
    /// `cudaError_t cudaDeviceSynchronize(void)`.
    fn cuda_device_synchronize: Runtime c"cudaDeviceSynchronize" =>
        unsafe extern "C" fn() -> c_int;
    /// `cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind)`.
    fn cuda_memcpy: Runtime c"cudaMemcpy" =>
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
    /// `cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count,
    /// cudaMemcpyKind kind, cudaStream_t stream)`.
    fn cuda_memcpy_async: Runtime c"cudaMemcpyAsync" =>
        unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int, Stream) -> c_int;
    /// `cudaError_t cudaMemset(void* devPtr, int value, size_t count)`.
    fn cuda_memset: Runtime c"cudaMemset" =>
        unsafe extern "C" fn(*mut c_void, c_int, usize) -> c_int;
    /// `cudaError_t cudaMemsetAsync(void* devPtr, int value, size_t count, cudaStream_t stream)`.
    fn cuda_memset_async: Runtime c"cudaMemsetAsync" =>
        unsafe extern "C" fn(*mut c_void, c_int, usize, Stream) -> c_int;
    /// `CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytesize)`.
    fn cu_mem_alloc: Driver c"cuMemAlloc_v2" =>
        unsafe extern "C" fn(*mut DevicePtr, usize) -> c_int;
    /// `CUresult cuMemFree_v2(CUdeviceptr dptr)`.
    fn cu_mem_free: Driver c"cuMemFree_v2" => unsafe extern "C" fn(DevicePtr) -> c_int;
    /// `CUresult cuCtxGetDevice(CUdevice* device)`.
    fn cu_ctx_get_device: Driver c"cuCtxGetDevice" => unsafe extern "C" fn(*mut c_int) -> c_int;
    /// `CUresult cuCtxGetCurrent(CUcontext* pctx)`.
    fn cu_ctx_get_current: Driver c"cuCtxGetCurrent" =>
        unsafe extern "C" fn(*mut Context) -> c_int;
    /// `CUresult cuStreamGetCtx(CUstream hStream, CUcontext* pctx)`.
    fn cu_stream_get_ctx: Driver c"cuStreamGetCtx" =>
        unsafe extern "C" fn(Stream, *mut Context) -> c_int;
    /// `CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev)`.
    fn cu_device_primary_ctx_retain: Driver c"cuDevicePrimaryCtxRetain" =>
        unsafe extern "C" fn(*mut Context, c_int) -> c_int;
    /// `CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)`.
    fn cu_device_primary_ctx_release: Driver c"cuDevicePrimaryCtxRelease_v2" =>
        unsafe extern "C" fn(c_int) -> c_int;
    /// `CUresult cuPointerGetAttribute(void* data, CUpointer_attribute attribute, CUdeviceptr ptr)`.
    fn cu_pointer_get_attribute: Driver c"cuPointerGetAttribute" =>
        unsafe extern "C" fn(*mut c_void, c_int, DevicePtr) -> c_int;
    /// `CUresult cuCtxSynchronize(void)`.
    fn cu_ctx_synchronize: Driver c"cuCtxSynchronize" => unsafe extern "C" fn() -> c_int;
}
