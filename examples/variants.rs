//! A variant group: four mutually exclusive variants (the shapes of one layer at context
//! parallelism 1, 2, 4 and 8) captured into one pool. Each variant starts from the state the
//! group began with, so the pool ends up holding the largest variant, not the sum.
//!
//! `cargo run --release --example variants`

use std::sync::Arc;

use slotpool::core::{Allocator, Config, PoolId, PoolOptions};
use slotpool::sim::{Backing, SimConfig, SimDevice};

const MIB: u64 = 1 << 20;

/// What one variant allocates: activations scaled by its sequence length, a temporary freed
/// before the end, and an output that stays live (the graph's output).
fn run_variant(
    alloc: &Allocator<SimDevice>,
    pool: PoolId,
    seq: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let act = alloc.alloc_in(pool, seq * 64 * 1024, 0)?;
    let tmp = alloc.alloc_in(pool, seq * 32 * 1024, 0)?;
    let _out = alloc.alloc_in(pool, seq * 16 * 1024, 0)?;
    alloc.free(tmp)?;
    alloc.free(act)?;
    Ok(())
}

fn device() -> Arc<SimDevice> {
    let config = SimConfig {
        backing: Backing::Accounting,
        auto_complete: true,
        ..SimConfig::default()
    };
    Arc::new(SimDevice::new(config).expect("a valid simulated device"))
}

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let seqs = [8192, 4096, 2048, 1024];

    // The largest variant alone.
    let dev = device();
    let alloc = Allocator::new(dev.clone(), Config::default());
    let pool = alloc.named_pool("alone", PoolOptions::default())?;
    run_variant(&alloc, pool, seqs[0])?;
    let alone = dev.peak_physical_bytes();

    // All four in one variant group, in any order.
    let dev = device();
    let alloc = Allocator::new(dev.clone(), Config::default());
    let pool = alloc.named_pool("variants", PoolOptions::default())?;
    let mut group = alloc.variant_group(pool, seqs.len())?;
    for k in [2, 0, 3, 1] {
        // Frees what the previous variant left live; the caller gives up those pointers.
        let _delta = alloc.begin_variant(&mut group, k)?;
        run_variant(&alloc, pool, seqs[k])?;
        alloc.end_variant(&mut group)?;
    }
    let grouped = dev.peak_physical_bytes();
    alloc.check_invariants()?;

    println!(
        "largest variant alone: {} MiB; four variants in a group: {} MiB",
        alone / MIB,
        grouped / MIB
    );
    assert!(
        grouped <= alone,
        "the group holds the largest variant, not the sum"
    );
    Ok(())
}
