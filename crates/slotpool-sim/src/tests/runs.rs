//! Physical runs (`memory/runs.rs`): mapped whole at one place, unmapped and released whole; their
//! pages refuse calls of their own; ranges over several mappings.

use slotpool_core::{Device, DeviceError};

use super::{MIB, PS, assert_violation, device};

#[test]
fn a_run_is_mapped_unmapped_and_released_whole() {
    let d = device(64 * MIB);
    let va = d.reserve(8 * PS).unwrap();
    let run = d.create_run(4).unwrap();
    assert_eq!(d.physical_bytes(), 4 * PS);
    assert_eq!((d.run_count(), d.page_count()), (1, 4));
    d.map_whole(va + PS, run, 4).unwrap();
    assert_eq!(d.mapped_bytes(), 4 * PS);
    // Its bytes are one range: a write across its pages reads back.
    let data: Vec<u8> = (0..2 * PS as usize).map(|i| (i % 251) as u8).collect();
    d.write(va + PS + PS / 2, &data).unwrap();
    assert_eq!(d.read(va + PS + PS / 2, data.len()).unwrap(), data);
    assert!(d.read(va, 1).is_err(), "slot 0 is not mapped");
    // Nothing of it goes alone.
    assert_violation(&d, d.unmap(va + 2 * PS), "part of a run");
    assert_violation(&d, d.unmap_range(va + PS, 2 * PS), "cuts run");
    assert_violation(&d, d.release_page(run), "still mapped");
    assert_violation(&d, d.map_whole(va + 5 * PS, run, 4), "mapped at");
    let inner = slotpool_core::PageHandle(run.0 + 1);
    assert_violation(&d, d.map(va, inner), "part of run");
    assert_violation(&d, d.release_page(inner), "part of run");
    d.unmap_range(va + PS, 4 * PS).unwrap();
    assert_eq!(d.mapped_bytes(), 0);
    d.release_page(run).unwrap();
    assert_eq!(
        (d.physical_bytes(), d.run_count(), d.page_count()),
        (0, 0, 0)
    );
    d.release_reservation(va, 8 * PS).unwrap();
    assert_eq!(d.contract_violations(), 6);
}

#[test]
fn a_run_must_fit_where_nothing_is_mapped() {
    let d = device(64 * MIB);
    let va = d.reserve(4 * PS).unwrap();
    let page = d.create_page().unwrap();
    d.map(va + 2 * PS, page).unwrap();
    let run = d.create_run(2).unwrap();
    assert_violation(&d, d.map_whole(va + PS, run, 2), "mapped at");
    assert_violation(
        &d,
        d.map_whole(va + 3 * PS, run, 2),
        "leaves its reservation",
    );
    assert_violation(&d, d.map_whole(va, run, 3), "has 2 pages");
    assert!(matches!(d.create_run(64), Err(DeviceError::OutOfMemory)));
    d.map_whole(va, run, 2).unwrap();
    // Several mappings next to each other: one call, or refused whole without changing anything.
    d.set_span_unmap(false);
    assert!(matches!(
        d.unmap_range(va, 3 * PS),
        Err(DeviceError::Unavailable(_))
    ));
    assert_eq!(d.mapped_bytes(), 3 * PS);
    d.unmap_range(va, 2 * PS).unwrap();
    d.map_whole(va, run, 2).unwrap();
    d.set_span_unmap(true);
    d.unmap_range(va, 3 * PS).unwrap();
    assert_eq!(d.mapped_bytes(), 0);
    assert_violation(&d, d.unmap_range(va, PS), "nothing is mapped");
    d.release_page(run).unwrap();
    d.release_page(page).unwrap();
    assert_eq!(d.physical_bytes(), 0);
}
