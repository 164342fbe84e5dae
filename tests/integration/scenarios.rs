//! Scenario tests of pools, checkpoint / restore and variant groups, shaped like the real
//! problem: mutually exclusive CUDA-graph variants and per-layer capture pools.

use std::sync::Arc;

use slotpool::core::{AllocError, Allocator, Config, GrowthMode, PoolId, PoolOptions, RouteFilter};
use slotpool::sim::{Backing, SimConfig, SimDevice};

use crate::common::{Live, MIB, check_all, fill_probes, setup, setup_with_pool, verify_probes};

const POOL: PoolId = PoolId(0, 1);

fn accounting(growth: GrowthMode) -> (Arc<SimDevice>, Allocator<SimDevice>) {
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            total_memory: 80 << 30,
            backing: Backing::Accounting,
            auto_complete: true,
            ..SimConfig::default()
        })
        .expect("sim"),
    );
    let config = Config {
        growth,
        vmm_reservation: Some(64 << 30),
        ..Config::default()
    };
    (dev.clone(), Allocator::new(dev, config))
}

fn live(ptr: u64, size: u64, seed: u64) -> Live {
    Live {
        ptr,
        size,
        seed,
        stream: 0,
    }
}

#[test]
fn checkpoint_restore_frees_new_and_recreates_old() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup_with_pool(growth, POOL);
        let pa = a.alloc_in(POOL, 3 * MIB, 0).unwrap();
        let pb = a.alloc_in(POOL, 4096, 0).unwrap();
        fill_probes(&dev, pb, 4096, 7);
        let cp = a.checkpoint(POOL).unwrap();
        // Unchanged: restore is a no-op.
        let d = a.restore(POOL, &cp, &[pa, pb]).unwrap();
        assert!(d.freed.is_empty() && d.created.is_empty(), "{d:?}");
        a.free(pa).unwrap();
        let pc = a.alloc_in(POOL, 5 * MIB, 0).unwrap();
        let pd = a.alloc_in(POOL, 512, 0).unwrap();
        check_all(&dev, &a, &[live(pb, 4096, 7)]);
        let mut d = a.restore(POOL, &cp, &[pb]).unwrap();
        d.sort_by_address();
        let mut freed = vec![(pc, a.config().policy.round_size(5 * MIB)), (pd, 512)];
        freed.sort_unstable();
        assert_eq!(d.freed, freed, "{growth:?}");
        assert_eq!(d.created, vec![(pa, 3 * MIB)], "{growth:?}");
        check_all(&dev, &a, &[live(pb, 4096, 7)]);
        assert_eq!(a.allocation_info(pa).unwrap().0, pa);
        if pc != pa {
            assert!(matches!(a.free(pc), Err(AllocError::UnknownPointer(_))));
        }
        assert_eq!(
            a.allocation_info(pa).unwrap().1,
            3 * MIB,
            "re-created at its old size"
        );
        // The same checkpoint restores again (what variant groups do).
        let pe = a.alloc_in(POOL, MIB, 0).unwrap();
        let d = a.restore(POOL, &cp, &[]).unwrap();
        assert_eq!(d.freed.len(), 1);
        assert_eq!(d.freed[0].0, pe);
        check_all(&dev, &a, &[live(pb, 4096, 7)]);
        a.free(pa).unwrap();
        a.free(pb).unwrap();
        drop(cp);
        check_all(&dev, &a, &[]);
    }
}

/// keep_live is resolved in the pool's own shards: pointers of several streams (shards) in one
/// list survive, and one stray pointer among them refuses the restore, named, with nothing changed.
#[test]
fn keep_live_spans_the_pools_shards() {
    let (_, a) = setup(GrowthMode::Vmm, 1 << 30);
    let other = PoolId(0, 2);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    a.create_or_incref_pool(other, PoolOptions::default())
        .unwrap();
    let kept: Vec<u64> = (0..12)
        .map(|i| a.alloc_in(POOL, MIB * (1 + i % 3), i % 4).unwrap())
        .collect();
    let q = a.alloc_in(other, MIB, 1).unwrap();
    let cp = a.checkpoint(POOL).unwrap();
    for s in 0..4 {
        a.alloc_in(POOL, 3 * MIB, s).unwrap();
    }
    a.check_invariants().unwrap();
    // Kept pointers interleaved across the four shards, then a stray of another pool in the
    // middle, then a pointer that was never allocated.
    let mut keep: Vec<u64> = kept.iter().rev().copied().collect();
    for stray in [q, 0xdead_0000] {
        keep.insert(5, stray);
        let before = a.state_dump();
        match a.restore(POOL, &cp, &keep) {
            Err(AllocError::CheckpointMismatch(d)) => {
                assert_eq!(d.mismatches.len(), 1, "{d}");
                assert!(d.mismatches[0].starts_with(&format!("{stray:#x}")), "{d}");
                assert_eq!(d.added.len(), 4, "{d}");
            }
            other => panic!("expected a mismatch, got {other:?}"),
        }
        assert_eq!(
            a.state_dump(),
            before,
            "a refused restore changed the state"
        );
        a.check_invariants().unwrap();
        keep.remove(5);
    }
    let delta = a.restore(POOL, &cp, &keep).unwrap();
    assert_eq!(delta.freed.len(), 4);
    assert!(delta.created.is_empty());
    a.check_invariants().unwrap();
    for p in kept {
        a.free(p).unwrap();
    }
    a.check_invariants().unwrap();
}

#[test]
fn restore_mismatches_change_nothing() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let other = PoolId(0, 2);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    a.create_or_incref_pool(other, PoolOptions::default())
        .unwrap();
    let p0 = a.alloc_in(POOL, MIB, 0).unwrap();
    let cp = a.checkpoint(POOL).unwrap();
    let p1 = a.alloc_in(POOL, 2 * MIB, 0).unwrap();
    let q = a.alloc_in(other, MIB, 0).unwrap();
    let mismatch = |r: Result<_, AllocError>| match r {
        Err(AllocError::CheckpointMismatch(d)) => d,
        other => panic!("expected a mismatch, got {other:?}"),
    };
    // A pointer allocated since the checkpoint cannot be kept.
    let d = mismatch(a.restore(POOL, &cp, &[p1]));
    assert!(d.mismatches[0].contains("must stay live"), "{d}");
    assert_eq!(d.added, vec![(p1, 2 * MIB)]);
    // Unknown pointers and pointers of another pool. No pointer of the pool is kept, so the
    // plan leaves the lists to the apply step; a refusal still reports them.
    let d = mismatch(a.restore(POOL, &cp, &[0xdead_0000]));
    assert_eq!(d.added, vec![(p1, 2 * MIB)], "{d}");
    let d = mismatch(a.restore(POOL, &cp, &[q]));
    assert!(d.to_string().contains("another pool"), "{d}");
    assert_eq!(d.added, vec![(p1, 2 * MIB)], "{d}");
    // A checkpoint of another pool.
    assert!(matches!(
        a.restore(other, &cp, &[]),
        Err(AllocError::InvalidArgument(_))
    ));
    // A checkpoint of another allocator.
    let (_, b) = setup(GrowthMode::Vmm, 1 << 30);
    b.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    let foreign = b.checkpoint(POOL).unwrap();
    assert!(matches!(
        a.restore(POOL, &foreign, &[]),
        Err(AllocError::InvalidArgument(_))
    ));
    // Frees waiting on another stream's events.
    a.record_stream(p0, 5).unwrap();
    dev.launch(5);
    a.free(p0).unwrap();
    let pending = a.state_dump();
    let d = mismatch(a.restore(POOL, &cp, &[]));
    assert!(d.to_string().contains("cross-stream"), "{d}");
    assert_eq!(
        a.state_dump(),
        pending,
        "a refused restore changed the state"
    );
    dev.complete(5);
    a.process_events();
    // Restoring an earlier checkpoint leaves later ones restorable (graph trees switch paths).
    // (Blocks and current statistics; the accumulated totals count what restores did.)
    let late = a.checkpoint(POOL).unwrap();
    let state = |a: &Allocator<SimDevice>| (a.snapshot(), a.stats().allocated_bytes.all().current);
    let at_late = state(&a);
    let at_early = {
        a.restore(POOL, &cp, &[]).unwrap();
        check_all(&dev, &a, &[]);
        state(&a)
    };
    assert_ne!(at_early, at_late);
    a.restore(POOL, &late, &[]).unwrap();
    check_all(&dev, &a, &[]);
    assert_eq!(state(&a), at_late, "back at the later checkpoint");
    a.restore(POOL, &cp, &[]).unwrap();
    assert_eq!(state(&a), at_early, "and at the earlier one again");
    a.restore(POOL, &late, &[]).unwrap();
    assert_eq!(state(&a), at_late, "and at the later one again");
    check_all(&dev, &a, &[]);
}

#[test]
fn refused_restore_leaves_state_byte_for_byte() {
    let (dev, a) = setup(GrowthMode::Classic, 1 << 30);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    let keep = a.alloc_in(POOL, 8192, 0).unwrap();
    let cp = a.checkpoint(POOL).unwrap();
    let newer = a.alloc_in(POOL, 3 * MIB, 0).unwrap();
    fill_probes(&dev, newer, 3 * MIB, 3);
    let before = a.state_dump();
    assert!(a.restore(POOL, &cp, &[keep, newer]).is_err());
    assert_eq!(a.state_dump(), before);
    check_all(&dev, &a, &[live(newer, 3 * MIB, 3)]);
    verify_probes(&dev, newer, 3 * MIB, 3).unwrap();
}

#[test]
fn checkpoint_of_unknown_pool_is_an_error() {
    let (_, a) = setup(GrowthMode::Vmm, 1 << 30);
    assert!(matches!(
        a.checkpoint(PoolId(0, 77)),
        Err(AllocError::UnknownPool(_))
    ));
}

#[test]
fn vmm_restore_remaps_pages_released_since() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    let p = a.alloc_in(POOL, 6 * MIB, 0).unwrap();
    let cp = a.checkpoint(POOL).unwrap();
    a.free(p).unwrap();
    a.empty_pool_cache(POOL).unwrap();
    assert_eq!(dev.mapped_bytes(), 0, "idle pages released");
    let d = a.restore(POOL, &cp, &[]).unwrap();
    assert_eq!(d.created, vec![(p, 6 * MIB)]);
    assert!(dev.mapped_bytes() >= 6 * MIB);
    fill_probes(&dev, p, 6 * MIB, 11);
    check_all(&dev, &a, &[live(p, 6 * MIB, 11)]);
}

/// One transformer layer's forward + backward allocations at local sequence length `s`
/// (d = 4096, FFN 16384, bf16): (slot, size) allocations and frees, ending with the outputs
/// live, as a captured graph leaves them.
fn layer(s: u64) -> Vec<(usize, Option<u64>)> {
    let hidden = s * 4096 * 2;
    let ffn = s * 16384 * 2;
    vec![
        (0, Some(hidden)),     // input copy
        (1, Some(3 * hidden)), // qkv
        (2, Some(hidden)),     // attention out
        (3, Some(hidden)),     // projection
        (1, None),
        (4, Some(ffn)), // ffn up
        (5, Some(ffn)), // activation
        (6, Some(hidden)),
        (4, None),
        (7, Some(hidden)), // output
        (8, Some(hidden)), // grad out
        (9, Some(ffn)),    // grad ffn
        (5, None),
        (10, Some(3 * hidden)),
        (9, None),
        (11, Some(hidden)), // grad input
        (2, None),
        (3, None),
        (6, None),
        (8, None),
        (10, None),
        (0, None),
    ]
}

fn run_layer(a: &Allocator<SimDevice>, pool: PoolId, s: u64) {
    let mut slots = [0u64; 12];
    for (slot, size) in layer(s) {
        match size {
            Some(n) => slots[slot] = a.alloc_in(pool, n, 0).expect("alloc"),
            None => a.free(slots[slot]).expect("free"),
        }
    }
}

const VARIANTS: [u64; 4] = [8192, 4096, 2048, 1024];

fn alone(s: u64) -> u64 {
    let (dev, a) = accounting(GrowthMode::Vmm);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    run_layer(&a, POOL, s);
    dev.peak_physical_bytes()
}

fn permutations(v: &[usize]) -> Vec<Vec<usize>> {
    if v.len() <= 1 {
        return vec![v.to_vec()];
    }
    let mut out = Vec::new();
    for i in 0..v.len() {
        let mut rest = v.to_vec();
        let x = rest.remove(i);
        for mut p in permutations(&rest) {
            p.insert(0, x);
            out.push(p);
        }
    }
    out
}

#[test]
fn variant_group_holds_the_largest_variant_in_every_order() {
    let largest = alone(VARIANTS[0]);
    for order in permutations(&[0, 1, 2, 3]) {
        let (dev, a) = accounting(GrowthMode::Vmm);
        let mut g = a.variant_group(POOL, 4).unwrap();
        for &k in &order {
            a.begin_variant(&mut g, k).unwrap();
            run_layer(&a, POOL, VARIANTS[k]);
            a.end_variant(&mut g).unwrap();
        }
        a.check_invariants().unwrap();
        let reserved = dev.peak_physical_bytes();
        assert!(
            reserved <= largest,
            "order {order:?}: group reserved {reserved}, largest alone {largest}"
        );
    }
    // Without the group, separate pools hold the sum and one shared pool more than the largest.
    let (dev, a) = accounting(GrowthMode::Vmm);
    for (i, &s) in VARIANTS.iter().enumerate() {
        let p = PoolId(0, 10 + i as u64);
        a.create_or_incref_pool(p, PoolOptions::default()).unwrap();
        run_layer(&a, p, s);
    }
    let separate = dev.peak_physical_bytes();
    let sum: u64 = VARIANTS.iter().map(|&s| alone(s)).sum();
    assert!(
        separate >= sum * 99 / 100,
        "separate {separate} vs sum {sum}"
    );
    let (dev, a) = accounting(GrowthMode::Vmm);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    for &s in VARIANTS.iter().rev() {
        run_layer(&a, POOL, s);
    }
    assert!(
        dev.peak_physical_bytes() > largest,
        "a shared pool without restore keeps outputs"
    );
}

#[test]
fn variant_group_rejects_misuse() {
    let (_, a) = accounting(GrowthMode::Vmm);
    assert!(a.variant_group(POOL, 0).is_err());
    let mut g = a.variant_group(POOL, 2).unwrap();
    assert!(a.begin_variant(&mut g, 2).is_err());
    a.begin_variant(&mut g, 0).unwrap();
    assert!(
        a.begin_variant(&mut g, 1).is_err(),
        "variant 0 has not ended"
    );
    a.end_variant(&mut g).unwrap();
    assert!(a.end_variant(&mut g).is_err());
}

/// 24 layers of attention + MoE-like MLP, each captured into its own pool vs one named pool.
#[test]
fn per_layer_pools_sharing_a_named_pool_reserve_less() {
    let layer_sizes = |i: u64| if i.is_multiple_of(2) { 2048 } else { 1536 };
    let (dev, a) = accounting(GrowthMode::Vmm);
    for i in 0..24u64 {
        let p = PoolId(0, 100 + i);
        a.create_or_incref_pool(p, PoolOptions::default()).unwrap();
        run_layer(&a, p, layer_sizes(i));
    }
    let separate = dev.peak_physical_bytes();
    let separate_alloc = a.stats().allocated_bytes.all().current as u64;

    let (dev, a) = accounting(GrowthMode::Vmm);
    let named = a.named_pool("layers", PoolOptions::default()).unwrap();
    for i in 0..24u64 {
        // Each layer's capture routes to the shared pool by its capture id.
        a.begin_allocate_to_pool(named, RouteFilter::All).unwrap();
        let mut slots = [0u64; 12];
        for (slot, size) in layer(layer_sizes(i)) {
            match size {
                Some(n) => slots[slot] = a.alloc(n, 0).unwrap(),
                None => a.free(slots[slot]).unwrap(),
            }
        }
        a.end_allocate_to_pool(named).unwrap();
        a.release_pool(named).unwrap();
    }
    let shared = dev.peak_physical_bytes();
    let peak_alloc = a.pool_stats(named).unwrap().allocated_bytes.all().peak as u64;
    assert_eq!(
        a.stats().allocated_bytes.all().current as u64,
        separate_alloc
    );
    assert!(shared < separate, "shared {shared} vs separate {separate}");
    assert!(
        shared as f64 <= peak_alloc as f64 * 1.05,
        "shared pool reserved {shared} for {peak_alloc} allocated"
    );
    a.check_invariants().unwrap();
}

#[test]
fn pools_route_by_thread_stream_and_capture() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let (p1, p2, p3) = (PoolId(0, 1), PoolId(0, 2), PoolId(9, 0));
    a.begin_allocate_to_pool(p1, RouteFilter::Stream(4))
        .unwrap();
    assert!(
        a.begin_allocate_to_pool(p1, RouteFilter::All).is_err(),
        "already recording"
    );
    a.begin_allocate_to_pool(p2, RouteFilter::Thread(slotpool::core::current_thread_id()))
        .unwrap();
    assert_eq!(a.route_for(4).unwrap(), p2, "newest route first");
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(a.route_for(4).unwrap(), p1));
        s.spawn(|| assert_eq!(a.route_for(3).unwrap(), PoolId::DEFAULT));
    });
    a.end_allocate_to_pool(p2).unwrap();
    assert_eq!(a.route_for(4).unwrap(), p1);
    // Capture routing: only the capturing stream's allocations go to the capture pool.
    let id = dev.begin_capture(6).unwrap();
    a.begin_allocate_to_pool(p3, RouteFilter::Capture(id))
        .unwrap();
    let x = a.alloc(MIB, 6).unwrap();
    let y = a.alloc(MIB, 7).unwrap();
    assert_eq!(
        a.pool_stats(p3).unwrap().allocated_bytes.all().current as u64,
        MIB
    );
    // A free during capture of a block used on another stream is deferred, with no event calls.
    a.record_stream(x, 8).unwrap();
    a.free(x).unwrap();
    // PyTorch's order: the capture ends on the stream, then the route ends.
    dev.end_capture(6).unwrap();
    a.end_allocate_to_pool(p3).unwrap();
    dev.complete_all();
    a.process_events();
    a.free(y).unwrap();
    check_all(&dev, &a, &[]);
    // end does not decrement; release does, and a released pool is freed by empty_cache.
    assert_eq!(a.pool_use_count(p3).unwrap(), 1);
    assert_eq!(a.release_pool(p3).unwrap(), 0);
    a.empty_cache();
    assert!(
        a.pool_use_count(p3).is_err(),
        "released, empty pool forgotten"
    );
    a.end_allocate_to_pool(p1).unwrap();
    check_all(&dev, &a, &[]);
}

#[test]
fn oom_reports_and_leaves_state_consistent() {
    let (dev, a) = setup(GrowthMode::Vmm, 64 * MIB);
    let mut live = Vec::new();
    loop {
        match a.alloc(7 * MIB, 0) {
            Ok(p) => live.push(p),
            Err(AllocError::OutOfMemory(r)) => {
                assert!(r.reserved <= 64 * MIB && r.allocated >= 7 * MIB * live.len() as u64);
                assert!(r.to_string().contains("fragmentation"));
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(a.stats().num_ooms, 1);
    check_all(&dev, &a, &[]);
    for p in live {
        a.free(p).unwrap();
    }
    a.alloc(40 * MIB, 0).expect("memory is back after frees");
}

#[test]
fn live_set_queries_and_drain() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    let x = a.alloc_in(POOL, MIB, 0).unwrap();
    let y = a.alloc_in(POOL, 4096, 0).unwrap();
    assert_eq!(a.live_allocations(POOL).unwrap().len(), 2);
    a.verify_live(POOL, &[y, x]).unwrap();
    let e = a.verify_live(POOL, &[x]).unwrap_err().to_string();
    assert!(e.contains(&format!("{y:#x}")), "{e}");
    a.record_stream(x, 3).unwrap();
    dev.launch(3);
    a.free(x).unwrap();
    assert!(
        a.verify_live(POOL, &[y]).is_ok(),
        "a pending free is not live"
    );
    assert_eq!(a.drain_pending_frees(POOL).unwrap(), 0);
    assert!(dev.completed(3) >= 1, "draining waited for stream 3");
    check_all(&dev, &a, &[]);
    assert!(a.live_allocations(PoolId(5, 5)).is_err());
}

#[test]
fn arena_slots_alias_across_branches() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    let ar = a.arena_create(POOL, 0).unwrap();
    a.arena_set_debug(ar, true).unwrap();
    // CP-like branches: every slot of branch 0 is at least as large as in the others.
    let sizes = |branch: u64, slot: u64| (8 >> branch) * MIB * (slot + 1);
    let mut addrs = vec![Vec::new(); 4];
    for branch in 0..4u32 {
        for slot in 0..5u32 {
            let p = a
                .arena_alloc(ar, branch, slot, sizes(branch as u64, slot as u64))
                .unwrap();
            addrs[branch as usize].push(p);
        }
        for slot in 0..5u32 {
            a.arena_free(ar, branch, slot).unwrap();
        }
    }
    for b in 1..4 {
        assert_eq!(addrs[b], addrs[0], "branch {b} got different addresses");
    }
    let r = a.arena_report(ar).unwrap();
    let largest: u64 = (0..5).map(|s| sizes(0, s)).sum();
    assert_eq!(r.size, largest, "the arena holds the largest branch");
    assert!(r.mapped <= largest + 2 * MIB);
    assert_eq!(r.relocations, 0);
    // Debug mode traps an overlap between two branches' live slots.
    a.arena_alloc(ar, 1, 0, MIB).unwrap();
    let e = a.arena_alloc(ar, 2, 0, MIB).unwrap_err().to_string();
    assert!(e.contains("not mutually exclusive"), "{e}");
    assert_eq!(a.arena_report(ar).unwrap().overlaps.len(), 1);
    assert!(a.arena_destroy(ar).is_err(), "live slots");
    a.arena_free(ar, 1, 0).unwrap();
    // A slot that grows after later slots were placed moves to the end.
    a.arena_alloc(ar, 3, 1, 64 * MIB).unwrap();
    assert_eq!(a.arena_report(ar).unwrap().relocations, 1);
    a.arena_free(ar, 3, 1).unwrap();
    a.check_invariants().unwrap();
    a.arena_destroy(ar).unwrap();
    a.empty_cache();
    assert_eq!(dev.physical_bytes(), 0);
    check_all(&dev, &a, &[]);
}

#[test]
fn history_records_pytorch_trace_actions() {
    use slotpool::core::TraceAction as A;
    let (dev, a) = setup(GrowthMode::Classic, 64 * MIB);
    let p = a.alloc(1000, 0).unwrap();
    a.record_history(100);
    let q = a.alloc(3 * MIB, 0).unwrap();
    a.record_stream(q, 5).unwrap();
    a.free(q).unwrap();
    dev.complete_all();
    a.process_events();
    a.free(p).unwrap();
    assert!(a.alloc(1 << 40, 0).is_err());
    a.empty_cache();
    let h = a.history();
    let actions: Vec<A> = h.iter().map(|e| e.action).collect();
    assert_eq!(
        actions,
        vec![
            A::SegmentAlloc, // 20 MiB segment for the 3 MiB block
            A::Alloc,
            A::FreeRequested, // waits for stream 5
            A::FreeCompleted,
            A::FreeRequested,
            A::FreeCompleted,
            A::Oom,
            A::SegmentFree,
            A::SegmentFree,
        ]
    );
    assert_eq!((h[1].addr, h[1].size), (q, 3 * MIB));
    assert!(h.windows(2).all(|w| w[0].time_us <= w[1].time_us));
    a.record_history(0);
    let _ = a.alloc(512, 0).unwrap();
    assert_eq!(a.history().len(), h.len(), "nothing recorded once stopped");
    a.clear_history();
    assert!(a.history().is_empty());
}

#[test]
fn device_wide_peaks_are_exact_across_streams() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup(growth, 1 << 30);
        // One 64 MiB allocation at a time, on four streams: the device never held two.
        for stream in 1..=4 {
            let p = a.alloc(64 * MIB, stream).unwrap();
            a.free(p).unwrap();
            a.empty_cache();
        }
        let st = a.stats();
        assert_eq!(st.allocated_bytes.all().peak as u64, 64 * MIB, "{growth:?}");
        assert!(
            (st.reserved_bytes.all().peak as u64) < 128 * MIB,
            "{growth:?}: reserved peak {}",
            st.reserved_bytes.all().peak
        );
        // Two at once is a peak of two; a reset starts from what is allocated now.
        let x = a.alloc(64 * MIB, 1).unwrap();
        let y = a.alloc(64 * MIB, 2).unwrap();
        a.free(y).unwrap();
        assert_eq!(a.stats().allocated_bytes.all().peak as u64, 128 * MIB);
        a.reset_peak_stats();
        assert_eq!(a.stats().allocated_bytes.all().peak as u64, 64 * MIB);
        a.free(x).unwrap();
        check_all(&dev, &a, &[]);
    }
}

#[test]
fn switching_between_checkpoints_forever_keeps_the_journal_bounded() {
    let (dev, a) = setup(GrowthMode::Vmm, 1 << 30);
    a.create_or_incref_pool(POOL, PoolOptions::default())
        .unwrap();
    // Two "paths" of a graph tree: checkpoint A, allocations of path 1, checkpoint B.
    let base = a.alloc_in(POOL, 4 * MIB, 0).unwrap();
    let at_a = a.checkpoint(POOL).unwrap();
    let path: Vec<u64> = (1..6)
        .map(|i| a.alloc_in(POOL, i * MIB, 0).unwrap())
        .collect();
    a.free(path[2]).unwrap();
    let at_b = a.checkpoint(POOL).unwrap();
    // A third, later checkpoint (a deeper node): restoring A or B must keep it valid.
    let deeper = a.alloc_in(POOL, 3 * MIB, 0).unwrap();
    let at_c = a.checkpoint(POOL).unwrap();
    let mut lens = Vec::new();
    for _ in 0..50 {
        a.restore(POOL, &at_a, &[base]).unwrap();
        a.restore(POOL, &at_b, &[base]).unwrap();
        lens.push(a.checkpoint_journal_len(POOL).unwrap());
    }
    check_all(&dev, &a, &[]);
    assert!(
        lens[49] <= lens[1],
        "the journal grows with every switch: {:?}",
        &lens[..5]
    );
    // All three checkpoints are still good.
    a.restore(POOL, &at_a, &[base]).unwrap();
    assert_eq!(a.live_allocations(POOL).unwrap().len(), 1);
    a.restore(POOL, &at_c, &[base]).unwrap();
    assert_eq!(a.live_allocations(POOL).unwrap().len(), 6);
    assert!(
        a.live_allocations(POOL)
            .unwrap()
            .iter()
            .any(|l| l.0 == deeper)
    );
    a.restore(POOL, &at_b, &[base]).unwrap();
    assert_eq!(a.live_allocations(POOL).unwrap().len(), 5);
    check_all(&dev, &a, &[]);
}

/// Under a live checkpoint, a block changed over and over is journaled once: a restore reads
/// only its first entry. Before, every alloc / free pair of the same hole added two entries.
#[test]
fn a_block_changed_over_and_over_is_journaled_once() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup_with_pool(growth, POOL);
        // [left][hole][right]: a 4 KiB request fits the hole exactly (no split, no merge).
        let left = a.alloc_in(POOL, 4096, 0).unwrap();
        let hole = a.alloc_in(POOL, 4096, 0).unwrap();
        let right = a.alloc_in(POOL, 4096, 0).unwrap();
        a.free(hole).unwrap();
        let cp = a.checkpoint(POOL).unwrap();
        let mut lens = Vec::new();
        for _ in 0..100 {
            let p = a.alloc_in(POOL, 4096, 0).unwrap();
            assert_eq!(p, hole, "{growth:?}: best fit takes the hole");
            a.free(p).unwrap();
            lens.push(a.checkpoint_journal_len(POOL).unwrap());
        }
        assert!(lens[0] > 0, "{growth:?}: the first change is journaled");
        assert_eq!(
            lens[99],
            lens[0],
            "{growth:?}: the journal grew: {:?}",
            &lens[..4]
        );
        // The one entry is enough to go back.
        let kept = a.alloc_in(POOL, 4096, 0).unwrap();
        a.restore(POOL, &cp, &[left, right]).unwrap();
        let live: Vec<u64> = a
            .live_allocations(POOL)
            .unwrap()
            .iter()
            .map(|l| l.0)
            .collect();
        assert!(
            !live.contains(&kept) && live.len() == 2,
            "{growth:?}: {live:?}"
        );
        check_all(&dev, &a, &[]);
    }
}

/// Churn that splits and merges under a live checkpoint reuses the ids it mints (no live mark
/// names them), so the journal stays bounded; the checkpoint still restores.
#[test]
fn churn_under_a_live_checkpoint_keeps_the_journal_bounded() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, a) = setup_with_pool(growth, POOL);
        let keep: Vec<u64> = (0..8)
            .map(|i| a.alloc_in(POOL, 4096 * (1 + i % 3), 0).unwrap())
            .collect();
        let cp = a.checkpoint(POOL).unwrap();
        let mut lens = Vec::new();
        for i in 0..2000u64 {
            let p = a.alloc_in(POOL, 512 * (1 + (i * 13) % 64), 0).unwrap();
            let q = a.alloc_in(POOL, 4096, 0).unwrap();
            a.free(p).unwrap();
            a.free(q).unwrap();
            lens.push(a.checkpoint_journal_len(POOL).unwrap());
        }
        assert!(
            lens[1999] <= lens[99].max(16),
            "{growth:?}: the journal grows with churn: {} after 100 pairs, {} after 2000",
            lens[99],
            lens[1999]
        );
        check_all(&dev, &a, &[]);
        let extra = a.alloc_in(POOL, 3 * MIB, 0).unwrap();
        a.restore(POOL, &cp, &keep).unwrap();
        let mut live: Vec<u64> = a
            .live_allocations(POOL)
            .unwrap()
            .iter()
            .map(|l| l.0)
            .collect();
        live.sort_unstable();
        let mut want = keep.clone();
        want.sort_unstable();
        assert_eq!(live, want, "{growth:?}");
        assert!(!live.contains(&extra));
        check_all(&dev, &a, &[]);
    }
}

#[test]
fn large_pages_keep_small_blocks_in_classic_segments() {
    let (dev, a) = crate::common::setup_paged(GrowthMode::Vmm, 1 << 30, Some(8 * MIB));
    let small = a.alloc(4096, 0).unwrap();
    let large = a.alloc(9 * MIB, 0).unwrap();
    let st = a.stats();
    // A small block takes a 2 MiB classic segment, not an 8 MiB page; the large one two pages.
    assert_eq!(st.reserved_bytes.small_pool().current, 2 * MIB as i64);
    assert_eq!(st.reserved_bytes.large_pool().current, 16 * MIB as i64);
    let snap = a.snapshot();
    assert!(snap.iter().any(|s| s.small && !s.vmm && s.size == 2 * MIB));
    assert!(snap.iter().any(|s| !s.small && s.vmm));
    fill_probes(&dev, small, 4096, 1);
    fill_probes(&dev, large, 9 * MIB, 2);
    a.check_invariants().unwrap();
    verify_probes(&dev, small, 4096, 1).unwrap();
    verify_probes(&dev, large, 9 * MIB, 2).unwrap();
    a.free(small).unwrap();
    a.free(large).unwrap();
    a.empty_cache();
    a.check_invariants().unwrap();
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn peer_access_reaches_pages_mapped_before_and_after() {
    let (dev, a) = setup_with_pool(GrowthMode::Vmm, POOL);
    let before = a.alloc(3 * MIB, 0).unwrap();
    let routed = a.alloc_in(POOL, 5 * MIB, 1).unwrap();
    let ar = a.arena_create(POOL, 0).unwrap();
    let slot = a.arena_alloc(ar, 0, 0, 2 * MIB).unwrap();
    for p in [before, routed, slot] {
        assert_eq!(dev.page_peers(p), Some(vec![]), "no peer yet at {p:#x}");
    }
    // A bad device changes nothing.
    assert!(a.enable_peer_access(-1).is_err());
    assert_eq!(dev.page_peers(before), Some(vec![]));
    a.enable_peer_access(1).unwrap();
    a.enable_peer_access(1).unwrap(); // twice: no change
    for p in [before, routed, slot, before + 3 * MIB - 1] {
        assert_eq!(dev.page_peers(p), Some(vec![1]), "mapped before, at {p:#x}");
    }
    let after = a.alloc(64 * MIB, 2).unwrap();
    assert_eq!(dev.page_peers(after), Some(vec![1]), "mapped after");
    assert_eq!(dev.page_peers(after + 63 * MIB), Some(vec![1]));
    for p in [before, routed, after] {
        a.free(p).unwrap();
    }
    a.empty_cache();
    check_all(&dev, &a, &[]);
}

/// Sizes from 512 B to 64 MiB, up to 64 live, random frees (alloc_bench's mixed pattern): with
/// little live memory, the percentage slack covers less than one large block, and pages move
/// whenever a large block lands elsewhere; `vmm_slack_base_mb` keeps enough idle memory for a few.
/// Returns (unmaps, peak reserved).
fn mixed_sizes(conf: &str) -> (u64, u64) {
    use slotpool::sim::CallKind;
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            backing: Backing::Accounting,
            auto_complete: true,
            ..SimConfig::default()
        })
        .unwrap(),
    );
    let a = Allocator::new(dev.clone(), Config::parse(conf).unwrap());
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut live: Vec<u64> = Vec::new();
    for _ in 0..40_000 {
        let r = next();
        if live.len() >= 64 || (!live.is_empty() && r & 1 == 1) {
            let i = (next() % live.len() as u64) as usize;
            a.free(live.swap_remove(i)).unwrap();
        } else {
            let log2 = 9.0 + 17.0 * ((next() >> 11) as f64 / (1u64 << 53) as f64);
            live.push(a.alloc(2f64.powf(log2) as u64, 1).unwrap());
        }
    }
    a.check_invariants().unwrap();
    let peak = a.stats().reserved_bytes.all().peak as u64;
    (dev.calls(CallKind::Unmap), peak)
}

#[test]
fn a_slack_base_stops_page_moves_of_mixed_sizes() {
    let (moves_none, reserved_none) = mixed_sizes("vmm_slack_percent:8,vmm_slack_base_mb:0");
    let (moves_base, reserved_base) = mixed_sizes("vmm_slack_percent:8,vmm_slack_base_mb:256");
    assert!(
        moves_none > 100,
        "the pattern moves pages without a base: {moves_none}"
    );
    assert!(
        moves_base * 10 <= moves_none,
        "unmaps: {moves_base} with a 256 MiB base, {moves_none} without"
    );
    assert!(
        reserved_base <= reserved_none + 256 * MIB,
        "the base costs at most itself: {reserved_base} against {reserved_none}"
    );
}

/// `shared_pages` (CUDA IPC of vmm memory): the physical pages under a live vmm block, in order,
/// covering it exactly from the page that holds its start; refusals for classic memory and for
/// pointers that are not live.
#[test]
fn shared_pages_cover_a_live_vmm_block() {
    let page = 2 * MIB;
    let (_, a) = crate::common::setup_paged(GrowthMode::Vmm, 1 << 30, Some(page));
    let small = a.alloc(3 * MIB, 0).unwrap();
    let big = a.alloc(9 * MIB, 0).unwrap();
    for (p, size) in [(small, 3 * MIB), (big, 9 * MIB)] {
        let (base, _, vmm) = a.segment_info(p).unwrap();
        assert!(vmm);
        let shared = a.shared_pages(p).unwrap();
        assert_eq!(shared.page_size, page);
        let first = (p - base) / page;
        assert_eq!(shared.offset, p - base - first * page);
        let end = (p + size - base).div_ceil(page);
        assert_eq!(shared.pages.len() as u64, end - first, "{shared:?}");
        let mut sorted = shared.pages.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), shared.pages.len(), "one physical page each");
    }
    // The two blocks are neighbours: the page they share appears in both lists.
    let (s, b) = (a.shared_pages(small).unwrap(), a.shared_pages(big).unwrap());
    if !(small + 3 * MIB).is_multiple_of(page) {
        assert_eq!(s.pages.last(), b.pages.first());
    }
    a.free(big).unwrap();
    assert!(matches!(
        a.shared_pages(big),
        Err(AllocError::UnknownPointer(_))
    ));
    assert!(matches!(
        a.shared_pages(small + 512),
        Err(AllocError::UnknownPointer(_))
    ));
    let (_, c) = setup(GrowthMode::Classic, 1 << 30);
    let q = c.alloc(MIB, 0).unwrap();
    assert!(matches!(
        c.shared_pages(q),
        Err(AllocError::InvalidArgument(_))
    ));
    a.check_invariants().unwrap();
}
