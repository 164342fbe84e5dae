//! The replay target that matters: slotpool's allocator on the simulated device.

use std::sync::Arc;

use slotpool_core::{Allocator, Config, GrowthMode};
use slotpool_sim::{Backing, CallKind, SimConfig, SimDevice};

use crate::replay::ReplayTarget;

/// slotpool on a simulated device with no bytes behind it (accounting only), whose streams
/// complete at once: a GPU that keeps up with the host, as in the recorded traces.
#[derive(Debug)]
pub struct SlotpoolTarget {
    dev: Arc<SimDevice>,
    alloc: Allocator<SimDevice>,
}

impl SlotpoolTarget {
    /// A target in `growth` mode on a device of `total_memory` bytes (the H200 has 141 GB).
    pub fn new(growth: GrowthMode, total_memory: u64) -> Result<Self, String> {
        Self::with_config(
            Config {
                growth,
                ..Config::default()
            },
            total_memory,
        )
    }

    /// A target with a full configuration (`SLOTPOOL_CONF` syntax through [`Config::parse`]).
    pub fn with_config(config: Config, total_memory: u64) -> Result<Self, String> {
        let dev = SimDevice::new(SimConfig {
            total_memory,
            backing: Backing::Accounting,
            auto_complete: true,
            page_size: (config.vmm_page_size).unwrap_or(SimConfig::default().page_size),
        })
        .map_err(|e| e.to_string())?;
        let dev = Arc::new(dev);
        Ok(SlotpoolTarget {
            alloc: Allocator::new(dev.clone(), config),
            dev,
        })
    }

    /// The allocator, for statistics and invariant checks after a replay.
    pub fn allocator(&self) -> &Allocator<SimDevice> {
        &self.alloc
    }

    /// The device's peak physical bytes, as the simulator counted them.
    pub fn peak_physical(&self) -> u64 {
        self.dev.peak_physical_bytes()
    }
}

impl ReplayTarget for SlotpoolTarget {
    fn alloc(&mut self, size: u64, stream: u64) -> Result<u64, String> {
        self.alloc.alloc(size, stream).map_err(|e| e.to_string())
    }

    fn free(&mut self, ptr: u64) -> Result<(), String> {
        self.alloc.free(ptr).map_err(|e| e.to_string())
    }

    fn sample(&self) -> (u64, u64) {
        (self.alloc.allocated_bytes(), self.dev.physical_bytes())
    }

    fn backend_calls(&self) -> Vec<(String, u64)> {
        CallKind::ALL
            .iter()
            .map(|&k| (k.name().to_string(), self.dev.calls(k)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    fn page_size(&self) -> u64 {
        slotpool_core::Device::page_size(&*self.dev)
    }
}
