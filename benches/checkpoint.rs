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
use std::time::Duration;

use criterion::{BatchSize, Bencher, BenchmarkId, Criterion, criterion_group, criterion_main};
use slotpool::core::{Allocator, Checkpoint, PoolId};
use slotpool::sim::SimDevice;

const POOL: PoolId = PoolId(0, 1);

#[path = "common/half_changed.rs"]
mod half_changed;

use half_changed::{FreshPool, half_change, holes};

/// An allocator with [`POOL`] created, on the simulated device.
fn allocator() -> Allocator<SimDevice> {
    half_changed::allocator(POOL)
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
