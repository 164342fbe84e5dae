//! Replay of a CUDA-graph variant trace (benches/gpu/record_graph_variants.py) three ways:
//! each variant's captures in a private pool of its own (PyTorch's default), all variants in one
//! shared pool (`graph_pool_handle`), and slotpool's variant group (one pool for everything each
//! variant allocates, captured or not; each variant starts from the checkpoint taken before
//! variant 0).
//!
//! Allocations between `capture_begin` and `capture_end` markers go to the capture pool of the
//! current variant; all others to the default pool. `empty_cache` runs at each `capture_begin`,
//! as `torch.cuda.graph` does before capturing. The figure that matters is the growth of
//! physical memory from the first `variant_begin` on, as PyTorch's "reserved growth caused by
//! capture".

use std::sync::Arc;

use rustc_hash::FxHashMap;
use serde::Serialize;
use slotpool_core::{
    Allocator, Config, GrowthMode, PoolId, PoolOptions, RouteFilter, VariantGroup,
};
use slotpool_sim::{Backing, SimConfig, SimDevice};

use crate::trace::{Action, Trace};

/// How the captures of the variants are pooled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VariantMode {
    /// One private pool per variant.
    Separate,
    /// One pool for every variant, no restore.
    Shared,
    /// One pool, a variant group: each variant starts from the same checkpoint.
    Group,
}

/// What a variant replay measured.
#[derive(Clone, Debug, Serialize)]
pub struct VariantReport {
    pub trace: String,
    pub mode: VariantMode,
    pub variants: usize,
    pub captures: usize,
    /// Physical bytes when the first variant began.
    pub base_physical: u64,
    /// Peak physical bytes from then on, minus the base.
    pub peak_growth: u64,
    /// Physical bytes at the end, minus the base (PyTorch's "reserved growth").
    pub final_growth: u64,
    /// Allocations that a variant's restore freed (what earlier variants left live).
    pub freed_by_restore: u64,
    pub skipped_frees: u64,
    /// Peak of the bytes the trace holds live (its own sizes, every pool), from the first
    /// `variant_begin` on: the "peak allocated" that a reserved/allocated ratio divides by.
    pub peak_live: u64,
    /// The least physical memory any allocator can hold, from the first `variant_begin` on, while
    /// keeping what captured graphs reference (separate and shared modes): at each step, every
    /// capture pool's high-water mark of live bytes so far (a graph may replay and touch all of
    /// it at any time) plus the bytes live outside capture pools; the maximum over the trace.
    /// `None` in group mode, whose variants never run at once.
    pub retention_floor: Option<u64>,
}

const H200_MEMORY: u64 = 143_771_000_832;

/// The pool of the shared and group modes.
const GROUP_POOL: PoolId = PoolId(0, 1);

/// The pool the captures of `variant` go to.
fn capture_pool(mode: VariantMode, variant: usize) -> PoolId {
    match mode {
        VariantMode::Separate => PoolId(0, 100 + variant as u64),
        VariantMode::Shared | VariantMode::Group => GROUP_POOL,
    }
}

/// Replay `trace` with its captures pooled as `mode` says, in vmm mode with the default
/// configuration.
pub fn replay_variants(trace: &Trace, mode: VariantMode) -> Result<VariantReport, String> {
    replay_variants_with(
        trace,
        mode,
        Config {
            growth: GrowthMode::Vmm,
            ..Config::default()
        },
    )
}

/// [`replay_variants`] with a given allocator configuration (`--conf`).
pub fn replay_variants_with(
    trace: &Trace,
    mode: VariantMode,
    config: Config,
) -> Result<VariantReport, String> {
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            total_memory: H200_MEMORY,
            backing: Backing::Accounting,
            auto_complete: true,
            page_size: config
                .vmm_page_size
                .unwrap_or(SimConfig::default().page_size),
        })
        .map_err(|e| e.to_string())?,
    );
    let alloc = Allocator::new(dev.clone(), config);
    let free_action = if trace.count(Action::FreeCompleted) > 0 {
        Action::FreeCompleted
    } else {
        Action::FreeRequested
    };
    let mut group: Option<VariantGroup> = None;
    let mut capture_route: Option<PoolId> = None;
    // Trace address -> (slotpool's pointer, size, capture pool or None).
    let mut live: FxHashMap<u64, (u64, u64, Option<PoolId>)> = FxHashMap::default();
    let mut floor = RetentionFloor::default();
    let (mut variant, mut variants, mut captures) = (0usize, 0usize, 0usize);
    let mut in_capture = false;
    let mut base: Option<u64> = None;
    let (mut peak, mut freed_by_restore, mut skipped) = (0u64, 0u64, 0u64);
    let at = |line: usize| trace.location(line).to_string();
    for e in &trace.events {
        match e.action {
            Action::VariantBegin => {
                variant = e.size as usize;
                variants += 1;
                if base.is_none() {
                    dev.reset_peak_physical();
                    base = Some(dev.physical_bytes());
                }
                if mode == VariantMode::Group {
                    let g = match &mut group {
                        Some(g) => {
                            alloc.end_variant(g).map_err(|e| e.to_string())?;
                            g
                        }
                        None => group.insert(
                            alloc
                                .variant_group(GROUP_POOL, 64)
                                .map_err(|e| e.to_string())?,
                        ),
                    };
                    let delta = alloc.begin_variant(g, variant).map_err(|e| e.to_string())?;
                    let gone: rustc_hash::FxHashSet<u64> =
                        delta.freed.iter().map(|f| f.0).collect();
                    let before = live.len();
                    live.retain(|_, (p, _, _)| !gone.contains(p));
                    freed_by_restore += (before - live.len()) as u64;
                }
            }
            Action::CaptureBegin => {
                // torch.cuda.graph's __enter__ empties the cache before every capture.
                alloc.empty_cache();
                in_capture = true;
                captures += 1;
                // A capture route whose id matches no stream (as the PyTorch shim registers
                // one before cudaStreamBeginCapture): slotpool knows a capture is underway and
                // keeps what the graph touches (graph-retained) while the pool is in use.
                let pool = capture_pool(mode, variant);
                alloc
                    .begin_allocate_to_pool(pool, RouteFilter::Capture(u64::MAX))
                    .map_err(|e| e.to_string())?;
                capture_route = Some(pool);
            }
            Action::CaptureEnd => {
                in_capture = false;
                if let Some(pool) = capture_route.take() {
                    alloc
                        .end_allocate_to_pool(pool)
                        .map_err(|e| e.to_string())?;
                }
            }
            Action::Alloc => {
                let pool = match (in_capture, mode) {
                    // A variant group takes everything its variants allocate, inside their
                    // captures or not (static inputs, gradient buffers, warm-up scratch), as
                    // slotpool_torch's variant block routes the thread to the group's pool.
                    (false, VariantMode::Group) if group.is_some() => GROUP_POOL,
                    (false, _) => PoolId::DEFAULT,
                    (true, _) => capture_pool(mode, variant),
                };
                if !pool.is_default() && alloc.pool_use_count(pool).is_err() {
                    alloc
                        .create_or_incref_pool(pool, PoolOptions::default())
                        .map_err(|e| e.to_string())?;
                }
                if let Some((old, size, cap)) = live.remove(&e.addr) {
                    alloc
                        .free(old)
                        .map_err(|err| format!("{}: {err}", at(e.line)))?;
                    floor.free(size, cap);
                }
                let p = alloc
                    .alloc_in(pool, e.size, e.stream)
                    .map_err(|err| format!("{}: {err}", at(e.line)))?;
                let cap = in_capture.then_some(pool);
                live.insert(e.addr, (p, e.size, cap));
                floor.alloc(e.size, cap);
            }
            a if a == free_action => match live.remove(&e.addr) {
                Some((p, size, cap)) => {
                    alloc
                        .free(p)
                        .map_err(|err| format!("{}: {err}", at(e.line)))?;
                    floor.free(size, cap);
                }
                None => skipped += 1,
            },
            _ => continue,
        }
        peak = peak.max(dev.physical_bytes());
        if base.is_some() {
            floor.sample();
        }
    }
    if let Some(mut g) = group
        && g.active().is_some()
    {
        alloc.end_variant(&mut g).map_err(|e| e.to_string())?;
    }
    alloc.check_invariants()?;
    let base = base.ok_or_else(|| format!("{}: no variant_begin markers", trace.source))?;
    Ok(VariantReport {
        trace: trace.name(),
        mode,
        variants,
        captures,
        base_physical: base,
        peak_growth: dev.peak_physical_bytes().max(peak).saturating_sub(base),
        final_growth: dev.physical_bytes().saturating_sub(base),
        freed_by_restore,
        skipped_frees: skipped,
        peak_live: floor.peak_live,
        retention_floor: (mode != VariantMode::Group).then_some(floor.floor),
    })
}

/// Live bytes per capture pool and outside them, and the two peaks of [`VariantReport`].
#[derive(Default)]
struct RetentionFloor {
    outside: u64,
    /// Per capture pool: (live bytes, high-water mark).
    pools: FxHashMap<PoolId, (u64, u64)>,
    peak_live: u64,
    floor: u64,
}

impl RetentionFloor {
    fn alloc(&mut self, size: u64, pool: Option<PoolId>) {
        match pool {
            None => self.outside += size,
            Some(p) => {
                let (live, high) = self.pools.entry(p).or_default();
                *live += size;
                *high = (*high).max(*live);
            }
        }
    }

    fn free(&mut self, size: u64, pool: Option<PoolId>) {
        match pool {
            None => self.outside -= size,
            Some(p) => self.pools.entry(p).or_default().0 -= size,
        }
    }

    fn sample(&mut self) {
        let (live, high) = self
            .pools
            .values()
            .fold((0, 0), |(l, h), &(pl, ph)| (l + pl, h + ph));
        self.peak_live = self.peak_live.max(self.outside + live);
        self.floor = self.floor.max(self.outside + high);
    }
}
