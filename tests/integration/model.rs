//! Property tests: random sequences of allocator operations over several streams, with every
//! invariant, the device contract and every live allocation's bytes checked after each step.

use proptest::prelude::*;
use slotpool::core::{AllocError, GrowthMode};
use slotpool::sim::CallKind;

use crate::common::{Live, MIB, check_all, fill_probes, setup_configured, setup_paged};

const STREAMS: [u64; 3] = [0, 7, 9];

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: usize },
    Launch { stream: usize },
    Complete { stream: usize },
    ProcessEvents,
    EmptyCache,
    InjectOom { kind: usize },
    SetLimit { mib: u64 },
}

fn size_strategy() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 1u64..=64 * 1024,
        2 => 64 * 1024u64..=MIB,
        2 => MIB + 1..=6 * MIB,
        1 => 10 * MIB..=24 * MIB,
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => (size_strategy(), 0..STREAMS.len()).prop_map(|(size, stream)| Op::Alloc { size, stream }),
        7 => any::<usize>().prop_map(|pick| Op::Free { pick }),
        2 => (any::<usize>(), 0..STREAMS.len()).prop_map(|(pick, stream)| Op::RecordStream { pick, stream }),
        2 => (0..STREAMS.len()).prop_map(|stream| Op::Launch { stream }),
        2 => (0..STREAMS.len()).prop_map(|stream| Op::Complete { stream }),
        1 => Just(Op::ProcessEvents),
        1 => Just(Op::EmptyCache),
        1 => (0..4usize).prop_map(|kind| Op::InjectOom { kind }),
        1 => (16u64..256).prop_map(|mib| Op::SetLimit { mib }),
    ]
}

/// A freed range that other streams used: it must not be handed out again before their work
/// queued before the free has completed.
struct Guard {
    ptr: u64,
    size: u64,
    waits: Vec<(u64, u64)>,
}

fn run(growth: GrowthMode, ops: &[Op]) {
    run_paged(growth, None, ops);
}

fn run_paged(growth: GrowthMode, page: Option<u64>, ops: &[Op]) {
    run_configured(growth, page, None, ops);
}

fn run_configured(growth: GrowthMode, page: Option<u64>, gc: Option<f64>, ops: &[Op]) {
    let (dev, alloc) = setup_configured(growth, 256 * MIB, page, gc);
    let mut live: Vec<Live> = Vec::new();
    let mut uses: Vec<Vec<u64>> = Vec::new();
    let mut guards: Vec<Guard> = Vec::new();
    let mut seed = 1u64;
    for op in ops {
        match *op {
            Op::Alloc { size, stream } => match alloc.alloc(size, STREAMS[stream]) {
                Ok(ptr) => {
                    for g in &guards {
                        if ptr < g.ptr + g.size && g.ptr < ptr + size {
                            for &(s, n) in &g.waits {
                                assert!(
                                    dev.completed(s) >= n,
                                    "{ptr:#x} reused while stream {s} may still use it"
                                );
                            }
                        }
                    }
                    seed += 1;
                    fill_probes(&dev, ptr, size, seed);
                    live.push(Live {
                        ptr,
                        size,
                        seed,
                        stream: STREAMS[stream],
                    });
                    uses.push(Vec::new());
                }
                Err(AllocError::OutOfMemory(_)) => {}
                Err(e) => panic!("unexpected error {e}"),
            },
            Op::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                let l = live.swap_remove(i);
                let used = uses.swap_remove(i);
                if !used.is_empty() {
                    // Work that reads the block is queued on each stream that used it.
                    let waits = used
                        .iter()
                        .map(|&s| {
                            dev.launch(s);
                            (s, dev.submitted(s))
                        })
                        .collect();
                    guards.push(Guard {
                        ptr: l.ptr,
                        size: l.size,
                        waits,
                    });
                }
                alloc.free(l.ptr).expect("free of a live pointer");
                assert!(alloc.free(l.ptr).is_err(), "double free accepted");
            }
            Op::RecordStream { pick, stream } => {
                if live.is_empty() {
                    continue;
                }
                let i = pick % live.len();
                let s = STREAMS[stream];
                alloc.record_stream(live[i].ptr, s).expect("record_stream");
                if s != live[i].stream && !uses[i].contains(&s) {
                    uses[i].push(s);
                }
            }
            Op::Launch { stream } => dev.launch(STREAMS[stream]),
            Op::Complete { stream } => dev.complete(STREAMS[stream]),
            Op::ProcessEvents => alloc.process_events(),
            Op::EmptyCache => alloc.empty_cache(),
            Op::InjectOom { kind } => {
                let k = [
                    CallKind::AllocSegment,
                    CallKind::CreatePage,
                    CallKind::Reserve,
                    CallKind::Map,
                ][kind];
                // A map fails on its second call: inside a run of pages when one maps several.
                dev.inject_oom(k, if k == CallKind::Map { 2 } else { 1 });
            }
            Op::SetLimit { mib } => alloc.set_memory_limit(mib * MIB),
        }
        guards.retain(|g| g.waits.iter().any(|&(s, n)| dev.completed(s) < n));
        check_all(&dev, &alloc, &live);
    }
    // Everything freed and complete: empty_cache returns every byte to the device.
    for l in live.drain(..) {
        alloc.free(l.ptr).expect("final free");
    }
    dev.complete_all();
    alloc.empty_cache();
    check_all(&dev, &alloc, &[]);
    assert_eq!(
        dev.physical_bytes(),
        0,
        "memory left behind after empty_cache"
    );
    assert_eq!(alloc.held_bytes(), 0);
    let st = alloc.stats();
    assert_eq!(st.allocated_bytes.all().current, 0);
    assert_eq!(st.active_bytes.all().current, 0);
    assert_eq!(st.reserved_bytes.all().current, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(48), ..ProptestConfig::default() })]

    #[test]
    fn vmm_random_sequences(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run(GrowthMode::Vmm, &ops);
    }

    #[test]
    fn classic_random_sequences(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run(GrowthMode::Classic, &ops);
    }

    /// Garbage collection under the limits that `SetLimit` sets: growth releases free segments.
    #[test]
    fn classic_random_sequences_with_gc(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run_configured(GrowthMode::Classic, None, Some(0.3), &ops);
    }

    /// 8 MiB pages: large blocks on vmm pages, small ones in classic segments, in one shard.
    #[test]
    fn vmm_large_page_random_sequences(ops in prop::collection::vec(op_strategy(), 1..120)) {
        run_paged(GrowthMode::Vmm, Some(8 * MIB), &ops);
    }
}

#[derive(Clone, Debug)]
enum CpOp {
    Alloc {
        size: u64,
    },
    Free {
        pick: usize,
    },
    Checkpoint,
    Restore {
        keep: u64,
        which: usize,
    },
    RestoreWithForeignKeep,
    CrossStreamFree {
        pick: usize,
        complete: bool,
    },
    EmptyPool,
    /// A graph temporary: allocated and freed while a capture of the pool is underway.
    CaptureTemp {
        size: u64,
    },
    /// `mark_reusable`: the owner keeps the pointer, the pool takes the memory back.
    MarkReusable {
        pick: usize,
    },
}

fn cp_op() -> impl Strategy<Value = CpOp> {
    prop_oneof![
        8 => size_strategy().prop_map(|size| CpOp::Alloc { size }),
        6 => any::<usize>().prop_map(|pick| CpOp::Free { pick }),
        2 => Just(CpOp::Checkpoint),
        3 => (any::<u64>(), any::<usize>()).prop_map(|(keep, which)| CpOp::Restore { keep, which }),
        1 => Just(CpOp::RestoreWithForeignKeep),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(pick, complete)| CpOp::CrossStreamFree { pick, complete }),
        1 => Just(CpOp::EmptyPool),
        1 => size_strategy().prop_map(|size| CpOp::CaptureTemp { size }),
        1 => any::<usize>().prop_map(|pick| CpOp::MarkReusable { pick }),
    ]
}

/// (address, block size, seed) of a live allocation in the pool. The seed is unique per
/// allocation, and a restore brings the checkpoint's allocations back with theirs: the tuple is
/// the allocation's identity, as a restore nets them (an address freed and allocated again at
/// its size holds another allocation).
type Held = (u64, u64, u64);

fn run_checkpoints(growth: GrowthMode, ops: &[CpOp]) {
    run_checkpoints_paged(growth, None, ops);
}

fn run_checkpoints_paged(growth: GrowthMode, page: Option<u64>, ops: &[CpOp]) {
    use slotpool::core::{PoolId, PoolOptions};
    let pool = PoolId(0, 42);
    let (dev, alloc) = setup_paged(growth, 512 * MIB, page);
    alloc
        .create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let mut live: Vec<Held> = Vec::new();
    // Addresses a captured graph may still touch: they stay mapped while the pool is in use.
    let mut retained: Vec<u64> = Vec::new();
    // Several live checkpoints: any of them can be restored, in any order.
    let mut cps: Vec<(slotpool::core::Checkpoint, Vec<Held>)> = Vec::new();
    let mut seed = 100u64;
    let as_live = |v: &[Held]| -> Vec<Live> {
        v.iter()
            .map(|&(ptr, size, seed)| Live {
                ptr,
                size,
                seed,
                stream: 0,
            })
            .collect()
    };
    for op in ops {
        match *op {
            CpOp::Alloc { size } => {
                if let Ok(p) = alloc.alloc_in(pool, size, 0) {
                    let bsize = alloc.allocation_info(p).unwrap().1;
                    seed += 1;
                    fill_probes(&dev, p, bsize, seed);
                    live.push((p, bsize, seed));
                }
            }
            CpOp::Free { pick } => {
                if !live.is_empty() {
                    let (p, _, _) = live.swap_remove(pick % live.len());
                    alloc.free(p).unwrap();
                }
            }
            CpOp::CrossStreamFree { pick, complete } => {
                if !live.is_empty() {
                    let (p, _, _) = live.swap_remove(pick % live.len());
                    alloc.record_stream(p, 7).unwrap();
                    dev.launch(7);
                    alloc.free(p).unwrap();
                    if complete {
                        dev.complete(7);
                        alloc.process_events();
                    }
                }
            }
            CpOp::Checkpoint => {
                let pending =
                    alloc.stats().active.all().current > alloc.stats().allocation.all().current;
                match alloc.checkpoint(pool) {
                    Ok(c) => {
                        assert!(!pending, "checkpoint accepted with pending frees");
                        cps.push((c, live.clone()));
                        if cps.len() > 3 {
                            cps.remove(0);
                        }
                    }
                    Err(_) => assert!(pending, "checkpoint refused without pending frees"),
                }
            }
            CpOp::Restore { keep, which } => {
                if cps.is_empty() {
                    continue;
                }
                let (c, then) = &cps[which % cps.len()];
                let keep_live: Vec<u64> = live
                    .iter()
                    .enumerate()
                    .filter(|(i, l)| keep >> (i % 64) & 1 == 1 && then.contains(l))
                    .map(|(_, l)| l.0)
                    .collect();
                let before = alloc.state_dump();
                match alloc.restore(pool, c, &keep_live) {
                    Ok(mut delta) => {
                        let mut freed: Vec<(u64, u64)> = live
                            .iter()
                            .filter(|x| !then.contains(x))
                            .map(|x| (x.0, x.1))
                            .collect();
                        let mut created: Vec<(u64, u64)> = then
                            .iter()
                            .filter(|x| !live.contains(x))
                            .map(|x| (x.0, x.1))
                            .collect();
                        freed.sort_unstable();
                        created.sort_unstable();
                        retained.extend(freed.iter().map(|f| f.0));
                        delta.sort_by_address();
                        assert_eq!(delta.freed, freed, "freed");
                        assert_eq!(delta.created, created, "created");
                        // Survivors keep their bytes; re-created allocations are the
                        // checkpoint's, their pattern written again.
                        for t in then.iter() {
                            if !live.contains(t) {
                                fill_probes(&dev, t.0, t.1, t.2);
                            }
                        }
                        live = then.clone();
                    }
                    Err(AllocError::CheckpointMismatch(_)) => {
                        assert_eq!(alloc.state_dump(), before, "refused restore changed state");
                    }
                    Err(AllocError::OutOfMemory(_)) => {}
                    Err(e) => panic!("restore: {e}"),
                }
            }
            CpOp::RestoreWithForeignKeep => {
                let Some((c, then)) = cps.last() else {
                    continue;
                };
                let Some(bad) = live.iter().find(|l| !then.contains(l)) else {
                    continue;
                };
                let before = alloc.state_dump();
                let r = alloc.restore(pool, c, &[bad.0]);
                assert!(matches!(r, Err(AllocError::CheckpointMismatch(_))), "{r:?}");
                assert_eq!(alloc.state_dump(), before);
            }
            CpOp::EmptyPool => alloc.empty_pool_cache(pool).unwrap(),
            CpOp::CaptureTemp { size } => {
                let id = dev.begin_capture(0).unwrap();
                alloc
                    .begin_allocate_to_pool(pool, slotpool::core::RouteFilter::Capture(id))
                    .unwrap();
                if let Ok(t) = alloc.alloc(size, 0) {
                    alloc.free(t).unwrap();
                    retained.push(t);
                }
                dev.end_capture(0).unwrap();
                alloc.end_allocate_to_pool(pool).unwrap();
                // The graph's use of the pool (begin took one); ours remains.
                alloc.release_pool(pool).unwrap();
            }
            CpOp::MarkReusable { pick } => {
                if !live.is_empty() {
                    let (p, size, _) = live.swap_remove(pick % live.len());
                    assert_eq!(alloc.mark_reusable(p).unwrap(), size);
                    retained.push(p);
                }
            }
        }
        if growth == GrowthMode::Vmm {
            for &r in &retained {
                assert!(dev.read(r, 1).is_ok(), "graph-retained {r:#x} was unmapped");
            }
        }
        check_all(&dev, &alloc, &as_live(&live));
        alloc
            .verify_live(pool, &live.iter().map(|l| l.0).collect::<Vec<_>>())
            .unwrap();
    }
    drop(cps);
    dev.complete_all();
    alloc.process_events();
    for (p, _, _) in live {
        alloc.free(p).unwrap();
    }
    alloc.release_pool(pool).unwrap();
    alloc.empty_cache();
    check_all(&dev, &alloc, &[]);
    assert_eq!(dev.physical_bytes(), 0, "checkpoints left memory behind");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(48), ..ProptestConfig::default() })]

    #[test]
    fn vmm_checkpoint_restore_sequences(ops in prop::collection::vec(cp_op(), 1..80)) {
        run_checkpoints(GrowthMode::Vmm, &ops);
    }

    #[test]
    fn classic_checkpoint_restore_sequences(ops in prop::collection::vec(cp_op(), 1..80)) {
        run_checkpoints(GrowthMode::Classic, &ops);
    }

    #[test]
    fn vmm_large_page_checkpoint_restore_sequences(ops in prop::collection::vec(cp_op(), 1..80)) {
        run_checkpoints_paged(GrowthMode::Vmm, Some(8 * MIB), &ops);
    }
}
