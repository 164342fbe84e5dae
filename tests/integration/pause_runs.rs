//! Physical runs of a resumed pool (`phys_run.rs`, shard invariant 12): one create and one map
//! per stretch of paused slots, one unmap and one release per run at the next pause, runs freed
//! whole once every slot is idle; and what a released paused pool does with its backup.

use slotpool::core::{AllocError, Allocator, GrowthMode, PauseMode, PoolId, PoolOptions};
use slotpool::sim::{CallKind, SimDevice};

use crate::common::{MIB, fill_probes, setup_paged, verify_probes};

fn pausable() -> PoolOptions {
    PoolOptions {
        pausable: true,
        ..PoolOptions::default()
    }
}

fn checked(dev: &SimDevice, alloc: &Allocator<SimDevice>) {
    alloc.check_invariants().expect("invariants");
    assert_eq!(dev.contract_violations(), 0, "{:?}", dev.last_violation());
    assert_eq!(dev.physical_bytes(), alloc.held_bytes(), "device vs budget");
}

/// Device calls of `kinds` made while `f` runs.
fn calls_during<R>(dev: &SimDevice, kinds: &[CallKind], f: impl FnOnce() -> R) -> (R, Vec<u64>) {
    let before: Vec<u64> = kinds.iter().map(|&k| dev.calls(k)).collect();
    let r = f();
    let after = kinds.iter().zip(before).map(|(&k, b)| dev.calls(k) - b);
    (r, after.collect())
}

const MAP_KINDS: [CallKind; 4] = [
    CallKind::CreateRun,
    CallKind::MapWhole,
    CallKind::CreatePage,
    CallKind::Map,
];
const UNMAP_KINDS: [CallKind; 3] = [CallKind::UnmapRange, CallKind::Unmap, CallKind::ReleasePage];

/// A pausable pool with two live blocks of 100 and 60 MiB (2 MiB pages) with 20 MiB unmapped
/// between them, filled with patterns: (device, allocator, pool, [(ptr, size, seed)]).
type Filled = (
    std::sync::Arc<SimDevice>,
    Allocator<SimDevice>,
    PoolId,
    Vec<(u64, u64, u64)>,
);

fn filled() -> Filled {
    let (dev, alloc) = setup_paged(GrowthMode::Vmm, 4 << 30, None);
    let pool = alloc.named_pool("weights", pausable()).unwrap();
    let mut live = Vec::new();
    let mut gap = 0;
    for (i, size) in [100 * MIB, 20 * MIB, 60 * MIB].into_iter().enumerate() {
        let p = alloc.alloc_in(pool, size, 0).unwrap();
        if i == 1 {
            gap = p;
            continue;
        }
        fill_probes(&dev, p, size, 40 + i as u64);
        live.push((p, size, 40 + i as u64));
    }
    // The middle block's pages go back: the pool's mapped slots are two stretches.
    alloc.free(gap).unwrap();
    alloc.empty_cache();
    checked(&dev, &alloc);
    (dev, alloc, pool, live)
}

/// Stretches of consecutive mapped slots of the pool: what a resume makes one run of each.
fn stretches(alloc: &Allocator<SimDevice>, pool: PoolId) -> u64 {
    alloc.snapshot().iter().filter(|s| s.pool == pool).count() as u64
}

#[test]
fn a_resume_maps_one_run_per_stretch_and_the_next_pause_unmaps_each_with_one_call() {
    let (dev, alloc, pool, live) = filled();
    let runs = stretches(&alloc, pool);
    let reserved = alloc.pool_stats(pool).unwrap().reserved_bytes.all().current;
    let pages = reserved as u64 / (2 * MIB);
    assert!(runs >= 2 && pages >= 80, "{runs} stretches, {pages} pages");
    // The first pause: pages mapped one by one, each stretch unmapped with one call, each page
    // released.
    let (_, n) = calls_during(&dev, &UNMAP_KINDS, || {
        alloc.pause_pool(pool, PauseMode::Backup).unwrap()
    });
    checked(&dev, &alloc);
    assert_eq!(
        n,
        vec![runs, 0, pages],
        "first pause: unmap_range, unmap, release"
    );
    // The resume: one create and one map per stretch, no page of its own.
    let (mapped, n) = calls_during(&dev, &MAP_KINDS, || alloc.resume_pool(pool).unwrap());
    checked(&dev, &alloc);
    assert_eq!(mapped as i64, reserved);
    assert_eq!(
        n,
        vec![runs, runs, 0, 0],
        "resume: create_run, map_whole, create_page, map"
    );
    assert_eq!(dev.run_count() as u64, runs);
    let st = alloc.pool_stats(pool).unwrap();
    assert_eq!(
        st.reserved_bytes.all().current,
        reserved,
        "runs counted whole"
    );
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
    // The backend counts: one create_page and one map per run.
    let before = alloc.backend_calls();
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    let after = alloc.backend_calls();
    assert_eq!(after.unmap - before.unmap, runs);
    assert_eq!(after.release_page - before.release_page, runs);
    checked(&dev, &alloc);
    assert_eq!(dev.run_count(), 0);
    let (_, n) = calls_during(&dev, &MAP_KINDS, || alloc.resume_pool(pool).unwrap());
    assert_eq!(n, vec![runs, runs, 0, 0]);
    checked(&dev, &alloc);
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
}

#[test]
fn without_ranges_over_several_mappings_a_first_pause_unmaps_page_by_page() {
    let (dev, alloc, pool, live) = filled();
    dev.set_span_unmap(false);
    let pages = alloc.pool_stats(pool).unwrap().reserved_bytes.all().current as u64 / (2 * MIB);
    let (_, n) = calls_during(&dev, &[CallKind::Unmap, CallKind::ReleasePage], || {
        alloc.pause_pool(pool, PauseMode::Backup).unwrap()
    });
    checked(&dev, &alloc);
    assert_eq!(n, vec![pages, pages]);
    alloc.resume_pool(pool).unwrap();
    // A run is one mapping: unmapped with one call all the same.
    let runs = dev.run_count() as u64;
    let (_, n) = calls_during(&dev, &UNMAP_KINDS, || {
        alloc.pause_pool(pool, PauseMode::Backup).unwrap()
    });
    assert_eq!(n, vec![runs, 0, runs]);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
}

#[test]
fn a_run_is_released_only_once_every_slot_of_it_is_idle() {
    let (dev, alloc, pool, live) = filled();
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    alloc.resume_pool(pool).unwrap();
    let runs = dev.run_count();
    // A small block inside the first run keeps the whole run when the large one goes.
    let (big, size, _) = live[0];
    alloc.free(big).unwrap();
    let small = alloc.alloc_in(pool, 64 * MIB, 0).unwrap();
    assert!(
        small >= big && small + 64 * MIB <= big + size,
        "best fit reuses the run"
    );
    let held = dev.physical_bytes();
    let kept = alloc.pool_stats(pool).unwrap().reserved_bytes.all().current;
    alloc.empty_cache();
    checked(&dev, &alloc);
    let st = alloc.pool_stats(pool).unwrap();
    assert_eq!(dev.run_count(), runs, "a run with a live slot stays");
    assert_eq!(dev.physical_bytes(), held);
    assert_eq!(st.reserved_bytes.all().current, kept, "counted whole");
    alloc.free(small).unwrap();
    alloc.free(live[1].0).unwrap();
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(dev.run_count(), 0, "idle runs go");
    assert_eq!(
        alloc.pool_stats(pool).unwrap().reserved_bytes.all().current,
        0
    );
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn a_run_the_device_cannot_make_is_made_in_halves_down_to_pages() {
    let (dev, alloc, pool, live) = filled();
    let runs = stretches(&alloc, pool);
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    dev.inject_oom(CallKind::CreateRun, 1);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    assert_eq!(
        dev.run_count() as u64,
        runs + 1,
        "the refused run in two halves"
    );
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
    // No runs at all: every slot gets a page of its own.
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    dev.fail_all(CallKind::CreateRun, true);
    let pages = alloc.pool_pause_state(pool).unwrap().paused_bytes / (2 * MIB);
    let (_, n) = calls_during(&dev, &MAP_KINDS, || alloc.resume_pool(pool).unwrap());
    dev.fail_all(CallKind::CreateRun, false);
    checked(&dev, &alloc);
    assert_eq!(n[1..], [0, pages, pages]);
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
}

#[test]
fn a_block_in_a_run_is_not_shared_page_by_page() {
    let (_dev, alloc, pool, live) = filled();
    assert!(alloc.shared_pages(live[0].0).is_ok());
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    alloc.resume_pool(pool).unwrap();
    match alloc.shared_pages(live[0].0) {
        Err(AllocError::InvalidArgument(why)) => assert!(why.contains("physical run"), "{why}"),
        other => panic!("shared a run page by page: {other:?}"),
    }
}

#[test]
fn a_released_paused_pool_keeps_its_backup_while_blocks_live_and_frees_it_after() {
    let (dev, alloc, pool, live) = filled();
    let state = alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    assert!(state.host_bytes > 0);
    assert_eq!(alloc.release_pool(pool).unwrap(), 0);
    // Live blocks: the program may still resume it and read them.
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(alloc.pool_pause_state(pool).unwrap(), state);
    assert_eq!(dev.host_buffer_bytes(), state.host_bytes);
    alloc.resume_pool(pool).unwrap();
    for &(p, size, seed) in &live {
        verify_probes(&dev, p, size, seed).unwrap();
    }
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    // Its blocks freed while paused, nothing can use the backup: the next empty-cache frees it,
    // forgets the paused bytes, gives the reservations back and forgets the pool.
    for &(p, _, _) in &live {
        alloc.free(p).unwrap();
    }
    checked(&dev, &alloc);
    assert!(dev.host_buffer_bytes() > 0);
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(dev.host_buffer_bytes(), 0, "backup leaked");
    assert_eq!(dev.reservation_count(), 0);
    assert_eq!(dev.physical_bytes(), 0);
    assert!(!alloc.pools().contains(&pool), "pool not forgotten");
    assert_eq!(alloc.stats().reserved_paused_bytes.all().current, 0);
}

#[test]
fn a_pool_in_use_keeps_its_pinned_buffer_and_its_pause_when_empty() {
    let (dev, alloc, pool, live) = filled();
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    alloc.resume_pool(pool).unwrap();
    // The backup's buffer is kept for the next backup; a discarding pause leaves it spare.
    let spare = dev.host_buffer_bytes();
    assert!(spare > 0);
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    for &(p, _, _) in &live {
        alloc.free(p).unwrap();
    }
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(
        dev.host_buffer_bytes(),
        spare,
        "the spare buffer of a pool in use went"
    );
    let st = alloc.pool_pause_state(pool).unwrap();
    assert!(
        st.is_paused() && st.paused_bytes > 0,
        "a pool in use stays paused"
    );
    alloc.resume_pool(pool).unwrap();
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(dev.physical_bytes(), 0);
    // Emptied of segments, its shard stays for the buffer; the next backup pins nothing.
    assert_eq!(dev.host_buffer_bytes(), spare);
    let p = alloc.alloc_in(pool, 10 * MIB, 0).unwrap();
    fill_probes(&dev, p, 10 * MIB, 5);
    let (_, n) = calls_during(&dev, &[CallKind::AllocHost], || {
        alloc.pause_pool(pool, PauseMode::Backup).unwrap()
    });
    assert_eq!(n, vec![0], "pinned again");
    alloc.resume_pool(pool).unwrap();
    verify_probes(&dev, p, 10 * MIB, 5).unwrap();
    checked(&dev, &alloc);
    // Released, the pool gives it back.
    alloc.free(p).unwrap();
    alloc.release_pool(pool).unwrap();
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(dev.host_buffer_bytes(), 0);
    assert!(!alloc.pools().contains(&pool));
}

#[test]
fn a_resume_reclaims_what_other_pools_cache_before_it_gives_up() {
    // 512 MiB device: a 200 MiB pausable pool, paused; the default pool then fills the device
    // and frees it all, so its cache holds what the resume needs.
    let (dev, alloc) = setup_paged(GrowthMode::Vmm, 512 * MIB, None);
    let pool = alloc.named_pool("kv_cache", pausable()).unwrap();
    let kv = alloc.alloc_in(pool, 200 * MIB, 0).unwrap();
    fill_probes(&dev, kv, 200 * MIB, 7);
    alloc.pause_pool(pool, PauseMode::Backup).unwrap();
    let mut held = Vec::new();
    while let Ok(p) = alloc.alloc(64 * MIB, 0) {
        held.push(p);
    }
    assert!(
        held.len() >= 6,
        "the default pool took the paused pool's memory"
    );
    for p in held {
        alloc.free(p).unwrap();
    }
    checked(&dev, &alloc);
    let retries = alloc.stats().num_alloc_retries;
    // Before: refused with an all-zero report while the default pool's cache held the memory.
    alloc
        .resume_pool(pool)
        .expect("the resume reclaims the default pool's cache");
    assert_eq!(alloc.stats().num_alloc_retries, retries + 1);
    verify_probes(&dev, kv, 200 * MIB, 7).expect("the backup came back");
    checked(&dev, &alloc);
    // What cannot fit even then is refused with a report, and the pool stays paused.
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    let big = alloc.alloc(400 * MIB, 0).unwrap();
    match alloc.resume_pool(pool) {
        Err(AllocError::OutOfMemory(r)) => assert!(r.allocated >= 400 * MIB, "{r:?}"),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(alloc.pool_pause_state(pool).unwrap().mode.is_some());
    checked(&dev, &alloc);
    alloc.free(big).unwrap();
    alloc.resume_pool(pool).unwrap();
    alloc.free(kv).unwrap();
    checked(&dev, &alloc);
}

/// A pause of 10 GiB of runs: every run is released exactly once, the device and the budget
/// agree, and a release the driver refuses leaves a stray run that the next empty-cache gives
/// back.
#[test]
fn a_large_pause_releases_each_run_once_and_loses_none() {
    let (dev, alloc) = setup_paged(GrowthMode::Vmm, 24 << 30, None);
    let pool = alloc.named_pool("kv", pausable()).unwrap();
    let blocks: Vec<u64> = (0..5)
        .map(|_| alloc.alloc_in(pool, 2 << 30, 0).unwrap())
        .collect();
    // The first pause gives back pages mapped one by one; the resume maps runs.
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    checked(&dev, &alloc);
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    let runs = dev.run_count() as u64;
    assert!(runs >= 2, "{runs} runs");
    let held = alloc.held_bytes();
    let (_, n) = calls_during(&dev, &[CallKind::ReleasePage], || {
        alloc.pause_pool(pool, PauseMode::Discard).unwrap()
    });
    assert_eq!(n, vec![runs], "one release per run");
    assert_eq!(dev.run_count(), 0);
    assert!(alloc.held_bytes() + (10 << 30) <= held, "10 GiB given back");
    checked(&dev, &alloc);
    // One release refused: that run stays held, counted by the device and the budget alike,
    // until the next empty-cache.
    alloc.resume_pool(pool).unwrap();
    checked(&dev, &alloc);
    dev.inject_oom(CallKind::ReleasePage, 2);
    alloc.pause_pool(pool, PauseMode::Discard).unwrap();
    checked(&dev, &alloc);
    assert_eq!(dev.run_count(), 1, "the refused run is still held");
    alloc.empty_cache();
    checked(&dev, &alloc);
    assert_eq!(dev.run_count(), 0, "empty_cache gave the stray run back");
    // The pool works after all that.
    alloc.resume_pool(pool).unwrap();
    fill_probes(&dev, blocks[4], 2 << 30, 9);
    verify_probes(&dev, blocks[4], 2 << 30, 9).unwrap();
    for p in blocks {
        alloc.free(p).unwrap();
    }
    alloc.empty_cache();
    checked(&dev, &alloc);
}
