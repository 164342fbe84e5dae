//! Pausing and resuming pools (`pause.rs`, shard invariant 10): physical memory given back,
//! addresses, blocks and statistics kept; backed-up bytes survive byte for byte.

use slotpool::core::{
    AllocError, Allocator, GrowthMode, PauseMode, PoolId, PoolOptions, RouteFilter,
    current_thread_id,
};
use slotpool::sim::{CallKind, PAGE_POISON, SimDevice};

use crate::common::{MIB, fill_probes, setup_paged, verify_probes};

const KIB: u64 = 1 << 10;

fn pausable() -> PoolOptions {
    PoolOptions {
        pausable: true,
        ..PoolOptions::default()
    }
}

/// Every statistic's current value (totals count the pages given back and mapped again).
fn currents(st: &slotpool::core::MemoryStats) -> Vec<(String, i64)> {
    st.to_flat_map()
        .into_iter()
        .filter(|(k, _)| k.ends_with(".current"))
        .collect()
}

/// A state dump without the statistics lines: segments, blocks, bytes held.
fn structure(dump: &str) -> Vec<&str> {
    dump.lines().filter(|l| !l.starts_with("shard ")).collect()
}

fn checked(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().expect("invariants");
    assert_eq!(dev.contract_violations(), 0, "{:?}", dev.last_violation());
    assert_eq!(dev.capture_violations(), 0);
    assert_eq!(dev.physical_bytes(), alloc.held_bytes(), "device vs budget");
}

/// What [`filled_pool`] makes: (device, allocator, pool, [(ptr, size, seed)]).
type Filled = (
    std::sync::Arc<SimDevice>,
    Allocator<SimDevice>,
    PoolId,
    Vec<(u64, u64, u64)>,
);

/// A pausable named pool on a device with 16 MiB pages, where small blocks of other pools take
/// classic segments.
fn filled_pool() -> Filled {
    let (dev, alloc) = setup_paged(GrowthMode::Vmm, 1 << 30, Some(16 * MIB));
    let pool = alloc.named_pool("kv", pausable()).unwrap();
    let mut live = Vec::new();
    for (i, size) in [4 * KIB, 300 * KIB, MIB, 5 * MIB, 40 * MIB]
        .into_iter()
        .enumerate()
    {
        let stream = (i % 2) as u64;
        let p = alloc.alloc_in(pool, size, stream).unwrap();
        fill_probes(&dev, p, size, i as u64 + 7);
        live.push((p, size, i as u64 + 7));
    }
    checked(&dev, &alloc);
    (dev, alloc, pool, live)
}

#[test]
fn a_backed_up_pause_gives_memory_back_and_the_resume_restores_every_byte() {
    let (dev, alloc, pool, live) = filled_pool();
    // A default-pool allocation that must not move.
    let other = alloc.alloc(2 * MIB, 0).unwrap();
    fill_probes(&dev, other, 2 * MIB, 99);
    let before = alloc.pool_stats(pool).unwrap();
    let reserved = before.reserved_bytes.all().current as u64;
    assert!(reserved > 0);
    // Every byte of the pool's mapped pages, for the byte-for-byte check.
    let snap: Vec<(u64, u64)> = alloc
        .snapshot()
        .iter()
        .filter(|s| s.pool == pool)
        .map(|s| (s.addr, s.size))
        .collect();
    let bytes: Vec<Vec<u8>> = snap
        .iter()
        .map(|&(a, n)| dev.read(a, n as usize).unwrap())
        .collect();
    let physical = dev.physical_bytes();
    let state = alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    checked(&dev, &alloc);
    assert_eq!(state.mode, Some(PauseMode::Backup));
    assert_eq!(state.paused_bytes, reserved);
    assert_eq!(state.host_bytes, reserved);
    assert_eq!(dev.host_buffer_bytes(), reserved);
    assert_eq!(
        dev.physical_bytes(),
        physical - reserved,
        "pages not given back"
    );
    let st = alloc.pool_stats(pool).unwrap();
    assert_eq!(st.reserved_bytes.all().current, 0);
    assert_eq!(st.reserved_paused_bytes.all().current as u64, reserved);
    assert_eq!(st.allocated_bytes, before.allocated_bytes, "blocks kept");
    assert_eq!(st.allocation, before.allocation);
    assert_eq!(alloc.pool_pause_state(pool).unwrap(), state);
    for &(p, _, _) in &live {
        assert!(dev.read(p, 1).is_err(), "{p:#x} still mapped");
        assert!(alloc.allocation_info(p).is_ok(), "block forgotten");
    }
    // The snapshot shows the paused runs where they were.
    let paused: Vec<(u64, u64)> = alloc
        .snapshot()
        .iter()
        .filter(|s| s.pool == pool)
        .inspect(|s| assert!(s.paused))
        .map(|s| (s.addr, s.size))
        .collect();
    assert_eq!(paused, snap);
    let mapped = alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    assert_eq!(mapped, reserved);
    // The backup's buffer stays for the next pause, which pins nothing new.
    assert_eq!(dev.host_buffer_bytes(), reserved);
    assert_eq!(alloc.pool_pause_state(pool).unwrap().host_bytes, reserved);
    assert_eq!(dev.physical_bytes(), physical);
    assert_eq!(
        currents(&alloc.pool_stats(pool).unwrap()),
        currents(&before)
    );
    for (&(a, n), want) in snap.iter().zip(&bytes) {
        assert_eq!(&dev.read(a, n as usize).unwrap(), want, "bytes at {a:#x}");
    }
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
    verify_probes(&dev, other, 2 * MIB, 99).unwrap();
    assert_eq!(alloc.pool_pause_state(pool).unwrap().mode, None);
    let pinned = dev.calls(CallKind::AllocHost);
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    assert_eq!(
        dev.calls(CallKind::AllocHost),
        pinned,
        "the spare buffer was not reused"
    );
    alloc.resume_pool(pool).unwrap();
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
    // empty_cache keeps it while the pool is in use (its next backup pins nothing)...
    let spare = dev.host_buffer_bytes();
    alloc.empty_pool_cache(pool).unwrap();
    alloc.empty_cache();
    assert_eq!(
        dev.host_buffer_bytes(),
        spare,
        "spare host buffer freed in use"
    );
    assert_eq!(alloc.pool_pause_state(pool).unwrap().host_bytes, spare);
    checked(&dev, &alloc);
    // ... and frees it once the pool is released.
    alloc.release_pool(pool).unwrap();
    alloc.empty_cache();
    assert_eq!(dev.host_buffer_bytes(), 0, "spare host buffer not freed");
    checked(&dev, &alloc);
}

#[test]
fn a_discarding_pause_loses_the_contents_and_keeps_the_addresses() {
    let (dev, alloc, pool, live) = filled_pool();
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    assert_eq!(dev.host_buffer_bytes(), 0);
    assert_eq!(alloc.pool_pause_state(pool).unwrap().host_bytes, 0);
    checked(&dev, &alloc);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    for &(p, size, _) in &live {
        // Fresh pages: the sim's poison, at the same addresses.
        let got = dev.read(p, size.min(4096) as usize).unwrap();
        assert!(got.iter().all(|&b| b == PAGE_POISON), "{p:#x} kept bytes");
        assert_eq!(alloc.allocation_info(p).unwrap().0, p);
    }
    for &(p, _, _) in &live {
        alloc.free(p).unwrap();
    }
    checked(&dev, &alloc);
}

#[test]
fn a_paused_pool_refuses_allocations_and_takes_frees() {
    let (dev, alloc, pool, live) = filled_pool();
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    let dump = alloc.state_dump();
    // The stream that allocated last (its shard is this thread's cached one) and a new stream.
    for stream in [0, 1, 5] {
        for size in [4 * KIB, 4 * MIB] {
            assert_eq!(
                alloc.alloc_in(pool, size, stream),
                Err(AllocError::PoolPaused(Box::new(pool)))
            );
        }
    }
    alloc.check_invariants().unwrap();
    // A route sends this thread's allocations to the paused pool: they fail the same way.
    alloc
        .begin_allocate_to_pool(pool, RouteFilter::Thread(current_thread_id()))
        .unwrap();
    assert_eq!(
        alloc.alloc(64 * KIB, 0),
        Err(AllocError::PoolPaused(Box::new(pool)))
    );
    alloc.end_allocate_to_pool(pool).unwrap();
    alloc.release_pool(pool).unwrap();
    // A free works; reserved_paused stays (the page is mapped again on resume).
    let paused = alloc.pool_stats(pool).unwrap().reserved_paused_bytes;
    alloc.free(live[1].0).unwrap();
    assert_ne!(alloc.state_dump(), dump);
    checked(&dev, &alloc);
    assert_eq!(
        alloc.pool_stats(pool).unwrap().reserved_paused_bytes,
        paused
    );
    assert_eq!(
        alloc.mark_reusable(live[0].0),
        Err(AllocError::PoolPaused(Box::new(pool)))
    );
    assert_eq!(
        alloc.arena_create(pool, 0),
        Err(AllocError::PoolPaused(Box::new(pool)))
    );
    // empty_cache leaves the paused pool alone.
    let physical = dev.physical_bytes();
    let dump = alloc.state_dump();
    alloc.empty_cache();
    alloc.empty_pool_cache(pool).unwrap();
    assert_eq!(alloc.state_dump(), dump);
    assert_eq!(dev.physical_bytes(), physical);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    let p = alloc.alloc_in(pool, 300 * KIB, 0).unwrap();
    alloc.free(p).unwrap();
    checked(&dev, &alloc);
}

#[test]
fn refused_pauses_and_resumes_change_nothing() {
    let (dev, alloc, pool, _live) = filled_pool();
    // A pool that is not pausable: its small blocks sit in classic 2 MiB segments.
    let plain = alloc.named_pool("plain", PoolOptions::default()).unwrap();
    let p = alloc.alloc_in(plain, 4 * KIB, 0).unwrap();
    let dump = alloc.state_dump();
    let refused = |r: Result<(), AllocError>| {
        assert!(r.is_err());
        assert_eq!(alloc.state_dump(), dump);
        checked(&dev, &alloc);
    };
    let e = alloc.pause_pool(plain, PauseMode::Discard).unwrap_err();
    assert!(e.to_string().contains("classic"), "{e}");
    refused(Err(e));
    refused(
        alloc
            .pause_pool(PoolId::DEFAULT, PauseMode::Discard)
            .map(|_| ()),
    );
    refused(
        alloc
            .pause_pool(PoolId(0, 12345), PauseMode::Discard)
            .map(|_| ()),
    );
    refused(alloc.resume_pool(pool).map(|_| ()));
    refused(alloc.resume_pool(PoolId(0, 12345)).map(|_| ()));
    // A failed backup (the copy, then the host allocation) leaves the pool as it was.
    dev.inject_oom(CallKind::CopyToHost, 2);
    refused(alloc.pause_pool(pool, PauseMode::Backup).map(|_| ()));
    assert_eq!(
        dev.host_buffer_bytes(),
        0,
        "a failed backup kept host memory"
    );
    dev.inject_oom(CallKind::AllocHost, 1);
    refused(alloc.pause_pool(pool, PauseMode::Backup).map(|_| ()));
    // During a capture.
    dev.begin_capture(3).unwrap();
    alloc
        .begin_allocate_to_pool(PoolId(7, 0), RouteFilter::Capture(1))
        .unwrap();
    let dump_capture = alloc.state_dump();
    assert!(alloc.pause_pool(pool, PauseMode::Discard).is_err());
    assert_eq!(alloc.state_dump(), dump_capture);
    alloc.end_allocate_to_pool(PoolId(7, 0)).unwrap();
    dev.end_capture(3).unwrap();
    alloc.free(p).unwrap();
    checked(&dev, &alloc);
    // Paused twice.
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    let dump = alloc.state_dump();
    assert!(alloc.pause_pool(pool, PauseMode::Backup).is_err());
    assert_eq!(alloc.state_dump(), dump);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    // A pool with an arena: its pages are the arena's, which a pause does not release.
    let ar_pool = alloc.named_pool("arena", pausable()).unwrap();
    let ar = alloc.arena_create(ar_pool, 0).unwrap();
    alloc.arena_alloc(ar, 0, 0, MIB).unwrap();
    let dump_arena = alloc.state_dump();
    let e = alloc.pause_pool(ar_pool, PauseMode::Discard).unwrap_err();
    assert!(e.to_string().contains("arenas"), "{e}");
    assert_eq!(alloc.state_dump(), dump_arena);
    alloc.arena_free(ar, 0, 0).unwrap();
    alloc.arena_destroy(ar).unwrap();
    checked(&dev, &alloc);
}

#[test]
fn a_resume_without_memory_is_refused_and_keeps_the_backup() {
    let (dev, alloc, pool, live) = filled_pool();
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    let state = alloc.pool_pause_state(pool).unwrap();
    // Someone else takes the memory back: the device has less room than the pool needs.
    let total = dev.physical_bytes() + state.paused_bytes / 2;
    dev.set_capacity(total);
    let dump = alloc.state_dump();
    let physical = dev.physical_bytes();
    let e = alloc.resume_pool(pool).unwrap_err();
    assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}");
    assert_eq!(alloc.state_dump(), dump);
    assert_eq!(
        dev.physical_bytes(),
        physical,
        "a refused resume kept pages"
    );
    assert_eq!(alloc.pool_pause_state(pool).unwrap(), state);
    checked(&dev, &alloc);
    // A copy that fails after the pages were mapped: undone too (the totals count the traffic).
    dev.set_capacity(1 << 30);
    dev.inject_oom(CallKind::CopyFromHost, 1);
    let cur = currents(&alloc.stats());
    assert!(alloc.resume_pool(pool).is_err());
    assert_eq!(structure(&alloc.state_dump()), structure(&dump));
    assert_eq!(currents(&alloc.stats()), cur);
    assert_eq!(dev.physical_bytes(), physical);
    checked(&dev, &alloc);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
}

#[test]
fn checkpoints_survive_a_pause_and_restores_wait_for_the_resume() {
    let (dev, alloc, pool, live) = filled_pool();
    let cp = alloc.checkpoint(pool).unwrap();
    let extra = alloc.alloc_in(pool, 3 * MIB, 0).unwrap();
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    let dump = alloc.state_dump();
    assert_eq!(
        alloc.restore(pool, &cp, &[]).unwrap_err(),
        AllocError::PoolPaused(Box::new(pool))
    );
    assert_eq!(alloc.state_dump(), dump);
    // A checkpoint records blocks only: it may be taken while paused.
    let cp2 = alloc.checkpoint(pool).unwrap();
    alloc.free(live[3].0).unwrap();
    checked(&dev, &alloc);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    let keep: Vec<u64> = live
        .iter()
        .map(|l| l.0)
        .filter(|&p| p != live[3].0)
        .collect();
    let delta = alloc.restore(pool, &cp2, &keep).unwrap();
    assert_eq!(delta.created, vec![(live[3].0, delta.created[0].1)]);
    checked(&dev, &alloc);
    let delta = alloc.restore(pool, &cp, &keep).unwrap();
    assert!(delta.freed.iter().any(|&(p, _)| p == extra));
    checked(&dev, &alloc);
    for &(p, size, seed) in &live[..3] {
        verify_probes(&dev, p, size, seed).unwrap();
    }
}

#[test]
fn graph_retained_pages_stay_retained_across_a_pause() {
    let (dev, alloc) = setup_paged(GrowthMode::Vmm, 1 << 30, None);
    let pool = PoolId(0, 9);
    alloc.create_or_incref_pool(pool, pausable()).unwrap();
    dev.begin_capture(1).unwrap();
    alloc
        .begin_allocate_to_pool(pool, RouteFilter::Capture(1))
        .unwrap();
    let t = alloc.alloc(4 * MIB, 1).unwrap();
    alloc.free(t).unwrap();
    alloc.end_allocate_to_pool(pool).unwrap();
    dev.end_capture(1).unwrap();
    let retained = alloc.retained_bytes(pool).unwrap();
    assert_eq!(retained, 4 * MIB);
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    assert_eq!(
        alloc.retained_bytes(pool).unwrap(),
        0,
        "nothing mapped while paused"
    );
    alloc.resume_pool(pool).unwrap();
    assert_eq!(alloc.retained_bytes(pool).unwrap(), retained);
    // The graph's temporaries stay mapped through empty_cache while the pool is in use.
    alloc.empty_cache();
    assert_eq!(alloc.retained_bytes(pool).unwrap(), retained);
    checked(&dev, &alloc);
}

mod model {
    //! Random sequences of pauses, resumes, allocations, frees, checkpoints, restores, variant
    //! groups, routes and cache emptying, with the invariants checked after every step, every
    //! refused call shown to change nothing, and backed-up bytes checked.
    use std::collections::BTreeMap;

    use proptest::prelude::*;
    use slotpool::core::{
        AllocError, Checkpoint, GrowthMode, PauseMode, PoolId, RestoreDelta, RouteFilter,
        VariantGroup, current_thread_id,
    };

    use super::{KIB, MIB, checked, pausable};
    use crate::common::{fill_probes, setup_paged, verify_probes};

    #[derive(Clone, Debug)]
    enum Op {
        Alloc {
            pool: usize,
            size: u64,
            stream: u64,
        },
        Free(usize),
        Pause {
            pool: usize,
            backup: bool,
        },
        Resume(usize),
        Checkpoint(usize),
        Restore(usize),
        VariantGroup(usize),
        BeginVariant(usize),
        Route(usize),
        EndRoute,
        EmptyCache,
        EmptyPoolCache(usize),
        /// Whether the device unmaps ranges over several mappings in one call.
        SpanUnmap(bool),
    }

    fn op() -> impl Strategy<Value = Op> {
        let size = prop_oneof![1u64..=512 * KIB, 512 * KIB..=2 * MIB, 2 * MIB..=20 * MIB];
        prop_oneof![
            6 => (0usize..3, size, 0u64..2).prop_map(|(pool, size, stream)| Op::Alloc { pool, size, stream }),
            4 => any::<usize>().prop_map(Op::Free),
            2 => (0usize..2, any::<bool>()).prop_map(|(pool, backup)| Op::Pause { pool, backup }),
            2 => (0usize..2).prop_map(Op::Resume),
            1 => (0usize..2).prop_map(Op::Checkpoint),
            1 => (0usize..2).prop_map(Op::Restore),
            1 => (0usize..2).prop_map(Op::VariantGroup),
            1 => (0usize..2).prop_map(Op::BeginVariant),
            1 => (0usize..2).prop_map(Op::Route),
            1 => Just(Op::EndRoute),
            1 => Just(Op::EmptyCache),
            1 => (0usize..3).prop_map(Op::EmptyPoolCache),
            1 => any::<bool>().prop_map(Op::SpanUnmap),
        ]
    }

    /// One live allocation: its pool index, size and the seed of its contents (None once lost or
    /// unknown: discarded by a pause, or re-created by a restore).
    #[derive(Clone, Debug)]
    struct Live {
        pool: usize,
        size: u64,
        seed: Option<u64>,
    }

    fn run(ops: &[Op], page: Option<u64>) -> Result<(), TestCaseError> {
        let (dev, alloc) = setup_paged(GrowthMode::Vmm, 1 << 30, page);
        // Two pausable pools (one named), and the default pool (index 2).
        let pools = [
            alloc.named_pool("weights", pausable()).unwrap(),
            PoolId(0, 77),
            PoolId::DEFAULT,
        ];
        alloc.create_or_incref_pool(pools[1], pausable()).unwrap();
        let mut live: BTreeMap<u64, Live> = BTreeMap::new();
        let mut paused = [false; 2];
        let mut cps: [Option<Checkpoint>; 2] = [None, None];
        let mut groups: [Option<VariantGroup>; 2] = [None, None];
        let mut route: Option<usize> = None;
        let mut seed = 1u64;
        let me = current_thread_id();
        let apply = |live: &mut BTreeMap<u64, Live>, pool: usize, d: &RestoreDelta| {
            for (p, _) in &d.freed {
                live.remove(p);
            }
            for &(p, size) in &d.created {
                live.insert(
                    p,
                    Live {
                        pool,
                        size,
                        seed: None,
                    },
                );
            }
        };
        for op in ops {
            let dump = alloc.state_dump();
            let refused: bool = match op {
                Op::Alloc { pool, size, stream } => {
                    let target = route.unwrap_or(*pool);
                    let r = if route.is_some() {
                        alloc.alloc(*size, *stream)
                    } else {
                        alloc.alloc_in(pools[target], *size, *stream)
                    };
                    match r {
                        Ok(p) => {
                            prop_assert!(
                                target == 2 || !paused[target],
                                "allocated from a paused pool"
                            );
                            seed += 1;
                            fill_probes(&dev, p, *size, seed);
                            live.insert(
                                p,
                                Live {
                                    pool: target,
                                    size: *size,
                                    seed: Some(seed),
                                },
                            );
                            false
                        }
                        Err(AllocError::PoolPaused(id)) => {
                            prop_assert!(target < 2 && paused[target] && *id == pools[target]);
                            true
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("alloc: {e}"))),
                    }
                }
                Op::Free(i) => {
                    if live.is_empty() {
                        continue;
                    }
                    let p = *live.keys().nth(i % live.len()).unwrap();
                    alloc
                        .free(p)
                        .map_err(|e| TestCaseError::fail(format!("free: {e}")))?;
                    live.remove(&p);
                    false
                }
                Op::Pause { pool, backup } => {
                    let mode = if *backup {
                        PauseMode::Backup
                    } else {
                        PauseMode::Discard
                    };
                    let r = alloc.pause_pool(pools[*pool], mode);
                    prop_assert_eq!(r.is_ok(), !paused[*pool]);
                    if r.is_ok() {
                        paused[*pool] = true;
                        if !backup {
                            for l in live.values_mut().filter(|l| l.pool == *pool) {
                                l.seed = None;
                            }
                        }
                    }
                    r.is_err()
                }
                Op::Resume(pool) => {
                    let r = alloc.resume_pool(pools[*pool]);
                    prop_assert_eq!(r.is_ok(), paused[*pool]);
                    paused[*pool] = false;
                    r.is_err()
                }
                Op::Checkpoint(pool) => {
                    // Frees on one stream only: nothing waits on events.
                    cps[*pool] = Some(alloc.checkpoint(pools[*pool]).unwrap());
                    false
                }
                Op::Restore(pool) => {
                    let Some(cp) = &cps[*pool] else { continue };
                    let keep: Vec<u64> = live
                        .iter()
                        .filter(|(_, l)| l.pool == *pool)
                        .map(|(&p, _)| p)
                        .collect();
                    match alloc.restore(pools[*pool], cp, &keep) {
                        Ok(d) => {
                            prop_assert!(!paused[*pool], "restored a paused pool");
                            apply(&mut live, *pool, &d);
                            false
                        }
                        Err(AllocError::PoolPaused(_)) => {
                            prop_assert!(paused[*pool]);
                            true
                        }
                        Err(AllocError::CheckpointMismatch(_)) => true,
                        Err(AllocError::OutOfMemory(_)) => {
                            // The device is full: a refusal, which may have released caches.
                            alloc.check_invariants().map_err(TestCaseError::fail)?;
                            continue;
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("restore: {e}"))),
                    }
                }
                Op::VariantGroup(pool) => {
                    groups[*pool] = Some(alloc.variant_group(pools[*pool], 2).unwrap());
                    false
                }
                Op::BeginVariant(pool) => {
                    let Some(g) = &mut groups[*pool] else {
                        continue;
                    };
                    if g.active().is_some() {
                        alloc.end_variant(g).unwrap();
                    }
                    let k = (seed % 2) as usize;
                    match alloc.begin_variant(g, k) {
                        Ok(d) => {
                            prop_assert!(!paused[*pool]);
                            apply(&mut live, *pool, &d);
                            false
                        }
                        Err(AllocError::PoolPaused(_)) => {
                            prop_assert!(paused[*pool]);
                            true
                        }
                        Err(AllocError::CheckpointMismatch(_) | AllocError::OutOfMemory(_)) => {
                            alloc.check_invariants().map_err(TestCaseError::fail)?;
                            continue;
                        }
                        Err(e) => return Err(TestCaseError::fail(format!("variant: {e}"))),
                    }
                }
                Op::Route(pool) => {
                    if route.is_none() {
                        alloc
                            .begin_allocate_to_pool(pools[*pool], RouteFilter::Thread(me))
                            .unwrap();
                        route = Some(*pool);
                    }
                    false
                }
                Op::EndRoute => {
                    if let Some(pool) = route.take() {
                        alloc.end_allocate_to_pool(pools[pool]).unwrap();
                    }
                    false
                }
                Op::EmptyCache => {
                    alloc.empty_cache();
                    false
                }
                Op::EmptyPoolCache(pool) => {
                    alloc.empty_pool_cache(pools[*pool]).unwrap();
                    false
                }
                Op::SpanUnmap(on) => {
                    dev.set_span_unmap(*on);
                    false
                }
            };
            if refused {
                prop_assert_eq!(
                    &alloc.state_dump(),
                    &dump,
                    "refused {:?} changed the state",
                    op
                );
            }
            checked(&dev, &alloc);
            for (i, &pool) in pools[..2].iter().enumerate() {
                let st = alloc.pool_pause_state(pool).unwrap();
                let stats = alloc.pool_stats(pool).unwrap();
                prop_assert_eq!(st.is_paused(), paused[i]);
                prop_assert_eq!(
                    st.paused_bytes as i64,
                    stats.reserved_paused_bytes.all().current
                );
                if paused[i] {
                    prop_assert_eq!(stats.reserved_bytes.all().current, 0);
                }
            }
            prop_assert_eq!(
                dev.host_buffer_bytes(),
                pools[..2]
                    .iter()
                    .map(|&p| alloc.pool_pause_state(p).unwrap().host_bytes)
                    .sum::<u64>()
            );
            for (&p, l) in &live {
                if l.pool < 2 && paused[l.pool] {
                    prop_assert!(
                        dev.read(p, 1).is_err(),
                        "{:#x} of a paused pool is mapped",
                        p
                    );
                } else if let Some(s) = l.seed {
                    verify_probes(&dev, p, l.size, s).map_err(TestCaseError::fail)?;
                }
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: crate::common::cases(24), ..ProptestConfig::default() })]

        /// 2 MiB pages, and 16 MiB pages (where pausable pools keep their small blocks in vmm
        /// segments while the default pool's go to classic ones).
        #[test]
        fn pause_resume_in_random_sequences(ops in prop::collection::vec(op(), 1..60)) {
            run(&ops, None)?;
            run(&ops, Some(16 * MIB))?;
        }
    }
}
