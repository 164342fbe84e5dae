//! Page aliasing: an idle physical page mapped into the slot that needs it, beside its other
//! mappings, so that a repeating loop stops making page calls, while no two live allocations
//! ever share a physical byte.

use slotpool::core::{Allocator, GrowthMode, PoolId, RouteFilter};
use slotpool::sim::{CallKind, SimDevice};

use crate::common::{Live, MIB, check_all, fill_probes, setup};

/// Page calls the device saw: (create_page, map, unmap).
fn page_calls(dev: &SimDevice) -> (u64, u64, u64) {
    (
        dev.calls(CallKind::CreatePage),
        dev.calls(CallKind::Map),
        dev.calls(CallKind::Unmap),
    )
}

/// One step of a loop whose pattern shifts within the step: blocks land on addresses that other
/// blocks of the same step left idle, so following live bytes needs pages where others were.
/// Every allocation is filled with a pattern and every live one checked after each operation.
fn step(dev: &SimDevice, a: &Allocator<SimDevice>, persistent: &[Live], seed: &mut u64) {
    let mut live: Vec<Live> = persistent.to_vec();
    let mut op = |live: &mut Vec<Live>, alloc: Option<u64>, free: Option<usize>| {
        if let Some(i) = free {
            let l = live.remove(persistent.len() + i);
            a.free(l.ptr).unwrap();
        }
        if let Some(size) = alloc {
            *seed += 1;
            let ptr = a.alloc(size, 0).unwrap();
            fill_probes(dev, ptr, size, *seed);
            live.push(Live {
                ptr,
                size,
                seed: *seed,
                stream: 0,
            });
        }
        check_all(dev, a, live);
    };
    op(&mut live, Some(2 * MIB), None); // t0 at slot 0
    op(&mut live, Some(2 * MIB), None); // t1 at slot 1
    op(&mut live, None, Some(0)); // free t0: slot 0 falls idle
    op(&mut live, Some(4 * MIB), None); // t2 does not fit slot 0: slots 2-3, one takes t0's page
    op(&mut live, None, Some(0)); // free t1
    while live.len() > persistent.len() {
        op(&mut live, None, Some(0));
    }
}

#[test]
fn a_repeating_loop_makes_no_page_call_after_its_second_step() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let mut seed = 0;
    let w = a.alloc(MIB, 0).unwrap();
    fill_probes(&dev, w, MIB, 99);
    let persistent = [Live {
        ptr: w,
        size: MIB,
        seed: 99,
        stream: 0,
    }];
    step(&dev, &a, &persistent, &mut seed);
    step(&dev, &a, &persistent, &mut seed);
    let before = page_calls(&dev);
    let peak = a.stats().reserved_bytes.all().peak;
    for _ in 0..4 {
        step(&dev, &a, &persistent, &mut seed);
    }
    assert_eq!(page_calls(&dev), before, "steady state: no page call");
    assert_eq!(a.stats().reserved_bytes.all().peak, peak);
    // The page-granular limit: 6 MiB live at most (t1 and t2), on three 2 MiB pages, beside the
    // small pool's 2 MiB page; four large slots are mapped, so one page is mapped at two of them.
    // (Moving pages instead, each step moved t0's page to slot 2 and back.)
    assert_eq!(peak as u64, 8 * MIB, "peak reserved {} MiB", peak >> 20);
    assert_eq!(
        (dev.physical_bytes(), dev.mapped_bytes()),
        (8 * MIB, 10 * MIB)
    );
    // The allocator counts the calls the device saw.
    let calls = a.backend_calls();
    assert_eq!(
        (calls.create_page, calls.map, calls.unmap),
        page_calls(&dev)
    );
    // empty_cache unmaps every idle slot and releases the pages nothing live maps.
    a.free(w).unwrap();
    a.empty_cache();
    check_all(&dev, &a, &[]);
    assert_eq!((dev.physical_bytes(), dev.mapped_bytes()), (0, 0));
}

/// A capture while the slots a best fit would take are stale (their page backs another live
/// slot): unmapping is illegal then, so the allocation is served elsewhere, and no forbidden
/// call reaches the device.
#[test]
fn stale_slots_are_not_unmapped_during_a_capture() {
    const POOL: PoolId = PoolId(0, 9);
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.create_or_incref_pool(POOL, Default::default()).unwrap();
    // In the capture pool: slot 0's page is aliased into slot 2, which is live, so slot 0 is
    // stale; the 2 MiB hole at slot 0 is a best fit that would need it unmapped.
    let x = a.alloc_in(POOL, 2 * MIB, 0).unwrap(); // slot 0
    let y = a.alloc_in(POOL, 2 * MIB, 0).unwrap(); // slot 1
    a.free(x).unwrap();
    let z = a.alloc_in(POOL, 4 * MIB, 0).unwrap(); // slots 2-3, one page new
    assert_eq!(z, y + 2 * MIB);
    assert_eq!(dev.physical_bytes(), 6 * MIB, "slot 0's page backs slot 2");
    assert_eq!(dev.mapped_bytes(), 8 * MIB);
    check_all(&dev, &a, &[]);
    let mut live = Vec::new();
    let id = dev.begin_capture(1).unwrap();
    a.begin_allocate_to_pool(POOL, RouteFilter::Capture(id))
        .unwrap();
    for i in 0..6u64 {
        let size = (1 + i % 3) * 2 * MIB;
        let p = a.alloc(size, 1).unwrap();
        fill_probes(&dev, p, size, 500 + i);
        live.push(Live {
            ptr: p,
            size,
            seed: 500 + i,
            stream: 1,
        });
        check_all(&dev, &a, &live);
    }
    assert_ne!(live[0].ptr, x, "not the stale hole");
    dev.end_capture(1).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    check_all(&dev, &a, &live);
    assert_eq!(dev.capture_violations(), 0);
    // Outside the capture the stale slot is unmapped and backed by a page of its own.
    let again = a.alloc_in(POOL, 2 * MIB, 0).unwrap();
    assert_eq!(again, x);
    fill_probes(&dev, again, 2 * MIB, 7);
    live.push(Live {
        ptr: again,
        size: 2 * MIB,
        seed: 7,
        stream: 0,
    });
    check_all(&dev, &a, &live);
    let _ = (y, z);
}
