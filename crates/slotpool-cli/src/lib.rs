//! The library behind the `slotpool` command: trace readers, the replay driver and plots.
//!
//! - [`trace`]: read allocation traces (the project's `action,addr,size,stream` CSV, gzip or not,
//!   and PyTorch's `_dump_snapshot` pickles) into a [`Trace`]; [`snapshot`] reads the pickles
//!   through [`pickle`], a streaming pickle machine.
//! - [`mod@replay`]: drive any [`ReplayTarget`] (an allocator) with a trace's alloc/free workload and
//!   report peak allocated/reserved, fragmentation ratio and per-call host latency.
//! - [`plot`]: draw a report's timeline as an SVG.
//! - [`model`]: [`ModelTarget`], a toy best-fit allocator used to test the driver.

pub mod driver_time;
pub mod help;
pub mod model;
pub mod pickle;
pub mod plot;
pub mod replay;
pub mod settings;
pub mod snapshot;
pub mod target;
pub mod trace;
pub mod trace_timeline;
pub mod variants;

pub use driver_time::DriverTime;
pub use model::{ModelMode, ModelTarget};
pub use replay::{ReplayError, ReplayOptions, ReplayReport, ReplayTarget, replay};
pub use target::SlotpoolTarget;
pub use trace::{
    Action, Location, ReadOptions, Trace, TraceError, TraceEvent, TraceFormat, parse_trace,
    read_trace, read_trace_with,
};
