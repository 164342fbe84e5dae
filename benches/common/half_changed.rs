//! The pattern of the restore benches (`checkpoint.rs`, `restore_count.rs`): a private pool of n
//! live blocks and n free holes, checkpointed, then half of the live blocks freed and as many
//! others allocated, on the simulated device. PyTorch's figures for it: benches/traces/README.md.

use std::sync::Arc;

use slotpool::core::{Allocator, Checkpoint, Config, PoolId, PoolOptions};
use slotpool::sim::{Backing, SimConfig, SimDevice};

/// An allocator on the simulated device, with `pool` created.
pub fn allocator(pool: PoolId) -> Allocator<SimDevice> {
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            backing: Backing::Accounting,
            auto_complete: true,
            ..SimConfig::default()
        })
        .expect("sim device"),
    );
    let a = Allocator::new(dev, Config::default());
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    a
}

/// `n` live blocks and `n` free holes between them in `pool`: the live ones.
pub fn holes(a: &Allocator<SimDevice>, pool: PoolId, n: usize) -> Vec<u64> {
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
pub fn half_change(a: &Allocator<SimDevice>, pool: PoolId, live: &[u64]) {
    for &p in live.iter().step_by(2) {
        a.free(p).unwrap();
    }
    for i in 0..live.len() as u64 / 2 {
        a.alloc_in(pool, 512 * (1 + (i * 13) % 64), 0).unwrap();
    }
}

/// A new pool of `n` live blocks and `n` holes, checkpointed, then half changed; dropped, its
/// blocks (those of the checkpoint, which a restore leaves live) are freed and it is released.
pub struct FreshPool<'a> {
    a: &'a Allocator<SimDevice>,
    pub pool: PoolId,
    pub cp: Checkpoint,
    live: Vec<u64>,
}

impl<'a> FreshPool<'a> {
    pub fn new(a: &'a Allocator<SimDevice>, pool: PoolId, n: usize) -> Self {
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
