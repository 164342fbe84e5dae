//! Address space, physical accounting and contract violations of memory calls.

use slotpool_core::{Device, DeviceError, PageHandle};

use super::{MIB, PS, assert_violation, dev, device};
use crate::{Backing, SimConfig, SimDevice};

#[test]
fn default_config() {
    let c = SimConfig::default();
    assert_eq!(c.total_memory, 80 << 30);
    assert_eq!(c.page_size, 2 << 20);
    assert_eq!(c.backing, Backing::Bytes);
    assert!(!c.auto_complete);
    let d = SimDevice::default();
    assert_eq!(d.total_memory(), 80 << 30);
    assert_eq!(d.free_memory(), 80 << 30);
    assert_eq!(d.page_size(), PS);
}

#[test]
fn page_size_must_be_a_power_of_two() {
    for page_size in [0, 3 << 20] {
        let config = SimConfig {
            page_size,
            ..SimConfig::default()
        };
        assert!(matches!(
            SimDevice::new(config),
            Err(DeviceError::InvalidArgument(_))
        ));
    }
}

#[test]
fn ranges_are_aligned_disjoint_and_guarded() {
    let d = device(1 << 30);
    let mut ranges = Vec::new();
    for size in [1, PS, PS + 1, 5 * MIB, 3 * PS] {
        ranges.push((d.alloc_segment(size).unwrap(), size));
        ranges.push((d.reserve(size.div_ceil(PS) * PS).unwrap(), size));
    }
    assert!(ranges[0].0 >= 0x7f00_0000_0000);
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((a, a_size), (b, _)) = (pair[0], pair[1]);
        assert_eq!(a % PS, 0);
        assert_eq!(b % PS, 0);
        assert!(
            b >= a + a_size.div_ceil(PS) * PS + PS,
            "no guard page between {a:#x} and {b:#x}"
        );
    }
    assert_eq!(d.segment_count(), 5);
    assert_eq!(d.reservation_count(), 5);
    assert_eq!(d.contract_violations(), 0);
}

#[test]
fn addresses_are_never_reused() {
    let d = dev();
    let a = d.alloc_segment(PS).unwrap();
    d.free_segment(a, PS).unwrap();
    let b = d.alloc_segment(PS).unwrap();
    assert_ne!(a, b);
    let p = d.create_page().unwrap();
    d.release_page(p).unwrap();
    assert_ne!(d.create_page().unwrap(), p);
}

#[test]
fn physical_memory_is_counted() {
    let d = dev();
    let seg = d.alloc_segment(3 * MIB).unwrap();
    let r = d.reserve(4 * PS).unwrap();
    assert_eq!(d.physical_bytes(), 3 * MIB, "reservations are virtual");
    let p1 = d.create_page().unwrap();
    let p2 = d.create_page().unwrap();
    assert_eq!(d.physical_bytes(), 3 * MIB + 2 * PS, "unmapped pages count");
    d.map(r + PS, p1).unwrap();
    assert_eq!(d.mapped_bytes(), PS);
    assert_eq!(
        d.physical_bytes(),
        3 * MIB + 2 * PS,
        "mapping costs nothing more"
    );
    assert_eq!(d.free_memory(), 64 * MIB - d.physical_bytes());
    assert_eq!(d.page_count(), 2);

    d.free_segment(seg, 3 * MIB).unwrap();
    assert_eq!(d.physical_bytes(), 2 * PS);
    assert_eq!(d.peak_physical_bytes(), 3 * MIB + 2 * PS);
    d.reset_peak_physical();
    assert_eq!(d.peak_physical_bytes(), 2 * PS);

    d.unmap(r + PS).unwrap();
    assert_eq!(d.mapped_bytes(), 0);
    d.release_page(p1).unwrap();
    d.release_page(p2).unwrap();
    d.release_reservation(r, 4 * PS).unwrap();
    assert_eq!(d.physical_bytes(), 0);
    assert_eq!(d.peak_physical_bytes(), 2 * PS);
    assert_eq!(
        (d.segment_count(), d.reservation_count(), d.page_count()),
        (0, 0, 0)
    );
    assert_eq!(d.contract_violations(), 0);
}

#[test]
fn allocation_beyond_total_is_out_of_memory() {
    let d = device(8 * MIB);
    d.alloc_segment(6 * MIB).unwrap();
    assert_eq!(d.alloc_segment(4 * MIB), Err(DeviceError::OutOfMemory));
    assert_eq!(d.alloc_segment(u64::MAX), Err(DeviceError::OutOfMemory));
    d.create_page().unwrap();
    assert_eq!(d.create_page(), Err(DeviceError::OutOfMemory));
    assert_eq!(d.physical_bytes(), 8 * MIB);
    assert_eq!(d.free_memory(), 0);
    assert_eq!((d.segment_count(), d.page_count()), (1, 1));
    assert_eq!(
        d.contract_violations(),
        0,
        "OOM is not a contract violation"
    );
    // Reservations take no physical memory, but the address space is finite.
    d.reserve(1 << 40).unwrap();
    assert_eq!(d.reserve(u64::MAX - PS + 1), Err(DeviceError::OutOfMemory));
}

#[test]
fn capacity_can_change_at_run_time() {
    let d = device(16 * MIB);
    let a = d.alloc_segment(8 * MIB).unwrap();
    d.set_capacity(4 * MIB);
    assert_eq!(d.total_memory(), 4 * MIB);
    assert_eq!(d.free_memory(), 0, "free saturates below the use");
    assert_eq!(d.create_page(), Err(DeviceError::OutOfMemory));
    d.free_segment(a, 8 * MIB).unwrap();
    d.create_page().unwrap();
    d.set_capacity(32 * MIB);
    assert_eq!(d.free_memory(), 32 * MIB - PS);
    d.alloc_segment(30 * MIB).unwrap();
}

#[test]
fn segment_contract_violations() {
    let d = dev();
    assert_violation(&d, d.alloc_segment(0), "size must be positive");
    let a = d.alloc_segment(PS).unwrap();
    let r = d.reserve(PS).unwrap();
    assert_violation(&d, d.free_segment(a, 2 * PS), "has size");
    assert_violation(&d, d.free_segment(a + 512, PS), "no live segment");
    assert_violation(&d, d.free_segment(r, PS), "is a reservation");
    assert_eq!(d.contract_violations(), 4);
    assert_eq!(d.physical_bytes(), PS, "rejected frees change nothing");
    d.free_segment(a, PS).unwrap();
    assert_violation(&d, d.free_segment(a, PS), "no live segment");
    assert_eq!(d.contract_violations(), 5);
}

#[test]
fn reservation_contract_violations() {
    let d = dev();
    assert_violation(&d, d.reserve(0), "multiple of the page size");
    assert_violation(&d, d.reserve(PS + 4096), "multiple of the page size");
    let r = d.reserve(2 * PS).unwrap();
    let a = d.alloc_segment(PS).unwrap();
    assert_violation(&d, d.release_reservation(r, PS), "has size");
    assert_violation(&d, d.release_reservation(a, PS), "is a segment");
    assert_violation(&d, d.release_reservation(r + PS, PS), "no reservation");
    let p = d.create_page().unwrap();
    d.map(r + PS, p).unwrap();
    assert_violation(&d, d.release_reservation(r, 2 * PS), "still mapped");
    assert_eq!(d.contract_violations(), 6);
    d.unmap(r + PS).unwrap();
    d.release_reservation(r, 2 * PS).unwrap();
    assert_violation(&d, d.release_reservation(r, 2 * PS), "no reservation");
}

#[test]
fn map_contract_violations() {
    let d = dev();
    let r = d.reserve(2 * PS).unwrap();
    let seg = d.alloc_segment(PS).unwrap();
    let p = d.create_page().unwrap();
    let q = d.create_page().unwrap();
    assert_violation(&d, d.map(seg, p), "not inside a reservation");
    assert_violation(&d, d.map(r + 2 * PS, p), "not inside a reservation");
    assert_violation(&d, d.map(r + 4096, p), "not page-aligned");
    assert_violation(&d, d.map(r, PageHandle(99)), "never created");
    d.map(r, p).unwrap();
    assert_violation(&d, d.map(r, q), "already mapped there");
    assert_eq!(d.contract_violations(), 5);
    assert_eq!(d.mapped_bytes(), PS, "rejected maps change nothing");
    d.release_page(q).unwrap();
    assert_violation(&d, d.map(r + PS, q), "already released");
}

/// One page mapped at two addresses (an alias) holds one set of bytes, costs one page of
/// physical memory, and may be released only once both mappings are gone.
#[test]
fn a_page_mapped_twice_shares_its_bytes() {
    let d = dev();
    let r = d.reserve(2 * PS).unwrap();
    let p = d.create_page().unwrap();
    d.map(r, p).unwrap();
    d.map(r + PS, p).unwrap();
    assert_eq!((d.mapped_bytes(), d.physical_bytes()), (2 * PS, PS));
    d.write(r + 100, &[1, 2, 3]).unwrap();
    assert_eq!(d.read(r + PS + 100, 3).unwrap(), vec![1, 2, 3]);
    d.write(r + PS + 101, &[9]).unwrap();
    assert_eq!(d.read(r + 100, 3).unwrap(), vec![1, 9, 3]);
    d.unmap(r).unwrap();
    assert_violation(&d, d.release_page(p), "still mapped");
    assert_eq!(d.read(r + PS + 100, 3).unwrap(), vec![1, 9, 3]);
    d.unmap(r + PS).unwrap();
    d.release_page(p).unwrap();
    assert_eq!(d.physical_bytes(), 0);
}

#[test]
fn unmap_and_release_page_contract_violations() {
    let d = dev();
    let r = d.reserve(2 * PS).unwrap();
    let p = d.create_page().unwrap();
    assert_violation(&d, d.unmap(r), "no page is mapped");
    assert_violation(&d, d.unmap(0x1000), "not inside a reservation");
    d.map(r, p).unwrap();
    assert_violation(&d, d.unmap(r + 4096), "no page is mapped");
    assert_violation(&d, d.release_page(p), "still mapped");
    assert_eq!(d.contract_violations(), 4);
    assert_eq!((d.mapped_bytes(), d.page_count()), (PS, 1));
    d.unmap(r).unwrap();
    assert_violation(&d, d.unmap(r), "no page is mapped");
    d.release_page(p).unwrap();
    assert_violation(&d, d.release_page(p), "already released");
    assert_violation(&d, d.release_page(PageHandle(0)), "never created");
    assert_eq!(d.contract_violations(), 7);
}

#[test]
fn shared_between_threads() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<SimDevice>();
    let d = device(1 << 30);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                for _ in 0..100 {
                    let a = d.alloc_segment(PS).unwrap();
                    d.free_segment(a, PS).unwrap();
                }
            });
        }
    });
    assert_eq!(d.physical_bytes(), 0);
    assert_eq!(d.contract_violations(), 0);
}
