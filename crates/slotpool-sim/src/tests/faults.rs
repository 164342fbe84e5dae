//! Call counts and out-of-memory injection.

use slotpool_core::{Device, DeviceError, DeviceResult, PageHandle};

use super::{PS, dev};
use crate::{CallKind, SimDevice};

/// Makes one call of `kind` on `d`, discarding its value.
fn call(d: &SimDevice, kind: CallKind, r: u64, page: PageHandle) -> DeviceResult<()> {
    match kind {
        CallKind::AllocSegment => d.alloc_segment(PS).map(drop),
        CallKind::CreatePage => d.create_page().map(drop),
        CallKind::Reserve => d.reserve(PS).map(drop),
        CallKind::CreateEvent => d.create_event().map(drop),
        CallKind::Map => d.map(r, page),
        _ => unreachable!("not used here"),
    }
}

#[test]
fn nth_call_fails_for_each_allocating_kind() {
    for kind in [
        CallKind::AllocSegment,
        CallKind::CreatePage,
        CallKind::Reserve,
        CallKind::CreateEvent,
        CallKind::Map,
    ] {
        let d = dev();
        let r = d.reserve(8 * PS).unwrap();
        let pages: Vec<PageHandle> = (0..3).map(|_| d.create_page().unwrap()).collect();
        let base = d.calls(kind);
        d.inject_oom(kind, 2);
        assert_eq!(call(&d, kind, r, pages[0]), Ok(()), "{kind:?} first");
        let physical = d.physical_bytes();
        let counts = (d.segment_count(), d.reservation_count(), d.page_count());
        let (mapped, events) = (d.mapped_bytes(), d.live_events());
        let second = call(&d, kind, r + PS, pages[1]);
        assert_eq!(second, Err(DeviceError::OutOfMemory), "{kind:?} second");
        assert_eq!(
            d.physical_bytes(),
            physical,
            "{kind:?}: a failed call changes nothing"
        );
        assert_eq!(
            (d.segment_count(), d.reservation_count(), d.page_count()),
            counts
        );
        assert_eq!((d.mapped_bytes(), d.live_events()), (mapped, events));
        assert_eq!(
            call(&d, kind, r + 2 * PS, pages[1]),
            Ok(()),
            "{kind:?} third"
        );
        assert_eq!(d.calls(kind) - base, 3, "failed calls are counted");
        assert_eq!(d.contract_violations(), 0);
    }
}

#[test]
fn several_injections_and_fail_all() {
    let d = dev();
    d.inject_oom(CallKind::AllocSegment, 1);
    d.inject_oom(CallKind::AllocSegment, 3);
    d.inject_oom(CallKind::CreatePage, 0);
    let results: Vec<bool> = (0..4).map(|_| d.alloc_segment(PS).is_ok()).collect();
    assert_eq!(results, [false, true, false, true]);
    assert_eq!(
        d.create_page(),
        Err(DeviceError::OutOfMemory),
        "0 counts as 1"
    );
    d.create_page().unwrap();

    d.fail_all(CallKind::Reserve, true);
    for _ in 0..3 {
        assert_eq!(d.reserve(PS), Err(DeviceError::OutOfMemory));
    }
    d.fail_all(CallKind::Reserve, false);
    d.reserve(PS).unwrap();
    assert_eq!(d.calls(CallKind::Reserve), 4);
    assert_eq!(d.calls(CallKind::AllocSegment), 4);
}

#[test]
fn every_call_is_counted() {
    let d = dev();
    let e = d.create_event().unwrap();
    d.record_event(e, 1).unwrap();
    d.query_event(e).unwrap();
    d.query_event(e).unwrap();
    d.synchronize_event(e).unwrap();
    d.stream_wait_event(2, e).unwrap();
    d.destroy_event(e).unwrap();
    let _ = d.free_segment(1, 1);
    let _ = d.unmap(1);
    let _ = d.release_page(PageHandle(7));
    let _ = d.release_reservation(1, 1);
    let h = d.alloc_host(4096).unwrap();
    let _ = d.copy_to_host(h, 0, 1, 16);
    let _ = d.copy_from_host(1, h, 0, 16);
    d.free_host(h).unwrap();
    let run = d.create_run(2).unwrap();
    let _ = d.map_whole(1, run, 2);
    let _ = d.unmap_range(1, 16);
    let counted: Vec<u64> = CallKind::ALL.iter().map(|&k| d.calls(k)).collect();
    assert_eq!(
        counted,
        [
            0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 1
        ]
    );
    assert_eq!(d.contract_violations(), 8);
    assert_eq!(CallKind::SynchronizeEvent.name(), "synchronize_event");
}

#[test]
fn a_run_that_fails_midway_leaves_nothing_mapped() {
    let d = dev();
    let r = d.reserve(8 * PS).unwrap();
    let pages: Vec<PageHandle> = (0..4).map(|_| d.create_page().unwrap()).collect();
    let base = d.calls(CallKind::Map);
    d.inject_oom(CallKind::Map, 3);
    assert_eq!(d.map_run(r, &pages), Err(DeviceError::OutOfMemory));
    assert_eq!(d.mapped_bytes(), 0, "the two mapped pages were unmapped");
    assert_eq!(d.calls(CallKind::Map) - base, 3);
    d.map_run(r, &pages).unwrap();
    assert_eq!(d.mapped_bytes(), 4 * PS);
    assert_eq!(d.contract_violations(), 0);
}
