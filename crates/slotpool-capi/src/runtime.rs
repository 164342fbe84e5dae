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

use slotpool_abi::sp_trace_event;
use slotpool_core::{
    AllocError, AllocResult, Allocator, Config, Device, DevicePtr, GrowthMode, Layer, TraceEntry,
    TraceSink,
};
use slotpool_cuda::CudaDevice;
use slotpool_sim::{SimConfig, SimDevice, SimOptions};

use crate::convert::trace_event;
use crate::error::{Error, Result};

/// Environment variable naming the backend for lazy initialisation (`cuda`, `sim`, `auto`).
pub use slotpool_core::layers::ENV_BACKEND;
/// Environment variable with the configuration string (merged under `sp_init`'s `conf`).
pub use slotpool_core::layers::ENV_CONF;
/// Environment variable that turns logging on (a `tracing` filter such as `info` or
/// `slotpool=debug`).
pub use slotpool_core::layers::ENV_LOG;

// ------------------------------------------------------------------------------------------------
// One device's allocator, over either backend

/// One device's allocator. An enum rather than a trait object: every call is a `match` on two
/// arms, and [`each!`](crate::each) writes the arms.
#[derive(Debug)]
pub enum DevAlloc {
    Sim(Allocator<SimDevice>),
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

/// The configuration in effect and the simulated backend's options: the layers of
/// [`slotpool_core::layers`] (the core's defaults, then `SLOTPOOL_CONF`'s text `env_conf`, then
/// `conf`, so `conf` wins), the `sim_*` keys to slotpool-sim's [`SimOptions`]. Nothing is applied
/// unless everything parses.
pub fn parse_conf(env_conf: &str, conf: &str) -> Result<(Config, SimOptions)> {
    let mut sim = SimOptions::default();
    let layers = [
        Layer {
            source: ENV_CONF,
            text: env_conf,
        },
        Layer {
            source: "conf",
            text: conf,
        },
    ];
    let config = Config::layered(&layers, Some(&mut sim))?;
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
            let event = trace_event(device as c_int, e);
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
                let page = (self.config.vmm_page_size).unwrap_or(SimConfig::default().page_size);
                let dev = self.sim.device(i, page)?;
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

/// The runtime if it is initialised (an error after shutdown); never initialises.
pub fn current() -> Result<Option<&'static Runtime>> {
    if SHUTDOWN.load(Ordering::Acquire) {
        return Err(Error::Shutdown);
    }
    Ok(RUNTIME.get())
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
    let env_conf = slotpool_core::layers::env_conf().unwrap_or_default();
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
    fn conf_is_layered_over_the_environment() {
        let (c, s) = parse_conf(
            "growth:classic,sim_devices:3,memory_limit_mb:10",
            "growth:vmm,sim_memory_mb:64",
        )
        .unwrap();
        assert_eq!(c.growth, GrowthMode::Vmm, "conf wins over the environment");
        assert_eq!(c.memory_limit, Some(10 << 20));
        assert_eq!(s.devices, 3);
        assert_eq!(s.memory, 64 << 20);
        let (c, _) = parse_conf("", "").unwrap();
        assert_eq!(
            c,
            Config::default(),
            "programs start from the core's defaults"
        );
        let e = parse_conf("sim_bogus:1", "").unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains("sim_bogus") && m.contains(ENV_CONF)));
        let e = parse_conf("", "growth:vmm,bogus:1").unwrap_err();
        assert!(matches!(&e, Error::Config(m) if m.contains("bogus")), "{e}");
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
        assert_ne!(p0 >> 56, p1 >> 56);
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
