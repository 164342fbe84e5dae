//! `Allocator`: one device's caching allocator, thread-safe.
//!
//! The state lives in [`Shard`]s, one per (pool, stream), each behind its own mutex, so that
//! different streams and pools never contend. A thread-local cache names the shard the thread
//! last allocated from: allocation uses it in place, and a free looks there first (each shard
//! maps its own live pointers). Other frees find their shard in a registry of segment ranges,
//! which changes only when segments come and go. Lock order is written down in [`crate::sync`].

mod arena;
mod check;
mod checkpoint;
pub mod pause;
mod peer;
mod pools;
mod readers;
mod reclaim;
mod registry;
mod report;
mod shards;
#[cfg(test)]
mod test_device;
#[cfg(test)]
mod tests;
mod thread_cache;

use thread_cache::{with_cached_shard, with_cached_shard_of};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};

use rustc_hash::FxHashMap;

use crate::block::MAX_REQUEST;
use crate::config::{Config, GrowthMode};
use crate::device::{Device, DevicePtr, PageHandle, StreamId};
use crate::env::{Budget, Env, EventPool, PagePool, Shared};
use crate::error::{AllocError, AllocResult};
use crate::pool::{PoolId, PoolOptions};
use crate::route::Route;
use crate::shard::{RestoreScratch, Shard, ShardCell, ShardError, ShardRef};
pub use crate::snapshot::{BlockSnapshot, SegmentSnapshot};
use pools::PoolEntry;
use shards::{ShardTable, shards_of};

use crate::sync::{Mutex, MutexGuard, RwLock, lock, rank};

/// Proof that the caller holds the allocator's `reclaim` lock.
pub(crate) type ReclaimGuard<'a> = MutexGuard<'a, RestoreScratch>;
pub use checkpoint::VariantGroup;
pub use readers::LiveAllocation;

/// The physical pages under one vmm allocation ([`Allocator::shared_pages`]): `pages` in address
/// order, each one physical allocation of `page_size` bytes, the allocation `offset` bytes into
/// the first. What another process maps, in order, to see the same memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedPages {
    pub page_size: u64,
    pub pages: Vec<PageHandle>,
    pub offset: u64,
}

/// Requests above this size are also checked against the device's memory before they are served.
const LARGE_REQUEST: u64 = 1 << 30;

static NEXT_ALLOCATOR_UID: AtomicU64 = AtomicU64::new(1);

/// One device's caching allocator. See the crate docs for the model.
pub struct Allocator<D: Device> {
    uid: u64,
    dev: Arc<D>,
    /// The same device, its calls counted: what the shards call ([`Allocator::backend_calls`]).
    counted: crate::counted::Counted,
    config: Config,
    /// What the shards of this device share (budget, page and event pools, the trace).
    shared: Shared,
    arenas: Mutex<FxHashMap<u64, crate::arena::Arena>>,
    next_arena: AtomicU64,
    pools: Mutex<FxHashMap<PoolId, PoolEntry>>,
    next_named_pool: AtomicU64,
    routes: Mutex<Vec<Route>>,
    routes_active: AtomicUsize,
    captures_active: AtomicUsize,
    shards: Mutex<ShardTable>,
    generation: AtomicU64,
    /// Every segment's address range and its shard, to find the shard of a pointer that the
    /// calling thread's cached shard does not own. Written only when segments come and go.
    segments: RwLock<BTreeMap<DevicePtr, (DevicePtr, Weak<ShardCell>)>>,
    /// Taken by the paths that visit every shard (OOM, cache emptying) or lock several of them
    /// (checkpoint, restore, pause, resume). It holds the restores' buffers, which one restore
    /// at a time uses.
    reclaim: Mutex<RestoreScratch>,
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
            arenas: Mutex::new(rank::ARENAS, FxHashMap::default()),
            next_arena: AtomicU64::new(1),
            pools: Mutex::new(rank::POOLS, pools),
            next_named_pool: AtomicU64::new(1),
            routes: Mutex::new(rank::ROUTES, Vec::new()),
            routes_active: AtomicUsize::new(0),
            captures_active: AtomicUsize::new(0),
            shards: Mutex::new(rank::SHARDS, FxHashMap::default()),
            generation: AtomicU64::new(0),
            segments: RwLock::new(rank::SEGMENTS, BTreeMap::new()),
            reclaim: Mutex::new(rank::RECLAIM, RestoreScratch::default()),
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
            return Err(AllocError::InvalidArgument(Box::new(format!(
                "memory fraction {fraction} is not in (0, 1]"
            ))));
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

    /// Allocate `size` bytes for use on `stream`. The pool is chosen by the active routes (the
    /// default pool when none match).
    ///
    /// The hot path, inlined into the caller (the C ABI's `sp_alloc`): a hit in the quick cache
    /// of the calling thread's cached shard, answered in registers; everything else goes to
    /// `Allocator::alloc_slow` with the size checked and rounded, neither done again.
    #[inline]
    pub fn alloc(&self, size: u64, stream: StreamId) -> AllocResult<DevicePtr> {
        // The one size check and the one rounding: the quick cache is keyed by the rounded
        // size, and the slow path takes it as it is.
        let rounded = self.round_request(size)?;
        // The quick cache holds small blocks of the default pool: a route may pick another pool
        // (one load, zero while no route is active), a large request would lock the shard to
        // find nothing, and a request over the limit is refused as `alloc_rounded` refuses it,
        // even where the cache holds a block.
        if self.routes_active.load(Ordering::Acquire) == 0
            && crate::policy::is_small(rounded)
            && rounded <= self.shared.budget.limit()
        {
            // The thread's cached shard, if it is still the table's shard of (default pool,
            // `stream`): no lookup, no reference count. `alloc_quick` hands out the cached
            // block of exactly `rounded` bytes, or declines with nothing changed.
            let hit = with_cached_shard_of!(self, PoolId::DEFAULT, stream, |cell| {
                let env = self.env(&cell.pool_budget);
                lock(&cell.shard).alloc_quick(&env, rounded, size)
            });
            if let Some((_, addr)) = hit {
                return Ok(addr);
            }
        }
        self.alloc_slow(size, rounded, stream)
    }

    /// [`Allocator::alloc`] past the quick cache: the routes choose the pool. `size` is valid
    /// and `rounded` its rounding.
    #[cold]
    #[inline(never)]
    fn alloc_slow(&self, size: u64, rounded: u64, stream: StreamId) -> AllocResult<DevicePtr> {
        let pool = self.route_for(stream)?;
        self.alloc_rounded(pool, size, rounded, stream)
    }

    /// Allocate from a given pool, bypassing routes.
    pub fn alloc_in(&self, pool: PoolId, size: u64, stream: StreamId) -> AllocResult<DevicePtr> {
        let rounded = self.round_request(size)?;
        self.alloc_rounded(pool, size, rounded, stream)
    }

    /// `size` rounded to its block size (PyTorch's size classes), if it is a valid request.
    #[inline(always)]
    fn round_request(&self, size: u64) -> AllocResult<u64> {
        // 0 wraps to u64::MAX: one comparison refuses 0 and sizes over `MAX_REQUEST` (a
        // request's block and its page counts must fit in their fields).
        if size.wrapping_sub(1) >= MAX_REQUEST {
            return Err(invalid_size(size));
        }
        Ok(self.config.policy.round_size(size))
    }

    /// Allocate `rounded` bytes (`size` asked, valid) from `pool`: the thread's cached shard
    /// (tried whole, the quick cache again included) or the table's, then the out-of-memory
    /// ladder.
    fn alloc_rounded(
        &self,
        pool: PoolId,
        size: u64,
        rounded: u64,
        stream: StreamId,
    ) -> AllocResult<DevicePtr> {
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
        let fast = with_cached_shard_of!(self, pool, stream, |cell| Some(
            self.alloc_on(cell, rounded, size)
        ));
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
                Err(ShardError::Paused) => return Err(AllocError::PoolPaused(Box::new(pool))),
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

    /// Free a pointer returned by [`Allocator::alloc`]. Unknown pointers and double frees are
    /// rejected and change nothing.
    ///
    /// The hot path, inlined into the caller (the C ABI's `sp_free`): the calling thread's
    /// cached shard; every other pointer, and every error, goes to `Allocator::free_slow`.
    #[inline]
    pub fn free(&self, ptr: DevicePtr) -> AllocResult<()> {
        // The thread's cached shard, asked once: its free looks the pointer up itself (one hash
        // probe in its live map), and changes nothing when it fails, so that the registry can
        // ask the owner, which also reports the error. The cached shard may have been forgotten
        // since: it then owns no pointer, and the free fails.
        let freed = with_cached_shard!(self, |cell| {
            let env = self.env(&cell.pool_budget);
            Some(lock(&cell.shard).free(&env, ptr).is_ok())
        });
        if freed == Some(true) {
            return Ok(());
        }
        self.free_slow(ptr)
    }

    /// [`Allocator::free`] past the calling thread's cached shard: the segment registry finds
    /// the owner.
    #[cold]
    #[inline(never)]
    fn free_slow(&self, ptr: DevicePtr) -> AllocResult<()> {
        self.with_registered_owner(ptr, |cell, s| s.free(&self.env(&cell.pool_budget), ptr))
            .ok_or(AllocError::UnknownPointer(ptr))?
            .map_err(shard_error)
    }

    /// Mark the allocation at `ptr` **graph-retained but reusable**: a captured graph still
    /// references it (a graph output, a static buffer), but later captures of the same pool may
    /// reuse its memory, because the caller promises that the graphs never run at the same time.
    /// The block returns to its pool now; its memory stays mapped at its address while the pool
    /// is in use. The caller keeps its pointer but must not free it again (the PyTorch shim
    /// swallows that later free). Returns the block's size.
    pub fn mark_reusable(&self, ptr: DevicePtr) -> AllocResult<u64> {
        let r = self.with_owner(ptr, |cell, s| {
            let pool = s.pool();
            if s.is_paused() {
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
            Err((ShardError::Paused, pool)) => Err(AllocError::PoolPaused(Box::new(pool))),
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
                return Some(Err(AllocError::InvalidArgument(Box::new(format!(
                    "{ptr:#x} lies in a classic segment: share it with cudaIpcGetMemHandle"
                )))));
            };
            let (first, end) = Shard::page_range(page_size, seg.addr, b.addr, b.size);
            if pt.any_in_run(first, end) {
                return Some(Err(AllocError::InvalidArgument(Box::new(format!(
                    "{ptr:#x} lies in a physical run (a resumed pool's memory), which is not \
                     shared page by page"
                )))));
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

    /// Whether the configured growth mode is vmm.
    pub fn is_vmm(&self) -> bool {
        self.config.growth == GrowthMode::Vmm
    }
}

/// [`AllocError::InvalidSize`], built out of line: the hot path keeps only the branch.
#[cold]
#[inline(never)]
fn invalid_size(size: u64) -> AllocError {
    AllocError::InvalidSize(size)
}

fn shard_error(e: ShardError) -> AllocError {
    match e {
        ShardError::OutOfMemory => AllocError::OutOfMemory(Box::default()),
        ShardError::Device(d) => AllocError::Device(d),
        ShardError::UnknownPointer => AllocError::InvalidState(Box::new("unknown pointer".into())),
        ShardError::NotVmm => AllocError::InvalidState(Box::new("not a vmm segment".into())),
        ShardError::PageNotMapped => AllocError::InvalidState(Box::new("page not mapped".into())),
        ShardError::Retired => AllocError::InvalidState(Box::new("the shard was forgotten".into())),
        ShardError::StaleDuringCapture => AllocError::InvalidState(Box::new(
            "a page slot must be unmapped during a capture".into(),
        )),
        ShardError::Paused => AllocError::InvalidState(Box::new("the pool is paused".into())),
        ShardError::InRun => AllocError::InvalidState(Box::new(
            "a page of a physical run is unmapped only whole".into(),
        )),
    }
}
