//! How a [`SimDevice`](crate::SimDevice) is built.

use slotpool_core::{DeviceError, DeviceResult};

/// One gibibyte.
const GIB: u64 = 1 << 30;
/// One mebibyte.
const MIB: u64 = 1 << 20;

/// Whether simulated device memory holds real bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Backing {
    /// Every segment and page holds real host bytes, allocated lazily per 64 KiB chunk on first
    /// write, so tests can write patterns and verify them later while untouched memory costs
    /// nothing.
    #[default]
    Bytes,
    /// No bytes at all, only accounting: for replaying traces whose peak exceeds host memory. The
    /// access API ([`SimDevice::read`](crate::SimDevice::read) and friends) then fails with
    /// [`SimAccessError::NoBacking`](crate::SimAccessError::NoBacking).
    Accounting,
}

/// Configuration of a [`SimDevice`](crate::SimDevice).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SimConfig {
    /// Device memory in bytes; physical allocations beyond it fail with `OutOfMemory`.
    pub total_memory: u64,
    /// Physical page size and address alignment; a power of two.
    pub page_size: u64,
    /// Whether memory holds real bytes.
    pub backing: Backing,
    /// Complete all work the moment it is launched (a GPU infinitely faster than the host).
    pub auto_complete: bool,
}

impl Default for SimConfig {
    /// 80 GiB, 2 MiB pages, real bytes, work completes only when the test says so.
    fn default() -> Self {
        SimConfig {
            total_memory: 80 * GIB,
            page_size: 2 * MIB,
            backing: Backing::Bytes,
            auto_complete: false,
        }
    }
}

impl SimConfig {
    /// Checks that the page size is a power of two.
    pub(crate) fn validate(&self) -> DeviceResult<()> {
        if self.page_size.is_power_of_two() {
            Ok(())
        } else {
            Err(DeviceError::InvalidArgument(format!(
                "SimConfig: page_size {} is not a power of two",
                self.page_size
            )))
        }
    }
}
