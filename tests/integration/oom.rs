//! The out-of-memory report counts each reserved byte once: allocated, cached in private pools,
//! or unallocated in the default pool; the three add up to what is reserved.

use slotpool::core::{AllocError, GrowthMode, OomReport, PoolId, PoolOptions};

use crate::common::*;

fn oom(err: AllocError) -> OomReport {
    match err {
        AllocError::OutOfMemory(report) => *report,
        other => panic!("expected out of memory, got {other}"),
    }
}

/// The three parts of the report, checked to add up to `reserved`.
#[track_caller]
fn parts(r: &OomReport) -> (u64, u64, u64) {
    assert_eq!(
        r.allocated + r.private_pools_cached + r.unallocated,
        r.reserved,
        "the parts do not add up: {r:?}"
    );
    (r.allocated, r.private_pools_cached, r.unallocated)
}

#[test]
fn a_private_pools_cache_is_counted_once() {
    let (_dev, a) = setup(GrowthMode::Classic, 1 << 30);
    let pool = PoolId(0, 7);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    // 2 MiB live in the pool, in a 20 MiB segment (PyTorch's size for 1-10 MiB requests): 18 MiB
    // that only the pool can use, and that freeing caches cannot return while the 2 MiB live.
    let _in_pool = a.alloc_in(pool, 2 * MIB, 0).unwrap();
    let _live = a.alloc(900 * MIB, 0).unwrap();
    let spare = a.alloc(64 * MIB, 0).unwrap();
    a.free(spare).unwrap();
    a.check_invariants().unwrap();

    let r = oom(a.alloc(200 * MIB, 0).unwrap_err());
    // The default pool's 64 MiB cache was released before giving up; the pool's was not.
    assert_eq!(r.reserved, 920 * MIB, "{r:?}");
    assert_eq!(parts(&r), (902 * MIB, 18 * MIB, 0), "{r:?}");
    let text = r.to_string();
    assert!(
        text.contains("0.90 GiB reserved of a 1.00 GiB limit: 0.88 GiB allocated, 0.02 GiB cached in private pools, 0.00 GiB reserved but unallocated"),
        "{text}"
    );
    a.check_invariants().unwrap();

    // A request that can never fit is reported the same way, before anything is released.
    let r = oom(a.alloc(2 << 30, 0).unwrap_err());
    assert_eq!(parts(&r), (902 * MIB, 18 * MIB, 0), "{r:?}");
}

#[test]
fn the_parts_add_up_under_vmm_growth() {
    let (_dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let pool = PoolId(0, 8);
    a.create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let _in_pool: Vec<_> = (0..5)
        .map(|i| a.alloc_in(pool, (3 + i) * MIB, 0).unwrap())
        .collect();
    let _live = a.alloc(800 * MIB, 0).unwrap();
    let r = oom(a.alloc(300 * MIB, 0).unwrap_err());
    let (allocated, _, _) = parts(&r);
    assert!(allocated >= 825 * MIB, "{r:?}");
    a.check_invariants().unwrap();
}

#[test]
fn without_private_pools_everything_unallocated_is_the_default_pools() {
    let (_dev, a) = setup(GrowthMode::Classic, 1 << 30);
    let _live = a.alloc(900 * MIB, 0).unwrap();
    let r = oom(a.alloc(200 * MIB, 0).unwrap_err());
    let (allocated, private_cached, unallocated) = parts(&r);
    assert_eq!(allocated, 900 * MIB);
    assert_eq!(private_cached, 0);
    assert_eq!(unallocated, r.reserved - 900 * MIB);
    assert!(
        r.to_string().contains("0.00 GiB cached in private pools"),
        "{r}"
    );
}
