//! The environment variables slotpool reads, by name. Which configuration layer each one is, and
//! in which order they apply, is slotpool-core's `config::layers`.

/// The backend for lazy initialisation: `cuda`, `sim` or `auto` (the C ABI; the preload library
/// reads it too and defaults to `cuda`).
pub const BACKEND: &str = "SLOTPOOL_BACKEND";
/// A configuration string (`key:value,...`): over the program defaults, beneath `sp_init`'s
/// `conf`, the replay's `--conf` and `slotpool_torch.install(conf=)`.
pub const CONF: &str = "SLOTPOOL_CONF";
/// Turns logging to stderr on: a `tracing` filter (`info`, `slotpool=debug`); the preload library
/// prints its exit line when it is set.
pub const LOG: &str = "SLOTPOOL_LOG";
/// The path of `libslotpool.so` the preload library opens (no fallback when set).
pub const LIBRARY: &str = "SLOTPOOL_LIBRARY";
/// `1`: a served `cudaFree` / `cuMemFree_v2` of the preload library synchronises the device first,
/// as the real ones do.
pub const PRELOAD_SYNC_FREE: &str = "SLOTPOOL_PRELOAD_SYNC_FREE";
