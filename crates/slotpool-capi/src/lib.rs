//! slotpool-capi: the C ABI of `include/slotpool.h`, built as `libslotpool.so` (SONAME
//! `libslotpool.so.0`, see `build.rs`), `libslotpool.a` and an rlib (for Rust tests and benches).
//!
//! * [`api`]: the exported `sp_*` functions. Every one runs its body under [`error::ffi`]
//!   (`catch_unwind`; errors become an [`sp_status`] and a per-thread message).
//! * [`error`]: the crate's one [`Error`] type and the mapping from errors to status codes
//!   (the codes and their names are slotpool-abi's; `sp_status_name`).
//! * [`runtime`]: the process-wide state (backend, one allocator per device, created lazily),
//!   initialisation from `sp_init` or from `SLOTPOOL_BACKEND` / `SLOTPOOL_CONF` (the layers are
//!   slotpool-core's, the `sim_*` keys slotpool-sim's), and shutdown.
//! * `convert`: the C types of slotpool-abi (the header's structs, layout pinned there) from and
//!   to the core's.
//! * [`snapshot`]: snapshots: the PyTorch-shaped JSON (with the configuration in effect) and the
//!   `sp_snapshot` handle with typed readers, both from one taken state.
//! * [`pause`]: pausing and resuming pools (physical memory given back, addresses kept).
//! * [`ipc`]: CUDA IPC of vmm memory (pages exported as file descriptors, and mapped).
//! * [`sim`]: the bytes of simulated device memory (`sim_bytes:1`), for tests.
//! * `handle`: the per-kind registries behind checkpoint, delta, variant-group and snapshot
//!   handles.
//!
//! `docs/c-api.md` is the user guide; `slotpool.h` documents every function.

pub mod api;
pub mod calls;
mod convert;
pub mod error;
pub mod graph;
mod handle;
pub mod ipc;
mod out;
pub mod pause;
pub mod runtime;
pub mod sim;
pub mod snapshot;

pub use api::*;
pub use calls::*;
pub use error::{Error, sp_status, sp_status_name};
pub use graph::*;
pub use ipc::*;
pub use pause::*;
pub use sim::*;
pub use slotpool_abi::types::*;
pub use snapshot::handle::*;
