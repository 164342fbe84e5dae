//! Arenas under hostile use: liveness per (branch, slot), refused calls that change nothing,
//! out-of-memory that keeps nothing, the arena's hold on its pool, and its pages in every
//! statistic and the snapshot.

use slotpool::core::{
    AllocError, Allocator, ArenaId, GrowthMode, PoolId, PoolOptions, block::BlockState,
};
use slotpool::sim::{CallKind, SimDevice};

use crate::common::{MIB, setup, setup_with_pool};

const POOL: PoolId = PoolId(0, 41);

/// Everything a refused arena call must leave as it was.
#[derive(Debug, PartialEq)]
struct Observed {
    report: slotpool::core::ArenaReport,
    stats: std::collections::BTreeMap<String, i64>,
    pool_stats: std::collections::BTreeMap<String, i64>,
    held: u64,
    physical: u64,
    mapped: u64,
    pages: usize,
    dump: String,
    snapshot: String,
}

fn observe(dev: &SimDevice, a: &Allocator<SimDevice>, ar: ArenaId) -> Observed {
    Observed {
        report: a.arena_report(ar).unwrap(),
        stats: a.stats().to_flat_map(),
        pool_stats: a.pool_stats(POOL).unwrap().to_flat_map(),
        held: a.held_bytes(),
        physical: dev.physical_bytes(),
        mapped: dev.mapped_bytes(),
        pages: dev.page_count(),
        dump: a.state_dump(),
        snapshot: format!("{:?}", a.snapshot()),
    }
}

/// Reserved bytes in the statistics are exactly what the budget holds beyond the device's pool
/// of unmapped pages, and the arena's pages are among them.
fn check_reserved(dev: &SimDevice, a: &Allocator<SimDevice>) {
    a.check_invariants().unwrap();
    let st = a.stats();
    let cached = dev.physical_bytes() - dev.mapped_bytes() - classic_bytes(a);
    assert_eq!(
        st.reserved_bytes.all().current as u64 + cached,
        a.held_bytes(),
        "reserved current + cached pages = held"
    );
    assert!(st.reserved_bytes.all().peak >= st.reserved_bytes.all().current);
    let snap: u64 = a.snapshot().iter().map(|s| s.size).sum();
    assert_eq!(
        snap,
        st.reserved_bytes.all().current as u64,
        "snapshot = reserved"
    );
    assert_eq!(dev.contract_violations(), 0, "{:?}", dev.last_violation());
}

/// Assert that `after` equals `before`, naming what differs.
#[track_caller]
fn unchanged(before: &Observed, after: &Observed, what: &str) {
    if before == after {
        return;
    }
    let mut diff = Vec::new();
    for (k, v) in &before.stats {
        if after.stats.get(k) != Some(v) {
            diff.push(format!("{k}: {v} -> {:?}", after.stats.get(k)));
        }
    }
    for (k, v) in &before.pool_stats {
        if after.pool_stats.get(k) != Some(v) {
            diff.push(format!("pool {k}: {v} -> {:?}", after.pool_stats.get(k)));
        }
    }
    let pairs = [
        (
            "report",
            format!("{:?}", before.report),
            format!("{:?}", after.report),
        ),
        ("held", before.held.to_string(), after.held.to_string()),
        (
            "physical",
            before.physical.to_string(),
            after.physical.to_string(),
        ),
        (
            "mapped",
            before.mapped.to_string(),
            after.mapped.to_string(),
        ),
        ("pages", before.pages.to_string(), after.pages.to_string()),
        ("dump", before.dump.clone(), after.dump.clone()),
        ("snapshot", before.snapshot.clone(), after.snapshot.clone()),
    ];
    for (name, b, a) in pairs {
        if a != b {
            diff.push(format!("{name}: {b} -> {a}"));
        }
    }
    panic!("{what}:\n{}", diff.join("\n"));
}

fn classic_bytes(a: &Allocator<SimDevice>) -> u64 {
    a.snapshot().iter().filter(|s| !s.vmm).map(|s| s.size).sum()
}

#[test]
fn a_free_touches_only_its_own_branch() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let ar = a.arena_create(POOL, 0).unwrap();
    let p0 = a.arena_alloc(ar, 0, 0, 4 * MIB).unwrap();
    let p1 = a.arena_alloc(ar, 1, 0, 4 * MIB).unwrap();
    assert_eq!(p0, p1, "slot 0 aliases across branches");
    assert_eq!(a.arena_report(ar).unwrap().live, 2);
    a.arena_free(ar, 1, 0).unwrap();
    assert_eq!(a.arena_report(ar).unwrap().live, 1);
    let before = observe(&dev, &a, ar);
    assert!(
        matches!(
            a.arena_alloc(ar, 0, 0, 4 * MIB),
            Err(AllocError::InvalidState(_))
        ),
        "branch 0's slot 0 is still live"
    );
    assert!(matches!(
        a.arena_destroy(ar),
        Err(AllocError::InvalidState(_))
    ));
    assert!(matches!(
        a.arena_free(ar, 1, 0),
        Err(AllocError::InvalidState(_))
    ));
    unchanged(
        &before,
        &observe(&dev, &a, ar),
        "refused calls changed state",
    );
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_destroy(ar).unwrap();
    check_reserved(&dev, &a);
}

#[test]
fn a_refused_alloc_does_not_grow_the_slot() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let ar = a.arena_create(POOL, 0).unwrap();
    a.arena_alloc(ar, 0, 0, MIB).unwrap();
    let before = observe(&dev, &a, ar);
    assert!(matches!(
        a.arena_alloc(ar, 0, 0, 64 * MIB),
        Err(AllocError::InvalidState(_))
    ));
    unchanged(
        &before,
        &observe(&dev, &a, ar),
        "the refused call grew the slot",
    );
    // Debug mode: an overlap is refused before anything is placed (only the report records it).
    a.arena_set_debug(ar, true).unwrap();
    let before = observe(&dev, &a, ar);
    assert!(matches!(
        a.arena_alloc(ar, 1, 0, 32 * MIB),
        Err(AllocError::InvalidState(_))
    ));
    let mut after = observe(&dev, &a, ar);
    assert_eq!(after.report.overlaps.len(), 1);
    after.report.overlaps.clear();
    unchanged(&before, &after, "the refused overlap grew the slot");
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_destroy(ar).unwrap();
    check_reserved(&dev, &a);
}

#[test]
fn an_alloc_out_of_memory_keeps_no_page() {
    for kind in [CallKind::CreatePage, CallKind::Map] {
        for nth in 1..=4 {
            let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
            let ar = a.arena_create(POOL, 0).unwrap();
            a.arena_alloc(ar, 0, 0, 3 * MIB).unwrap();
            let before = observe(&dev, &a, ar);
            dev.inject_oom(kind, nth);
            // The failed first try reclaims the cache, synchronising: from then on every call
            // of `kind` fails too, so that the retries fail as well.
            let d = dev.clone();
            dev.after_next_synchronize(move || d.fail_all(kind, true));
            let r = a.arena_alloc(ar, 0, 1, 8 * MIB);
            dev.fail_all(kind, false);
            assert!(
                matches!(r, Err(AllocError::OutOfMemory(_))),
                "{kind:?} {nth}: {r:?}"
            );
            // Counted as an allocation's refusal is: one retry after reclaiming, one OOM.
            let mut after = observe(&dev, &a, ar);
            for key in ["num_alloc_retries", "num_ooms"] {
                let n = after.stats.get_mut(key).unwrap();
                assert_eq!(*n, before.stats[key] + 1, "{kind:?} {nth}: {key}");
                *n -= 1;
            }
            unchanged(
                &before,
                &after,
                &format!("{kind:?} {nth}: the failed call kept what it mapped"),
            );
            check_reserved(&dev, &a);
            // The arena still works, at the same place.
            let p = a.arena_alloc(ar, 0, 1, 8 * MIB).unwrap();
            assert_eq!(p, a.arena_report(ar).unwrap().base + 3 * MIB);
            assert_eq!(a.arena_report(ar).unwrap().mapped, 12 * MIB);
            check_reserved(&dev, &a);
            a.arena_free(ar, 0, 0).unwrap();
            a.arena_free(ar, 0, 1).unwrap();
            a.arena_destroy(ar).unwrap();
            a.empty_cache();
            assert_eq!(dev.physical_bytes(), 0);
        }
    }
}

#[test]
fn an_arena_holds_a_use_of_its_pool() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let ar = a.arena_create(POOL, 0).unwrap();
    assert_eq!(a.pool_use_count(POOL).unwrap(), 2, "the arena's use");
    a.arena_alloc(ar, 0, 0, 8 * MIB).unwrap();
    a.arena_free(ar, 0, 0).unwrap();
    assert_eq!(a.release_pool(POOL).unwrap(), 1);
    a.empty_cache();
    assert_eq!(
        a.pool_use_count(POOL).unwrap(),
        1,
        "the pool outlives the arena"
    );
    assert_eq!(
        a.create_or_incref_pool(POOL, PoolOptions::default())
            .unwrap(),
        2
    );
    a.check_invariants().unwrap();
    a.arena_destroy(ar).unwrap();
    assert_eq!(a.pool_use_count(POOL).unwrap(), 1);
    a.check_invariants().unwrap();
    // The pool's budget is whole: a limit of 8 MiB still admits 8 MiB.
    a.set_pool_options(
        POOL,
        PoolOptions {
            limit: Some(8 * MIB),
            ..PoolOptions::default()
        },
    )
    .unwrap();
    let p = a.alloc_in(POOL, 8 * MIB, 0).unwrap();
    a.free(p).unwrap();
    // Even a use released by mistake (the arena's own) does not let the pool be forgotten
    // under a live arena, nor its id re-created with another budget.
    a.empty_cache();
    let ar = a.arena_create(POOL, 0).unwrap();
    a.arena_alloc(ar, 0, 0, 4 * MIB).unwrap();
    assert_eq!(a.release_pool(POOL).unwrap(), 1);
    assert_eq!(a.release_pool(POOL).unwrap(), 0);
    a.empty_cache();
    assert_eq!(
        a.pool_use_count(POOL).unwrap(),
        0,
        "kept while its arena lives"
    );
    assert_eq!(
        a.create_or_incref_pool(POOL, PoolOptions::default())
            .unwrap(),
        1
    );
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_destroy(ar).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.pool_stats(POOL).unwrap().reserved_bytes.all().current, 0);
    // An arena in a pool it creates gives it back on destroy: the pool is then freeable.
    let fresh = PoolId(0, 42);
    let ar = a.arena_create(fresh, 0).unwrap();
    assert_eq!(a.pool_use_count(fresh).unwrap(), 1);
    a.arena_alloc(ar, 0, 0, MIB).unwrap();
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_destroy(ar).unwrap();
    assert_eq!(a.pool_use_count(fresh).unwrap(), 0);
    a.empty_cache();
    assert!(a.pool_use_count(fresh).is_err(), "forgotten once freeable");
    check_reserved(&dev, &a);
}

#[test]
fn arena_pages_are_reserved_bytes_and_snapshot_segments() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let x = a.alloc(3 * MIB, 0).unwrap();
    let ar = a.arena_create(POOL, 5).unwrap();
    let p = a.arena_alloc(ar, 0, 0, 3 * MIB).unwrap();
    let q = a.arena_alloc(ar, 0, 1, 2 * MIB).unwrap();
    check_reserved(&dev, &a);
    let st = a.stats();
    assert_eq!(st.reserved_bytes.all().current as u64, 4 * MIB + 6 * MIB);
    assert_eq!(
        a.pool_stats(POOL).unwrap().reserved_bytes.all().current as u64,
        6 * MIB
    );
    assert_eq!(st.reserved_bytes.all().peak as u64, 10 * MIB);
    let snap = a.snapshot();
    let seg = snap
        .iter()
        .find(|s| s.pool == POOL)
        .expect("the arena is a segment of its pool");
    assert_eq!((seg.addr, seg.size, seg.stream), (p, 6 * MIB, 5));
    let blocks: Vec<_> = seg
        .blocks
        .iter()
        .map(|b| (b.addr, b.size, b.state))
        .collect();
    assert_eq!(
        blocks,
        vec![
            (p, 3 * MIB, BlockState::Allocated),
            (q, 2 * MIB, BlockState::Allocated),
            (q + 2 * MIB, MIB, BlockState::Free),
        ]
    );
    a.arena_free(ar, 0, 0).unwrap();
    let seg = a.snapshot().into_iter().find(|s| s.pool == POOL).unwrap();
    assert_eq!(seg.blocks[0].state, BlockState::Free);
    // A smaller request in the slot is a smaller allocation; the rest of the slot shows free.
    a.arena_alloc(ar, 1, 0, MIB).unwrap();
    let seg = a.snapshot().into_iter().find(|s| s.pool == POOL).unwrap();
    let head: Vec<_> = seg.blocks[..2]
        .iter()
        .map(|b| (b.addr, b.size, b.requested, b.state))
        .collect();
    assert_eq!(
        head,
        vec![
            (p, MIB, MIB, BlockState::Allocated),
            (p + MIB, 2 * MIB, 0, BlockState::Free)
        ]
    );
    assert_eq!(
        a.pool_stats(POOL).unwrap().allocated_bytes.all().current as u64,
        3 * MIB
    );
    a.arena_free(ar, 1, 0).unwrap();
    a.arena_free(ar, 0, 1).unwrap();
    a.arena_destroy(ar).unwrap();
    a.free(x).unwrap();
    check_reserved(&dev, &a);
    let st = a.stats();
    assert_eq!(st.reserved_bytes.all().current as u64, 4 * MIB);
    assert_eq!(st.reserved_bytes.all().peak as u64, 10 * MIB);
    a.empty_cache();
    check_reserved(&dev, &a);
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn arena_in_the_default_pool_and_unknown_arenas() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let ar = a.arena_create(PoolId::DEFAULT, 0).unwrap();
    a.arena_alloc(ar, 0, 0, MIB).unwrap();
    check_reserved(&dev, &a);
    let bad = ArenaId(ar.0 + 100);
    for r in [
        a.arena_alloc(bad, 0, 0, MIB).map(|_| ()),
        a.arena_free(bad, 0, 0),
        a.arena_destroy(bad),
        a.arena_set_debug(bad, true),
    ] {
        assert!(matches!(r, Err(AllocError::InvalidArgument(_))), "{r:?}");
    }
    for size in [0, (1 << 56) + 1] {
        assert!(matches!(
            a.arena_alloc(ar, 0, 1, size),
            Err(AllocError::InvalidSize(_))
        ));
    }
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_destroy(ar).unwrap();
    assert!(a.arena_destroy(ar).is_err(), "destroyed twice");
    a.empty_cache();
    check_reserved(&dev, &a);
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn growth_during_a_capture_never_unmaps() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let ar = a.arena_create(POOL, 3).unwrap();
    let id = dev.begin_capture(3).unwrap();
    a.begin_allocate_to_pool(POOL, slotpool::core::RouteFilter::Capture(id))
        .unwrap();
    let p = a.arena_alloc(ar, 0, 0, 3 * MIB).unwrap();
    // The third page's map fails: the two mapped before it stay (unmapping is illegal now) and
    // serve the next growth; the call fails and allocates nothing.
    dev.inject_oom(CallKind::Map, 3);
    let r = a.arena_alloc(ar, 0, 1, 8 * MIB);
    assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
    assert_eq!(
        dev.capture_violations(),
        0,
        "nothing unmapped during the capture"
    );
    let rep = a.arena_report(ar).unwrap();
    assert_eq!((rep.live, rep.slots, rep.size), (1, 1, 3 * MIB));
    assert_eq!(rep.mapped, 8 * MIB, "2 pages before, 2 kept");
    a.check_invariants().unwrap();
    assert!(matches!(
        a.arena_destroy(ar),
        Err(AllocError::InvalidState(_))
    ));
    let q = a.arena_alloc(ar, 0, 1, 8 * MIB).unwrap();
    assert_eq!(q, p + 3 * MIB);
    assert_eq!(a.arena_report(ar).unwrap().mapped, 12 * MIB);
    dev.end_capture(3).unwrap();
    a.end_allocate_to_pool(POOL).unwrap();
    check_reserved(&dev, &a);
    a.arena_free(ar, 0, 0).unwrap();
    a.arena_free(ar, 0, 1).unwrap();
    a.arena_destroy(ar).unwrap();
    a.empty_cache();
    check_reserved(&dev, &a);
    assert_eq!(dev.physical_bytes(), 0);
}
