//! Checkpoint / restore of a private pool against its number of live blocks, in the shape that
//! PyTorch's own figures were measured on (`benches/traces/README.md`): a pool holding n live
//! blocks and n free holes. PyTorch 2.11 on the H200 host: checkpoint 86 / 786 / 7,414 us and
//! restore 203 / 3,193 / 32,104 us for n = 100 / 1,000 / 10,000.
//!
//! - `unchanged/<n>`: checkpoint + restore of an unchanged pool (empty keep-live list).
//! - `unchanged_keep_all/<n>`: the same, validating all n live blocks as keep-live.
//! - `half_changed/<n>`: restore after half the live blocks were freed and as many allocated
//!   (the changes are made outside the timing).
//! - `half_changed_fresh/<n>`: the same in a pool made, checkpointed and changed for the one
//!   restore (outside the timing), as each new CUDA graph's pool is.
//! - `half_changed_older/<n>`: `half_changed` to a checkpoint that a later one follows (alive),
//!   as CUDA graph trees return to a node whose children hold checkpoints: the restore is
//!   journaled (it logs its own change for the later checkpoint).
//!
//! Run: `cargo bench --bench checkpoint -- --noplot`.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, Bencher, BenchmarkId, Criterion, criterion_group, criterion_main};
use slotpool::core::{Allocator, Checkpoint, Config, PoolId, PoolOptions};
use slotpool::sim::{Backing, SimConfig, SimDevice};

const POOL: PoolId = PoolId(0, 1);

/// An allocator with [`POOL`] created, on the simulated device.
fn allocator() -> Allocator<SimDevice> {
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            backing: Backing::Accounting,
            auto_complete: true,
            ..SimConfig::default()
        })
        .expect("sim device"),
    );
    let a = Allocator::new(dev, Config::default());
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    a
}

/// `n` live blocks and `n` free holes between them in `pool`: the live ones.
fn holes(a: &Allocator<SimDevice>, pool: PoolId, n: usize) -> Vec<u64> {
    let all: Vec<u64> = (0..2 * n as u64)
        .map(|i| a.alloc_in(pool, 512 * (1 + (i * 7) % 64), 0).unwrap())
        .collect();
    let mut live = Vec::with_capacity(n);
    for (i, p) in all.into_iter().enumerate() {
        if i % 2 == 0 {
            live.push(p);
        } else {
            a.free(p).unwrap();
        }
    }
    live
}

/// Half of `live` freed and as many others allocated in `pool`.
fn half_change(a: &Allocator<SimDevice>, pool: PoolId, live: &[u64]) {
    for &p in live.iter().step_by(2) {
        a.free(p).unwrap();
    }
    for i in 0..live.len() as u64 / 2 {
        a.alloc_in(pool, 512 * (1 + (i * 13) % 64), 0).unwrap();
    }
}

/// A new pool of `n` live blocks and `n` holes, checkpointed, then half changed; dropped, its
/// blocks (those of the checkpoint, which a restore leaves live) are freed and it is released.
struct FreshPool<'a> {
    a: &'a Allocator<SimDevice>,
    pool: PoolId,
    cp: Checkpoint,
    live: Vec<u64>,
}

impl<'a> FreshPool<'a> {
    fn new(a: &'a Allocator<SimDevice>, pool: PoolId, n: usize) -> Self {
        a.create_or_incref_pool(pool, PoolOptions::default())
            .unwrap();
        let live = holes(a, pool, n);
        let cp = a.checkpoint(pool).unwrap();
        half_change(a, pool, &live);
        FreshPool { a, pool, cp, live }
    }
}

impl Drop for FreshPool<'_> {
    fn drop(&mut self) {
        // Restored: the checkpoint's blocks are the pool's live ones.
        for &p in &self.live {
            self.a.free(p).unwrap();
        }
        self.a.release_pool(self.pool).unwrap();
    }
}

/// Samples of [`POOL`] restored to `cp` after a [`half_change`] of `live` (made outside the
/// timing).
fn restore_half_changed(b: &mut Bencher, a: &Allocator<SimDevice>, live: &[u64], cp: &Checkpoint) {
    b.iter_batched(
        || half_change(a, POOL, live),
        |()| black_box(a.restore(POOL, cp, &[]).unwrap()),
        BatchSize::PerIteration,
    )
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("checkpoint");
    g.sample_size(30)
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300));
    for n in [100usize, 1_000, 10_000] {
        let a = allocator();
        let live = holes(&a, POOL, n);
        g.bench_with_input(BenchmarkId::new("unchanged", n), &n, |b, _| {
            b.iter(|| {
                let cp = a.checkpoint(POOL).unwrap();
                black_box(a.restore(POOL, &cp, &[]).unwrap());
            })
        });
        g.bench_with_input(BenchmarkId::new("unchanged_keep_all", n), &n, |b, _| {
            b.iter(|| {
                let cp = a.checkpoint(POOL).unwrap();
                black_box(a.restore(POOL, &cp, &live).unwrap());
            })
        });
        let cp = a.checkpoint(POOL).unwrap();
        g.bench_with_input(BenchmarkId::new("half_changed", n), &n, |b, _| {
            restore_half_changed(b, &a, &live, &cp)
        });
        if n == 10_000 {
            // The pool is back at `cp`; a later checkpoint, one block on.
            let later = a.alloc_in(POOL, 4096, 0).unwrap();
            let cp_later = a.checkpoint(POOL).unwrap();
            g.bench_with_input(BenchmarkId::new("half_changed_older", n), &n, |b, _| {
                restore_half_changed(b, &a, &live, &cp)
            });
            // Back to `cp`, which frees `later` (the samples' restores have already, unless a
            // filter skipped them).
            a.restore(POOL, &cp, &[]).unwrap();
            drop(cp_later);
            assert!(a.free(later).is_err(), "the restore freed the later block");
        }
        drop(cp);
        if n == 10_000 {
            // One allocator for every sample; each sample's pool is freed and released when
            // the sample is dropped (after its timing), as graphs' pools come and go.
            let a = allocator();
            let mut next = 1;
            g.bench_with_input(BenchmarkId::new("half_changed_fresh", n), &n, |b, _| {
                b.iter_batched(
                    || {
                        next += 1;
                        FreshPool::new(&a, PoolId(0, next), n)
                    },
                    |s| {
                        black_box(a.restore(s.pool, &s.cp, &[]).unwrap());
                        s
                    },
                    BatchSize::PerIteration,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
