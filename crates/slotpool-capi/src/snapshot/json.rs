//! `sp_snapshot_json`: a snapshot in the shape of PyTorch's `torch.cuda.memory._snapshot()`
//! (see `docs/c-api.md`), with the recorded history of each device in `device_traces`.

use serde_json::{Value, json};
use slotpool_core::allocator::SegmentSnapshot;
use slotpool_core::block::BlockState;

use crate::runtime::Runtime;

fn state_name(s: BlockState) -> &'static str {
    match s {
        BlockState::Free | BlockState::Cached => "inactive",
        BlockState::Allocated => "active_allocated",
        BlockState::PendingFree => "active_pending_free",
    }
}

fn segment_json(device: usize, seg: &SegmentSnapshot) -> Value {
    let mut allocated = 0u64;
    let mut active = 0u64;
    let mut requested = 0u64;
    let blocks: Vec<Value> = seg
        .blocks
        .iter()
        .map(|b| {
            if b.state == BlockState::Allocated {
                allocated += b.size;
            }
            if matches!(b.state, BlockState::Allocated | BlockState::PendingFree) {
                active += b.size;
                requested += b.requested;
            }
            json!({
                "address": b.addr,
                "size": b.size,
                "requested_size": b.requested,
                "state": state_name(b.state),
                "frames": [],
            })
        })
        .collect();
    json!({
        "device": device,
        "address": seg.addr,
        "total_size": seg.size,
        "allocated_size": allocated,
        "active_size": active,
        "requested_size": requested,
        "stream": seg.stream,
        "segment_type": if seg.small { "small" } else { "large" },
        "segment_pool_id": [seg.pool.0, seg.pool.1],
        "is_expandable": seg.vmm,
        "is_paused": seg.paused,
        "frames": [],
        "blocks": blocks,
    })
}

/// The snapshot of one device (`Some(i)`) or of every device (`None`) as a JSON string.
/// Devices whose allocator was never created have no segments.
pub fn snapshot_json(rt: &Runtime, device: Option<usize>) -> String {
    let taken = super::take(rt, device, true);
    let segments: Vec<Value> = taken
        .segments
        .iter()
        .map(|(i, seg)| segment_json(*i, seg))
        .collect();
    let mut traces: Vec<Value> = (0..rt.device_count()).map(|_| json!([])).collect();
    for (i, entries) in &taken.traces {
        traces[*i] = entries
            .iter()
            .map(|e| {
                json!({
                    "action": e.action,
                    "addr": e.addr,
                    "size": e.size,
                    "stream": e.stream,
                    "time_us": e.time_us,
                    "frames": [],
                })
            })
            .collect();
    }
    json!({
        "segments": segments,
        "device_traces": traces,
        "allocator_settings": {
            "backend": rt.kind.name(),
            // Every setting, as `key:value,...` (`Config`'s Display): parses back to the same.
            "conf": rt.config.to_string(),
        },
    })
    .to_string()
}
