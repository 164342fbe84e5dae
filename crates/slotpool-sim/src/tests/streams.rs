//! Streams, events, waits and auto-completion.

use slotpool_core::{Device, EventHandle};

use super::{assert_violation, dev};
use crate::{SimConfig, SimDevice};

#[test]
fn events_complete_when_their_stream_does() {
    let d = dev();
    let e = d.create_event().unwrap();
    assert!(
        d.query_event(e).unwrap(),
        "a never-recorded event is complete"
    );
    d.launch(1);
    d.launch(1);
    d.record_event(e, 1).unwrap();
    assert!(!d.query_event(e).unwrap());
    d.launch(1);
    d.complete(2);
    assert!(
        !d.query_event(e).unwrap(),
        "another stream's progress does not help"
    );
    d.complete(1);
    assert!(d.query_event(e).unwrap());
    assert_eq!((d.submitted(1), d.completed(1)), (3, 3));
    // Re-recording takes a new snapshot.
    d.launch(1);
    d.record_event(e, 1).unwrap();
    assert!(!d.query_event(e).unwrap());
    d.complete_all();
    assert!(d.query_event(e).unwrap());
}

#[test]
fn an_event_on_an_idle_stream_is_complete_at_once() {
    let d = dev();
    let e = d.create_event().unwrap();
    d.record_event(e, 9).unwrap();
    assert!(d.query_event(e).unwrap());
}

#[test]
fn synchronize_completes_up_to_the_event() {
    let d = dev();
    let e = d.create_event().unwrap();
    d.launch(0);
    d.record_event(e, 0).unwrap();
    d.launch(0);
    d.synchronize_event(e).unwrap();
    assert!(d.query_event(e).unwrap());
    assert_eq!(
        (d.submitted(0), d.completed(0)),
        (2, 1),
        "later work still pending"
    );
    assert_eq!(d.synchronizations(), 1);
}

#[test]
fn work_after_a_wait_completes_only_after_the_event() {
    let d = dev();
    let (on1, before, after) = (
        d.create_event().unwrap(),
        d.create_event().unwrap(),
        d.create_event().unwrap(),
    );
    d.launch(1);
    d.record_event(on1, 1).unwrap();
    d.launch(2);
    d.record_event(before, 2).unwrap();
    d.stream_wait_event(2, on1).unwrap();
    d.record_event(after, 2).unwrap();
    assert_eq!(d.stream_waits(), 1);
    d.synchronize_event(before).unwrap();
    assert_eq!(
        d.completed(1),
        0,
        "work before the wait does not need stream 1"
    );
    assert!(
        !d.query_event(after).unwrap(),
        "an event after the wait is pending"
    );
    d.complete(2);
    assert!(d.query_event(after).unwrap());
    assert!(
        d.query_event(on1).unwrap(),
        "completing after the wait completed stream 1"
    );
}

#[test]
fn waits_chain_and_cycles_terminate() {
    let d = dev();
    let (e1, e2) = (d.create_event().unwrap(), d.create_event().unwrap());
    d.launch(1);
    d.record_event(e1, 1).unwrap();
    d.stream_wait_event(2, e1).unwrap();
    d.launch(2);
    d.record_event(e2, 2).unwrap();
    d.stream_wait_event(3, e2).unwrap();
    d.launch(3);
    d.complete(3);
    assert_eq!((d.completed(1), d.completed(2)), (1, 2));
    // Two streams waiting on each other's (earlier) events.
    d.launch(1);
    d.record_event(e1, 1).unwrap();
    d.launch(2);
    d.record_event(e2, 2).unwrap();
    d.stream_wait_event(1, e2).unwrap();
    d.stream_wait_event(2, e1).unwrap();
    d.complete(1);
    assert_eq!(
        d.completed(2),
        3,
        "stream 1's wait needed stream 2's second launch"
    );
    assert_eq!(
        d.completed(2),
        d.submitted(2) - 1,
        "not stream 2's own wait marker"
    );
    d.complete_all();
    assert_eq!(d.completed(2), d.submitted(2));
}

#[test]
fn auto_complete_completes_everything_at_once() {
    let config = SimConfig {
        auto_complete: true,
        ..SimConfig::default()
    };
    let d = SimDevice::new(config).unwrap();
    assert!(d.auto_complete());
    let e = d.create_event().unwrap();
    d.launch(1);
    d.record_event(e, 1).unwrap();
    assert!(d.query_event(e).unwrap());
    d.stream_wait_event(2, e).unwrap();
    assert_eq!(d.completed(2), d.submitted(2));

    let d = dev();
    d.launch(1);
    d.launch(2);
    d.set_auto_complete(true);
    assert_eq!(
        (d.completed(1), d.completed(2)),
        (1, 1),
        "switching on completes pending work"
    );
    d.set_auto_complete(false);
    d.launch(1);
    assert_eq!(d.completed(1), 1);
}

#[test]
fn event_contract_violations() {
    let d = dev();
    let e = d.create_event().unwrap();
    let f = d.create_event().unwrap();
    assert_eq!(d.live_events(), 2);
    assert_violation(&d, d.record_event(EventHandle(77), 0), "never created");
    assert_violation(&d, d.query_event(EventHandle(0)), "never created");
    assert_violation(&d, d.stream_wait_event(1, EventHandle(77)), "never created");
    d.destroy_event(e).unwrap();
    assert_eq!(d.live_events(), 1);
    assert_violation(&d, d.destroy_event(e), "already destroyed");
    assert_violation(&d, d.record_event(e, 0), "already destroyed");
    assert_violation(&d, d.query_event(e), "already destroyed");
    assert_violation(&d, d.synchronize_event(e), "already destroyed");
    assert_eq!(d.contract_violations(), 7);
    assert_eq!(
        (d.synchronizations(), d.stream_waits(), d.submitted(1)),
        (0, 0, 0)
    );
    assert_eq!(d.live_events(), 1);
    d.destroy_event(f).unwrap();
    assert_eq!(d.live_events(), 0);
}
