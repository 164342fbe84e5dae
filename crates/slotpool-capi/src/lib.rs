//! slotpool-capi: the C ABI of `include/slotpool.h`, built as `libslotpool.so` (SONAME
//! `libslotpool.so.0`, see `build.rs`), `libslotpool.a` and an rlib (for Rust tests and benches).
//!
//! * [`api`]: the exported `sp_*` functions. Every one runs its body under [`error::ffi`]
//!   (`catch_unwind`; errors become an [`sp_status`] and a per-thread message).
//! * [`error`]: the crate's one [`Error`] type, the status codes and their names
//!   (`sp_status_name`), and the mapping from errors to codes.
//! * [`runtime`]: the process-wide state (backend, one allocator per device, created lazily),
//!   initialisation from `sp_init` or from `SLOTPOOL_BACKEND` / `SLOTPOOL_CONF`, and shutdown.
//! * [`types`]: `#[repr(C)]` mirrors of the header's structs, layout pinned by const asserts.
//! * [`snapshot`]: the PyTorch-shaped JSON snapshot, with the configuration in effect.
//! * [`pause`]: pausing and resuming pools (physical memory given back, addresses kept).
//! * [`ipc`]: CUDA IPC of vmm memory (pages exported as file descriptors, and mapped).
//! * [`sim`]: the bytes of simulated device memory (`sim_bytes:1`), for tests.
//! * `handle`: the per-kind registries behind checkpoint, delta and variant-group handles.
//!
//! `docs/c-api.md` is the user guide; `slotpool.h` documents every function.

pub mod api;
pub mod calls;
pub mod error;
pub mod graph;
mod handle;
pub mod ipc;
mod out;
pub mod pause;
pub mod runtime;
pub mod sim;
pub mod snapshot;
pub mod types;

pub use api::*;
pub use calls::*;
pub use error::{Error, sp_status, sp_status_name};
pub use graph::*;
pub use ipc::*;
pub use pause::*;
pub use sim::*;
pub use types::{
    sp_memory_stats, sp_pool_id, sp_pool_options, sp_route_kind, sp_stat, sp_stat_array,
    sp_trace_action, sp_trace_event,
};
