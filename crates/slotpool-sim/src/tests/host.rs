//! Pinned host buffers and the copies between them and device memory (invariant 9).

use slotpool_core::{Device, DeviceError};

use super::{PS, dev};
use crate::{Backing, PAGE_POISON, SimConfig, SimDevice};

#[test]
fn a_copy_to_the_host_and_back_keeps_every_byte() {
    let d = dev();
    let r = d.reserve(4 * PS).unwrap();
    let pages = [d.create_page().unwrap(), d.create_page().unwrap()];
    d.map_run(r, &pages).unwrap();
    d.fill(r, 2 * PS, 42).unwrap();
    let h = d.alloc_host(3 * PS).unwrap();
    assert_eq!(d.host_buffer_bytes(), 3 * PS);
    // Across the page boundary, at an offset into the buffer.
    d.copy_to_host(h, PS, r, 2 * PS).unwrap();
    for &p in &pages {
        d.unmap(r + if p == pages[0] { 0 } else { PS }).unwrap();
        d.release_page(p).unwrap();
    }
    let fresh = [d.create_page().unwrap(), d.create_page().unwrap()];
    d.map_run(r, &fresh).unwrap();
    assert_eq!(d.read(r, 1).unwrap(), [PAGE_POISON]);
    d.copy_from_host(r, h, PS, 2 * PS).unwrap();
    d.verify(r, 2 * PS, 42).unwrap();
    d.free_host(h).unwrap();
    assert_eq!(d.host_buffer_bytes(), 0);
    assert_eq!(d.contract_violations(), 0);
}

#[test]
fn bad_copies_are_refused_and_change_nothing() {
    let d = dev();
    let r = d.reserve(2 * PS).unwrap();
    let p = d.create_page().unwrap();
    d.map(r, p).unwrap();
    d.fill(r, PS, 1).unwrap();
    let h = d.alloc_host(PS).unwrap();
    let invalid = |e: Result<(), DeviceError>| {
        assert!(matches!(e, Err(DeviceError::InvalidArgument(_))), "{e:?}")
    };
    // Past the buffer's end, from unmapped memory (the second page), to an unknown buffer.
    invalid(d.copy_to_host(h, 1, r, PS));
    invalid(d.copy_to_host(h, 0, r + PS, 16));
    invalid(d.copy_to_host(slotpool_core::HostBuffer(99), 0, r, 16));
    invalid(d.copy_from_host(r + PS / 2, h, 0, PS));
    invalid(d.free_host(slotpool_core::HostBuffer(99)));
    invalid(d.alloc_host(0).map(drop));
    d.verify(r, PS, 1).unwrap();
    assert_eq!(d.contract_violations(), 6);
    d.free_host(h).unwrap();
    invalid(d.free_host(h));
}

#[test]
fn copies_are_illegal_during_a_capture() {
    let d = dev();
    let r = d.reserve(PS).unwrap();
    d.map(r, d.create_page().unwrap()).unwrap();
    let h = d.alloc_host(PS).unwrap();
    d.begin_capture(1).unwrap();
    assert!(matches!(
        d.copy_to_host(h, 0, r, 16),
        Err(DeviceError::IllegalDuringCapture(_))
    ));
    assert_eq!(d.capture_violations(), 1);
    let _ = d.end_capture(1);
}

#[test]
fn accounting_devices_copy_nothing_but_check_the_buffer() {
    let d = SimDevice::new(SimConfig {
        backing: Backing::Accounting,
        ..SimConfig::default()
    })
    .unwrap();
    let r = d.reserve(PS).unwrap();
    d.map(r, d.create_page().unwrap()).unwrap();
    let h = d.alloc_host(PS).unwrap();
    d.copy_to_host(h, 0, r, PS).unwrap();
    d.copy_from_host(r, h, 0, PS).unwrap();
    assert!(d.copy_to_host(h, 1, r, PS).is_err());
}
