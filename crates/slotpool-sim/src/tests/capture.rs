//! Stream capture and the calls it forbids.

use slotpool_core::{CaptureStatus, Device, DeviceError, EventHandle, PageHandle};

use super::{PS, assert_violation, dev};
use crate::{CallKind, SimDevice};

#[test]
fn capture_ids_are_unique_and_statuses_follow() {
    let d = dev();
    assert_eq!(d.capture_status(5).unwrap(), CaptureStatus::None);
    assert_eq!(d.begin_capture(5).unwrap(), 1);
    assert_eq!(d.begin_capture(6).unwrap(), 2);
    assert_eq!(d.capture_status(5).unwrap(), CaptureStatus::Active(1));
    assert_eq!(d.capture_status(6).unwrap(), CaptureStatus::Active(2));
    assert_eq!(d.end_capture(5).unwrap(), 1);
    assert_eq!(d.capture_status(5).unwrap(), CaptureStatus::None);
    assert_eq!(d.begin_capture(5).unwrap(), 3);
    assert_eq!(d.capture_violations(), 0);
}

#[test]
fn capture_api_misuse_is_a_contract_violation() {
    let d = dev();
    d.begin_capture(1).unwrap();
    assert_violation(&d, d.begin_capture(1), "already capturing");
    assert_violation(&d, d.end_capture(2), "not capturing");
    assert_eq!(d.contract_violations(), 2);
    assert_eq!(d.capture_status(1).unwrap(), CaptureStatus::Active(1));
}

/// A device with one of everything, stream 2 busy, and stream 1 capturing.
struct Fixture {
    d: SimDevice,
    /// A live segment of one page.
    seg: u64,
    /// A two-page reservation with a page mapped at its start.
    mapped: u64,
    /// An empty one-page reservation.
    empty: u64,
    /// An unmapped page.
    page: PageHandle,
    /// An event recorded on stream 2.
    e: EventHandle,
}

fn capturing() -> Fixture {
    let d = dev();
    let seg = d.alloc_segment(PS).unwrap();
    let mapped = d.reserve(2 * PS).unwrap();
    let empty = d.reserve(PS).unwrap();
    d.map(mapped, d.create_page().unwrap()).unwrap();
    let page = d.create_page().unwrap();
    let e = d.create_event().unwrap();
    d.launch(2);
    d.record_event(e, 2).unwrap();
    d.begin_capture(1).unwrap();
    Fixture {
        d,
        seg,
        mapped,
        empty,
        page,
        e,
    }
}

#[test]
fn forbidden_calls_are_rejected_and_invalidate_captures() {
    type Call = fn(&Fixture) -> Result<(), DeviceError>;
    let calls: [(&str, Call); 8] = [
        ("query_event", |f| f.d.query_event(f.e).map(drop)),
        ("synchronize_event", |f| f.d.synchronize_event(f.e)),
        ("free_segment", |f| f.d.free_segment(f.seg, PS)),
        ("unmap", |f| f.d.unmap(f.mapped)),
        ("release_page", |f| f.d.release_page(f.page)),
        ("release_reservation", |f| {
            f.d.release_reservation(f.empty, PS)
        }),
        ("record_event", |f| f.d.record_event(f.e, 1)),
        ("stream_wait_event", |f| f.d.stream_wait_event(1, f.e)),
    ];
    for (name, call) in calls {
        let f = capturing();
        let d = &f.d;
        d.begin_capture(3).unwrap();
        let state = |d: &SimDevice| {
            let counts = (d.segment_count(), d.reservation_count(), d.page_count());
            (d.physical_bytes(), d.mapped_bytes(), counts, d.submitted(1))
        };
        let before = state(d);
        assert_eq!(call(&f), Err(DeviceError::IllegalDuringCapture(name)));
        assert_eq!(d.capture_violations(), 1, "{name}");
        assert_eq!(d.contract_violations(), 0, "{name}");
        assert_eq!(
            d.capture_status(1).unwrap(),
            CaptureStatus::Invalidated,
            "{name}"
        );
        assert_eq!(
            d.capture_status(3).unwrap(),
            CaptureStatus::Invalidated,
            "{name}"
        );
        assert!(d.capture_status(1).unwrap().is_capturing());
        assert_eq!(before, state(d), "{name}: a rejected call changes nothing");
        assert_eq!((d.synchronizations(), d.stream_waits()), (0, 0), "{name}");
        let ended = d.end_capture(1);
        assert!(
            matches!(ended, Err(DeviceError::Driver { code: 901, .. })),
            "{ended:?}"
        );
        assert_eq!(d.capture_status(1).unwrap(), CaptureStatus::None);
        assert!(d.end_capture(3).is_err());
        // With no capture left, the call is legal again.
        assert_eq!(call(&f), Ok(()), "{name}");
        assert_eq!(d.contract_violations(), 0, "{name}");
    }
}

#[test]
fn allocation_calls_are_allowed_during_capture() {
    let Fixture { d, mapped, e, .. } = capturing();
    let seg = d.alloc_segment(PS).unwrap();
    let page = d.create_page().unwrap();
    d.map(mapped + PS, page).unwrap();
    d.reserve(PS).unwrap();
    let f = d.create_event().unwrap();
    d.record_event(f, 2).unwrap();
    d.stream_wait_event(2, e).unwrap();
    d.destroy_event(f).unwrap();
    d.capture_status(1).unwrap();
    assert_eq!(d.capture_violations(), 0);
    assert_eq!(d.capture_status(1).unwrap(), CaptureStatus::Active(1));
    assert_eq!(d.end_capture(1), Ok(1));
    d.free_segment(seg, PS).unwrap();
    assert_eq!(d.contract_violations(), 0);
}

#[test]
fn launches_on_a_capturing_stream_are_not_queued() {
    let d = dev();
    d.launch(1);
    d.begin_capture(1).unwrap();
    d.launch(1);
    d.launch(2);
    assert_eq!((d.submitted(1), d.submitted(2)), (1, 1));
    d.end_capture(1).unwrap();
    d.launch(1);
    assert_eq!(d.submitted(1), 2);
}

#[test]
fn capture_rules_come_before_injected_faults() {
    let d = dev();
    let e = d.create_event().unwrap();
    d.inject_oom(CallKind::QueryEvent, 1);
    d.begin_capture(1).unwrap();
    assert_eq!(
        d.query_event(e),
        Err(DeviceError::IllegalDuringCapture("query_event"))
    );
    d.end_capture(1).unwrap_err();
    assert!(
        d.query_event(e).unwrap(),
        "the injection was spent on the rejected call"
    );
}
