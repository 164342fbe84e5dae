//! The core's one error type. The C ABI maps each variant to a status code in one place.

use crate::device::{DeviceError, DevicePtr};
use crate::pool::PoolId;

/// What an out-of-memory failure looked like, for the message and for callers that report it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OomReport {
    pub requested: u64,
    pub rounded: u64,
    /// Physical bytes this allocator holds.
    pub reserved: u64,
    /// Bytes handed out (rounded).
    pub allocated: u64,
    /// Bytes held by private (capture and user) pools.
    pub private_pools: u64,
    /// Reserved but not allocated: cached, lost to fragmentation or page rounding.
    pub fragmentation: u64,
    /// The byte limit in force.
    pub limit: u64,
    /// What the backend says is free.
    pub device_free: u64,
}

const GIB: f64 = (1u64 << 30) as f64;

impl std::fmt::Display for OomReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tried to allocate {:.2} GiB; {:.2} GiB reserved of a {:.2} GiB limit, {:.2} GiB \
             allocated, {:.2} GiB held by private pools, {:.2} GiB reserved but unallocated \
             (fragmentation), {:.2} GiB free on the device",
            self.requested as f64 / GIB,
            self.reserved as f64 / GIB,
            self.limit as f64 / GIB,
            self.allocated as f64 / GIB,
            self.private_pools as f64 / GIB,
            self.fragmentation as f64 / GIB,
            self.device_free as f64 / GIB,
        )
    }
}

/// Every way a core call can fail. A failed call changes no state.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    #[error("invalid size {0}: must be between 1 and 2^56 bytes")]
    InvalidSize(u64),
    #[error("pointer {0:#x} was not allocated by slotpool or was already freed")]
    UnknownPointer(DevicePtr),
    #[error("unknown pool {0}")]
    UnknownPool(PoolId),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("invalid state: {0}")]
    InvalidState(String),
    #[error("restore refused, nothing changed: {0}")]
    CheckpointMismatch(Box<crate::checkpoint::RestoreDiff>),
    #[error("pool {0} is paused: resume it before allocating from it")]
    PoolPaused(PoolId),
    #[error("device error: {0}")]
    Device(DeviceError),
}

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(e)
    }
}

/// Result of a core call.
pub type AllocResult<T> = Result<T, AllocError>;
