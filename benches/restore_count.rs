//! A restore's instructions, for callgrind (`bash benches/restore_count.sh`): the pattern of
//! `benches/checkpoint.rs`'s `half_changed/<n>` (`common/half_changed.rs`), repeated, each
//! restore inside `restore_once`, which the script counts alone (`--toggle-collect`).
//!
//! `cargo bench --bench restore_count -- [N [REPEATS [fresh]]]`: N live blocks (10,000), REPEATS
//! restores (5); `fresh`: each restore in a pool of its own, made, checkpointed and changed for
//! it, as each new CUDA graph's pool is (`half_changed_fresh`).

#[path = "common/half_changed.rs"]
mod half_changed;

use std::hint::black_box;

use half_changed::{FreshPool, allocator, half_change, holes};
use slotpool::core::{Allocator, Checkpoint, PoolId, RestoreDelta};
use slotpool::sim::SimDevice;

/// The one call the script counts.
#[inline(never)]
fn restore_once(a: &Allocator<SimDevice>, pool: PoolId, cp: &Checkpoint) -> RestoreDelta {
    a.restore(pool, cp, &[]).expect("restore")
}

fn main() {
    // `cargo bench` passes `--bench`: only the numbers count.
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let n: usize = args.first().map_or(10_000, |s| s.parse().expect("N"));
    let repeats: u64 = args.get(1).map_or(5, |s| s.parse().expect("REPEATS"));
    let fresh = args.get(2).is_some_and(|s| s == "fresh");
    let pool = PoolId(0, 1);
    let a = allocator(pool);
    let mut changes = 0;
    if fresh {
        for r in 0..repeats {
            let s = FreshPool::new(&a, PoolId(0, 2 + r), n);
            let d = black_box(restore_once(&a, s.pool, &s.cp));
            changes += d.freed.len() + d.created.len();
        }
    } else {
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
