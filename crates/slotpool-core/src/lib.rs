//! slotpool-core: a CUDA caching allocator's state, generic over a [`Device`].
//!
//! No CUDA, no FFI, no `unsafe`: backends implement [`Device`] (the simulated device in
//! `slotpool-sim`, the CUDA driver in `slotpool-cuda`), and this crate decides every address.
//!
//! - [`Allocator`] is one device's allocator: thread-safe, sharded by (pool, stream).
//! - [`shard::Shard`] is the `&mut self` state machine of one (pool, stream) pair, with
//!   `check_invariants`.
//! - [`policy`] holds PyTorch 2.11's size rules; [`stats`] its `memory_stats()` keys.
//!
//! ```
//! # use std::sync::Arc;
//! # use slotpool_core::{Allocator, Config};
//! # fn demo<D: slotpool_core::Device>(dev: Arc<D>) -> Result<(), slotpool_core::AllocError> {
//! let alloc = Allocator::new(dev, Config::default());
//! let p = alloc.alloc(1 << 20, 0)?; // 1 MiB on the default stream
//! alloc.free(p)?;
//! # Ok(()) }
//! ```
#![forbid(unsafe_code)]

pub mod allocator;
pub mod arena;
pub mod block;
pub use block::alias;
mod block_slab;
pub mod checkpoint;
pub mod config;
mod counted;
pub mod device;
pub mod env;
pub mod error;
mod free_index;
pub mod history;
pub mod id_slab;
pub mod layers;
mod live_map;
mod paged;
pub use allocator::pause;
pub mod peak;
pub mod policy;
pub mod pool;
pub mod route;
pub mod shard;
pub mod snapshot;
pub mod stats;
pub mod sync;

pub use allocator::LiveAllocation;
pub use allocator::VariantGroup;
pub use allocator::{Allocator, SharedPages};
pub use arena::{ArenaId, ArenaReport, Overlap};
pub use block::MAX_REQUEST;
pub use checkpoint::{Checkpoint, RestoreDelta, RestoreDiff};
pub use config::{Config, ConfigError, GrowthMode};
pub use counted::BackendCalls;
pub use device::{
    CaptureStatus, Device, DeviceError, DevicePtr, DeviceResult, EventHandle, HostBuffer,
    PageHandle, StreamId,
};
pub use error::{AllocError, AllocResult, OomReport};
pub use history::{TraceAction, TraceEntry, TraceSink};
pub use layers::{KeyOwner, Layer};
pub use pause::{PauseMode, PauseState};
pub use pool::{PoolId, PoolOptions};
pub use route::{RouteFilter, current_thread_id};
pub use stats::{MemoryStats, Stat, StatArray};
