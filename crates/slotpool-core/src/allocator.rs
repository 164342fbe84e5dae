//! `Allocator`: one device's caching allocator, thread-safe.
//!
//! The state lives in [`Shard`]s, one per (pool, stream), each behind its own mutex, so that
//! different streams and pools never contend. A thread-local cache names the shard the thread
//! last allocated from: allocation uses it in place, and a free looks there first (each shard
//! maps its own live pointers). Other frees find their shard in a registry of segment ranges,
//! which changes only when segments come and go. Lock order is written down in [`crate::sync`].

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};

use rustc_hash::FxHashMap;

use crate::config::{Config, GrowthMode};
use crate::device::{CaptureStatus, Device, DevicePtr, PageHandle, StreamId};
use crate::env::{Budget, Env, EventPool, PagePool, Shared};
use crate::error::{AllocError, AllocResult, OomReport};
use crate::history::TraceSink;
use crate::pool::{PoolId, PoolOptions};
use crate::route::{Route, RouteFilter, current_thread_id};
use crate::shard::{Shard, ShardError};
use crate::stats::MemoryStats;
use crate::sync::lock;

/// The physical pages under one vmm allocation ([`Allocator::shared_pages`]): `pages` in address
/// order, each one physical allocation of `page_size` bytes, the allocation `offset` bytes into
/// the first. What another process maps, in order, to see the same memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPages {
    pub page_size: u64,
    pub pages: Vec<PageHandle>,
    pub offset: u64,
}

/// Largest request accepted (2^56 bytes); anything above is a caller bug, not an OOM.
pub const MAX_REQUEST: u64 = 1 << 56;

/// Requests above this size are also checked against the device's memory before they are served.
const LARGE_REQUEST: u64 = 1 << 30;

/// A shard and the budget of the pool it belongs to. Aligned to two cache lines (what x86's
/// adjacent-line prefetch pulls in together), so that shards allocated one after another share
/// no line.
#[derive(Debug)]
#[repr(align(128))]
pub(crate) struct ShardCell {
    pub shard: crate::sync::ShardMutex<Shard>,
    pub pool_budget: Arc<Budget>,
}

pub(crate) type ShardRef = Arc<ShardCell>;

/// One pool's registration.
#[derive(Debug)]
pub(crate) struct PoolEntry {
    pub name: Option<String>,
    pub use_count: u64,
    pub options: PoolOptions,
    pub budget: Arc<Budget>,
    /// Checkpoints of the pool taken so far (dead ones pruned at each new one): a shard born
    /// while one is alive keeps no quick cache (`Shard::quick_off`).
    pub checkpoints: Vec<Weak<crate::checkpoint::CheckpointToken>>,
    /// Set while the pool is paused (`pause.rs`): no shard of it is created meanwhile.
    pub paused: Option<crate::pause::PauseMode>,
}

static NEXT_ALLOCATOR_UID: AtomicU64 = AtomicU64::new(1);

struct CachedShard {
    allocator: u64,
    generation: u64,
    pool: PoolId,
    stream: StreamId,
    shard: ShardRef,
}

impl CachedShard {
    /// Whether this is the shard of (`pool`, `stream`) of allocator `allocator` at
    /// `generation` (no shard was forgotten since it was cached).
    #[inline(always)]
    fn serves(&self, allocator: u64, generation: u64, pool: PoolId, stream: StreamId) -> bool {
        self.allocator == allocator
            && self.generation == generation
            && self.pool == pool
            && self.stream == stream
    }
}

thread_local! {
    static LAST_SHARD: RefCell<Option<CachedShard>> = const { RefCell::new(None) };
}

/// One device's caching allocator. See the crate docs for the model.
pub struct Allocator<D: Device> {
    pub(crate) uid: u64,
    pub(crate) dev: Arc<D>,
    /// The same device, its calls counted: what the shards call ([`Allocator::backend_calls`]).
    pub(crate) counted: crate::counted::Counted,
    pub(crate) config: Config,
    /// What the shards of this device share (budget, page and event pools, the trace).
    pub(crate) shared: Shared,
    pub(crate) arenas: Mutex<FxHashMap<u64, crate::arena::Arena>>,
    pub(crate) next_arena: AtomicU64,
    pub(crate) pools: Mutex<FxHashMap<PoolId, PoolEntry>>,
    next_named_pool: AtomicU64,
    pub(crate) routes: Mutex<Vec<Route>>,
    routes_active: AtomicUsize,
    captures_active: AtomicUsize,
    pub(crate) shards: Mutex<ShardTable>,
    generation: AtomicU64,
    /// Every segment's address range and its shard, to find the shard of a pointer that the
    /// calling thread's cached shard does not own. Written only when segments come and go.
    pub(crate) segments: RwLock<BTreeMap<DevicePtr, (DevicePtr, Weak<ShardCell>)>>,
    /// Taken by the OOM and cache-emptying paths, which visit every shard one at a time.
    pub(crate) reclaim: Mutex<()>,
    num_alloc_retries: AtomicI64,
    num_ooms: AtomicI64,
}

impl<D: Device> std::fmt::Debug for Allocator<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Allocator")
            .field("uid", &self.uid)
            .field("growth", &self.config.growth)
            .field("held", &self.shared.budget.held())
            .finish_non_exhaustive()
    }
}

impl<D: Device> Allocator<D> {
    /// An allocator over `dev` with `config`.
    pub fn new(dev: Arc<D>, config: Config) -> Self {
        let total = dev.total_memory();
        let ps = dev.page_size().max(1);
        if config.vmm_page_size.is_some_and(|want| want != ps) {
            tracing::warn!(
                device_page = ps,
                configured = config.vmm_page_size,
                "vmm_page_mb applies where the device is built; this device keeps its page size"
            );
        }
        let limit = Self::limit_for(&config, total);
        let vmm_reservation = config.vmm_reservation.unwrap_or(total).max(ps).div_ceil(ps) * ps;
        let mut pools = FxHashMap::default();
        pools.insert(
            PoolId::DEFAULT,
            PoolEntry {
                name: Some("default".into()),
                use_count: 1,
                options: PoolOptions::default(),
                budget: Arc::new(Budget::new(u64::MAX)),
                checkpoints: Vec::new(),
                paused: None,
            },
        );
        Allocator {
            uid: NEXT_ALLOCATOR_UID.fetch_add(1, Ordering::Relaxed),
            shared: Shared {
                page_size: ps,
                policy: config.policy.clone(),
                growth: config.growth,
                budget: Budget::new(limit),
                allocated: Default::default(),
                pages: PagePool::default(),
                events: EventPool::default(),
                trace: Default::default(),
                vmm_reservation,
                vmm_slack_percent: config.vmm_slack_percent,
                vmm_slack_base: config.vmm_slack_base,
                gc_threshold: config.gc_threshold,
            },
            counted: crate::counted::Counted::new(dev.clone()),
            dev,
            config,
            arenas: Mutex::new(FxHashMap::default()),
            next_arena: AtomicU64::new(1),
            pools: Mutex::new(pools),
            next_named_pool: AtomicU64::new(1),
            routes: Mutex::new(Vec::new()),
            routes_active: AtomicUsize::new(0),
            captures_active: AtomicUsize::new(0),
            shards: Mutex::new(FxHashMap::default()),
            generation: AtomicU64::new(0),
            segments: RwLock::new(BTreeMap::new()),
            reclaim: Mutex::new(()),
            num_alloc_retries: AtomicI64::new(0),
            num_ooms: AtomicI64::new(0),
        }
    }

    fn limit_for(config: &Config, total: u64) -> u64 {
        let mut limit = config
            .memory_limit
            .and_then(crate::config::limit_from_bytes)
            .unwrap_or(total);
        if let Some(f) = config.memory_fraction {
            limit = limit.min((total as f64 * f) as u64);
        }
        limit
    }

    /// The backend.
    pub fn device(&self) -> &Arc<D> {
        &self.dev
    }

    /// The configuration this allocator was built with.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Cap physical memory at `fraction` of the device (`set_per_process_memory_fraction`).
    pub fn set_memory_fraction(&self, fraction: f64) -> AllocResult<()> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(AllocError::InvalidArgument(format!(
                "memory fraction {fraction} is not in (0, 1]"
            )));
        }
        self.shared
            .budget
            .set_limit((self.dev.total_memory() as f64 * fraction) as u64);
        Ok(())
    }

    /// Cap physical memory at `bytes`; 0 removes the cap (the device's total memory), as
    /// `memory_limit_mb:0` does ([`crate::config::limit_from_bytes`]).
    pub fn set_memory_limit(&self, bytes: u64) {
        let limit = crate::config::limit_from_bytes(bytes).unwrap_or(self.dev.total_memory());
        self.shared.budget.set_limit(limit);
    }

    /// The cap on physical memory in force.
    pub fn memory_limit(&self) -> u64 {
        self.shared.budget.limit()
    }

    /// Physical bytes held: segments, mapped pages and cached unmapped pages.
    pub fn held_bytes(&self) -> u64 {
        self.shared.budget.held()
    }

    /// The backend calls this allocator made so far, by kind (arenas' own calls aside).
    pub fn backend_calls(&self) -> crate::BackendCalls {
        self.counted.calls()
    }

    pub(crate) fn capture_underway(&self) -> bool {
        self.captures_active.load(Ordering::Acquire) > 0
    }

    pub(crate) fn env<'a>(&'a self, pool_budget: &'a Budget) -> Env<'a> {
        Env {
            dev: &self.counted,
            shared: &self.shared,
            pool_budget,
            capture_underway: self.capture_underway(),
        }
    }

    // ----------------------------------------------------------------------------------------
    // Allocation

    /// Allocate `size` bytes for use on `stream`. The pool is chosen by the active routes (the
    /// default pool when none match).
    pub fn alloc(&self, size: u64, stream: StreamId) -> AllocResult<DevicePtr> {
        if size == 0 || size > MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let pool = self.route_for(stream)?;
        self.alloc_in(pool, size, stream)
    }

    /// [`Allocator::alloc`] where it is a hit in the quick cache of the calling thread's cached
    /// shard, in the default pool with no route active; `None`, with nothing changed, where it
    /// would take any other path (call [`Allocator::alloc`] then). For the C ABI's hot path: the
    /// answer travels in registers, where an `AllocResult` goes through memory at every layer.
    #[inline]
    pub fn alloc_fast(&self, size: u64, stream: StreamId) -> Option<DevicePtr> {
        if size == 0 || size > MAX_REQUEST || self.routes_active.load(Ordering::Acquire) != 0 {
            return None;
        }
        let rounded = self.config.policy.round_size(size);
        // The quick cache holds small blocks only. As `alloc_in`, a request over the limit is
        // refused even where the cache could serve it.
        if !crate::policy::is_small(rounded) || rounded > self.shared.budget.limit() {
            return None;
        }
        let generation = self.generation.load(Ordering::Acquire);
        LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref()?;
                if !e.serves(self.uid, generation, PoolId::DEFAULT, stream) {
                    return None;
                }
                let env = self.env(&e.shard.pool_budget);
                lock(&e.shard.shard)
                    .alloc_quick(&env, rounded, size)
                    .map(|(_, addr)| addr)
            })
            .ok()
            .flatten()
    }

    /// Allocate from a given pool, bypassing routes.
    pub fn alloc_in(&self, pool: PoolId, size: u64, stream: StreamId) -> AllocResult<DevicePtr> {
        if size == 0 || size > MAX_REQUEST {
            return Err(AllocError::InvalidSize(size));
        }
        let rounded = self.config.policy.round_size(size);
        if rounded > self.shared.budget.limit()
            || (rounded > LARGE_REQUEST && rounded > self.dev.total_memory())
        {
            // Can never fit (over the limit, or over the device when a limit above it was set):
            // refuse before any bookkeeping is sized for it (a vmm request of 2^50 bytes would
            // cost gigabytes of page tables), and count it as PyTorch counts an OOM.
            self.num_ooms.fetch_add(1, Ordering::Relaxed);
            self.shared
                .trace
                .record(crate::history::TraceAction::Oom, 0, rounded, stream);
            return Err(AllocError::OutOfMemory(Box::new(
                self.oom_report(size, rounded),
            )));
        }
        // The thread's cached shard, used in place (no reference count traffic).
        let generation = self.generation.load(Ordering::Acquire);
        let fast = LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref()?;
                e.serves(self.uid, generation, pool, stream)
                    .then(|| self.alloc_on(&e.shard, rounded, size))
            })
            .ok()
            .flatten();
        let mut result = match fast {
            Some(r) => r,
            None => {
                let cell = self.shard_for(pool, stream)?;
                self.alloc_on(&cell, rounded, size)
            }
        };
        loop {
            match result {
                Ok(addr) => return Ok(addr),
                // The shard was forgotten between finding it and locking it: the table has
                // (or makes) its successor.
                Err(ShardError::Retired) => {
                    let cell = self.refresh_shard(pool, stream)?;
                    result = self.alloc_on(&cell, rounded, size);
                }
                Err(ShardError::OutOfMemory) => {
                    return self.alloc_after_oom(pool, stream, rounded, size);
                }
                Err(ShardError::Paused) => return Err(AllocError::PoolPaused(pool)),
                Err(e) => return Err(shard_error(e)),
            }
        }
    }

    /// Allocate in one shard, registering any segment it added.
    #[inline(always)]
    fn alloc_on(&self, cell: &ShardRef, rounded: u64, size: u64) -> Result<DevicePtr, ShardError> {
        let env = self.env(&cell.pool_budget);
        let mut s = lock(&cell.shard);
        let r = s.alloc(&env, rounded, size).map(|(_, addr)| addr);
        self.register_segments(cell, &mut s);
        r
    }

    /// Release a shard's cache, unregistering the segments it gave back.
    fn release_on(&self, pool: PoolId, cell: &ShardRef, synchronize: bool, keep_pages: bool) {
        let keep_retained = self.pool_in_use(pool);
        let env = self.env(&cell.pool_budget);
        let mut s = lock(&cell.shard);
        s.release_cached(&env, synchronize, keep_pages, keep_retained);
        self.register_segments(cell, &mut s);
    }

    /// Bring the segment registry up to date with a shard's changes (called under its lock).
    #[inline]
    fn register_segments(&self, cell: &ShardRef, s: &mut Shard) {
        if !s.seg_log.is_empty() {
            self.register_segments_now(cell, s);
        }
    }

    #[cold]
    fn register_segments_now(&self, cell: &ShardRef, s: &mut Shard) {
        let mut reg = self.segments.write().unwrap_or_else(|e| e.into_inner());
        for (addr, size, added) in s.seg_log.drain(..) {
            if added {
                reg.insert(addr, (addr + size, Arc::downgrade(cell)));
            } else {
                reg.remove(&addr);
            }
        }
    }

    /// Run `f` on the shard that holds the allocation at `ptr`, locked; `None` if no shard does.
    /// The calling thread's cached shard is tried first, then the segment registry.
    pub(crate) fn with_owner<R>(
        &self,
        ptr: DevicePtr,
        mut f: impl FnMut(&ShardRef, &mut Shard) -> R,
    ) -> Option<R> {
        let fast = LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let e = c.as_ref().filter(|e| e.allocator == self.uid)?;
                let mut s = lock(&e.shard.shard);
                s.lookup(ptr)?;
                Some(f(&e.shard, &mut s))
            })
            .ok()
            .flatten();
        if fast.is_some() {
            return fast;
        }
        self.with_registered_owner(ptr, f)
    }

    /// [`Allocator::with_owner`] through the segment registry alone.
    fn with_registered_owner<R>(
        &self,
        ptr: DevicePtr,
        mut f: impl FnMut(&ShardRef, &mut Shard) -> R,
    ) -> Option<R> {
        let cell = {
            let reg = self.segments.read().unwrap_or_else(|e| e.into_inner());
            let (_, (end, owner)) = reg.range(..=ptr).next_back()?;
            if ptr >= *end {
                return None;
            }
            owner.upgrade()?
        };
        let mut s = lock(&cell.shard);
        s.lookup(ptr)?;
        Some(f(&cell, &mut s))
    }

    /// PyTorch's retry ladder: free this pool's cache, try `use_on_oom` pools, free every unused
    /// cached byte on the device, retry; then fail with a report.
    fn alloc_after_oom(
        &self,
        pool: PoolId,
        stream: StreamId,
        rounded: u64,
        size: u64,
    ) -> AllocResult<DevicePtr> {
        let _reclaim = lock(&self.reclaim);
        // Shards are retired only under `reclaim`: the one looked up now stays in the table
        // until this returns.
        let cell = self.refresh_shard(pool, stream)?;
        let attempt = |cell: &ShardRef| self.alloc_on(cell, rounded, size);
        // 1. This shard's own cache.
        self.release_on(pool, &cell, false, true);
        if let Ok(addr) = attempt(&cell) {
            return Ok(addr);
        }
        // 2. Free blocks of pools marked use_on_oom, on the same stream.
        for other in self.use_on_oom_pools(pool) {
            if let Some(oc) = self.existing_shard(other, stream)
                && let Ok(addr) = attempt(&oc)
            {
                return Ok(addr);
            }
        }
        // 3. Every unused cached byte on the device (never during a capture).
        if !self.capture_underway() {
            let synced = self.counted.synchronize().is_ok();
            self.release_all_cached(synced, true);
            self.num_alloc_retries.fetch_add(1, Ordering::Relaxed);
            match attempt(&cell) {
                Ok(addr) => {
                    return Ok(addr);
                }
                Err(ShardError::OutOfMemory) => {}
                Err(e) => return Err(shard_error(e)),
            }
        }
        self.num_ooms.fetch_add(1, Ordering::Relaxed);
        self.shared
            .trace
            .record(crate::history::TraceAction::Oom, 0, rounded, stream);
        let report = self.oom_report(size, rounded);
        tracing::info!(%report, "out of memory");
        Err(AllocError::OutOfMemory(Box::new(report)))
    }

    fn oom_report(&self, size: u64, rounded: u64) -> OomReport {
        let (mut allocated, mut private_reserved, mut private_allocated) = (0, 0, 0);
        for (&(pool, _), cell) in self.all_shards().iter() {
            let s = lock(&cell.shard);
            let shard_allocated = s.stats.allocated_bytes.all().current as u64;
            allocated += shard_allocated;
            if !pool.is_default() {
                private_reserved += s.stats.reserved_bytes.all().current as u64;
                private_allocated += shard_allocated;
            }
        }
        OomReport {
            requested: size,
            rounded,
            limit: self.shared.budget.limit(),
            device_free: self.dev.free_memory(),
            ..OomReport::counting(
                self.shared.budget.held(),
                allocated,
                private_reserved,
                private_allocated,
            )
        }
    }

    /// Free a pointer returned by [`Allocator::alloc`]. Unknown pointers and double frees are
    /// rejected and change nothing.
    pub fn free(&self, ptr: DevicePtr) -> AllocResult<()> {
        // The thread's cached shard first, asked once: its free looks the pointer up itself.
        if self.free_fast(ptr) {
            return Ok(());
        }
        self.free_registered(ptr)
    }

    /// [`Allocator::free`] past the calling thread's cached shard (which
    /// [`Allocator::free_fast`] asked): the segment registry finds the owner.
    pub fn free_registered(&self, ptr: DevicePtr) -> AllocResult<()> {
        self.with_registered_owner(ptr, |cell, s| s.free(&self.env(&cell.pool_budget), ptr))
            .ok_or(AllocError::UnknownPointer(ptr))?
            .map_err(shard_error)
    }

    /// [`Allocator::free`] where the calling thread's cached shard holds `ptr`: `false`, with
    /// nothing changed, otherwise (call [`Allocator::free_registered`] then, which also reports
    /// errors).
    #[inline(always)]
    pub fn free_fast(&self, ptr: DevicePtr) -> bool {
        LAST_SHARD
            .try_with(|c| {
                let c = c.borrow();
                let Some(e) = c.as_ref().filter(|e| e.allocator == self.uid) else {
                    return false;
                };
                let env = self.env(&e.shard.pool_budget);
                // A shard's free changes nothing when it fails.
                lock(&e.shard.shard).free(&env, ptr).is_ok()
            })
            .unwrap_or(false)
    }

    /// Mark the allocation at `ptr` **graph-retained but reusable**: a captured graph still
    /// references it (a graph output, a static buffer), but later captures of the same pool may
    /// reuse its memory, because the caller promises that the graphs never run at the same time.
    /// The block returns to its pool now; its memory stays mapped at its address while the pool
    /// is in use. The caller keeps its pointer but must not free it again (the PyTorch shim
    /// swallows that later free). Returns the block's size.
    pub fn mark_reusable(&self, ptr: DevicePtr) -> AllocResult<u64> {
        let r = self.with_owner(ptr, |cell, s| {
            let pool = s.pool;
            if s.pause.is_some() {
                // Its pages are not mapped: retention could not be recorded.
                return Err((ShardError::Paused, pool));
            }
            let env = self.env(&cell.pool_budget);
            let unknown = (ShardError::UnknownPointer, pool);
            let id = s.lookup(ptr).ok_or(unknown.clone())?;
            let (seg, size) = {
                let b = s.block(id).ok_or(unknown)?;
                (b.segment, b.size)
            };
            s.retain_range(&env, seg, ptr, size);
            s.free(&env, ptr).map(|()| size).map_err(|e| (e, pool))
        });
        match r.ok_or(AllocError::UnknownPointer(ptr))? {
            Ok(size) => Ok(size),
            Err((ShardError::Paused, pool)) => Err(AllocError::PoolPaused(pool)),
            Err((e, _)) => Err(shard_error(e)),
        }
    }

    /// Note that `ptr` is used on `stream` (`Tensor.record_stream`): it is reused on another
    /// stream only after the work queued on `stream` before its free has completed.
    pub fn record_stream(&self, ptr: DevicePtr, stream: StreamId) -> AllocResult<()> {
        self.with_owner(ptr, |_, s| s.record_stream(ptr, stream))
            .ok_or(AllocError::UnknownPointer(ptr))?
            .map_err(shard_error)
    }

    /// (base, size) of the live allocation that starts at `ptr`.
    pub fn allocation_info(&self, ptr: DevicePtr) -> AllocResult<(DevicePtr, u64, u64)> {
        self.with_owner(ptr, |_, s| {
            let b = s.block(s.lookup(ptr)?)?;
            Some((b.addr, b.size, b.requested))
        })
        .flatten()
        .ok_or(AllocError::UnknownPointer(ptr))
    }

    /// The segment holding the live allocation that starts at `ptr`: its address, its size, and
    /// whether it is a vmm reservation (else one classic `cuMemAlloc` allocation, which CUDA IPC
    /// can share).
    pub fn segment_info(&self, ptr: DevicePtr) -> AllocResult<(DevicePtr, u64, bool)> {
        self.with_owner(ptr, |_, s| {
            let b = s.block(s.lookup(ptr)?)?;
            let seg = s.segment(b.segment)?;
            Some((seg.addr, seg.size, seg.is_vmm()))
        })
        .flatten()
        .ok_or(AllocError::UnknownPointer(ptr))
    }

    /// The physical pages under the live allocation at `ptr`, for sharing it with another
    /// process (CUDA IPC of vmm memory): the pages cover the whole block, and the allocation
    /// starts `offset` bytes into the first. A live block's pages are all mapped (shard invariant
    /// 6), and they stay so while it is live.
    ///
    /// Errors: [`AllocError::UnknownPointer`] if `ptr` is not a live allocation;
    /// [`AllocError::InvalidArgument`] if it lies in a classic segment, which is `cudaMalloc`
    /// memory and is shared with `cudaIpcGetMemHandle` instead.
    pub fn shared_pages(&self, ptr: DevicePtr) -> AllocResult<SharedPages> {
        let page_size = self.device().page_size();
        self.with_owner(ptr, |_, s| {
            let b = s.block(s.lookup(ptr)?)?;
            let seg = s.segment(b.segment)?;
            let crate::block::SegmentKind::Vmm(pt) = &seg.kind else {
                return Some(Err(AllocError::InvalidArgument(format!(
                    "{ptr:#x} lies in a classic segment: share it with cudaIpcGetMemHandle"
                ))));
            };
            let (first, end) = Shard::page_range(page_size, seg.addr, b.addr, b.size);
            if pt.any_in_run(first, end) {
                return Some(Err(AllocError::InvalidArgument(format!(
                    "{ptr:#x} lies in a physical run (a resumed pool's memory), which is not \
                     shared page by page"
                ))));
            }
            let pages: Option<Vec<PageHandle>> =
                pt.handle.get(first..end)?.iter().copied().collect();
            Some(Ok(SharedPages {
                page_size,
                pages: pages?,
                offset: b.addr - seg.addr - first as u64 * page_size,
            }))
        })
        .flatten()
        .ok_or(AllocError::UnknownPointer(ptr))?
    }

    /// Retire completed cross-stream events in every shard.
    pub fn process_events(&self) {
        for cell in self.all_shards().values() {
            let env = self.env(&cell.pool_budget);
            lock(&cell.shard).process_events(&env);
        }
    }

    // ----------------------------------------------------------------------------------------
    // Shards

    /// The shard of (pool, stream), created on first use.
    pub(crate) fn shard_for(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        let generation = self.generation.load(Ordering::Acquire);
        let cached = LAST_SHARD
            .try_with(|c| {
                c.borrow().as_ref().and_then(|e| {
                    e.serves(self.uid, generation, pool, stream)
                        .then(|| e.shard.clone())
                })
            })
            .ok()
            .flatten();
        if let Some(cell) = cached {
            return Ok(cell);
        }
        let cell = self.shard_for_slow(pool, stream)?;
        let _ = LAST_SHARD.try_with(|c| {
            *c.borrow_mut() = Some(CachedShard {
                allocator: self.uid,
                generation,
                pool,
                stream,
                shard: cell.clone(),
            })
        });
        Ok(cell)
    }

    /// The shard of (pool, stream) from the table itself (created if missing), cached for the
    /// calling thread: after a [`ShardError::Retired`], whose shard the cache may still name.
    fn refresh_shard(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        let generation = self.generation.load(Ordering::Acquire);
        let cell = self.shard_for_slow(pool, stream)?;
        let _ = LAST_SHARD.try_with(|c| {
            *c.borrow_mut() = Some(CachedShard {
                allocator: self.uid,
                generation,
                pool,
                stream,
                shard: cell.clone(),
            })
        });
        Ok(cell)
    }

    /// The table's shard of (pool, stream), created if missing. A shard in the table is never
    /// retired (see [`Allocator::drop_empty_shards`]).
    fn shard_for_slow(&self, pool: PoolId, stream: StreamId) -> AllocResult<ShardRef> {
        let pools = lock(&self.pools);
        let entry = pools.get(&pool).ok_or(AllocError::UnknownPool(pool))?;
        let mut shards = lock(&self.shards);
        if let Some(cell) = shards.get(&(pool, stream)) {
            return Ok(cell.clone());
        }
        if entry.paused.is_some() {
            // A new shard would have nothing to serve from.
            return Err(AllocError::PoolPaused(pool));
        }
        let mut shard = Shard::new(
            pool,
            stream,
            entry.options.no_split,
            &self.config.policy,
            self.shared.allocated.new_lease(),
        );
        shard.quick_off = entry.checkpoints.iter().any(|c| c.strong_count() > 0);
        shard.pausable = entry.options.pausable;
        let cell = Arc::new(ShardCell {
            shard: crate::sync::ShardMutex::new(shard),
            pool_budget: entry.budget.clone(),
        });
        shards.insert((pool, stream), cell.clone());
        Ok(cell)
    }

    pub(crate) fn existing_shard(&self, pool: PoolId, stream: StreamId) -> Option<ShardRef> {
        lock(&self.shards).get(&(pool, stream)).cloned()
    }

    /// A copy of the shard table, so that shards can be locked one at a time without the table
    /// lock.
    pub(crate) fn all_shards(&self) -> FxHashMap<(PoolId, StreamId), ShardRef> {
        lock(&self.shards).clone()
    }

    pub(crate) fn pool_shards(&self, pool: PoolId) -> Vec<ShardRef> {
        shards_of(&lock(&self.shards), pool)
    }

    /// Forget the empty shards of private pools (of `pool` only, if given) that no live
    /// checkpoint marked; invalidates thread caches.
    ///
    /// The protocol with allocation: a shard leaves the table under the table's lock and its own,
    /// and is marked [`Shard::retired`] in the same critical section. A thread that found the
    /// shard before (its cached shard, or a lookup that released the table's lock) locks it
    /// next, sees the mark and looks (pool, stream) up again; so no segment is ever added to a
    /// shard outside the table, and the segment registry names only shards in it. Called under
    /// `reclaim` (the guard proves it), which checkpoints, restores and the OOM ladder also
    /// hold: no shard they have looked up is retired under them.
    pub(crate) fn drop_empty_shards(&self, _reclaim: &MutexGuard<'_, ()>, pool: Option<PoolId>) {
        let mut shards = lock(&self.shards);
        let before = shards.len();
        shards.retain(|&(p, _), cell| {
            if pool.is_some_and(|q| q != p) || p.is_default() {
                return true;
            }
            let mut s = lock(&cell.shard);
            // A live checkpoint's shard stays: restoring it needs its marks; so does one that
            // keeps a pinned backup buffer for its pool's next pause.
            if !s.is_empty() || s.has_live_mark() || s.host_spare.is_some() {
                return true;
            }
            s.settle_credit(&self.env(&cell.pool_budget));
            self.shared.allocated.end_lease(&s.lease);
            s.retired = true;
            false
        });
        if shards.len() != before {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    // ----------------------------------------------------------------------------------------
    // Pools and routes

    fn use_on_oom_pools(&self, except: PoolId) -> Vec<PoolId> {
        let pools = lock(&self.pools);
        let mut v: Vec<PoolId> = pools
            .iter()
            .filter(|(id, e)| **id != except && e.options.use_on_oom)
            .map(|(id, _)| *id)
            .collect();
        v.sort_unstable();
        v
    }

    /// Create pool `id` with `options` (use count 1), or add one use to an existing pool
    /// (PyTorch's `createOrIncrefPool`).
    pub fn create_or_incref_pool(&self, id: PoolId, options: PoolOptions) -> AllocResult<u64> {
        if id.is_default() {
            return Err(AllocError::InvalidArgument(
                "the default pool always exists".into(),
            ));
        }
        Ok(Self::incref_locked(&mut lock(&self.pools), id, options))
    }

    /// `create_or_incref_pool` on the locked pool table; returns the new use count.
    fn incref_locked(
        pools: &mut FxHashMap<PoolId, PoolEntry>,
        id: PoolId,
        options: PoolOptions,
    ) -> u64 {
        let e = pools.entry(id).or_insert_with(|| PoolEntry {
            name: None,
            use_count: 0,
            budget: Arc::new(Budget::new(options.limit.unwrap_or(u64::MAX))),
            options,
            checkpoints: Vec::new(),
            paused: None,
        });
        e.use_count += 1;
        e.use_count
    }

    /// The pool named `name`, created (use count 1) if it does not exist, else given one more use.
    /// Named pools get ids `{0, 2^63 + n}`, apart from PyTorch's.
    pub fn named_pool(&self, name: &str, options: PoolOptions) -> AllocResult<PoolId> {
        if name.is_empty() {
            return Err(AllocError::InvalidArgument("empty pool name".into()));
        }
        let mut pools = lock(&self.pools);
        if let Some((id, e)) = pools
            .iter_mut()
            .find(|(_, e)| e.name.as_deref() == Some(name))
        {
            e.use_count += 1;
            return Ok(*id);
        }
        // The next id in the named range that no pool has: a user pool may have taken one
        // (`create_or_incref_pool` accepts any id), and it stays that pool's.
        let id = loop {
            let id = PoolId(
                0,
                (1 << 63) | self.next_named_pool.fetch_add(1, Ordering::Relaxed),
            );
            if !pools.contains_key(&id) {
                break id;
            }
        };
        pools.insert(
            id,
            PoolEntry {
                name: Some(name.to_string()),
                use_count: 1,
                options: options.clone(),
                budget: Arc::new(Budget::new(options.limit.unwrap_or(u64::MAX))),
                checkpoints: Vec::new(),
                paused: None,
            },
        );
        Ok(id)
    }

    /// The id of the pool named `name`, if any.
    pub fn pool_by_name(&self, name: &str) -> Option<PoolId> {
        lock(&self.pools)
            .iter()
            .find(|(_, e)| e.name.as_deref() == Some(name))
            .map(|(id, _)| *id)
    }

    /// Use count of a pool (`MemPool.use_count()`).
    pub fn pool_use_count(&self, id: PoolId) -> AllocResult<u64> {
        lock(&self.pools)
            .get(&id)
            .map(|e| e.use_count)
            .ok_or(AllocError::UnknownPool(id))
    }

    /// Change a pool's options (`setUseOnOOM`, `setNoSplit`, byte limit).
    pub fn set_pool_options(&self, id: PoolId, options: PoolOptions) -> AllocResult<()> {
        let mut pools = lock(&self.pools);
        let e = pools.get_mut(&id).ok_or(AllocError::UnknownPool(id))?;
        e.budget.set_limit(options.limit.unwrap_or(u64::MAX));
        e.options = options;
        Ok(())
    }

    /// A pool's options.
    pub fn pool_options(&self, id: PoolId) -> AllocResult<PoolOptions> {
        lock(&self.pools)
            .get(&id)
            .map(|e| e.options.clone())
            .ok_or(AllocError::UnknownPool(id))
    }

    /// Drop one use of a pool (`releasePool`). At zero the pool is freeable: its cached memory
    /// returns on `empty_cache` or under memory pressure, and it is forgotten once empty.
    ///
    /// The last use of a pool that a route still sends allocations to is not released
    /// ([`AllocError::InvalidState`], nothing changes): the route took a use of its own
    /// ([`Allocator::begin_allocate_to_pool`]), and a pool forgotten under an active route would
    /// fail every allocation the route takes. End the route first, as PyTorch's `MemPool`
    /// cannot be dropped inside its own `use_mem_pool` block.
    pub fn release_pool(&self, id: PoolId) -> AllocResult<u64> {
        if id.is_default() {
            return Err(AllocError::InvalidArgument(
                "the default pool cannot be released".into(),
            ));
        }
        let mut pools = lock(&self.pools);
        let e = pools.get_mut(&id).ok_or(AllocError::UnknownPool(id))?;
        if e.use_count == 0 {
            return Err(AllocError::InvalidState(format!(
                "pool {id} was already released"
            )));
        }
        if e.use_count == 1 && lock(&self.routes).iter().any(|r| r.pool == id) {
            return Err(AllocError::InvalidState(format!(
                "pool {id} has an active route (begin_allocate_to_pool): end the route before \
                 releasing the pool's last use"
            )));
        }
        e.use_count -= 1;
        Ok(e.use_count)
    }

    /// Live allocations of `pool`: (address, size), in address order. Costs O(blocks of the
    /// pool).
    pub fn live_allocations(&self, pool: PoolId) -> AllocResult<Vec<(DevicePtr, u64)>> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        let mut out = Vec::new();
        for cell in self.pool_shards(pool) {
            let s = lock(&cell.shard);
            for (sid, _) in s.segments() {
                out.extend(
                    s.segment_blocks(sid)
                        .filter(|(_, b)| b.state == crate::block::BlockState::Allocated)
                        .map(|(_, b)| (b.addr, b.size)),
                );
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Whether the live allocations of `pool` are exactly `expected` (PyTorch's
    /// `checkPoolLiveAllocations`); the error names what differs.
    pub fn verify_live(&self, pool: PoolId, expected: &[DevicePtr]) -> AllocResult<()> {
        let live: Vec<DevicePtr> = self
            .live_allocations(pool)?
            .into_iter()
            .map(|(a, _)| a)
            .collect();
        let mut want = expected.to_vec();
        want.sort_unstable();
        want.dedup();
        if live == want {
            return Ok(());
        }
        let extra: Vec<String> = live
            .iter()
            .filter(|p| want.binary_search(p).is_err())
            .map(|p| format!("{p:#x}"))
            .collect();
        let missing: Vec<String> = want
            .iter()
            .filter(|p| live.binary_search(p).is_err())
            .map(|p| format!("{p:#x}"))
            .collect();
        Err(AllocError::InvalidState(format!(
            "pool {pool}: live but not expected [{}], expected but not live [{}]",
            extra.join(", "),
            missing.join(", ")
        )))
    }

    /// Wait for the cross-stream events of `pool`'s pending frees, so that they become reusable.
    /// Does nothing during a capture. Returns the frees still pending.
    pub fn drain_pending_frees(&self, pool: PoolId) -> AllocResult<usize> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        let mut left = 0;
        for cell in self.pool_shards(pool) {
            let env = self.env(&cell.pool_budget);
            let mut s = lock(&cell.shard);
            s.synchronize_events(&env);
            left += s.pending_frees();
        }
        Ok(left)
    }

    /// Every registered pool id.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut v: Vec<PoolId> = lock(&self.pools).keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// Send allocations that match `filter` to `pool` until [`Allocator::end_allocate_to_pool`]
    /// (PyTorch's `beginAllocateToPool`): the pool gains a use (created if new). Newest route
    /// first; a pool already being recorded to is refused.
    pub fn begin_allocate_to_pool(&self, pool: PoolId, filter: RouteFilter) -> AllocResult<()> {
        if pool.is_default() {
            return Err(AllocError::InvalidArgument(
                "cannot route to the default pool".into(),
            ));
        }
        // Lock order: pools, then routes (`release_pool` reads the routes under the pools).
        let mut pools = lock(&self.pools);
        let mut routes = lock(&self.routes);
        if routes.iter().any(|r| r.pool == pool) {
            return Err(AllocError::InvalidState(format!(
                "already recording to pool {pool}"
            )));
        }
        Self::incref_locked(&mut pools, pool, PoolOptions::default());
        drop(pools);
        if matches!(filter, RouteFilter::Capture(_)) {
            self.captures_active.fetch_add(1, Ordering::AcqRel);
        }
        routes.push(Route { pool, filter });
        self.routes_active.store(routes.len(), Ordering::Release);
        Ok(())
    }

    /// Stop routing to `pool` (no change to its use count).
    pub fn end_allocate_to_pool(&self, pool: PoolId) -> AllocResult<()> {
        let mut routes = lock(&self.routes);
        let i = routes
            .iter()
            .rposition(|r| r.pool == pool)
            .ok_or_else(|| AllocError::InvalidState(format!("no route to pool {pool}")))?;
        let r = routes.remove(i);
        if matches!(r.filter, RouteFilter::Capture(_)) {
            self.captures_active.fetch_sub(1, Ordering::AcqRel);
        }
        self.routes_active.store(routes.len(), Ordering::Release);
        drop(routes);
        if !self.capture_underway() {
            // Frees deferred by the capture can now record their events.
            self.process_events();
        }
        Ok(())
    }

    /// The pool an allocation on `stream` by this thread goes to.
    pub fn route_for(&self, stream: StreamId) -> AllocResult<PoolId> {
        if self.routes_active.load(Ordering::Acquire) == 0 {
            return Ok(PoolId::DEFAULT);
        }
        let routes = lock(&self.routes);
        let mut capture: Option<CaptureStatus> = None;
        for r in routes.iter().rev() {
            let hit = match r.filter {
                RouteFilter::All => true,
                RouteFilter::Thread(t) => t == current_thread_id(),
                RouteFilter::Stream(s) => s == stream,
                RouteFilter::Capture(id) => {
                    let st = match capture {
                        Some(st) => st,
                        None => {
                            let st = self.dev.capture_status(stream)?;
                            capture = Some(st);
                            st
                        }
                    };
                    st == CaptureStatus::Active(id)
                }
            };
            if hit {
                return Ok(r.pool);
            }
        }
        Ok(PoolId::DEFAULT)
    }

    // ----------------------------------------------------------------------------------------
    // Releasing memory

    /// Return every unused cached byte of the default pool and of freeable private pools to the
    /// device (`torch.cuda.empty_cache`). Pools in use keep their graph-retained memory (live
    /// graphs may touch it) and release the rest.
    pub fn empty_cache(&self) {
        let reclaim = lock(&self.reclaim);
        let synced = !self.capture_underway() && self.counted.synchronize().is_ok();
        self.end_orphaned_pauses(&reclaim);
        self.release_all_cached(synced, false);
        self.release_page_pool();
        self.forget_freeable_pools(&reclaim);
    }

    /// `empty_cache` for one pool; a pool in use keeps its graph-retained memory.
    pub fn empty_pool_cache(&self, pool: PoolId) -> AllocResult<()> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        let reclaim = lock(&self.reclaim);
        let synced = !self.capture_underway() && self.counted.synchronize().is_ok();
        self.end_orphaned_pauses(&reclaim);
        for cell in self.pool_shards(pool) {
            self.release_on(pool, &cell, synced, false);
        }
        self.release_page_pool();
        self.forget_freeable_pools(&reclaim);
        Ok(())
    }

    /// Release cached memory, one shard at a time: all of it in the default pool and freeable
    /// pools; in pools in use, what no captured graph may touch (not graph-retained).
    fn release_all_cached(&self, synchronize: bool, keep_pages: bool) {
        for ((pool, _), cell) in self.all_shards() {
            self.release_on(pool, &cell, synchronize, keep_pages);
        }
    }

    /// A private pool with uses left: its graph-retained memory must stay where it is.
    pub(crate) fn pool_in_use(&self, pool: PoolId) -> bool {
        !pool.is_default() && lock(&self.pools).get(&pool).is_none_or(|e| e.use_count > 0)
    }

    fn release_page_pool(&self) {
        if self.capture_underway() {
            return;
        }
        for page in self.shared.pages.drain() {
            if self.counted.release_page(page).is_ok() {
                self.shared.budget.release(self.shared.page_size);
            } else {
                self.shared.pages.put(page);
                break;
            }
        }
        for (run, bytes) in self.shared.pages.drain_runs() {
            if self.counted.release_page(run).is_ok() {
                self.shared.budget.release(bytes);
            } else {
                self.shared.pages.put_run(run, bytes);
            }
        }
    }

    /// Forget freeable pools that hold nothing any more (no shard, no live arena) and that no
    /// live checkpoint needs.
    fn forget_freeable_pools(&self, reclaim: &MutexGuard<'_, ()>) {
        self.drop_empty_shards(reclaim, None);
        let arena_pools = self.arena_pools();
        let mut pools = lock(&self.pools);
        let shards = lock(&self.shards);
        pools.retain(|id, e| {
            id.is_default()
                || e.use_count > 0
                || e.checkpoints.iter().any(|c| c.strong_count() > 0)
                || shards.keys().any(|(p, _)| p == id)
                || arena_pools.contains(id)
        });
    }

    // ----------------------------------------------------------------------------------------
    // Statistics

    /// Pages and live-map ops logged for the live checkpoints of `pool` (host memory a
    /// checkpoint holds: it grows with what changes in the pool while a checkpoint is alive, and
    /// stays bounded by the pool's pages and addresses).
    pub fn checkpoint_journal_len(&self, pool: PoolId) -> AllocResult<usize> {
        self.sum_over_pool(pool, Shard::journal_len)
    }

    /// Bytes of `pool` that captured graphs may touch and that therefore stay mapped while the
    /// pool is in use (see [`crate::block::PageTable`]).
    pub fn retained_bytes(&self, pool: PoolId) -> AllocResult<u64> {
        self.sum_over_pool(pool, |s| s.retained_bytes(self.shared.page_size))
    }

    /// `f` summed over the shards of `pool`; an unknown pool is an error.
    fn sum_over_pool<T: std::iter::Sum>(
        &self,
        pool: PoolId,
        f: impl Fn(&Shard) -> T,
    ) -> AllocResult<T> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        Ok(self
            .pool_shards(pool)
            .iter()
            .map(|c| f(&lock(&c.shard)))
            .sum())
    }

    /// Device-wide statistics (`torch.cuda.memory_stats`). Current values and totals are exact;
    /// peaks are exact while one (pool, stream) shard is active, else an upper bound.
    pub fn stats(&self) -> MemoryStats {
        let mut out = MemoryStats {
            max_split_size: if self.config.policy.max_split_size == u64::MAX {
                -1
            } else {
                self.config.policy.max_split_size as i64
            },
            ..Default::default()
        };
        for cell in self.all_shards().values() {
            out.merge(&lock(&cell.shard).stats);
        }
        self.merge_arena_stats(&mut out, None);
        out.num_alloc_retries += self.num_alloc_retries.load(Ordering::Relaxed);
        out.num_ooms += self.num_ooms.load(Ordering::Relaxed);
        // Device-wide peaks from one counter (the merged per-shard peaks add up per shard).
        out.allocated_bytes
            .set_all_peak(self.shared.allocated.peak());
        out.reserved_bytes
            .set_all_peak(self.shared.budget.peak() as i64);
        out
    }

    /// Bytes handed out now (rounded), summed over shards: `memory_allocated()`.
    pub fn allocated_bytes(&self) -> u64 {
        let shards: u64 = lock(&self.shards)
            .values()
            .map(|c| lock(&c.shard).stats.allocated_bytes.all().current as u64)
            .sum();
        shards + self.arena_allocated_bytes()
    }

    /// Statistics of one pool.
    pub fn pool_stats(&self, pool: PoolId) -> AllocResult<MemoryStats> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(pool));
        }
        let mut out = MemoryStats::default();
        for cell in self.pool_shards(pool) {
            out.merge(&lock(&cell.shard).stats);
        }
        self.merge_arena_stats(&mut out, Some(pool));
        Ok(out)
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak_stats(&self) {
        for cell in self.all_shards().values() {
            let mut s = lock(&cell.shard);
            s.stats.reset_peak();
            // The device-wide counter restarts from the exact allocated bytes.
            s.settle_credit(&self.env(&cell.pool_budget));
        }
        self.arena_stats_mut(MemoryStats::reset_peak);
        self.shared.allocated.reset_peak();
        self.shared.budget.reset_peak();
    }

    /// `reset_accumulated_memory_stats`.
    pub fn reset_accumulated_stats(&self) {
        for cell in self.all_shards().values() {
            lock(&cell.shard).stats.reset_accumulated();
        }
        self.arena_stats_mut(MemoryStats::reset_accumulated);
        self.num_alloc_retries.store(0, Ordering::Relaxed);
        self.num_ooms.store(0, Ordering::Relaxed);
    }

    /// The largest request the cache serves without new physical memory (`cacheInfo`, used by
    /// cuDNN benchmark): the largest cached free block, vmm blocks up to their first unmapped
    /// page ([`Shard::largest_free`]).
    pub fn largest_free_block(&self) -> u64 {
        let ps = self.shared.page_size;
        self.all_shards()
            .values()
            .map(|c| lock(&c.shard).largest_free(ps))
            .max()
            .unwrap_or(0)
    }

    // ----------------------------------------------------------------------------------------
    // Invariants

    /// Check the whole state (call it while no other thread uses the allocator: it visits the
    /// shards one at a time): every shard's invariants, then
    ///
    /// 1. the segment registry holds exactly the shards' segments, each with its shard (every
    ///    shard's own live map is its invariant 8), and no shard in the table is retired;
    /// 2. no two segments of any shards overlap;
    /// 3. physical bytes held equal classic segments + mapped pages + cached pages;
    /// 4. each pool's budget equals what its shards hold;
    /// 5. the device-wide allocated counter equals the shards' allocated bytes plus their credits
    ///    and leases, plus the arenas' live slots (each arena's own invariants are checked too).
    pub fn check_invariants(&self) -> Result<(), String> {
        let _reclaim = lock(&self.reclaim);
        let ps = self.shared.page_size;
        let shards = self.all_shards();
        let mut ranges = Vec::new();
        let mut held = self.shared.pages.len() as u64 * ps + self.shared.pages.run_bytes();
        let mut per_pool: FxHashMap<PoolId, u64> = FxHashMap::default();
        let mut allocated = 0i64;
        for (pool, bytes) in self.arena_bytes() {
            held += bytes;
            *per_pool.entry(pool).or_default() += bytes;
        }
        allocated += self.check_arenas()?;
        for (&(pool, stream), cell) in &shards {
            let s = lock(&cell.shard);
            if s.retired {
                return Err(format!(
                    "1: shard {pool}/{stream} is retired but in the table"
                ));
            }
            s.check_invariants(ps)
                .map_err(|e| format!("shard {pool}/{stream}: invariant {e}"))?;
            let reserved = s.stats.reserved_bytes.all().current as u64;
            allocated += s.stats.allocated_bytes.all().current + s.peak_credit + s.lease.get();
            held += reserved;
            *per_pool.entry(pool).or_default() += reserved;
            let reg = self.segments.read().unwrap_or_else(|e| e.into_inner());
            for (_, seg) in s.segments() {
                ranges.push((seg.addr, seg.addr + seg.size));
                match reg.get(&seg.addr) {
                    Some((end, owner))
                        if *end == seg.addr + seg.size
                            && owner.upgrade().is_some_and(|c| Arc::ptr_eq(&c, cell)) => {}
                    _ => {
                        return Err(format!(
                            "1: segment {:#x} of shard {pool}/{stream} is not registered",
                            seg.addr
                        ));
                    }
                }
            }
        }
        let registered = self
            .segments
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len();
        if registered != ranges.len() {
            return Err(format!(
                "1: {registered} segments registered, {} in shards",
                ranges.len()
            ));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("2: segments of different shards overlap".into());
        }
        if held != self.shared.budget.held() {
            return Err(format!(
                "3: {} bytes held by the budget, {held} counted",
                self.shared.budget.held()
            ));
        }
        if allocated != self.shared.allocated.current() {
            return Err(format!(
                "5: device-wide allocated {} vs {allocated} in shards",
                self.shared.allocated.current()
            ));
        }
        let pools = lock(&self.pools);
        for (id, e) in pools.iter() {
            let have = per_pool.get(id).copied().unwrap_or(0);
            if !id.is_default() && e.budget.held() != have {
                return Err(format!(
                    "4: pool {id} budget {} vs {have} held",
                    e.budget.held()
                ));
            }
        }
        Ok(())
    }

    /// A text dump of every shard's segments, blocks and statistics, in a stable order: tests
    /// compare two dumps to show that a refused call changed nothing.
    pub fn state_dump(&self) -> String {
        use std::fmt::Write;
        let shards = self.all_shards();
        let mut keys: Vec<_> = shards.keys().copied().collect();
        keys.sort_unstable();
        let mut out = String::new();
        for k in keys {
            let s = lock(&shards[&k].shard);
            let _ = writeln!(out, "shard {}/{}: {:?}", k.0, k.1, s.stats);
            let mut segs: Vec<_> = s.segments().collect();
            segs.sort_by_key(|(_, seg)| seg.addr);
            for (sid, seg) in segs {
                let _ = writeln!(
                    out,
                    " segment {:#x}+{} small={}",
                    seg.addr, seg.size, seg.small
                );
                for (_, b) in s.segment_blocks(sid) {
                    let _ = writeln!(
                        out,
                        "  block {:#x}+{} {:?} req={} uses={:?}",
                        b.addr, b.size, b.state, b.requested, b.stream_uses
                    );
                }
            }
        }
        out.push_str(&self.arena_dump());
        let _ = writeln!(
            out,
            "held {} pages {}",
            self.shared.budget.held(),
            self.shared.pages.len()
        );
        out
    }

    /// Record allocator events into a ring of `max_entries` (0 stops recording), as
    /// `torch.cuda.memory._record_memory_history` does.
    pub fn record_history(&self, max_entries: usize) {
        self.shared.trace.set(max_entries);
    }

    /// Hand every trace entry to `sink` as it is made (`None` detaches): PyTorch's
    /// `attachAllocatorTraceTracker`. The sink runs under a shard's lock and must not call the
    /// allocator.
    pub fn set_trace_sink(&self, sink: Option<TraceSink>) {
        self.shared.trace.set_sink(sink);
    }

    /// Forget the recorded history.
    pub fn clear_history(&self) {
        self.shared.trace.clear();
    }

    /// The recorded history, oldest first.
    pub fn history(&self) -> Vec<crate::history::TraceEntry> {
        self.shared.trace.entries()
    }

    /// Whether the configured growth mode is vmm.
    pub fn is_vmm(&self) -> bool {
        self.config.growth == GrowthMode::Vmm
    }

    /// Every segment of every pool and stream with its blocks, in address order (for PyTorch's
    /// `memory_snapshot()`). A vmm reservation is reported as one segment per contiguous run of
    /// mapped pages, as PyTorch reports expandable segments; free blocks are clipped to the run.
    /// A paused pool's segments are reported with the pages that its resume maps, `paused` set.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let ps = self.shared.page_size.max(1);
        let mut out = Vec::new();
        for cell in self.all_shards().values() {
            let s = lock(&cell.shard);
            for (sid, seg) in s.segments() {
                let blocks: Vec<BlockSnapshot> = s
                    .segment_blocks(sid)
                    .map(|(_, b)| BlockSnapshot {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        state: b.state,
                    })
                    .collect();
                let runs: Vec<(DevicePtr, DevicePtr)> = match &seg.kind {
                    crate::block::SegmentKind::Classic => vec![(seg.addr, seg.addr + seg.size)],
                    crate::block::SegmentKind::Vmm(pt) => {
                        let mut runs = Vec::new();
                        let mut start: Option<usize> = None;
                        let pages = seg.size.div_ceil(ps) as usize;
                        for p in 0..=pages {
                            // A paused page is shown where it was, as a paused run.
                            let mapped =
                                p < pages && (pt.shows_page(p) || s.is_paused_page(sid, p));
                            match (mapped, start) {
                                (true, None) => start = Some(p),
                                (false, Some(a)) => {
                                    let lo = seg.addr + a as u64 * ps;
                                    let hi = (seg.addr + p as u64 * ps).min(seg.addr + seg.size);
                                    runs.push((lo, hi));
                                    start = None;
                                }
                                _ => {}
                            }
                        }
                        runs
                    }
                };
                for (lo, hi) in runs {
                    let clipped = blocks
                        .iter()
                        .filter(|b| b.addr < hi && b.addr + b.size > lo)
                        .map(|b| {
                            let a = b.addr.max(lo);
                            BlockSnapshot {
                                addr: a,
                                size: (b.addr + b.size).min(hi) - a,
                                ..b.clone()
                            }
                        })
                        .collect();
                    out.push(SegmentSnapshot {
                        pool: s.pool,
                        stream: s.stream,
                        addr: lo,
                        size: hi - lo,
                        small: seg.small,
                        vmm: seg.is_vmm(),
                        paused: s.pause.is_some(),
                        blocks: clipped,
                    });
                }
            }
        }
        out.extend(self.arena_snapshots());
        out.sort_unstable_by_key(|seg| seg.addr);
        out
    }
}

pub(crate) fn shard_error(e: ShardError) -> AllocError {
    match e {
        ShardError::OutOfMemory => AllocError::OutOfMemory(Box::default()),
        ShardError::Device(d) => AllocError::Device(*d),
        ShardError::UnknownPointer => AllocError::InvalidState("unknown pointer".into()),
        ShardError::NotVmm => AllocError::InvalidState("not a vmm segment".into()),
        ShardError::PageNotMapped => AllocError::InvalidState("page not mapped".into()),
        ShardError::Retired => AllocError::InvalidState("the shard was forgotten".into()),
        ShardError::StaleDuringCapture => {
            AllocError::InvalidState("a page slot must be unmapped during a capture".into())
        }
        ShardError::Paused => AllocError::InvalidState("the pool is paused".into()),
        ShardError::InRun => {
            AllocError::InvalidState("a page of a physical run is unmapped only whole".into())
        }
    }
}

/// One block of a [`SegmentSnapshot`].
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct BlockSnapshot {
    pub addr: DevicePtr,
    /// Rounded size (clipped to the segment's mapped run for vmm free blocks).
    pub size: u64,
    /// Size the user asked for (0 when free).
    pub requested: u64,
    pub state: crate::block::BlockState,
}

/// One segment as [`Allocator::snapshot`] reports it: a classic segment, or one contiguous mapped
/// run of a vmm reservation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct SegmentSnapshot {
    pub pool: PoolId,
    pub stream: StreamId,
    pub addr: DevicePtr,
    pub size: u64,
    /// Serves small (<= 1 MiB) requests.
    pub small: bool,
    /// Part of a vmm reservation (PyTorch's `is_expandable`).
    pub vmm: bool,
    /// Its pool is paused: the run's pages are given back and mapped again by the resume.
    pub paused: bool,
    /// Blocks in address order, tiling `[addr, addr + size)`.
    pub blocks: Vec<BlockSnapshot>,
}

/// The shard table: one shard per (pool, stream).
pub(crate) type ShardTable = FxHashMap<(PoolId, StreamId), ShardRef>;

/// The shards of `pool` in `table`.
pub(crate) fn shards_of(table: &ShardTable, pool: PoolId) -> Vec<ShardRef> {
    table
        .iter()
        .filter(|((p, _), _)| *p == pool)
        .map(|(_, c)| c.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::QUICK_MAX;

    /// Shards made one after another by one thread (a warm-up pair per stream) must not share
    /// cache lines: the cell is aligned to two lines, and the containers every pair writes start
    /// large enough that their first heap blocks are not packed beside another shard's.
    #[test]
    fn shards_made_in_a_row_share_no_cache_line() {
        let policy = crate::policy::SizePolicy::default();
        let counter = crate::peak::PeakCounter::default();
        let cells: Vec<ShardRef> = (0..4)
            .map(|stream| {
                Arc::new(ShardCell {
                    shard: crate::sync::ShardMutex::new(Shard::new(
                        PoolId::DEFAULT,
                        stream,
                        false,
                        &policy,
                        counter.new_lease(),
                    )),
                    pool_budget: Arc::new(Budget::new(u64::MAX)),
                })
            })
            .collect();
        for c in &cells {
            assert_eq!(
                Arc::as_ptr(c) as usize % 128,
                0,
                "cell not on its own lines"
            );
            let s = lock(&c.shard);
            assert!(s.blocks.capacity() >= 32);
            assert!(s.live.capacity() >= 32);
            assert!(s.quick.capacity() >= QUICK_MAX);
        }
    }
}
