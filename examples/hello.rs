//! The smallest allocator: one simulated device, one allocation and its free.
//!
//! `cargo run --release --example hello`. With a GPU, build the device with
//! `slotpool_cuda::CudaDevice::new(0)?` instead (crate `slotpool-cuda`); nothing else changes.

use std::sync::Arc;

use slotpool::core::{Allocator, Config};
use slotpool::sim::SimDevice;

pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Arc::new(SimDevice::default());
    let alloc = Allocator::new(dev, Config::default()); // vmm growth, PyTorch's size rules
    let p = alloc.alloc(1 << 20, /* stream */ 0)?;
    let stats = alloc.stats();
    println!(
        "1 MiB at {p:#x}: allocated {} B, reserved {} B",
        stats.allocated_bytes.all().current,
        stats.reserved_bytes.all().current
    );
    alloc.free(p)?;
    // The freed block stays cached: the next request of the same size gets it back.
    let q = alloc.alloc(1 << 20, 0)?;
    assert_eq!(p, q);
    alloc.free(q)?;
    alloc.check_invariants()?;
    Ok(())
}
