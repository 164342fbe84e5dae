//! The memory access API: bytes, patterns, sparse backing, pages that move.

use slotpool_core::Device;

use super::{MIB, PS, accounting, dev};
use crate::{PAGE_POISON, SimAccessError, pattern_byte};

#[test]
fn fill_and_verify_a_segment() {
    let d = dev();
    let a = d.alloc_segment(3 * MIB).unwrap();
    d.fill(a, 3 * MIB, 7).unwrap();
    d.verify(a, 3 * MIB, 7).unwrap();
    let head = d.read(a + 100, 4).unwrap();
    assert_eq!(
        head,
        (100..104).map(|i| pattern_byte(7, i)).collect::<Vec<_>>()
    );
    assert!(matches!(
        d.verify(a, 3 * MIB, 8),
        Err(SimAccessError::Mismatch { .. })
    ));
}

#[test]
fn verify_reports_the_first_mismatch() {
    let d = dev();
    let a = d.alloc_segment(PS).unwrap();
    d.fill(a, PS, 42).unwrap();
    let at = a + 70_000;
    let old = d.read(at, 1).unwrap()[0];
    d.write(at, &[!old]).unwrap();
    d.write(at + 5, &[!pattern_byte(42, 70_005)]).unwrap();
    assert_eq!(
        d.verify(a, PS, 42),
        Err(SimAccessError::Mismatch {
            addr: at,
            expected: old,
            found: !old
        })
    );
    // A verify that starts past the damage sees the pattern relative to its own start.
    assert!(d.verify(at + 6, 100, 42).is_err());
    d.fill(at + 6, 100, 42).unwrap();
    d.verify(at + 6, 100, 42).unwrap();
}

#[test]
fn pattern_depends_on_seed_and_offset() {
    let a: Vec<u8> = (0..64).map(|i| pattern_byte(1, i)).collect();
    let b: Vec<u8> = (0..64).map(|i| pattern_byte(2, i)).collect();
    assert_ne!(a, b);
    assert_ne!(a[..8], a[8..16]);
    assert!(a.iter().any(|&x| x != 0) && (0..64).any(|i| pattern_byte(0, i) != 0));
}

#[test]
fn fresh_segments_read_zero_and_cost_nothing() {
    let d = dev();
    let a = d.alloc_segment(20 * MIB).unwrap();
    assert_eq!(d.read(a + 5 * MIB, 16).unwrap(), vec![0; 16]);
    d.verify(a, 20 * MIB, 3).unwrap_err();
    assert_eq!(d.host_bytes(), 0, "reads and verifies allocate nothing");
    d.write(a + MIB, &[1]).unwrap();
    assert_eq!(d.host_bytes(), 64 << 10, "one chunk per written 64 KiB");
    d.free_segment(a, 20 * MIB).unwrap();
    assert_eq!(d.host_bytes(), 0, "freeing returns the bytes");
}

#[test]
fn fresh_pages_are_poisoned() {
    let d = dev();
    let r = d.reserve(PS).unwrap();
    let p = d.create_page().unwrap();
    d.map(r, p).unwrap();
    assert_eq!(d.read(r + PS - 3, 3).unwrap(), vec![PAGE_POISON; 3]);
}

#[test]
fn access_outside_live_memory_fails_and_writes_nothing() {
    let d = dev();
    let a = d.alloc_segment(PS).unwrap();
    let end = a + PS;
    assert_eq!(d.read(end, 1), Err(SimAccessError::Unmapped { addr: end }));
    assert_eq!(
        d.write(end - 2, &[9; 4]),
        Err(SimAccessError::Unmapped { addr: end })
    );
    assert_eq!(
        d.read(end - 2, 2).unwrap(),
        vec![0, 0],
        "failed write wrote nothing"
    );
    assert_eq!(
        d.fill(0x1000, 1, 0),
        Err(SimAccessError::Unmapped { addr: 0x1000 })
    );
    d.free_segment(a, PS).unwrap();
    assert_eq!(d.read(a, 1), Err(SimAccessError::Unmapped { addr: a }));
    assert_eq!(d.read(a, 0), Ok(vec![]), "empty accesses always succeed");
    // A reservation without a page is not accessible.
    let r = d.reserve(PS).unwrap();
    assert_eq!(
        d.verify(r + 10, 1, 0),
        Err(SimAccessError::Unmapped { addr: r + 10 })
    );
}

#[test]
fn page_bytes_follow_the_page() {
    let d = dev();
    let r = d.reserve(4 * PS).unwrap();
    let p = d.create_page().unwrap();
    d.map(r, p).unwrap();
    d.fill(r, PS, 5).unwrap();
    d.unmap(r).unwrap();
    assert_eq!(d.read(r, 1), Err(SimAccessError::Unmapped { addr: r }));
    d.map(r + 2 * PS, p).unwrap();
    d.verify(r + 2 * PS, PS, 5).unwrap();
    // A new page at the old place is fresh, not the old bytes.
    let q = d.create_page().unwrap();
    d.map(r, q).unwrap();
    assert_eq!(d.read(r, 2).unwrap(), vec![PAGE_POISON; 2]);
}

#[test]
fn accesses_span_mapped_pages() {
    let d = dev();
    let r = d.reserve(3 * PS).unwrap();
    let (a, b) = (d.create_page().unwrap(), d.create_page().unwrap());
    d.map(r, a).unwrap();
    d.map(r + PS, b).unwrap();
    let start = r + PS - 100;
    d.fill(start, 200, 11).unwrap();
    d.verify(start, 200, 11).unwrap();
    // Swap the pages: each page's half of the pattern moves with it.
    d.unmap(r).unwrap();
    d.unmap(r + PS).unwrap();
    d.map(r, b).unwrap();
    d.map(r + PS, a).unwrap();
    let tail_of_a: Vec<u8> = (0..100).map(|i| pattern_byte(11, i)).collect();
    let head_of_b: Vec<u8> = (100..200).map(|i| pattern_byte(11, i)).collect();
    assert_eq!(d.read(r + 2 * PS - 100, 100).unwrap(), tail_of_a);
    assert_eq!(d.read(r, 100).unwrap(), head_of_b);
    // A hole stops the access at its first address.
    assert_eq!(
        d.read(r + 2 * PS - 10, 20),
        Err(SimAccessError::Unmapped { addr: r + 2 * PS })
    );
}

#[test]
fn accounting_backing_has_no_bytes() {
    let d = accounting(1 << 40);
    let a = d.alloc_segment(100 << 30).unwrap();
    assert_eq!(d.physical_bytes(), 100 << 30);
    assert_eq!(d.write(a, &[1]), Err(SimAccessError::NoBacking));
    assert_eq!(d.read(a, 1), Err(SimAccessError::NoBacking));
    assert_eq!(d.fill(a, 1, 0), Err(SimAccessError::NoBacking));
    assert_eq!(d.verify(a, 1, 0), Err(SimAccessError::NoBacking));
    assert_eq!(d.host_bytes(), 0);
}

#[test]
fn a_read_past_mapped_memory_fails_before_allocating_host_memory() {
    let d = dev();
    let a = d.alloc_segment(PS).unwrap();
    d.fill(a, PS, 3).unwrap();
    // A length no host could back: refused by the mapping check, not by an aborting allocation.
    assert_eq!(
        d.read(a, 1 << 50),
        Err(SimAccessError::Unmapped { addr: a + PS })
    );
    assert_eq!(
        d.check_access(a, PS + 1),
        Err(SimAccessError::Unmapped { addr: a + PS })
    );
    d.check_access(a, PS).unwrap();
    let mut buf = [0u8; 8];
    d.read_into(a + 16, &mut buf).unwrap();
    assert_eq!(
        buf.to_vec(),
        (16..24).map(|i| pattern_byte(3, i)).collect::<Vec<_>>()
    );
    let mut big = vec![0u8; 2 * PS as usize];
    assert!(d.read_into(a, &mut big).is_err());
    assert_eq!(
        accounting(PS).check_access(a, 1),
        Err(SimAccessError::NoBacking)
    );
}
