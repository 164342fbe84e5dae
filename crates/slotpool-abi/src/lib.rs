//! slotpool-abi: the facts that `libslotpool.so` (slotpool-capi), `libslotpool_preload.so`
//! (slotpool-preload) and the rest of the workspace share, each written once:
//!
//! * [`status`]: the `sp_status` codes, their names (`sp_status_name`) and messages;
//! * [`types`]: the `#[repr(C)]` structs and enums of `include/slotpool.h`, layout pinned by const
//!   asserts (and checked against the header by slotpool-capi's `tests/header.rs`);
//! * [`env`](mod@env): the names of the environment variables slotpool reads.
//!
//! No `unsafe`, no dependencies: conversions from the allocator's own types live in slotpool-capi.
#![forbid(unsafe_code)]
#![allow(non_camel_case_types)]

pub mod env;
pub mod status;
pub mod types;

pub use status::{UNRECOGNIZED_STATUS, sp_status};
pub use types::*;
