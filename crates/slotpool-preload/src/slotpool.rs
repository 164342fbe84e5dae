//! The forwarder's one link to slotpool: `libslotpool.so`, opened at the first allocation call.
//!
//! # Why `dlopen` and not `DT_NEEDED`
//!
//! A process must hold one allocator, however many slotpool front ends it loads (this library,
//! the PyTorch shim, a program linked with `-lslotpool`). So this library contains no allocator:
//! it forwards to `libslotpool.so` (SONAME `libslotpool.so.0`). It opens it with `dlopen` rather
//! than linking it, because cargo does not order the builds of two cdylibs of one workspace (a
//! link-time `-lslotpool` can fail on a clean clone), and because a lazy open lets every call pass
//! through when slotpool cannot be had (a program must not fail to start because of us).
//!
//! The library is looked for, in order:
//!
//! 1. `$SLOTPOOL_LIBRARY`, when set (a path; no fallback if it cannot be opened);
//! 2. a `libslotpool.so` already loaded in the process (`RTLD_NOLOAD` of `libslotpool.so.0`,
//!    matched by SONAME, whatever the file is called): the allocator of the PyTorch shim or of
//!    the program is then shared;
//! 3. `libslotpool.so.0`, else `libslotpool.so`, in the directory of this library (found with
//!    `dladdr` when this library is loaded, so a relative `LD_PRELOAD` path and a later `chdir` do
//!    not matter): an installed prefix has both, cargo's `target/release` the second;
//! 4. `libslotpool.so.0` on the loader's search path (`LD_LIBRARY_PATH`, `ldconfig`).
//!
//! This library itself has no versioned SONAME: it is loaded by path (`LD_PRELOAD`), never
//! linked against, so nothing records its name.
//!
//! It is opened `RTLD_NOW | RTLD_GLOBAL`, so that later users (a shim linked against it,
//! `ctypes.CDLL("libslotpool.so")`) find this same copy.
//!
//! # Backend
//!
//! If `libslotpool.so` is not initialised yet, this library calls `sp_init(backend, NULL)` (the
//! configuration comes from `SLOTPOOL_CONF`). `backend` is `$SLOTPOOL_BACKEND` when set, else
//! `"cuda"`: unlike other front ends, the preload library never falls back to the simulated
//! device on its own, since host memory handed to a real CUDA program as device memory would
//! crash it. `SLOTPOOL_BACKEND=sim` (tests) and `=auto` are honoured when asked for.
//!
//! Whatever goes wrong (library missing, wrong version, `sp_init` failing), the reason is printed
//! once on stderr and every call passes through to CUDA unchanged.

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::codes::{
    AllocOutcome, FreeOutcome, SP_ERR_INVALID_STATE, SP_OK, alloc_outcome, free_outcome,
};
use crate::report;
use slotpool_abi::sp_segment_view;

/// Environment variable: an explicit path of `libslotpool.so`.
pub const ENV_LIBRARY: &str = slotpool_abi::env::LIBRARY;
/// Environment variable: the backend (`cuda`, `sim`, `auto`), read here and by `libslotpool.so`.
pub const ENV_BACKEND: &str = slotpool_abi::env::BACKEND;
/// Environment variable: `1` makes a served `cudaFree`/`cuMemFree_v2` synchronise the device
/// first, as the real ones do (see docs/preload.md).
pub const ENV_SYNC_FREE: &str = slotpool_abi::env::PRELOAD_SYNC_FREE;
/// The SONAME of slotpool's C ABI library (see crates/slotpool-capi/build.rs).
const SONAME: &CStr = c"libslotpool.so.0";
/// The file names looked for beside this library, in order: the installed name, then cargo's.
const FILE_NAMES: [&str; 2] = ["libslotpool.so.0", "libslotpool.so"];

// ------------------------------------------------------------------------------------------------
// dladdr and this library's own location

/// What `dladdr` says about an address.
#[derive(Debug)]
pub struct DlInfo {
    /// Load address of the object that contains it.
    pub base: usize,
    /// Path of that object as the loader recorded it (may be relative).
    pub path: Option<PathBuf>,
}

/// `dladdr(addr)`, or `None` if no loaded object contains the address `addr`.
pub fn dl_info(addr: usize) -> Option<DlInfo> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: `Dl_info` is plain old data; all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `info` is a valid out-pointer; dladdr only compares the address with the loaded
    // objects' ranges, it never dereferences it.
    if unsafe { libc::dladdr(addr as *const c_void, &mut info) } == 0 {
        return None;
    }
    let path = (!info.dli_fname.is_null()).then(|| {
        // SAFETY: dladdr returned a NUL-terminated string owned by the loader, alive while the
        // object is loaded; it is copied at once.
        let name = unsafe { CStr::from_ptr(info.dli_fname) };
        PathBuf::from(std::ffi::OsStr::from_bytes(name.to_bytes()))
    });
    Some(DlInfo {
        base: info.dli_fbase as usize,
        path,
    })
}

/// The directory of this library, made absolute against the working directory at load time.
fn own_dir() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let path = dl_info(own_dir as *const () as usize)?.path?;
        let path = std::fs::canonicalize(&path).unwrap_or(path);
        path.parent().map(Path::to_path_buf)
    })
    .as_deref()
}

/// Runs when the loader maps this library: records its directory while the working directory is
/// still the one `LD_PRELOAD`'s relative paths were resolved against. Nothing else happens at
/// load time (no CUDA, no slotpool: a process that never allocates pays nothing).
extern "C" fn on_load() {
    let _ = std::panic::catch_unwind(own_dir);
}

/// The load hook, as an entry of this library's `.init_array`.
#[used]
#[unsafe(link_section = ".init_array")]
static ON_LOAD: extern "C" fn() = on_load;

// ------------------------------------------------------------------------------------------------
// The functions of libslotpool.so that are used

type SpVersion = unsafe extern "C" fn(*mut c_int, *mut c_int, *mut c_int) -> c_int;
type SpIsInitialized = unsafe extern "C" fn(*mut c_int) -> c_int;
type SpInit = unsafe extern "C" fn(*const c_char, *const c_char) -> c_int;
type SpBackendName = unsafe extern "C" fn(*mut *const c_char) -> c_int;
type SpLastErrorMessage = unsafe extern "C" fn() -> *const c_char;
type SpAlloc = unsafe extern "C" fn(c_int, usize, u64, *mut *mut c_void) -> c_int;
type SpFree = unsafe extern "C" fn(*mut c_void) -> c_int;
type SpRecordStream = unsafe extern "C" fn(*mut c_void, u64) -> c_int;
type SpSnapshotTake = unsafe extern "C" fn(c_int, c_int, *mut *mut c_void) -> c_int;
type SpSnapshotFree = unsafe extern "C" fn(*mut c_void) -> c_int;
type SpSnapshotSegmentCount = unsafe extern "C" fn(*const c_void) -> usize;
type SpSnapshotSegment = unsafe extern "C" fn(*const c_void, usize, *mut sp_segment_view) -> c_int;
type SpMemoryPeaks = unsafe extern "C" fn(c_int, *mut u64, *mut u64) -> c_int;
type SpEnablePeerAccess = unsafe extern "C" fn(c_int, c_int) -> c_int;
type SpSimWrite = unsafe extern "C" fn(c_int, *mut c_void, *const c_void, usize) -> c_int;
type SpSimRead = unsafe extern "C" fn(c_int, *const c_void, *mut c_void, usize) -> c_int;
type SpAllocationInfo = unsafe extern "C" fn(
    *mut c_void,
    *mut *mut c_void,
    *mut usize,
    *mut usize,
    *mut c_int,
) -> c_int;

/// slotpool, ready to serve.
#[derive(Debug)]
pub struct Slotpool {
    /// `"cuda"` or `"sim"`.
    pub backend: String,
    /// True for the simulated backend (its devices need no CUDA context).
    pub sim: bool,
    /// Where `libslotpool.so` was found.
    pub path: String,
    /// `SLOTPOOL_LOG` is set: keep live and peak bytes for the exit line.
    log: bool,
    /// `SLOTPOOL_PRELOAD_SYNC_FREE=1`.
    pub sync_free: bool,
    alloc: SpAlloc,
    free: SpFree,
    record_stream: SpRecordStream,
    allocation_info: SpAllocationInfo,
    /// `sp_snapshot_take`, `_segment_count`, `_segment` and `_free`: the typed snapshot.
    snapshot: (
        SpSnapshotTake,
        SpSnapshotSegmentCount,
        SpSnapshotSegment,
        SpSnapshotFree,
    ),
    memory_peaks: SpMemoryPeaks,
    /// Absent from a `libslotpool.so` older than this library: peer grants then stop at CUDA.
    enable_peer_access: Option<SpEnablePeerAccess>,
    /// `sp_sim_write` and `sp_sim_read`, on the simulated backend only (see [`crate::copies`]).
    sim_bytes: Option<(SpSimWrite, SpSimRead)>,
}

impl Slotpool {
    /// Copies `n` host bytes at `src` to simulated device memory at `dst` (`sp_sim_write`); the
    /// status, or `None` off the simulated backend.
    ///
    /// # Safety
    ///
    /// `src` must be valid for `n` reads; `dst` is checked by slotpool, never dereferenced.
    pub unsafe fn sim_write(
        &self,
        device: c_int,
        dst: usize,
        src: *const c_void,
        n: usize,
    ) -> Option<c_int> {
        // SAFETY: the caller's contract on `src`; sp_sim_write checks `dst`.
        self.sim_bytes
            .map(|(write, _)| unsafe { write(device, dst as *mut c_void, src, n) })
    }

    /// Copies `n` bytes of simulated device memory at `src` to host memory at `dst`
    /// (`sp_sim_read`); the status, or `None` off the simulated backend.
    ///
    /// # Safety
    ///
    /// `dst` must be valid for `n` writes; `src` is checked by slotpool, never dereferenced.
    pub unsafe fn sim_read(
        &self,
        device: c_int,
        src: usize,
        dst: *mut c_void,
        n: usize,
    ) -> Option<c_int> {
        // SAFETY: the caller's contract on `dst`; sp_sim_read checks `src`.
        self.sim_bytes
            .map(|(_, read)| unsafe { read(device, src as *const c_void, dst, n) })
    }

    /// Let device `peer` reach `device`'s vmm pages (`sp_enable_peer_access`); the status, or
    /// `None` when this `libslotpool.so` cannot.
    pub fn enable_peer_access(&self, device: c_int, peer: c_int) -> Option<c_int> {
        // SAFETY: sp_enable_peer_access takes any two ints and validates them.
        self.enable_peer_access.map(|f| unsafe { f(device, peer) })
    }

    /// Exact device-wide (allocated, reserved) peaks of `device`; `None` if slotpool refuses.
    pub fn peaks(&self, device: c_int) -> Option<(u64, u64)> {
        let (mut a, mut r) = (0u64, 0u64);
        // SAFETY: two valid out-pointers; any device index is accepted (an error if unknown).
        (unsafe { (self.memory_peaks)(device, &mut a, &mut r) } == SP_OK).then_some((a, r))
    }

    /// Allocates from slotpool. `Some(code)`: answered (`cudaSuccess` with `*out` set, or out of
    /// memory with `*out` NULL); `None`: pass the call through.
    ///
    /// # Safety
    ///
    /// `out` must be valid for a write of a pointer.
    #[inline]
    pub unsafe fn alloc(
        &self,
        device: c_int,
        size: usize,
        stream: u64,
        out: *mut *mut c_void,
    ) -> Option<c_int> {
        let mut p = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; sp_alloc takes any other argument values.
        let status = unsafe { (self.alloc)(device, size, stream, &mut p) };
        match alloc_outcome(status) {
            AllocOutcome::Served => {
                // SAFETY: the caller guarantees that `out` is writable.
                unsafe { out.write(p) };
                report::served_alloc(self.log.then_some(size));
                Some(crate::codes::CUDA_SUCCESS)
            }
            AllocOutcome::OutOfMemory => {
                // SAFETY: as above.
                unsafe { out.write(std::ptr::null_mut()) };
                report::out_of_memory();
                Some(crate::codes::CUDA_ERROR_OUT_OF_MEMORY)
            }
            AllocOutcome::PassThrough => None,
        }
    }

    /// Frees the allocation at address `ptr` if slotpool owns it. `Some(cudaSuccess)`: done;
    /// `None`: not slotpool's, pass the call through.
    #[inline]
    pub fn free(&self, ptr: usize) -> Option<c_int> {
        let bytes = if self.log {
            self.requested_size(ptr)
        } else {
            None
        };
        // SAFETY: sp_free accepts any value and never dereferences it.
        let status = unsafe { (self.free)(ptr as *mut c_void) };
        match free_outcome(status) {
            FreeOutcome::Freed => {
                report::served_free(bytes);
                Some(crate::codes::CUDA_SUCCESS)
            }
            FreeOutcome::AcceptedAfterShutdown => Some(crate::codes::CUDA_SUCCESS),
            FreeOutcome::PassThrough => None,
        }
    }

    /// Frees `ptr` in the order of `stream` (`cudaFreeAsync`): the memory is reused on another
    /// stream than its own only after the work queued on `stream` so far. As [`Slotpool::free`].
    #[inline]
    pub fn free_on_stream(&self, ptr: usize, stream: u64) -> Option<c_int> {
        // SAFETY: sp_record_stream accepts any value and never dereferences it.
        let status = unsafe { (self.record_stream)(ptr as *mut c_void, stream) };
        match free_outcome(status) {
            FreeOutcome::Freed => self.free(ptr),
            FreeOutcome::AcceptedAfterShutdown => Some(crate::codes::CUDA_SUCCESS),
            FreeOutcome::PassThrough => None,
        }
    }

    /// True if a free of `ptr` that slotpool refused (not a live allocation of its own) must not
    /// reach the real library either, because `ptr` is the start of memory slotpool holds: a
    /// double free of a block at the base of a classic segment would otherwise make the real
    /// `cudaFree` release the whole segment under slotpool's feet.
    ///
    /// Only a pointer that starts a driver allocation is at risk (the real free rejects any other
    /// pointer, and slotpool's vmm memory), so the driver is asked first; only then is slotpool's
    /// snapshot searched for the address. The simulated backend holds no driver memory.
    pub fn holds_segment_start(&self, ptr: usize) -> bool {
        if self.sim {
            return false;
        }
        if let Some(get) = crate::real::cu_pointer_get_attribute() {
            let mut start: crate::real::DevicePtr = 0;
            // SAFETY: `start` is a valid out-pointer for this attribute's CUdeviceptr; the driver
            // checks `ptr` and never dereferences it on the host.
            let status = unsafe {
                get(
                    (&raw mut start).cast(),
                    crate::real::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                    ptr as crate::real::DevicePtr,
                )
            };
            if status != crate::codes::CUDA_SUCCESS || start != ptr as crate::real::DevicePtr {
                return false;
            }
        }
        let (take, count, segment, free) = self.snapshot;
        let mut snap: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; -1 is every device, 0 no history.
        if unsafe { take(-1, 0, &mut snap) } != SP_OK || snap.is_null() {
            return false;
        }
        // SAFETY: `snap` is the live snapshot just taken.
        let n = unsafe { count(snap) };
        let found = (0..n).any(|i| {
            let mut view = sp_segment_view::default();
            // SAFETY: `snap` is live, `i` below its count and `view` a valid out-pointer.
            let status = unsafe { segment(snap, i, &mut view) };
            status == SP_OK && view.address == ptr as u64
        });
        // SAFETY: the snapshot came from sp_snapshot_take and is freed once.
        unsafe { free(snap) };
        found
    }

    /// The size the live allocation at `ptr` asked for, if slotpool owns it.
    fn requested_size(&self, ptr: usize) -> Option<usize> {
        let (mut base, mut size, mut requested, mut device) = (std::ptr::null_mut(), 0, 0, 0);
        // SAFETY: four valid out-pointers; `ptr` is never dereferenced.
        let status = unsafe {
            (self.allocation_info)(
                ptr as *mut c_void,
                &mut base,
                &mut size,
                &mut requested,
                &mut device,
            )
        };
        (status == SP_OK).then_some(requested)
    }
}

// ------------------------------------------------------------------------------------------------
// Process-wide state

/// `None` until the first allocation call; then slotpool, or why every call passes through.
static STATE: OnceLock<Result<Slotpool, String>> = OnceLock::new();

thread_local! {
    /// Set on the thread that is starting slotpool: a CUDA call it makes meanwhile (from inside
    /// the driver, say) passes through instead of waiting for itself.
    static STARTING: Cell<bool> = const { Cell::new(false) };
}

/// The state if it was decided, without deciding it.
pub fn state() -> Option<&'static Result<Slotpool, String>> {
    STATE.get()
}

/// slotpool if it serves, without starting it (the free hooks: a pointer cannot be slotpool's
/// before the first allocation started it).
#[inline]
pub fn get() -> Option<&'static Slotpool> {
    STATE.get().and_then(|s| s.as_ref().ok())
}

/// slotpool if it serves, starting it on the first call.
#[inline]
pub fn get_or_start() -> Option<&'static Slotpool> {
    match STATE.get() {
        Some(s) => s.as_ref().ok(),
        None => start_once(),
    }
}

#[cold]
#[inline(never)]
fn start_once() -> Option<&'static Slotpool> {
    if STARTING.get() {
        return None;
    }
    STATE
        .get_or_init(|| {
            STARTING.set(true);
            let started = std::panic::catch_unwind(start)
                .unwrap_or_else(|_| Err("a panic while starting slotpool".to_owned()));
            STARTING.set(false);
            if let Err(why) = &started {
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "slotpool-preload: warning: slotpool is not serving this process; every CUDA \
                     allocation call passes through unchanged: {why}"
                );
            }
            started
        })
        .as_ref()
        .ok()
}

/// The last `dlerror()` message.
fn dlerror() -> String {
    // SAFETY: dlerror takes no argument; it returns NULL or a NUL-terminated string valid until
    // the next dl call on this thread, copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: as above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// `dlopen(name, flags)`: the handle, or dlerror's message.
fn dlopen(name: &CStr, flags: c_int) -> Result<*mut c_void, String> {
    // SAFETY: `name` is NUL-terminated. Opening libslotpool.so runs no code of ours.
    let h = unsafe { libc::dlopen(name.as_ptr(), flags) };
    if h.is_null() { Err(dlerror()) } else { Ok(h) }
}

/// Opens libslotpool.so (see the module documentation): the handle and the path it came from.
fn open_library() -> Result<(*mut c_void, String), String> {
    use std::os::unix::ffi::OsStrExt;
    let flags = libc::RTLD_NOW | libc::RTLD_GLOBAL;
    if let Some(path) = std::env::var_os(ENV_LIBRARY).filter(|p| !p.is_empty()) {
        let c = CString::new(path.as_bytes()).map_err(|_| format!("{ENV_LIBRARY} has a NUL"))?;
        return dlopen(&c, flags)
            .map(|h| (h, path.to_string_lossy().into_owned()))
            .map_err(|e| format!("{ENV_LIBRARY}={}: {e}", path.to_string_lossy()));
    }
    if let Ok(h) = dlopen(SONAME, flags | libc::RTLD_NOLOAD) {
        let path = loaded_path(h).unwrap_or_else(|| "libslotpool.so (already loaded)".into());
        return Ok((h, path));
    }
    let mut tried = Vec::new();
    if let Some(dir) = own_dir() {
        match FILE_NAMES
            .map(|n| dir.join(n))
            .into_iter()
            .find(|p| p.exists())
        {
            Some(path) => {
                let c = CString::new(path.as_os_str().as_bytes())
                    .map_err(|_| "the library's path has a NUL".to_owned())?;
                match dlopen(&c, flags) {
                    Ok(h) => return Ok((h, path.display().to_string())),
                    Err(e) => tried.push(e),
                }
            }
            None => tried.push(format!(
                "neither {} exists in {}",
                FILE_NAMES.join(" nor "),
                dir.display()
            )),
        }
    }
    match dlopen(SONAME, flags) {
        Ok(h) => Ok((
            h,
            loaded_path(h).unwrap_or_else(|| "libslotpool.so.0".into()),
        )),
        Err(e) => {
            tried.push(e);
            Err(format!(
                "libslotpool.so could not be loaded ({}); put it next to \
                 libslotpool_preload.so or set {ENV_LIBRARY}",
                tried.join("; ")
            ))
        }
    }
}

/// The file a dlopen handle refers to (for the log), via one of its symbols.
fn loaded_path(handle: *mut c_void) -> Option<String> {
    // SAFETY: `handle` is a live dlopen handle; the name is NUL-terminated.
    let sym = unsafe { libc::dlsym(handle, c"sp_version".as_ptr()) };
    if sym.is_null() {
        return None;
    }
    dl_info(sym as usize)?.path.map(|p| p.display().to_string())
}

/// Looks up `name` in `handle` as a function of type `F`.
///
/// # Safety
///
/// `handle` must be a live dlopen handle, and `F` must be the `unsafe extern "C" fn` type of the
/// C function `name` (as declared in include/slotpool.h).
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &CStr) -> Result<F, String> {
    const { assert!(size_of::<F>() == size_of::<*mut c_void>()) };
    // SAFETY: `handle` is live and `name` NUL-terminated (caller's contract).
    let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if p.is_null() {
        return Err(format!(
            "libslotpool.so has no {} (an older library?)",
            name.to_string_lossy()
        ));
    }
    // SAFETY: `F` is a function pointer type of the same size (asserted above) matching the
    // symbol's C prototype (caller's contract); data and function pointers share one
    // representation on the platforms this library is built for.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
}

/// sp_last_error_message() as a String.
fn last_error(f: SpLastErrorMessage) -> String {
    // SAFETY: takes no argument; returns a NUL-terminated string (never NULL per the header),
    // valid until the next sp_* call on this thread; copied at once.
    let p = unsafe { f() };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Opens and initialises slotpool.
fn start() -> Result<Slotpool, String> {
    let (h, path) = open_library()?;
    // SAFETY: `h` is a live handle and the type is the prototype in include/slotpool.h (as for
    // every `symbol` call below).
    let version: SpVersion = unsafe { symbol(h, c"sp_version") }?;
    let (mut major, mut minor, mut patch) = (0, 0, 0);
    // SAFETY: three valid out-pointers.
    let status = unsafe { version(&mut major, &mut minor, &mut patch) };
    let want = (
        env!("CARGO_PKG_VERSION_MAJOR")
            .parse::<c_int>()
            .unwrap_or(-1),
        env!("CARGO_PKG_VERSION_MINOR")
            .parse::<c_int>()
            .unwrap_or(-1),
    );
    if status != SP_OK || (major, minor) != want {
        return Err(format!(
            "{path} is version {major}.{minor}.{patch}, this library needs {}.{}.x",
            want.0, want.1
        ));
    }
    // SAFETY: see above.
    let (is_initialized, init, backend_name, last_error_message): (
        SpIsInitialized,
        SpInit,
        SpBackendName,
        SpLastErrorMessage,
    ) = unsafe {
        (
            symbol(h, c"sp_is_initialized")?,
            symbol(h, c"sp_init")?,
            symbol(h, c"sp_backend_name")?,
            symbol(h, c"sp_last_error_message")?,
        )
    };
    let mut initialized = 0;
    // SAFETY: a valid out-pointer.
    if unsafe { is_initialized(&mut initialized) } != SP_OK {
        return Err(format!(
            "sp_is_initialized failed: {}",
            last_error(last_error_message)
        ));
    }
    if initialized == 0 {
        let asked = std::env::var(ENV_BACKEND)
            .ok()
            .map(|b| b.trim().to_owned())
            .filter(|b| !b.is_empty());
        // No SLOTPOOL_BACKEND: the real device, never the simulated one by default.
        let backend = CString::new(asked.as_deref().unwrap_or("cuda"))
            .map_err(|_| format!("{ENV_BACKEND} has a NUL"))?;
        // SAFETY: a NUL-terminated backend name; NULL conf (SLOTPOOL_CONF applies).
        let status = unsafe { init(backend.as_ptr(), std::ptr::null()) };
        // INVALID_STATE: another front end initialised it meanwhile; use that.
        if status != SP_OK && status != SP_ERR_INVALID_STATE {
            return Err(format!(
                "sp_init(\"{}\") failed (status {status}): {}",
                backend.to_string_lossy(),
                last_error(last_error_message)
            ));
        }
    }
    let mut name: *const c_char = std::ptr::null();
    // SAFETY: a valid out-pointer.
    if unsafe { backend_name(&mut name) } != SP_OK || name.is_null() {
        return Err(format!(
            "sp_backend_name failed: {}",
            last_error(last_error_message)
        ));
    }
    // SAFETY: a static NUL-terminated string of libslotpool.so.
    let backend = unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see above.
    let (alloc, free, record_stream, allocation_info, snapshot, memory_peaks) = unsafe {
        (
            symbol(h, c"sp_alloc")?,
            symbol(h, c"sp_free")?,
            symbol(h, c"sp_record_stream")?,
            symbol(h, c"sp_allocation_info")?,
            (
                symbol(h, c"sp_snapshot_take")?,
                symbol(h, c"sp_snapshot_segment_count")?,
                symbol(h, c"sp_snapshot_segment")?,
                symbol(h, c"sp_snapshot_free")?,
            ),
            symbol(h, c"sp_memory_peaks")?,
        )
    };
    let sim = backend == "sim";
    Ok(Slotpool {
        sim,
        backend,
        path,
        log: report::log_enabled(),
        sync_free: std::env::var(ENV_SYNC_FREE).is_ok_and(|v| v.trim() == "1"),
        alloc,
        free,
        record_stream,
        allocation_info,
        snapshot,
        memory_peaks,
        // SAFETY: see above.
        enable_peer_access: unsafe { symbol(h, c"sp_enable_peer_access") }.ok(),
        sim_bytes: if sim {
            // SAFETY: see above.
            unsafe { Some((symbol(h, c"sp_sim_write")?, symbol(h, c"sp_sim_read")?)) }
        } else {
            None
        },
    })
}
