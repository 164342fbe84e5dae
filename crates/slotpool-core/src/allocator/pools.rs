//! Pools and routes: the pool table (use counts, options, budgets), and the routes that send allocations to a pool.

use crate::device::{CaptureStatus, Device, DevicePtr, StreamId};
use crate::env::Budget;
use crate::error::{AllocError, AllocResult};
use crate::pool::{PoolId, PoolOptions};
use crate::route::{Route, RouteFilter, current_thread_id};
use crate::sync::lock;
use rustc_hash::FxHashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::Allocator;
use super::pause::PauseMode;

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
    pub paused: Option<PauseMode>,
}

impl<D: Device> Allocator<D> {
    pub(super) fn use_on_oom_pools(&self, except: PoolId) -> Vec<PoolId> {
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
            return Err(AllocError::InvalidArgument(Box::new(
                "the default pool always exists".into(),
            )));
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
            return Err(AllocError::InvalidArgument(Box::new(
                "empty pool name".into(),
            )));
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
            .ok_or_else(|| AllocError::UnknownPool(Box::new(id)))
    }

    /// Change a pool's options (`setUseOnOOM`, `setNoSplit`, byte limit).
    pub fn set_pool_options(&self, id: PoolId, options: PoolOptions) -> AllocResult<()> {
        let mut pools = lock(&self.pools);
        let e = pools
            .get_mut(&id)
            .ok_or_else(|| AllocError::UnknownPool(Box::new(id)))?;
        e.budget.set_limit(options.limit.unwrap_or(u64::MAX));
        e.options = options;
        Ok(())
    }

    /// A pool's options.
    pub fn pool_options(&self, id: PoolId) -> AllocResult<PoolOptions> {
        lock(&self.pools)
            .get(&id)
            .map(|e| e.options.clone())
            .ok_or_else(|| AllocError::UnknownPool(Box::new(id)))
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
            return Err(AllocError::InvalidArgument(Box::new(
                "the default pool cannot be released".into(),
            )));
        }
        let mut pools = lock(&self.pools);
        let e = pools
            .get_mut(&id)
            .ok_or_else(|| AllocError::UnknownPool(Box::new(id)))?;
        if e.use_count == 0 {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {id} was already released"
            ))));
        }
        if e.use_count == 1 && lock(&self.routes).iter().any(|r| r.pool == id) {
            return Err(AllocError::InvalidState(Box::new(format!(
                "pool {id} has an active route (begin_allocate_to_pool): end the route before \
                 releasing the pool's last use"
            ))));
        }
        e.use_count -= 1;
        Ok(e.use_count)
    }

    /// Every registered pool id.
    pub fn pools(&self) -> Vec<PoolId> {
        let mut v: Vec<PoolId> = lock(&self.pools).keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// A private pool with uses left: its graph-retained memory must stay where it is.
    pub(super) fn pool_in_use(&self, pool: PoolId) -> bool {
        !pool.is_default() && lock(&self.pools).get(&pool).is_none_or(|e| e.use_count > 0)
    }

    /// Live allocations of `pool`: (address, size), in address order. Costs O(blocks of the
    /// pool).
    pub fn live_allocations(&self, pool: PoolId) -> AllocResult<Vec<(DevicePtr, u64)>> {
        Ok(self
            .live_allocation_list(pool)?
            .into_iter()
            .map(|l| (l.addr, l.size))
            .collect())
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
        Err(AllocError::InvalidState(Box::new(format!(
            "pool {pool}: live but not expected [{}], expected but not live [{}]",
            extra.join(", "),
            missing.join(", ")
        ))))
    }

    /// Wait for the cross-stream events of `pool`'s pending frees, so that they become reusable.
    /// Does nothing during a capture. Returns the frees still pending.
    pub fn drain_pending_frees(&self, pool: PoolId) -> AllocResult<usize> {
        if !lock(&self.pools).contains_key(&pool) {
            return Err(AllocError::UnknownPool(Box::new(pool)));
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

    /// Send allocations that match `filter` to `pool` until [`Allocator::end_allocate_to_pool`]
    /// (PyTorch's `beginAllocateToPool`): the pool gains a use (created if new). Newest route
    /// first; a pool already being recorded to is refused.
    pub fn begin_allocate_to_pool(&self, pool: PoolId, filter: RouteFilter) -> AllocResult<()> {
        if pool.is_default() {
            return Err(AllocError::InvalidArgument(Box::new(
                "cannot route to the default pool".into(),
            )));
        }
        // Lock order: pools, then routes (`release_pool` reads the routes under the pools).
        let mut pools = lock(&self.pools);
        let mut routes = lock(&self.routes);
        if routes.iter().any(|r| r.pool == pool) {
            return Err(AllocError::InvalidState(Box::new(format!(
                "already recording to pool {pool}"
            ))));
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
        let i = routes.iter().rposition(|r| r.pool == pool).ok_or_else(|| {
            AllocError::InvalidState(Box::new(format!("no route to pool {pool}")))
        })?;
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
}
