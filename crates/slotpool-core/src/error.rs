//! The core's one error type. The C ABI maps each variant to a status code in one place.

use crate::device::{DeviceError, DevicePtr};
use crate::pool::PoolId;

/// What an out-of-memory failure looked like, for the message and for callers that report it.
/// Each reserved byte is counted once: `allocated + private_pools_cached + unallocated ==
/// reserved`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OomReport {
    pub requested: u64,
    pub rounded: u64,
    /// Physical bytes this allocator holds.
    pub reserved: u64,
    /// Bytes handed out (rounded), in every pool.
    pub allocated: u64,
    /// Reserved but not allocated, held by private (capture and user) pools: memory only those
    /// pools can use.
    pub private_pools_cached: u64,
    /// The rest of what is reserved and not allocated: the default pool's cache, fragmentation,
    /// page rounding.
    pub unallocated: u64,
    /// The byte limit in force.
    pub limit: u64,
    /// What the backend says is free.
    pub device_free: u64,
}

impl OomReport {
    /// The byte counts of a report, with parts that add up to `reserved` (the other fields are
    /// 0): the private pools' share of the unallocated bytes is capped so that no byte is
    /// counted twice. `private_pools_reserved` is what those pools hold, allocated or not;
    /// `private_pools_allocated` the part handed out.
    pub fn counting(
        reserved: u64,
        allocated: u64,
        private_pools_reserved: u64,
        private_pools_allocated: u64,
    ) -> OomReport {
        let allocated = allocated.min(reserved);
        let free = reserved - allocated;
        let private_pools_cached = private_pools_reserved
            .saturating_sub(private_pools_allocated)
            .min(free);
        OomReport {
            reserved,
            allocated,
            private_pools_cached,
            unallocated: free - private_pools_cached,
            ..OomReport::default()
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

impl std::fmt::Display for OomReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tried to allocate {:.2} GiB; {:.2} GiB reserved of a {:.2} GiB limit: {:.2} GiB \
             allocated, {:.2} GiB cached in private pools, {:.2} GiB reserved but unallocated \
             (cache and fragmentation); {:.2} GiB free on the device",
            self.requested as f64 / GIB,
            self.reserved as f64 / GIB,
            self.limit as f64 / GIB,
            self.allocated as f64 / GIB,
            self.private_pools_cached as f64 / GIB,
            self.unallocated as f64 / GIB,
            self.device_free as f64 / GIB,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::OomReport;

    #[test]
    fn the_parts_add_up_to_reserved() {
        let parts = |r: OomReport| (r.allocated, r.private_pools_cached, r.unallocated);
        // 10 reserved: 6 allocated (1 of them in private pools), private pools hold 4.
        assert_eq!(parts(OomReport::counting(10, 6, 4, 1)), (6, 3, 1));
        // Inconsistent inputs (counters read at slightly different times) still add up.
        assert_eq!(parts(OomReport::counting(10, 12, 4, 0)), (10, 0, 0));
        assert_eq!(parts(OomReport::counting(10, 2, 20, 1)), (2, 8, 0));
        for r in [
            OomReport::counting(1 << 40, 1 << 39, 1 << 38, 1 << 30),
            OomReport::default(),
        ] {
            assert_eq!(
                r.allocated + r.private_pools_cached + r.unallocated,
                r.reserved
            );
        }
    }
}

/// Every way a core call can fail. A failed call changes no state.
///
/// Two words, as [`crate::shard::ShardError`] is: every payload larger than a word (a report, a
/// diff, a message, a pool id, a device error) is boxed, so that an `AllocResult<DevicePtr>`
/// travels in registers (a larger `Result` goes through the stack at every layer). The messages
/// are `Box<String>`, a thin pointer, because a `Box<str>` is two words itself.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[allow(clippy::box_collection)] // the boxed `String`s above: the error stays two words
pub enum AllocError {
    #[error("out of memory: {0}")]
    OutOfMemory(Box<OomReport>),
    #[error("invalid size {0}: must be between 1 and 2^56 bytes")]
    InvalidSize(u64),
    #[error("pointer {0:#x} was not allocated by slotpool or was already freed")]
    UnknownPointer(DevicePtr),
    #[error("unknown pool {0}")]
    UnknownPool(Box<PoolId>),
    #[error("invalid argument: {0}")]
    InvalidArgument(Box<String>),
    #[error("invalid state: {0}")]
    InvalidState(Box<String>),
    #[error("restore refused, nothing changed: {0}")]
    CheckpointMismatch(Box<RestoreDiff>),
    #[error("pool {0} is paused: resume it before allocating from it")]
    PoolPaused(Box<PoolId>),
    #[error("device error: {0}")]
    Device(Box<DeviceError>),
}

const _: () = assert!(size_of::<AllocError>() == 16);
const _: () = assert!(size_of::<AllocResult<DevicePtr>>() == 16);

impl From<DeviceError> for AllocError {
    fn from(e: DeviceError) -> Self {
        AllocError::Device(Box::new(e))
    }
}

/// Result of a core call.
pub type AllocResult<T> = Result<T, AllocError>;

/// Why a restore was refused; nothing changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreDiff {
    /// Human-readable reasons, one per mismatch.
    pub mismatches: Vec<String>,
    /// Allocations live now that the checkpoint does not have: (address, size).
    pub added: Vec<(DevicePtr, u64)>,
    /// Allocations of the checkpoint that are not live now: (address, size).
    pub removed: Vec<(DevicePtr, u64)>,
}

impl std::fmt::Display for RestoreDiff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.mismatches.join("; "))?;
        let list = |v: &[(DevicePtr, u64)]| {
            v.iter()
                .take(8)
                .map(|(a, s)| format!("{a:#x}+{s}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !self.added.is_empty() {
            write!(
                f,
                "; {} added since: {}",
                self.added.len(),
                list(&self.added)
            )?;
        }
        if !self.removed.is_empty() {
            write!(
                f,
                "; {} removed since: {}",
                self.removed.len(),
                list(&self.removed)
            )?;
        }
        Ok(())
    }
}
