//! The process-wide state behind the C ABI: which backend, how many devices, one
//! [`Allocator`] per device (created on first use), initialisation from arguments or from the
//! environment, and shutdown.
//!
//! The state is a `static` [`OnceLock`] that is set once and never dropped, plus a shutdown flag:
//! a call that read the state keeps using it safely even if `sp_shutdown` runs meanwhile, and the
//! hot path reads one `OnceLock` and one atomic flag (no lock, no reference count).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Once, OnceLock, PoisonError};

use slotpool_core::{
    AllocError, AllocResult, Allocator, CaptureStatus, Config, Device, DevicePtr, DeviceResult,
    EventHandle, GrowthMode, HostBuffer, PageHandle, StreamId, TraceEntry, TraceSink,
};
use slotpool_cuda::CudaDevice;
use slotpool_sim::{Backing, SimConfig, SimDevice};

use crate::error::{Error, Result};
use crate::types::sp_trace_event;

/// Environment variable naming the backend for lazy initialisation (`cuda`, `sim`, `auto`).
pub const ENV_BACKEND: &str = "SLOTPOOL_BACKEND";
/// Environment variable with the configuration string (merged under `sp_init`'s `conf`).
pub const ENV_CONF: &str = "SLOTPOOL_CONF";
/// Environment variable that turns logging on (a `tracing` filter such as `info` or
/// `slotpool=debug`).
pub const ENV_LOG: &str = "SLOTPOOL_LOG";

/// Most simulated devices (`sim_devices`).
const MAX_SIM_DEVICES: usize = 64;
/// Simulated device `i` has its addresses moved up by `i << SIM_ADDRESS_SHIFT`, so that pointers
/// of different simulated devices never coincide (CUDA's unified addressing gives the same
/// guarantee on real devices).
const SIM_ADDRESS_SHIFT: u32 = 56;
const MIB: u64 = 1 << 20;

// ------------------------------------------------------------------------------------------------
// The simulated device, with per-device address offsets

/// A [`SimDevice`] whose addresses are shifted by a per-device offset.
#[derive(Debug)]
pub struct SimDev {
    pub inner: SimDevice,
    offset: u64,
}

impl SimDev {
    /// [`SimDevice::page_peers`] at one of this device's (shifted) addresses.
    pub fn page_peers(&self, ptr: DevicePtr) -> Option<Vec<i32>> {
        self.inner.page_peers(ptr.wrapping_sub(self.offset))
    }

    /// The address in [`SimDev::inner`]'s own space of one of this device's addresses.
    pub fn local(&self, ptr: DevicePtr) -> DevicePtr {
        ptr.wrapping_sub(self.offset)
    }
}

impl Device for SimDev {
    fn page_size(&self) -> u64 {
        self.inner.page_size()
    }
    fn total_memory(&self) -> u64 {
        self.inner.total_memory()
    }
    fn free_memory(&self) -> u64 {
        self.inner.free_memory()
    }
    fn alloc_segment(&self, size: u64) -> DeviceResult<DevicePtr> {
        Ok(self.inner.alloc_segment(size)? + self.offset)
    }
    fn free_segment(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner.free_segment(ptr.wrapping_sub(self.offset), size)
    }
    fn reserve(&self, size: u64) -> DeviceResult<DevicePtr> {
        Ok(self.inner.reserve(size)? + self.offset)
    }
    fn release_reservation(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner
            .release_reservation(ptr.wrapping_sub(self.offset), size)
    }
    fn create_page(&self) -> DeviceResult<PageHandle> {
        self.inner.create_page()
    }
    fn release_page(&self, page: PageHandle) -> DeviceResult<()> {
        self.inner.release_page(page)
    }
    fn map(&self, ptr: DevicePtr, page: PageHandle) -> DeviceResult<()> {
        self.inner.map(ptr.wrapping_sub(self.offset), page)
    }
    fn map_run(&self, ptr: DevicePtr, pages: &[PageHandle]) -> DeviceResult<()> {
        self.inner.map_run(ptr.wrapping_sub(self.offset), pages)
    }
    fn unmap(&self, ptr: DevicePtr) -> DeviceResult<()> {
        self.inner.unmap(ptr.wrapping_sub(self.offset))
    }
    fn create_event(&self) -> DeviceResult<EventHandle> {
        self.inner.create_event()
    }
    fn destroy_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.inner.destroy_event(event)
    }
    fn record_event(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        self.inner.record_event(event, stream)
    }
    fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: EventHandle) -> DeviceResult<()> {
        self.inner.synchronize_event(event)
    }
    fn synchronize(&self) -> DeviceResult<()> {
        self.inner.synchronize()
    }
    fn stream_wait_event(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        self.inner.stream_wait_event(stream, event)
    }
    fn capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        self.inner.capture_status(stream)
    }
    fn add_peer(&self, peer: i32) -> DeviceResult<()> {
        self.inner.add_peer(peer)
    }
    fn refresh_access(&self, ptr: DevicePtr, size: u64) -> DeviceResult<()> {
        self.inner
            .refresh_access(ptr.wrapping_sub(self.offset), size)
    }
    fn alloc_host(&self, size: u64) -> DeviceResult<HostBuffer> {
        self.inner.alloc_host(size)
    }
    fn free_host(&self, buf: HostBuffer) -> DeviceResult<()> {
        self.inner.free_host(buf)
    }
    fn copy_to_host(
        &self,
        dst: HostBuffer,
        offset: u64,
        src: DevicePtr,
        size: u64,
    ) -> DeviceResult<()> {
        self.inner
            .copy_to_host(dst, offset, src.wrapping_sub(self.offset), size)
    }
    fn copy_from_host(
        &self,
        dst: DevicePtr,
        src: HostBuffer,
        offset: u64,
        size: u64,
    ) -> DeviceResult<()> {
        self.inner
            .copy_from_host(dst.wrapping_sub(self.offset), src, offset, size)
    }
}

// ------------------------------------------------------------------------------------------------
// One device's allocator, over either backend

/// One device's allocator. An enum rather than a trait object: every call is a `match` on two
/// arms, and [`each!`](crate::each) writes the arms.
#[derive(Debug)]
pub enum DevAlloc {
    Sim(Allocator<SimDev>),
    Cuda(Allocator<CudaDevice>),
}

/// Runs `$body` with `$a` bound to the device's `Allocator`, whichever backend it has.
macro_rules! each {
    ($dev:expr, $a:ident => $body:expr) => {
        match $dev {
            $crate::runtime::DevAlloc::Sim($a) => $body,
            $crate::runtime::DevAlloc::Cuda($a) => $body,
        }
    };
}
pub(crate) use each;

impl DevAlloc {
    /// Total memory of the device in bytes.
    pub fn total_memory(&self) -> u64 {
        each!(self, a => a.device().total_memory())
    }
}

// ------------------------------------------------------------------------------------------------
// Backends and configuration

/// Which backend the process uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Sim,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Sim => "sim",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// Options of the simulated backend (`sim_*` keys of the configuration string).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimOptions {
    /// Memory of each simulated device.
    pub memory: u64,
    /// Number of simulated devices.
    pub devices: usize,
    /// Streams complete the moment work is queued (a C caller cannot complete them otherwise).
    pub auto_complete: bool,
    /// Device memory holds host-backed bytes (`sim_bytes:1`), which `sp_sim_write` and friends
    /// access; else only its accounts are kept.
    pub bytes: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            memory: SimConfig::default().total_memory,
            devices: 1,
            auto_complete: true,
            bytes: false,
        }
    }
}

/// The keys of [`SimOptions`].
pub const SIM_KEYS: &[&str] = &[
    "sim_memory_mb",
    "sim_devices",
    "sim_auto_complete",
    "sim_bytes",
];

/// A `0|1` configuration value.
fn flag(value: &str) -> Option<bool> {
    match value {
        "1" | "true" | "True" => Some(true),
        "0" | "false" | "False" => Some(false),
        _ => None,
    }
}

impl SimOptions {
    fn set(&mut self, key: &str, value: &str) -> Result<()> {
        let bad = |what: &str| Error::Config(format!("{key}: {what} (got {value:?})"));
        match key {
            "sim_memory_mb" => {
                let mb: u64 = value
                    .parse()
                    .map_err(|_| bad("expected a whole number of MiB"))?;
                self.memory = mb
                    .checked_mul(MIB)
                    .filter(|&b| b > 0 && b <= 1 << 56)
                    .ok_or_else(|| bad("must be between 1 and 2^36"))?;
            }
            "sim_devices" => {
                let n: usize = value.parse().map_err(|_| bad("expected a number"))?;
                if !(1..=MAX_SIM_DEVICES).contains(&n) {
                    return Err(bad(&format!("must be between 1 and {MAX_SIM_DEVICES}")));
                }
                self.devices = n;
            }
            "sim_auto_complete" => {
                self.auto_complete = flag(value).ok_or_else(|| bad("expected 0 or 1"))?;
            }
            "sim_bytes" => self.bytes = flag(value).ok_or_else(|| bad("expected 0 or 1"))?,
            _ => {
                return Err(Error::Config(format!(
                    "invalid slotpool configuration: unknown key {key:?}; known sim keys: {}",
                    SIM_KEYS.join(", ")
                )));
            }
        }
        Ok(())
    }
}

/// Splits a configuration string into its `sim_*` pairs and the rest (for [`Config::apply`]).
/// Commas inside `[...]` do not split.
pub fn split_conf(s: &str) -> (Vec<(String, String)>, String) {
    let mut parts = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, ch) in s.char_indices() {
        match ch {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    let mut sim = Vec::new();
    let mut rest = Vec::new();
    for part in parts {
        let part = part.trim();
        if part.is_empty() {
            continue;
        }
        match part.split_once(':') {
            Some((k, v)) if k.trim().starts_with("sim_") => {
                sim.push((k.trim().to_string(), v.trim().to_string()));
            }
            _ => rest.push(part),
        }
    }
    (sim, rest.join(","))
}

/// The core's defaults ([`Config::default`], the one set every program and the replay start
/// from), with `SLOTPOOL_CONF` applied over them and `conf` over both (so `conf` wins), and the
/// sim options of both. Nothing is applied unless everything parses.
pub fn parse_conf(env_conf: &str, conf: &str) -> Result<(Config, SimOptions)> {
    let mut sim = SimOptions::default();
    let mut config = Config::default();
    for (source, text) in [(ENV_CONF, env_conf), ("conf", conf)] {
        let (sim_pairs, rest) = split_conf(text);
        for (k, v) in sim_pairs {
            sim.set(&k, &v)
                .map_err(|e| Error::Config(format!("{source}: {e}")))?;
        }
        config
            .apply(&rest)
            .map_err(|e| Error::Config(format!("{source}: {e}")))?;
    }
    Ok((config, sim))
}

// ------------------------------------------------------------------------------------------------
// The runtime

/// Everything the C ABI serves from, once initialised.
#[derive(Debug)]
pub struct Runtime {
    pub kind: BackendKind,
    pub config: Config,
    pub sim: SimOptions,
    slots: Box<[OnceLock<DevAlloc>]>,
    /// Serialises the creation of device allocators; holds what an allocator created later
    /// must start with.
    create: Mutex<Pending>,
    /// The device opened while probing for CUDA, handed to device 0's allocator.
    cuda0: Mutex<Option<CudaDevice>>,
}

/// Settings made for devices whose allocators do not exist yet.
#[derive(Debug, Default)]
struct Pending {
    /// The history ring size `sp_record_history(-1, n)` set (0: not recording).
    history: usize,
    /// (device, peer) pairs of `sp_enable_peer_access`.
    peers: Vec<(usize, i32)>,
    /// The callback of `sp_set_trace_callback`, given to every allocator.
    trace: Option<TraceCallback>,
}

/// A C function that receives every allocator event (`sp_set_trace_callback`).
#[derive(Clone, Copy, Debug)]
pub struct TraceCallback {
    pub callback: unsafe extern "C" fn(*const sp_trace_event, *mut c_void),
    /// The caller's `user_data`, kept as an address: slotpool never dereferences it.
    pub user_data: usize,
}

impl TraceCallback {
    /// The core's sink for device `device`: one C call per entry.
    fn sink(self, device: usize) -> TraceSink {
        Arc::new(move |e: &TraceEntry| {
            let event = sp_trace_event::new(device as c_int, e);
            // SAFETY: `sp_set_trace_callback`'s contract: the function may be called from any
            // thread, with an event valid for the call and the caller's `user_data`, until it
            // is replaced; it does not unwind and does not call slotpool.
            unsafe { (self.callback)(&event, self.user_data as *mut c_void) }
        })
    }
}

thread_local! {
    /// The device of this thread's last successful pointer lookup: tried first by `sp_free`.
    static HINT: Cell<usize> = const { Cell::new(0) };
}

/// This thread's [`HINT`]. Not inlined: in a shared library every thread-local costs a
/// `__tls_get_addr` call, which the compiler hoisted above the one-device test when inlined.
#[inline(never)]
fn hint() -> usize {
    HINT.try_with(Cell::get).unwrap_or(0)
}

impl Runtime {
    fn new(kind: BackendKind, config: Config, sim: SimOptions) -> Result<Runtime> {
        let (count, cuda0) = match kind {
            BackendKind::Sim => (sim.devices, None),
            BackendKind::Cuda => {
                let d0 = CudaDevice::new(0)?;
                (cuda_device_count()?, Some(d0))
            }
        };
        Ok(Runtime {
            kind,
            config,
            sim,
            slots: (0..count).map(|_| OnceLock::new()).collect(),
            create: Mutex::new(Pending::default()),
            cuda0: Mutex::new(cuda0),
        })
    }

    /// Number of devices.
    pub fn device_count(&self) -> usize {
        self.slots.len()
    }

    fn index(&self, device: c_int) -> Result<usize> {
        usize::try_from(device)
            .ok()
            .filter(|&i| i < self.slots.len())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "device {device}: the {} backend has {} device(s), 0..{}",
                    self.kind.name(),
                    self.slots.len(),
                    self.slots.len()
                ))
            })
    }

    /// The allocator of `device`, created on first use.
    #[inline]
    pub fn device(&self, device: c_int) -> Result<&DevAlloc> {
        let i = self.index(device)?;
        match self.slots[i].get() {
            Some(d) => Ok(d),
            None => self.create_device(i),
        }
    }

    /// The allocator of `device` if it was created; an unknown device is an error.
    pub fn existing(&self, device: c_int) -> Result<Option<&DevAlloc>> {
        let i = self.index(device)?;
        Ok(self.slots[i].get())
    }

    /// Every created allocator with its device index.
    pub fn created(&self) -> impl Iterator<Item = (usize, &DevAlloc)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.get().map(|d| (i, d)))
    }

    /// Record the history of every device, present and future, into rings of `max_entries`
    /// (0 stops recording).
    pub fn record_history_all(&self, max_entries: usize) {
        let mut pending = self.create.lock().unwrap_or_else(PoisonError::into_inner);
        pending.history = max_entries;
        for (_, d) in self.created() {
            each!(d, a => a.record_history(max_entries));
        }
    }

    /// Hand every allocator event of every device, present and future, to `callback` (`None`:
    /// stop).
    pub fn set_trace_callback(&self, callback: Option<TraceCallback>) {
        let mut pending = self.create.lock().unwrap_or_else(PoisonError::into_inner);
        pending.trace = callback;
        for (i, d) in self.created() {
            each!(d, a => a.set_trace_sink(callback.map(|c| c.sink(i))));
        }
    }

    /// Give device `peer` access to `device`'s memory (see `sp_enable_peer_access`); remembered
    /// for an allocator not created yet, without creating it.
    pub fn enable_peer_access(&self, device: c_int, peer: c_int) -> Result<()> {
        let i = self.index(device)?;
        let p = self.index(peer)?;
        if i == p {
            return Ok(());
        }
        let mut pending = self.create.lock().unwrap_or_else(PoisonError::into_inner);
        match self.slots[i].get() {
            Some(d) => each!(d, a => a.enable_peer_access(peer))?,
            None => {
                if !pending.peers.contains(&(i, peer)) {
                    pending.peers.push((i, peer));
                }
            }
        }
        Ok(())
    }

    #[cold]
    fn create_device(&self, i: usize) -> Result<&DevAlloc> {
        let pending = self.create.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(d) = self.slots[i].get() {
            return Ok(d);
        }
        let alloc = match self.kind {
            BackendKind::Sim => {
                let dev = SimDevice::new(SimConfig {
                    total_memory: self.sim.memory,
                    backing: if self.sim.bytes {
                        Backing::Bytes
                    } else {
                        Backing::Accounting
                    },
                    auto_complete: self.sim.auto_complete,
                    page_size: (self.config.vmm_page_size)
                        .unwrap_or(SimConfig::default().page_size),
                })?;
                let dev = SimDev {
                    inner: dev,
                    offset: (i as u64) << SIM_ADDRESS_SHIFT,
                };
                DevAlloc::Sim(Allocator::new(Arc::new(dev), self.config.clone()))
            }
            BackendKind::Cuda => {
                let probed = if i == 0 {
                    self.cuda0
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .take()
                } else {
                    None
                };
                let mut dev = match probed {
                    Some(d) => d,
                    None => CudaDevice::new(i as i32)?,
                };
                if let Some(page) = self.config.vmm_page_size {
                    dev.set_page_size(page)?;
                }
                let mut config = self.config.clone();
                if config.growth == GrowthMode::Vmm && !dev.vmm_supported() {
                    tracing::warn!(
                        device = i,
                        "device has no virtual memory management; using classic growth"
                    );
                    config.growth = GrowthMode::Classic;
                }
                DevAlloc::Cuda(Allocator::new(Arc::new(dev), config))
            }
        };
        if pending.history > 0 {
            each!(&alloc, a => a.record_history(pending.history));
        }
        if let Some(c) = pending.trace {
            each!(&alloc, a => a.set_trace_sink(Some(c.sink(i))));
        }
        for &(_, peer) in pending.peers.iter().filter(|&&(d, _)| d == i) {
            // A grant made before the device was used was not checked then; refused now, it
            // must not cost the device its allocator.
            if let Err(e) = each!(&alloc, a => a.enable_peer_access(peer)) {
                tracing::warn!(device = i, peer, error = %e, "peer access refused");
            }
        }
        tracing::debug!(
            device = i,
            backend = self.kind.name(),
            "device allocator created"
        );
        Ok(self.slots[i].get_or_init(|| alloc))
    }

    /// Runs `f` on the allocator that owns `ptr`: the device of this thread's last lookup first,
    /// then the others. Only `UnknownPointer` moves on to the next device.
    #[inline]
    pub fn on_owner<T>(
        &self,
        ptr: DevicePtr,
        f: impl Fn(&DevAlloc) -> AllocResult<T>,
    ) -> Result<(usize, T)> {
        // One device (the common case): no thread-local hint to read.
        let hint = if self.slots.len() == 1 { 0 } else { hint() };
        if let Some(d) = self.slots.get(hint).and_then(OnceLock::get) {
            match f(d) {
                Ok(v) => return Ok((hint, v)),
                Err(AllocError::UnknownPointer(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.on_owner_slow(ptr, hint, f)
    }

    #[cold]
    fn on_owner_slow<T>(
        &self,
        ptr: DevicePtr,
        skip: usize,
        f: impl Fn(&DevAlloc) -> AllocResult<T>,
    ) -> Result<(usize, T)> {
        for (i, d) in self.created() {
            if i == skip {
                continue;
            }
            match f(d) {
                Ok(v) => {
                    let _ = HINT.try_with(|h| h.set(i));
                    return Ok((i, v));
                }
                Err(AllocError::UnknownPointer(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::UnknownPointer(ptr))
    }
}

/// Number of CUDA devices (`cuDeviceGetCount`); the driver is loaded and initialised by a
/// successful `CudaDevice::new` before this is called.
fn cuda_device_count() -> Result<usize> {
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-pointer for the duration of the call; the driver library was
    // loaded and `cuInit` succeeded (a `CudaDevice` exists). `guard` turns cudarc's panic on a
    // missing symbol into an error.
    let code = slotpool_cuda::guard(|| unsafe { cudarc::driver::sys::cuDeviceGetCount(&mut n) })?;
    slotpool_cuda::error::check("cuDeviceGetCount", code)?;
    Ok(usize::try_from(n).unwrap_or(0).max(1))
}

// ------------------------------------------------------------------------------------------------
// Global state

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
/// Serialises initialisation and shutdown.
static INIT: Mutex<()> = Mutex::new(());
static LOGGING: Once = Once::new();

/// The runtime, initialising it from the environment on first use.
#[inline]
pub fn runtime() -> Result<&'static Runtime> {
    if SHUTDOWN.load(Ordering::Acquire) {
        return Err(Error::Shutdown);
    }
    match RUNTIME.get() {
        Some(rt) => Ok(rt),
        None => lazy_init(),
    }
}

/// Whether the runtime is initialised (and not shut down); never initialises.
pub fn is_initialized() -> Result<bool> {
    if SHUTDOWN.load(Ordering::Acquire) {
        return Err(Error::Shutdown);
    }
    Ok(RUNTIME.get().is_some())
}

#[cold]
fn lazy_init() -> Result<&'static Runtime> {
    init(None, None, true).map_err(|e| match e {
        Error::Shutdown => Error::Shutdown,
        other => Error::NotInitialized(format!(
            "initialisation from the environment ({ENV_BACKEND}={:?}, {ENV_CONF}={:?}) failed: \
             {other}",
            std::env::var(ENV_BACKEND).unwrap_or_default(),
            std::env::var(ENV_CONF).unwrap_or_default(),
        )),
    })
}

/// Installs a stderr `tracing` subscriber once if `SLOTPOOL_LOG` is set; never otherwise.
fn install_logging() {
    LOGGING.call_once(|| {
        if let Ok(filter) = std::env::var(ENV_LOG) {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_writer(std::io::stderr)
                // Colours only on a terminal: a log piped to a file or a CI log stays plain text.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .try_init();
        }
    });
}

/// Initialises the runtime with `backend` (`None`: `SLOTPOOL_BACKEND`, else `auto`) and `conf`
/// merged over `SLOTPOOL_CONF`. With `lazy`, an existing runtime is returned; otherwise an
/// existing runtime is an error. On error nothing is initialised.
pub fn init(backend: Option<&str>, conf: Option<&str>, lazy: bool) -> Result<&'static Runtime> {
    let _guard = INIT.lock().unwrap_or_else(PoisonError::into_inner);
    if SHUTDOWN.load(Ordering::Acquire) {
        return Err(Error::Shutdown);
    }
    if lazy && let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    install_logging();
    // Arguments are checked first, so that a bad one is reported as such even when the library
    // is already initialised.
    let env_backend = std::env::var(ENV_BACKEND).ok();
    let backend = backend
        .or(env_backend.as_deref())
        .map(str::trim)
        .filter(|b| !b.is_empty())
        .unwrap_or("auto");
    if !matches!(backend, "sim" | "cuda" | "auto") {
        return Err(Error::InvalidArgument(format!(
            "backend {backend:?}: expected \"cuda\", \"sim\" or \"auto\""
        )));
    }
    let env_conf = std::env::var(ENV_CONF).unwrap_or_default();
    let (config, sim) = parse_conf(&env_conf, conf.unwrap_or(""))?;
    if let Some(rt) = RUNTIME.get() {
        return Err(Error::InvalidState(format!(
            "already initialised (backend {}, {} device(s)); sp_init must come before any other \
             call, which initialises from the environment",
            rt.kind.name(),
            rt.device_count()
        )));
    }
    let rt = match backend {
        "sim" => Runtime::new(BackendKind::Sim, config, sim)?,
        "cuda" => Runtime::new(BackendKind::Cuda, config, sim)?,
        _ => match Runtime::new(BackendKind::Cuda, config.clone(), sim) {
            Ok(rt) => rt,
            Err(e) => {
                tracing::info!(reason = %e, "no usable CUDA device; using the simulated backend");
                Runtime::new(BackendKind::Sim, config, sim)?
            }
        },
    };
    tracing::info!(
        backend = rt.kind.name(),
        devices = rt.device_count(),
        growth = ?rt.config.growth,
        "slotpool initialised"
    );
    Ok(RUNTIME.get_or_init(|| rt))
}

/// Shuts the library down: every later call fails with `Shutdown`. Cached memory of every device
/// is returned to the backend; live allocations stay where they are (the allocators are never
/// dropped, so calls already running finish safely).
pub fn shutdown() -> Result<()> {
    let _guard = INIT.lock().unwrap_or_else(PoisonError::into_inner);
    if SHUTDOWN.swap(true, Ordering::AcqRel) {
        return Err(Error::Shutdown);
    }
    if let Some(rt) = RUNTIME.get() {
        for (_, d) in rt.created() {
            each!(d, a => a.empty_cache());
        }
    }
    tracing::info!("slotpool shut down");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_is_split_and_merged() {
        let (sim, rest) =
            split_conf("sim_devices:2, growth:classic,roundup_power2_divisions:[256:1,>:4],");
        assert_eq!(sim, vec![("sim_devices".into(), "2".into())]);
        assert_eq!(rest, "growth:classic,roundup_power2_divisions:[256:1,>:4]");
        let (c, s) = parse_conf(
            "growth:classic,sim_devices:3,memory_limit_mb:10",
            "growth:vmm,sim_memory_mb:64",
        )
        .unwrap();
        assert_eq!(c.growth, GrowthMode::Vmm, "conf wins over the environment");
        assert_eq!(c.memory_limit, Some(10 * MIB));
        assert_eq!(s.devices, 3);
        assert_eq!(s.memory, 64 * MIB);
    }

    #[test]
    fn defaults_lie_beneath_the_environment_and_conf() {
        let (c, _) = parse_conf("", "").unwrap();
        assert_eq!(
            c,
            Config::default(),
            "programs start from the core's defaults"
        );
        let (c, _) = parse_conf("vmm_slack_percent:8", "").unwrap();
        assert_eq!(
            c.vmm_slack_percent, 8.0,
            "the environment wins over the defaults"
        );
        assert_eq!(
            c.vmm_page_size,
            Config::default().vmm_page_size,
            "and keeps the ones it does not name"
        );
        let (c, _) = parse_conf("vmm_page_mb:4", "vmm_page_mb:2").unwrap();
        assert_eq!(c.vmm_page_size, Some(2 * MIB));
    }

    #[test]
    fn bad_conf_names_the_key() {
        let e = parse_conf("", "growth:vmm,bogus:1").unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains("bogus")), "{e}");
        let e = parse_conf("sim_bogus:1", "").unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains("sim_bogus") && m.contains(ENV_CONF)));
        assert!(parse_conf("", "sim_devices:0").is_err());
        assert!(parse_conf("", "sim_devices:65").is_err());
        assert!(parse_conf("", "sim_memory_mb:x").is_err());
        assert!(parse_conf("", "sim_auto_complete:2").is_err());
        assert!(parse_conf("", "sim_bytes:yes").is_err());
        assert!(parse_conf("", "sim_bytes:1").unwrap().1.bytes);
        assert!(
            !parse_conf("", "").unwrap().1.bytes,
            "accounts only by default"
        );
    }

    #[test]
    fn sim_devices_have_disjoint_addresses() {
        let rt = Runtime::new(
            BackendKind::Sim,
            Config::default(),
            SimOptions {
                devices: 2,
                ..SimOptions::default()
            },
        )
        .unwrap();
        let p0 = each!(rt.device(0).unwrap(), a => a.alloc(1 << 20, 0)).unwrap();
        let p1 = each!(rt.device(1).unwrap(), a => a.alloc(1 << 20, 0)).unwrap();
        assert_ne!(p0 >> SIM_ADDRESS_SHIFT, p1 >> SIM_ADDRESS_SHIFT);
        assert_eq!(rt.on_owner(p1, |d| each!(d, a => a.free(p1))).unwrap().0, 1);
        assert_eq!(rt.on_owner(p0, |d| each!(d, a => a.free(p0))).unwrap().0, 0);
        assert!(matches!(
            rt.on_owner(p0, |d| each!(d, a => a.free(p0))),
            Err(Error::UnknownPointer(_))
        ));
        assert!(rt.device(2).is_err());
        assert!(rt.device(-1).is_err());
    }
}
