//! The typed snapshot readers against the JSON snapshot.

use serde_json::Value;
use slotpool::*;

use super::ok;

/// The snapshot handle `h` against the JSON snapshot `json` taken at the same state: every
/// segment's fields and every block's, in the same order, and every recorded event.
pub fn snapshot_agrees(h: *mut sp_snapshot, json: &str) {
    let v: Value = serde_json::from_str(json).expect("the snapshot is JSON");
    let segs = v["segments"].as_array().expect("segments");
    let s = h as *const sp_snapshot;
    assert_eq!(sp_snapshot_segment_count(s), segs.len(), "segment count");
    let u = |x: &Value| x.as_u64().expect("a number");
    for (i, js) in segs.iter().enumerate() {
        let mut seg = sp_segment_view::default();
        // SAFETY: a live handle; valid out-pointer.
        ok(unsafe { sp_snapshot_segment(s, i, &mut seg) });
        let pool = js["segment_pool_id"].as_array().expect("pool id");
        assert_eq!(
            (
                seg.device as u64,
                seg.address,
                seg.total_size,
                seg.stream,
                seg.is_large != 0,
                seg.is_expandable != 0,
                (seg.pool.a, seg.pool.b),
                seg.reserved0,
            ),
            (
                u(&js["device"]),
                u(&js["address"]),
                u(&js["total_size"]),
                u(&js["stream"]),
                js["segment_type"] == "large",
                js["is_expandable"] == true,
                (u(&pool[0]), u(&pool[1])),
                0,
            ),
            "segment {i}"
        );
        let blocks = js["blocks"].as_array().expect("blocks");
        assert_eq!(seg.block_count, blocks.len(), "segment {i}: blocks");
        for (j, jb) in blocks.iter().enumerate() {
            let mut b = sp_block_view {
                state: sp_block_state(-1),
                ..sp_block_view::default()
            };
            // SAFETY: a live handle; valid out-pointer.
            ok(unsafe { sp_snapshot_block(s, i, j, &mut b) });
            let state = match jb["state"].as_str().expect("state") {
                "inactive" => sp_block_state::SP_BLOCK_INACTIVE,
                "active_allocated" => sp_block_state::SP_BLOCK_ACTIVE_ALLOCATED,
                "active_pending_free" => sp_block_state::SP_BLOCK_ACTIVE_PENDING_FREE,
                other => panic!("state {other}"),
            };
            assert_eq!(
                (b.address, b.size, b.requested_size, b.state),
                (
                    u(&jb["address"]),
                    u(&jb["size"]),
                    u(&jb["requested_size"]),
                    state
                ),
                "segment {i} block {j}"
            );
        }
    }
    let traces: Vec<(usize, &Value)> = v["device_traces"]
        .as_array()
        .expect("device_traces")
        .iter()
        .enumerate()
        .flat_map(|(d, t)| {
            t.as_array()
                .expect("a device's trace")
                .iter()
                .map(move |e| (d, e))
        })
        .collect();
    let n = sp_snapshot_trace_count(s);
    assert!(
        n == 0 || n == traces.len(),
        "{n} events against {}",
        traces.len()
    );
    for (i, &(d, je)) in traces.iter().enumerate().take(n) {
        let mut e = sp_trace_event {
            action: sp_trace_action(-1),
            device: -1,
            ..sp_trace_event::default()
        };
        // SAFETY: a live handle; valid out-pointer.
        ok(unsafe { sp_snapshot_trace(s, i, &mut e) });
        assert_eq!(
            (e.device as usize, e.addr, e.size, e.stream, e.time_us),
            (
                d,
                u(&je["addr"]),
                u(&je["size"]),
                u(&je["stream"]),
                u(&je["time_us"])
            ),
            "event {i}"
        );
    }
}
