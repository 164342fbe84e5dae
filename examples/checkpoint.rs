//! A named pool, a checkpoint of it, and a restore that puts the pool back as it was while one
//! allocation survives at its address.
//!
//! `cargo run --release --example checkpoint`

use std::sync::Arc;

use slotpool::core::{Allocator, Config, PoolOptions};
use slotpool::sim::SimDevice;

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let alloc = Allocator::new(Arc::new(SimDevice::default()), Config::default());
    let pool = alloc.named_pool("scratch", PoolOptions::default())?;
    let weights = alloc.alloc_in(pool, 4 << 20, 0)?;
    let temp = alloc.alloc_in(pool, 1 << 20, 0)?;

    let cp = alloc.checkpoint(pool)?;
    alloc.free(temp)?; // freed since the checkpoint: the restore re-creates it
    let later = alloc.alloc_in(pool, 3 << 20, 0)?; // made since: the restore frees it

    let delta = alloc.restore(pool, &cp, &[weights])?;
    for (ptr, size) in &delta.freed {
        println!("restore freed {ptr:#x} ({size} B, allocated after the checkpoint)");
    }
    for (ptr, size) in &delta.created {
        println!("restore re-created {ptr:#x} ({size} B, freed after the checkpoint)");
    }
    assert_eq!(delta.freed, vec![(later, 3 << 20)]);
    assert_eq!(delta.created, vec![(temp, 1 << 20)]);

    // The caller owns what the restore re-created; `later` is gone and must not be freed.
    alloc.free(temp)?;
    alloc.free(weights)?;
    drop(cp);
    alloc.release_pool(pool)?;
    alloc.check_invariants()?;
    Ok(())
}
