//! Cross-crate tests of the allocator on the simulated device, in one test binary.

mod alias;
mod arena;
mod arena_model;
mod common;
mod gc;
mod lifetimes;
mod model;
mod oom;
mod pause;
mod pause_runs;
mod peaks;
mod queued_work;
mod quick;
mod races;
mod retained;
mod scenarios;
mod stress;
