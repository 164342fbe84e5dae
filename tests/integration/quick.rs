//! The shards' quick cache (shard invariant 9): a freed block kept whole for the next request of
//! its exact size, merged back before the shard grows, releases memory or is checkpointed.

use slotpool::core::block::BlockState;
use slotpool::core::{GrowthMode, PoolId};
use slotpool::sim::CallKind;

use crate::common::{MIB, setup, setup_with_pool};

const KIB: u64 = 1 << 10;

fn checked(alloc: &slotpool::core::Allocator<slotpool::sim::SimDevice>) {
    alloc.check_invariants().expect("invariants");
}

#[test]
fn a_freed_block_serves_the_next_request_of_its_size() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (dev, alloc) = setup(growth, 1 << 30);
        let a = alloc.alloc(300 * KIB, 0).unwrap();
        let keep = alloc.alloc(64 * KIB, 0).unwrap();
        alloc.free(a).unwrap();
        checked(&alloc);
        let st = alloc.stats();
        assert_eq!(st.allocated_bytes.all().current as u64, 64 * KIB);
        assert_eq!(st.active.all().current, 1, "a cached block is not active");
        let calls = (dev.calls(CallKind::Map), dev.calls(CallKind::AllocSegment));
        // Same rounded size: the same block comes back, with no device call.
        let b = alloc.alloc(300 * KIB - 100, 0).unwrap();
        assert_eq!(b, a, "{growth:?}");
        assert_eq!(
            (dev.calls(CallKind::Map), dev.calls(CallKind::AllocSegment)),
            calls
        );
        checked(&alloc);
        let st = alloc.stats();
        assert_eq!(st.allocated_bytes.all().current as u64, 364 * KIB);
        assert_eq!(st.requested_bytes.all().current as u64, 364 * KIB - 100);
        // A double free is still refused.
        alloc.free(b).unwrap();
        assert!(alloc.free(b).is_err());
        alloc.free(keep).unwrap();
        checked(&alloc);
    }
}

#[test]
fn the_cache_merges_back_before_the_shard_grows() {
    // Classic: four 512 KiB blocks fill one 2 MiB small segment. Cached whole, they cannot serve
    // 1 MiB; merged, they can, so no second segment is allocated.
    let (dev, alloc) = setup(GrowthMode::Classic, 1 << 30);
    let blocks: Vec<u64> = (0..4).map(|_| alloc.alloc(512 * KIB, 0).unwrap()).collect();
    assert_eq!(dev.segment_count(), 1);
    for &p in &blocks {
        alloc.free(p).unwrap();
    }
    checked(&alloc);
    let big = alloc.alloc(MIB, 0).unwrap();
    assert_eq!(dev.segment_count(), 1, "grew instead of merging the cache");
    assert_eq!(big, blocks[0]);
    checked(&alloc);
    alloc.free(big).unwrap();

    // vmm: a cached block's pages stay mapped. 512 KiB + 512 KiB + 1 MiB fill the first 2 MiB
    // page; once all three are cached, 896 KiB fits nowhere mapped until the cache merges back,
    // which it does rather than map the next page.
    let (dev, alloc) = setup(GrowthMode::Vmm, 1 << 30);
    let a = alloc.alloc(512 * KIB, 0).unwrap();
    let b = alloc.alloc(512 * KIB, 0).unwrap();
    let c = alloc.alloc(MIB, 0).unwrap();
    for p in [a, b, c] {
        alloc.free(p).unwrap();
    }
    checked(&alloc);
    let mapped = dev.mapped_bytes();
    let d = alloc.alloc(896 * KIB, 0).unwrap();
    assert_eq!(d, a);
    assert_eq!(
        dev.mapped_bytes(),
        mapped,
        "mapped a page beside cached blocks"
    );
    checked(&alloc);
}

/// Only blocks of the small pool (<= 1 MiB) are cached: reusing a large block in place instead
/// of the best fit changed the packing of 16 MiB pages (llama_train's replay reserved 4% more).
#[test]
fn large_blocks_are_not_cached() {
    let (_dev, alloc) = setup(GrowthMode::Vmm, 1 << 30);
    let p = alloc.alloc(4 * MIB, 0).unwrap();
    alloc.free(p).unwrap();
    assert!(
        alloc
            .snapshot()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .all(|b| b.state != BlockState::Cached)
    );
}

#[test]
fn empty_cache_and_snapshots_see_cached_blocks_as_free() {
    let (dev, alloc) = setup(GrowthMode::Vmm, 1 << 30);
    let p = alloc.alloc(768 * KIB, 0).unwrap();
    alloc.free(p).unwrap();
    let snap = alloc.snapshot();
    let states: Vec<BlockState> = snap
        .iter()
        .flat_map(|s| s.blocks.iter().map(|b| b.state))
        .collect();
    assert!(states.contains(&BlockState::Cached), "{states:?}");
    assert!(alloc.largest_free_block() >= 768 * KIB);
    alloc.empty_cache();
    checked(&alloc);
    assert_eq!(
        dev.physical_bytes(),
        0,
        "a cached block kept memory through empty_cache"
    );
    assert_eq!(alloc.stats().reserved_bytes.all().current, 0);
}

#[test]
fn no_block_is_cached_while_a_checkpoint_is_alive() {
    let pool = PoolId(0, 7);
    let (_dev, alloc) = setup_with_pool(GrowthMode::Vmm, pool);
    let a = alloc.alloc_in(pool, MIB, 0).unwrap();
    alloc.free(a).unwrap(); // cached
    let cp = alloc.checkpoint(pool).unwrap();
    checked(&alloc); // invariant 9: the checkpoint merged it back
    let b = alloc.alloc_in(pool, MIB, 0).unwrap();
    let c = alloc.alloc_in(pool, 512 * KIB, 5).unwrap(); // a shard born after the checkpoint
    alloc.free(b).unwrap();
    alloc.free(c).unwrap();
    checked(&alloc);
    let snap = alloc.snapshot();
    assert!(
        snap.iter()
            .flat_map(|s| s.blocks.iter())
            .all(|b| b.state != BlockState::Cached),
        "cached while journaling"
    );
    let delta = alloc.restore(pool, &cp, &[]).unwrap();
    assert!(delta.freed.is_empty(), "{delta:?}");
    checked(&alloc);
    drop(cp);
    // Once the checkpoint is gone the existing shard caches again.
    let d = alloc.alloc_in(pool, MIB, 0).unwrap();
    alloc.free(d).unwrap();
    checked(&alloc);
    assert!(
        alloc
            .snapshot()
            .iter()
            .flat_map(|s| s.blocks.iter())
            .any(|b| b.state == BlockState::Cached)
    );
}

fn cached_blocks(alloc: &slotpool::core::Allocator<slotpool::sim::SimDevice>) -> usize {
    alloc
        .snapshot()
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == BlockState::Cached)
        .count()
}

/// Sizes that never recur turn the cache off (so they pay nothing for it); a loop of one size
/// turns it on again within a probe period.
#[test]
fn the_cache_follows_whether_it_pays() {
    let (_dev, alloc) = setup(GrowthMode::Classic, 1 << 30);
    let keep = alloc.alloc(KIB, 0).unwrap();
    for i in 0..200u64 {
        let p = alloc.alloc(4 * KIB + 512 * (i % 100), 0).unwrap();
        let q = alloc.alloc(8 * KIB + 512 * (i % 100), 0).unwrap();
        alloc.free(p).unwrap();
        alloc.free(q).unwrap();
    }
    checked(&alloc);
    let off = cached_blocks(&alloc);
    assert!(off <= 1, "{off} blocks cached while sizes never recur");
    for _ in 0..100 {
        let p = alloc.alloc(64 * KIB, 0).unwrap();
        alloc.free(p).unwrap();
    }
    checked(&alloc);
    assert_eq!(cached_blocks(&alloc), 1, "a recurring size is cached again");
    alloc.free(keep).unwrap();
}

/// A checkpoint of a pool with no shard yet: the shard born after it caches nothing, so a
/// refused restore leaves the state exactly as it was (the proptest case that found it: a
/// restore with a foreign keep-live pointer merged that shard's cache before refusing).
#[test]
fn a_shard_born_after_a_checkpoint_of_its_empty_pool_caches_nothing() {
    let pool = PoolId(0, 9);
    let (_dev, alloc) = setup_with_pool(GrowthMode::Classic, pool);
    let cp = alloc.checkpoint(pool).unwrap();
    let a = alloc.alloc_in(pool, 8 * KIB, 0).unwrap();
    let b = alloc.alloc_in(pool, 300 * KIB, 0).unwrap();
    alloc.free(b).unwrap();
    checked(&alloc);
    assert_eq!(cached_blocks(&alloc), 0);
    let foreign = alloc.alloc(4 * KIB, 0).unwrap(); // the default pool's
    let before = alloc.state_dump();
    assert!(alloc.restore(pool, &cp, &[foreign]).is_err());
    assert_eq!(
        alloc.state_dump(),
        before,
        "a refused restore changed the state"
    );
    let delta = alloc.restore(pool, &cp, &[]).unwrap();
    assert_eq!(delta.freed.len(), 1, "{delta:?}");
    assert_eq!(delta.freed[0].0, a);
    checked(&alloc);
}

/// A cached block stays in its shard's live map (invariant 8) but is no allocation: every
/// pointer lookup refuses it, from this thread (whose cached shard holds it) and from another,
/// and the refusals change nothing.
#[test]
fn a_cached_block_is_no_allocation_to_pointer_lookups() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (_dev, alloc) = setup(growth, 1 << 30);
        let alloc = std::sync::Arc::new(alloc);
        let a = alloc.alloc(8 * KIB, 0).unwrap();
        alloc.free(a).unwrap();
        let before = alloc.stats();
        assert!(alloc.allocation_info(a).is_err());
        assert!(alloc.record_stream(a, 5).is_err());
        assert!(alloc.mark_reusable(a).is_err());
        assert!(alloc.free(a).is_err());
        let other = alloc.clone();
        std::thread::spawn(move || {
            assert!(other.free(a).is_err());
            assert!(other.allocation_info(a).is_err());
        })
        .join()
        .unwrap();
        assert_eq!(alloc.stats(), before, "{growth:?}");
        checked(&alloc);
        // Still served to the next request of its size.
        assert_eq!(alloc.alloc(8 * KIB, 0).unwrap(), a);
        assert_eq!(alloc.allocation_info(a).unwrap().1, 8 * KIB);
        alloc.free(a).unwrap();
        checked(&alloc);
    }
}

/// A free of another shard's block, by a thread whose cached shard does not hold it, is found
/// through the segment registry; the block goes to its own shard's quick cache.
#[test]
fn a_free_on_another_threads_shard_finds_the_owner() {
    let (_dev, alloc) = setup(GrowthMode::Vmm, 1 << 30);
    let alloc = std::sync::Arc::new(alloc);
    let mine = alloc.alloc(4 * KIB, 0).unwrap();
    let other = alloc.clone();
    let theirs = std::thread::spawn(move || other.alloc(4 * KIB, 9).unwrap())
        .join()
        .unwrap();
    // This thread's cached shard is stream 0's: the free asks it, then the registry.
    alloc.free(theirs).unwrap();
    checked(&alloc);
    assert!(alloc.free(theirs).is_err(), "a double free is refused");
    assert_eq!(cached_blocks(&alloc), 1);
    let other = alloc.clone();
    let again = std::thread::spawn(move || other.alloc(4 * KIB, 9).unwrap())
        .join()
        .unwrap();
    assert_eq!(
        again, theirs,
        "stream 9's shard serves it back from its cache"
    );
    alloc.free(again).unwrap();
    alloc.free(mine).unwrap();
    checked(&alloc);
}

/// `alloc` / `free` serve the quick-cache round trip of the calling thread's cached shard inline,
/// and every other request through their slow paths, which answer as the general path does:
/// another stream, another size, a request over the limit, an active route, another shard's
/// pointer, a double free.
#[test]
fn the_inline_path_is_the_quick_hit_and_nothing_else() {
    use slotpool::core::{AllocError, RouteFilter};
    let pool = PoolId(0, 7);
    let (_, alloc) = setup_with_pool(GrowthMode::Vmm, pool);
    let a = alloc.alloc(300 * KIB, 0).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.free(a),
        Err(AllocError::UnknownPointer(a)),
        "a double free is refused"
    );
    checked(&alloc);
    // Another stream: its own shard, not the cached block. (Another size on stream 0 may take
    // the cached block apart: `the_inline_path_matches_the_slow_path` compares those answers.)
    let p = alloc.alloc(300 * KIB, 1).unwrap();
    assert_ne!(p, a, "stream 1's own block");
    alloc.free(p).unwrap();
    checked(&alloc);
    // Over the limit: refused as `alloc_in` refuses it, though the cache holds the block, and
    // nothing changes but the count of refusals.
    alloc.set_memory_limit(256 * KIB);
    let before = alloc.stats();
    assert!(matches!(
        alloc.alloc(300 * KIB, 0),
        Err(AllocError::OutOfMemory(_))
    ));
    let after = alloc.stats();
    assert_eq!(after.num_ooms, before.num_ooms + 1);
    assert_eq!(after.allocated_bytes, before.allocated_bytes);
    assert_eq!(after.requested_bytes, before.requested_bytes);
    checked(&alloc);
    alloc.set_memory_limit(u64::MAX);
    // A route is active: the slow path decides the pool.
    alloc
        .begin_allocate_to_pool(pool, RouteFilter::All)
        .unwrap();
    let routed = alloc.alloc(300 * KIB, 0).unwrap();
    assert_ne!(routed, a, "routed to the pool");
    alloc.end_allocate_to_pool(pool).unwrap();
    // The thread's cached shard is now the pool's: the slow path finds the default pool's
    // shard and its cached block.
    let b = alloc.alloc(300 * KIB, 0).unwrap();
    assert_eq!(b, a, "the cached block, through the slow path");
    alloc.free(b).unwrap();
    // The hit: the same block back, counted as the slow path counts it.
    assert_eq!(alloc.alloc(300 * KIB - 100, 0).unwrap(), a);
    checked(&alloc);
    let st = alloc.stats();
    assert_eq!(
        st.requested_bytes.all().current as u64,
        2 * 300 * KIB - 100,
        "the routed block and the hit"
    );
    // A pointer of another shard: freed through the segment registry.
    alloc.free(routed).unwrap();
    alloc.free(a).unwrap();
    checked(&alloc);
    assert_eq!(alloc.stats().allocated_bytes.all().current, 0);
}

mod inline_path_model {
    use proptest::prelude::*;
    use slotpool::core::{Allocator, GrowthMode};
    use slotpool::sim::SimDevice;

    use crate::common::{MIB, setup};

    #[derive(Clone, Debug)]
    enum Op {
        Alloc { size: u64, stream: u64 },
        Free(usize),
        Limit(Option<u64>),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (prop::sample::select(vec![512u64, 4096, 300 << 10, 1 << 20, 3 << 20, 40 << 20]),
                  0..3u64).prop_map(|(size, stream)| Op::Alloc { size, stream }),
            5 => (0..64usize).prop_map(Op::Free),
            1 => prop::option::of(prop::sample::select(vec![8 * MIB, 64 * MIB]))
                .prop_map(Op::Limit),
        ]
    }

    /// What one run saw: every call's answer and the statistics after it.
    type Seen = Vec<(Option<u64>, std::collections::BTreeMap<String, i64>)>;

    /// One call of a run.
    fn step(a: &Allocator<SimDevice>, live: &mut Vec<u64>, op: &Op) -> Option<u64> {
        match *op {
            Op::Alloc { size, stream } => a.alloc(size, stream).ok().inspect(|&p| live.push(p)),
            Op::Free(i) if !live.is_empty() => {
                let p = live.swap_remove(i % live.len());
                a.free(p).expect("a live pointer frees");
                Some(p)
            }
            Op::Free(_) => None,
            Op::Limit(l) => {
                a.set_memory_limit(l.unwrap_or(u64::MAX));
                None
            }
        }
    }

    /// Run `ops` on a fresh allocator, every call on one thread of its own (`inline`: the
    /// thread's cached shard serves the quick cache's hits and frees in place) or each call on
    /// a new thread, which has no cached shard: every call takes the slow path (the shard
    /// table for an allocation, the segment registry for a free).
    fn run(growth: GrowthMode, ops: &[Op], inline: bool) -> Seen {
        let ops = ops.to_vec();
        std::thread::spawn(move || {
            let (_, a): (_, Allocator<SimDevice>) = setup(growth, 1 << 30);
            let mut live: Vec<u64> = Vec::new();
            let mut seen = Seen::new();
            for op in &ops {
                let answer = if inline {
                    step(&a, &mut live, op)
                } else {
                    std::thread::scope(|s| {
                        s.spawn(|| step(&a, &mut live, op))
                            .join()
                            .expect("the call panicked")
                    })
                };
                a.check_invariants().expect("invariants");
                seen.push((answer, a.stats().to_flat_map()));
            }
            seen
        })
        .join()
        .expect("the run panicked")
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: crate::common::cases(32), ..ProptestConfig::default() })]

        /// The inline path changes no address, no answer and no statistic.
        #[test]
        fn the_inline_path_matches_the_slow_path(ops in prop::collection::vec(op(), 1..100)) {
            for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
                prop_assert_eq!(run(growth, &ops, true), run(growth, &ops, false));
            }
        }
    }
}
