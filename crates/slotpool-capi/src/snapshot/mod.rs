//! Snapshots of the allocator state: what one holds ([`take`]), and its two forms, the
//! PyTorch-shaped JSON of `sp_snapshot_json` ([`json`]) and the `sp_snapshot` handle with typed
//! readers ([`handle`]). Both are built from the same [`Taken`], so they agree segment for segment.

use slotpool_core::TraceEntry;
use slotpool_core::allocator::SegmentSnapshot;

use crate::runtime::{Runtime, each};

pub mod handle;
pub mod json;

pub use handle::*;
pub use json::snapshot_json;

/// The state of some devices at one moment.
pub(crate) struct Taken {
    /// Every segment with its device, devices ascending, each device's in the core's order.
    pub segments: Vec<(usize, SegmentSnapshot)>,
    /// The recorded history of each device taken (devices ascending), oldest first; empty
    /// unless asked for.
    pub traces: Vec<(usize, Vec<TraceEntry>)>,
}

/// The segments of device `device` (`None`: every device in use), and their history with
/// `with_traces`. Devices whose allocator was never created have nothing.
pub(crate) fn take(rt: &Runtime, device: Option<usize>, with_traces: bool) -> Taken {
    let chosen = || {
        rt.created()
            .filter(move |&(i, _)| device.is_none_or(|want| want == i))
    };
    let segments = chosen()
        .flat_map(|(i, d)| each!(d, a => a.snapshot()).into_iter().map(move |s| (i, s)))
        .collect();
    let traces = if with_traces {
        chosen()
            .map(|(i, d)| (i, each!(d, a => a.history())))
            .collect()
    } else {
        Vec::new()
    };
    Taken { segments, traces }
}
