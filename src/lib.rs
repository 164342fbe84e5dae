//! slotpool: a CUDA caching memory allocator. This facade re-exports the core and the simulated
//! device; see `docs/design.md`.
#![forbid(unsafe_code)]

pub use slotpool_core as core;
pub use slotpool_sim as sim;
