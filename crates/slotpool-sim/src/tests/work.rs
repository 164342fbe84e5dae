//! Work that touches memory, and memory freed under it.

use slotpool_core::Device;

use super::{PS, dev};
use crate::{SimConfig, SimDevice};

#[test]
fn unmapping_a_page_under_queued_work_is_a_violation_until_the_stream_completes() {
    let d = dev();
    let base = d.reserve(4 * PS).unwrap();
    let (p0, p1) = (d.create_page().unwrap(), d.create_page().unwrap());
    d.map(base, p0).unwrap();
    d.map(base + PS, p1).unwrap();
    // A kernel on stream 3 touching the second half of page 0 and the start of page 1.
    d.launch_touching(3, base + PS / 2, PS);
    assert_eq!(d.pending_touches(), vec![(3, base + PS / 2, PS)]);
    // Work on another range and plain launches do not matter.
    d.launch(3);
    d.unmap(base + PS).unwrap();
    assert_eq!(d.work_violations(), 1);
    let why = d.last_work_violation().unwrap();
    assert!(why.contains("unmap") && why.contains("stream 3"), "{why}");
    d.complete(3);
    assert!(d.pending_touches().is_empty());
    d.unmap(base).unwrap();
    assert_eq!(d.work_violations(), 1, "completed work touches nothing");
    assert_eq!(
        d.contract_violations(),
        0,
        "the calls themselves were legal"
    );
}

#[test]
fn freeing_a_segment_under_queued_work_is_a_violation() {
    let d = dev();
    let a = d.alloc_segment(2 * PS).unwrap();
    let b = d.alloc_segment(2 * PS).unwrap();
    d.launch_touching(1, a + 100, 10);
    d.free_segment(b, 2 * PS).unwrap();
    assert_eq!(d.work_violations(), 0, "other memory");
    d.free_segment(a, 2 * PS).unwrap();
    assert_eq!(d.work_violations(), 1);
    assert!(d.last_work_violation().unwrap().contains("free_segment"));
}

#[test]
fn each_kind_of_synchronisation_retires_the_work_it_covers() {
    let d = dev();
    let segs: Vec<_> = (0..4).map(|_| d.alloc_segment(PS).unwrap()).collect();
    // Device synchronisation retires everything.
    d.launch_touching(1, segs[0], PS);
    d.launch_touching(2, segs[0], PS);
    d.synchronize().unwrap();
    assert!(d.pending_touches().is_empty());
    // An event retires what was queued before its record, not after.
    let e = d.create_event().unwrap();
    d.launch_touching(1, segs[1], PS);
    d.record_event(e, 1).unwrap();
    d.launch_touching(1, segs[2], PS);
    d.synchronize_event(e).unwrap();
    assert_eq!(d.pending_touches(), vec![(1, segs[2], PS)]);
    d.free_segment(segs[1], PS).unwrap();
    assert_eq!(d.work_violations(), 0);
    // A stream that waits on the event: completing it completes what the event covers.
    d.launch_touching(2, segs[3], PS);
    d.record_event(e, 2).unwrap();
    d.stream_wait_event(4, e).unwrap();
    d.complete(4);
    d.free_segment(segs[3], PS).unwrap();
    assert_eq!(d.work_violations(), 0);
    d.free_segment(segs[2], PS).unwrap();
    assert_eq!(
        d.work_violations(),
        1,
        "stream 1's last unit was still queued"
    );
}

#[test]
fn auto_completed_and_captured_work_touches_nothing() {
    let d = SimDevice::new(SimConfig {
        auto_complete: true,
        ..SimConfig::default()
    })
    .unwrap();
    let a = d.alloc_segment(PS).unwrap();
    d.launch_touching(1, a, PS);
    assert!(d.pending_touches().is_empty());
    d.free_segment(a, PS).unwrap();

    let d = dev();
    let a = d.alloc_segment(PS).unwrap();
    d.begin_capture(5).unwrap();
    d.launch_touching(5, a, PS);
    d.end_capture(5).unwrap();
    assert!(
        d.pending_touches().is_empty(),
        "captured work goes into the graph"
    );
    d.free_segment(a, PS).unwrap();
    assert_eq!(d.work_violations(), 0);
}
