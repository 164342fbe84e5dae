//! Helpers shared by the integration tests.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use slotpool::core::{Allocator, Config, GrowthMode, PoolId, PoolOptions};
use slotpool::sim::{Backing, SimConfig, SimDevice};

pub const MIB: u64 = 1 << 20;

/// How long racing threads run: `default` normally, `heavy` under `SLOTPOOL_HEAVY=1`.
pub fn race_duration(default: Duration, heavy: Duration) -> Duration {
    if std::env::var("SLOTPOOL_HEAVY").as_deref() == Ok("1") {
        heavy
    } else {
        default
    }
}

/// A thread that calls `f` again and again until `stop` is set; it joins to how many times.
pub fn repeat_until(
    stop: &Arc<AtomicBool>,
    mut f: impl FnMut() + Send + 'static,
) -> JoinHandle<u64> {
    let stop = stop.clone();
    thread::spawn(move || {
        let mut n = 0u64;
        while !stop.load(Ordering::Relaxed) {
            f();
            n += 1;
        }
        n
    })
}

/// A byte-backed simulated device of `total` bytes and an allocator over it.
pub fn setup(growth: GrowthMode, total: u64) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    setup_paged(growth, total, None)
}

/// As [`setup`] on a 1 GiB device, with `pool` created (default options).
pub fn setup_with_pool(growth: GrowthMode, pool: PoolId) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let (dev, a) = setup(growth, 1 << 30);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .expect("create the test's pool");
    (dev, a)
}

/// As [`setup`], with vmm pages of `page` bytes (`vmm_page_mb`; the device is built with them).
/// Pages above 2 MiB put small blocks in classic segments: one shard mixes both kinds.
pub fn setup_paged(
    growth: GrowthMode,
    total: u64,
    page: Option<u64>,
) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    setup_configured(growth, total, page, None)
}

/// As [`setup_paged`], with `garbage_collection_threshold` (active once a limit is set).
pub fn setup_configured(
    growth: GrowthMode,
    total: u64,
    page: Option<u64>,
    gc_threshold: Option<f64>,
) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let defaults = SimConfig::default();
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            total_memory: total,
            backing: Backing::Bytes,
            page_size: page.unwrap_or(defaults.page_size),
            ..defaults
        })
        .expect("sim device"),
    );
    let config = Config {
        growth,
        vmm_reservation: Some(1 << 30),
        vmm_page_size: page,
        gc_threshold,
        ..Config::default()
    };
    let alloc = Allocator::new(dev.clone(), config);
    (dev, alloc)
}

/// One live allocation the test wrote a pattern into.
#[derive(Clone, Debug)]
pub struct Live {
    pub ptr: u64,
    pub size: u64,
    pub seed: u64,
    pub stream: u64,
}

/// Assert the allocator's invariants, the device contract, and that no live allocation
/// overlaps another or lost its pattern.
pub fn check_all(dev: &SimDevice, alloc: &Allocator<SimDevice>, live: &[Live]) {
    if let Err(e) = alloc.check_invariants() {
        panic!("invariant broken: {e}");
    }
    assert_eq!(
        dev.contract_violations(),
        0,
        "device contract: {:?}",
        dev.last_violation()
    );
    assert_eq!(dev.capture_violations(), 0, "capture rule broken");
    assert_eq!(
        dev.work_violations(),
        0,
        "memory released under queued work: {:?}",
        dev.last_work_violation()
    );
    let mut by_addr: BTreeMap<u64, u64> = BTreeMap::new();
    for l in live {
        by_addr.insert(l.ptr, l.size);
    }
    let mut end = 0;
    for (&a, &s) in &by_addr {
        assert!(a >= end, "live allocations overlap at {a:#x}");
        end = a + s;
    }
    for l in live {
        if let Err(e) = verify_probes(dev, l.ptr, l.size, l.seed) {
            panic!("allocation {:#x}+{} lost its pattern: {e}", l.ptr, l.size);
        }
    }
}

/// Probes of an allocation: 64 bytes at every 64 KiB (the sim's chunk) and the last 64 bytes,
/// each with its own seed, so that a page that moved or an overlap anywhere shows.
fn probes(ptr: u64, size: u64, seed: u64) -> impl Iterator<Item = (u64, u64, u64)> {
    const STRIDE: u64 = 64 * 1024;
    let n = size.div_ceil(STRIDE);
    (0..n)
        .map(move |i| {
            let off = i * STRIDE;
            (
                ptr + off,
                (size - off).min(64),
                seed.wrapping_mul(31).wrapping_add(i),
            )
        })
        .chain((size >= (n - 1) * STRIDE + 128).then(|| (ptr + size - 64, 64, !seed)))
}

/// Write the probes' patterns.
pub fn fill_probes(dev: &SimDevice, ptr: u64, size: u64, seed: u64) {
    for (p, n, s) in probes(ptr, size, seed) {
        dev.fill(p, n, s).expect("fill");
    }
}

/// Check the probes' patterns.
pub fn verify_probes(dev: &SimDevice, ptr: u64, size: u64, seed: u64) -> Result<(), String> {
    for (p, n, s) in probes(ptr, size, seed) {
        dev.verify(p, n, s).map_err(|e| format!("{e:?}"))?;
    }
    Ok(())
}

/// Proptest cases: `default`, or `PROPTEST_CASES` when set (`SLOTPOOL_HEAVY=1` sets it).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
