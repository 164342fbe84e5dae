//! A restore's instructions, for callgrind (`bash benches/restore_count.sh`): the pattern of
//! `benches/checkpoint.rs`'s `half_changed/<n>` (a private pool of n live blocks and n holes,
//! checkpointed; half of the live blocks freed and as many others allocated; restored), repeated,
//! each restore inside `restore_once`, which the script counts alone (`--toggle-collect`).
//!
//! `cargo bench --bench restore_count -- [N [REPEATS [fresh]]]`: N live blocks (10,000), REPEATS
//! restores (5); `fresh`: each restore in a pool of its own, made, checkpointed and changed for
//! it, as each new CUDA graph's pool is (`half_changed_fresh`).

use std::hint::black_box;
use std::sync::Arc;

use slotpool::core::{Allocator, Checkpoint, Config, PoolId, PoolOptions, RestoreDelta};
use slotpool::sim::{Backing, SimConfig, SimDevice};

/// The one call the script counts.
#[inline(never)]
fn restore_once(a: &Allocator<SimDevice>, pool: PoolId, cp: &Checkpoint) -> RestoreDelta {
    a.restore(pool, cp, &[]).expect("restore")
}

/// `n` live blocks and `n` holes in `pool`: the live ones.
fn holes(a: &Allocator<SimDevice>, pool: PoolId, n: u64) -> Vec<u64> {
    let all: Vec<u64> = (0..2 * n)
        .map(|i| {
            a.alloc_in(pool, 512 * (1 + (i * 7) % 64), 0)
                .expect("alloc")
        })
        .collect();
    let mut live = Vec::new();
    for (i, p) in all.into_iter().enumerate() {
        if i % 2 == 0 {
            live.push(p);
        } else {
            a.free(p).expect("free");
        }
    }
    live
}

/// Half of `live` freed and as many others allocated in `pool`.
fn half_change(a: &Allocator<SimDevice>, pool: PoolId, live: &[u64]) {
    for &p in live.iter().step_by(2) {
        a.free(p).expect("free");
    }
    for i in 0..live.len() as u64 / 2 {
        a.alloc_in(pool, 512 * (1 + (i * 13) % 64), 0)
            .expect("alloc");
    }
}

fn main() {
    // `cargo bench` passes `--bench`: only the numbers count.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let n: u64 = args.first().map_or(10_000, |s| s.parse().expect("N"));
    let repeats: u64 = args.get(1).map_or(5, |s| s.parse().expect("REPEATS"));
    let fresh = args.get(2).is_some_and(|s| s == "fresh");
    let dev = SimDevice::new(SimConfig {
        backing: Backing::Accounting,
        auto_complete: true,
        ..SimConfig::default()
    })
    .expect("sim device");
    let a = Allocator::new(Arc::new(dev), Config::default());
    let mut changes = 0;
    if fresh {
        for r in 0..repeats {
            let pool = PoolId(0, 2 + r);
            a.create_or_incref_pool(pool, PoolOptions::default())
                .expect("pool");
            let live = holes(&a, pool, n);
            let cp = a.checkpoint(pool).expect("checkpoint");
            half_change(&a, pool, &live);
            let d = black_box(restore_once(&a, pool, &cp));
            changes += d.freed.len() + d.created.len();
            drop(cp);
            for p in live {
                a.free(p).expect("free");
            }
            a.release_pool(pool).expect("release");
        }
    } else {
        let pool = PoolId(0, 1);
        a.create_or_incref_pool(pool, PoolOptions::default())
            .expect("pool");
        let live = holes(&a, pool, n);
        let cp = a.checkpoint(pool).expect("checkpoint");
        for _ in 0..repeats {
            half_change(&a, pool, &live);
            let d = black_box(restore_once(&a, pool, &cp));
            changes += d.freed.len() + d.created.len();
        }
    }
    println!("restore_count: live_blocks={n} repeats={repeats} fresh={fresh} changes={changes}");
}
