//! Host cost of the allocator's hot path on the simulated device (accounting only, streams
//! complete at once), so only slotpool's own bookkeeping is measured.
//!
//! - `pair/{vmm,classic}/<size>`: one alloc + free of a cached size on one thread. The cache is
//!   warmed first and the device calls are counted around the measurement: the measured pair
//!   never grows (no segment, reservation, page or map call).
//! - `random_64_live/{vmm,classic}`: 64 live allocations of log-uniform random sizes
//!   512 B - 64 MiB (fixed seed); each iteration frees a random live one and allocates a new one.
//! - `threads/<n>` (vmm, the default growth mode): n threads on one shared `Allocator`, each on its
//!   own stream, each doing alloc + free pairs of 1 MiB. The figure is ns per pair per thread
//!   (wall time / pairs of one thread); the throughput line is the aggregate in pairs/s. A summary
//!   with the ratio to one thread is printed at the end.
//! - `threads_classic/<n>`: the same in classic growth mode.
//! - `threads_64MiB/<n>`: the same with 64 MiB pairs (vmm): larger than a shard's credit, so each
//!   pair goes through the shard's lease (`slotpool_core::peak`); before leases, through the one
//!   device-wide allocated counter, which every thread then wrote.
//!
//! Run: `cargo bench --bench alloc -- --noplot`.

use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use slotpool::core::{Allocator, Config, GrowthMode};
use slotpool::sim::{Backing, CallKind, SimConfig, SimDevice};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The device calls that mean the allocator grew or shrank.
const GROWTH_CALLS: [CallKind; 6] = [
    CallKind::AllocSegment,
    CallKind::FreeSegment,
    CallKind::Reserve,
    CallKind::CreatePage,
    CallKind::Map,
    CallKind::Unmap,
];

fn device() -> Arc<SimDevice> {
    Arc::new(
        SimDevice::new(SimConfig {
            backing: Backing::Accounting,
            auto_complete: true,
            ..SimConfig::default()
        })
        .expect("sim device"),
    )
}

fn allocator(growth: GrowthMode) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = device();
    let config = Config {
        growth,
        ..Config::default()
    };
    (dev.clone(), Allocator::new(dev, config))
}

fn growth_calls(dev: &SimDevice) -> u64 {
    GROWTH_CALLS.iter().map(|&k| dev.calls(k)).sum()
}

fn mode_name(growth: GrowthMode) -> &'static str {
    match growth {
        GrowthMode::Vmm => "vmm",
        GrowthMode::Classic => "classic",
    }
}

fn size_name(size: u64) -> String {
    if size >= MIB {
        format!("{}MiB", size / MIB)
    } else if size >= KIB {
        format!("{}KiB", size / KIB)
    } else {
        format!("{size}B")
    }
}

/// xorshift64*: small, fast, deterministic.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in [512 B, 64 MiB] (2^9 .. 2^26).
    fn size(&mut self) -> u64 {
        let s = (512.0 * (self.unit() * 17.0).exp2()) as u64;
        s.clamp(512, 64 * MIB)
    }
}

fn bench_pair(c: &mut Criterion) {
    let mut g = c.benchmark_group("pair");
    g.sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        for size in [512, 4 * KIB, MIB, 64 * MIB] {
            let (dev, a) = allocator(growth);
            // Warm: the first pair grows the cache, the second must not.
            for _ in 0..2 {
                let p = a.alloc(size, 0).expect("warm alloc");
                a.free(p).expect("warm free");
            }
            let before = growth_calls(&dev);
            let id = BenchmarkId::new(mode_name(growth), size_name(size));
            g.bench_function(id, |b| {
                b.iter(|| {
                    let p = a.alloc(black_box(size), 0).expect("alloc");
                    a.free(black_box(p)).expect("free");
                })
            });
            let grew = growth_calls(&dev) - before;
            assert_eq!(
                grew,
                0,
                "pair/{}/{}: {grew} growth calls while measuring",
                mode_name(growth),
                size_name(size)
            );
        }
    }
    g.finish();
}

/// 64 live allocations; each step frees a random one and allocates a random size in its place.
struct Churn {
    live: Vec<u64>,
    /// Pre-drawn (slot, size) pairs, so the PRNG is outside the measured loop.
    steps: Vec<(usize, u64)>,
    at: usize,
}

impl Churn {
    const LIVE: usize = 64;

    fn new(a: &Allocator<SimDevice>) -> Self {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let live = (0..Self::LIVE)
            .map(|_| a.alloc(rng.size(), 0).expect("initial alloc"))
            .collect();
        let steps = (0..1 << 16)
            .map(|_| ((rng.next() % Self::LIVE as u64) as usize, rng.size()))
            .collect();
        Churn { live, steps, at: 0 }
    }

    #[inline]
    fn step(&mut self, a: &Allocator<SimDevice>) {
        let (slot, size) = self.steps[self.at];
        self.at = (self.at + 1) & (self.steps.len() - 1);
        a.free(self.live[slot]).expect("free");
        self.live[slot] = a.alloc(black_box(size), 0).expect("alloc");
    }
}

fn bench_random(c: &mut Criterion) {
    let mut g = c.benchmark_group("random_64_live");
    g.sample_size(50)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = allocator(growth);
        let mut churn = Churn::new(&a);
        // Reach the steady state: the cache holds what the mix needs.
        for _ in 0..200_000 {
            churn.step(&a);
        }
        let before = growth_calls(&dev);
        g.bench_function(mode_name(growth), |b| b.iter(|| churn.step(&a)));
        eprintln!(
            "random_64_live/{}: {} growth calls (segment/reserve/page/map/unmap) while measuring",
            mode_name(growth),
            growth_calls(&dev) - before
        );
    }
    g.finish();
}

/// One measured run of [`run_threads`].
#[derive(Clone, Copy, Debug)]
struct ThreadRun {
    threads: usize,
    /// Pairs each thread did.
    iters: u64,
    wall: Duration,
    /// Summed over the threads: ns on a CPU, and ns runnable but waiting for one
    /// (`/proc/thread-self/schedstat`; 0 where unavailable).
    on_cpu_ns: u64,
    runq_wait_ns: u64,
}

/// (ns on a CPU, ns waiting on a run queue) of the calling thread so far, from
/// `/proc/thread-self/schedstat`; zeros where that file is missing.
fn schedstat() -> (u64, u64) {
    let Ok(s) = std::fs::read_to_string("/proc/thread-self/schedstat") else {
        return (0, 0);
    };
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
    (f.next().unwrap_or(0), f.next().unwrap_or(0))
}

/// n threads, each on its own stream, each doing `iters` alloc + free pairs of `size` bytes on
/// `a`. The wall time runs from the first thread's start to the last thread's end, so wall / iters
/// is ns per pair per thread.
fn run_threads(a: &Arc<Allocator<SimDevice>>, n: usize, iters: u64, size: u64) -> ThreadRun {
    let barrier = Arc::new(Barrier::new(n));
    let handles: Vec<_> = (0..n)
        .map(|t| {
            let a = a.clone();
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let stream = t as u64 + 1;
                // Warm this thread's shard and its thread-local shard cache.
                let p = a.alloc(size, stream).expect("warm alloc");
                a.free(p).expect("warm free");
                barrier.wait();
                let s0 = schedstat();
                let start = Instant::now();
                for _ in 0..iters {
                    let p = a.alloc(black_box(size), stream).expect("alloc");
                    a.free(black_box(p)).expect("free");
                }
                let end = Instant::now();
                let s1 = schedstat();
                (start, end, s1.0 - s0.0, s1.1 - s0.1)
            })
        })
        .collect();
    let spans: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("bench thread"))
        .collect();
    let start = spans.iter().map(|s| s.0).min().expect("one thread");
    let end = spans.iter().map(|s| s.1).max().expect("one thread");
    ThreadRun {
        threads: n,
        iters,
        wall: end - start,
        on_cpu_ns: spans.iter().map(|s| s.2).sum(),
        runq_wait_ns: spans.iter().map(|s| s.3).sum(),
    }
}

/// Over all runs of n threads: (ns per pair per thread, aggregate pairs/s, share of n x wall the
/// threads spent on a CPU, share they spent runnable but waiting for a CPU).
fn pooled(runs: &[ThreadRun], n: usize) -> (f64, f64, f64, f64) {
    let (mut pairs, mut wall, mut cpu, mut wait) = (0u64, 0f64, 0f64, 0f64);
    for r in runs.iter().filter(|r| r.threads == n) {
        pairs += r.iters;
        wall += r.wall.as_nanos() as f64;
        cpu += r.on_cpu_ns as f64;
        wait += r.runq_wait_ns as f64;
    }
    let per_thread_ns = wall / pairs as f64;
    let slots = wall * n as f64;
    (
        per_thread_ns,
        n as f64 * 1e9 / per_thread_ns,
        cpu / slots,
        wait / slots,
    )
}

fn bench_threads_in(c: &mut Criterion, group: &str, growth: GrowthMode, size: u64) {
    const COUNTS: [usize; 3] = [1, 2, 4];
    let (_dev, a) = allocator(growth);
    let a = Arc::new(a);
    let runs: Mutex<Vec<ThreadRun>> = Mutex::new(Vec::new());
    let mut g = c.benchmark_group(group);
    g.sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for n in COUNTS {
        // Elements per iteration = pairs per iteration over all threads: criterion's thrpt line
        // is then the aggregate pairs/s.
        g.throughput(Throughput::Elements(n as u64));
        g.bench_function(BenchmarkId::from_parameter(n), |b| {
            b.iter_custom(|iters| {
                let run = run_threads(&a, n, iters, size);
                runs.lock().expect("runs").push(run);
                run.wall
            })
        });
    }
    g.finish();

    let runs = runs.into_inner().expect("runs");
    if COUNTS.iter().any(|&n| !runs.iter().any(|r| r.threads == n)) {
        return; // filtered out, or --profile-time: nothing to summarise
    }
    // With 2 cores shared with other processes, a "waiting for a CPU" share well above 0 means
    // the threads did not all run at once, and the scaling figure understates the allocator.
    let (_, one, _, _) = pooled(&runs, 1);
    println!(
        "{group} summary ({} pairs, {}, all runs incl. warm-up pooled):",
        size_name(size),
        mode_name(growth)
    );
    for n in COUNTS {
        let (ns, pps, cpu, wait) = pooled(&runs, n);
        println!(
            "  {group}/{n}: {ns:.1} ns per pair per thread, {:.2} M pairs/s aggregate, \
             {:.2}x one thread; threads on a CPU {:.0}% of the time, waiting for one {:.0}%",
            pps / 1e6,
            pps / one,
            cpu * 100.0,
            wait * 100.0
        );
    }
}

/// `threads/<n>`: 1 MiB pairs in the default growth mode (vmm).
fn bench_threads(c: &mut Criterion) {
    bench_threads_in(c, "threads", GrowthMode::Vmm, MIB);
}

/// `threads_classic/<n>`: the same in classic mode, whose hot path makes no device call.
fn bench_threads_classic(c: &mut Criterion) {
    bench_threads_in(c, "threads_classic", GrowthMode::Classic, MIB);
}

/// `threads_64MiB/<n>`: large pairs, which go beyond a shard's credit into its lease (a small
/// pair stays within the credit).
fn bench_threads_large(c: &mut Criterion) {
    bench_threads_in(c, "threads_64MiB", GrowthMode::Vmm, 64 * MIB);
}

criterion_group!(
    benches,
    bench_pair,
    bench_random,
    bench_threads,
    bench_threads_classic,
    bench_threads_large
);
criterion_main!(benches);
