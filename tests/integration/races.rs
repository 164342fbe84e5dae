//! Cache emptying, pool release, checkpoints and restores race allocation and cross-thread frees.
//! Afterwards every invariant holds and nothing is lost: every live pointer frees, its bytes
//! intact, the statistics return to zero and the device can be allocated whole again.
//!
//! Each test runs for a short while by default and longer under `SLOTPOOL_HEAVY=1`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use slotpool::core::{Allocator, GrowthMode, PoolId, PoolOptions};
use slotpool::sim::SimDevice;

use crate::common::{
    Live, MIB, check_all, fill_probes, race_duration, repeat_until, setup, verify_probes,
};

/// How long each racing thread runs.
fn duration() -> Duration {
    race_duration(Duration::from_millis(700), Duration::from_secs(20))
}

/// A small xorshift generator, one per thread.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn size_of(x: u64) -> u64 {
    match x % 8 {
        0 => 2 * MIB + x % MIB,
        1 | 2 => 64 * 1024 + x % (512 * 1024),
        _ => 1 + x % 8192,
    }
}

/// Pointers handed from one thread to another, freed by whichever thread takes them.
type Mailbox = Arc<Mutex<Vec<Live>>>;

/// After the race: invariants and bytes, every live pointer frees, the statistics are back to
/// zero, and once `pools` are released (a pool in use keeps its graph-retained memory, such as
/// what restores took back) the cache empties to nothing and the device can be allocated whole.
fn settle(
    dev: &SimDevice,
    alloc: &Allocator<SimDevice>,
    live: Vec<Live>,
    pools: &[PoolId],
    total: u64,
) {
    dev.complete_all();
    alloc.process_events();
    check_all(dev, alloc, &live);
    for l in &live {
        alloc
            .free(l.ptr)
            .unwrap_or_else(|e| panic!("free of live {:#x}+{}: {e}", l.ptr, l.size));
    }
    dev.complete_all();
    alloc.process_events();
    let st = alloc.stats();
    assert_eq!(st.allocation.all().current, 0, "allocations left");
    assert_eq!(st.allocated_bytes.all().current, 0, "allocated bytes left");
    for &p in pools {
        assert_eq!(alloc.release_pool(p).expect("release"), 0);
    }
    alloc.empty_cache();
    check_all(dev, alloc, &[]);
    assert_eq!(alloc.stats().reserved_bytes.all().current, 0);
    assert_eq!(dev.physical_bytes(), 0, "memory leaked");
    let whole = alloc.alloc(total, 0).expect("the whole device again");
    alloc.free(whole).unwrap();
    alloc.empty_cache();
    check_all(dev, alloc, &[]);
}

/// Two threads allocate in a private pool on streams they have not used before (each a new
/// shard) and in the default pool, freeing each other's pointers; a third empties the cache.
/// A shard that `empty_cache` forgot while a thread was about to allocate in it once took
/// segments that no table knew: their frees failed as unknown pointers and the memory leaked.
fn empty_cache_races_new_shards(growth: GrowthMode) {
    const TOTAL: u64 = 1 << 30;
    let (dev, alloc) = setup(growth, TOTAL);
    let alloc = Arc::new(alloc);
    let pool = PoolId(0, 7);
    alloc
        .create_or_incref_pool(pool, PoolOptions::default())
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mailbox: Mailbox = Arc::default();
    let workers: Vec<_> = (0..2u64)
        .map(|t| {
            let (dev, alloc, stop, mailbox) =
                (dev.clone(), alloc.clone(), stop.clone(), mailbox.clone());
            thread::spawn(move || {
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (t + 1));
                let mut live: Vec<Live> = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let x = rng.next();
                    let size = size_of(x);
                    let seed = t << 40 | i;
                    // Pool allocations on a new stream most of the time.
                    let (ptr, stream) = if !x.is_multiple_of(3) {
                        let stream = 1000 + t * 1_000_000 + i;
                        (
                            alloc.alloc_in(pool, size, stream).expect("pool alloc"),
                            stream,
                        )
                    } else {
                        (alloc.alloc(size, 0).expect("default alloc"), 0)
                    };
                    fill_probes(&dev, ptr, size, seed);
                    let l = Live {
                        ptr,
                        size,
                        seed,
                        stream,
                    };
                    match x % 7 {
                        0 => mailbox.lock().unwrap().push(l),
                        1 | 2 => {
                            verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern");
                            alloc.free(l.ptr).expect("free of a pointer just allocated");
                        }
                        _ => live.push(l),
                    }
                    if live.len() > 48 {
                        let l = live.swap_remove((x as usize >> 8) % live.len());
                        verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern");
                        alloc.free(l.ptr).expect("free of a live pointer");
                    }
                    if x.is_multiple_of(5) {
                        let taken = mailbox.lock().unwrap().pop();
                        if let Some(l) = taken {
                            verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern");
                            alloc
                                .free(l.ptr)
                                .expect("cross-thread free of a live pointer");
                        }
                    }
                }
                live
            })
        })
        .collect();
    let reclaimer = {
        let alloc = alloc.clone();
        repeat_until(&stop, move || alloc.empty_cache())
    };
    thread::sleep(duration());
    stop.store(true, Ordering::Relaxed);
    let mut live = Vec::new();
    for w in workers {
        live.extend(w.join().expect("worker panicked"));
    }
    assert!(reclaimer.join().expect("reclaimer panicked") > 0);
    live.extend(mailbox.lock().unwrap().drain(..));
    settle(&dev, &alloc, live, &[pool], TOTAL);
}

#[test]
fn empty_cache_races_allocation_on_new_shards_vmm() {
    empty_cache_races_new_shards(GrowthMode::Vmm);
}

#[test]
fn empty_cache_races_allocation_on_new_shards_classic() {
    empty_cache_races_new_shards(GrowthMode::Classic);
}

/// Everything at once: two workers allocate in the default pool and a shared pool on a few
/// streams and free each other's pointers; one thread empties the device's and the shared pool's
/// cache; one creates, fills, empties and releases short-lived pools; one checkpoints and
/// restores a pool of its own and checks each restore against what it did since.
fn everything_races(growth: GrowthMode) {
    const TOTAL: u64 = 1 << 30;
    let (dev, alloc) = setup(growth, TOTAL);
    let alloc = Arc::new(alloc);
    let shared = PoolId(0, 1);
    let own = PoolId(0, 2);
    for p in [shared, own] {
        alloc
            .create_or_incref_pool(p, PoolOptions::default())
            .unwrap();
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mailbox: Mailbox = Arc::default();
    let mut handles = Vec::new();
    for t in 0..2u64 {
        let (dev, alloc, stop, mailbox) =
            (dev.clone(), alloc.clone(), stop.clone(), mailbox.clone());
        handles.push(thread::spawn(move || {
            let mut rng = Rng(0x2545_F491_4F6C_DD1D ^ (t + 7));
            let mut live: Vec<Live> = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let x = rng.next();
                let size = size_of(x);
                let stream = 10 + (x >> 20) % 4;
                let pool = if x.is_multiple_of(2) {
                    shared
                } else {
                    PoolId::DEFAULT
                };
                let ptr = alloc.alloc_in(pool, size, stream).expect("alloc");
                let seed = t << 40 | i;
                fill_probes(&dev, ptr, size, seed);
                let l = Live {
                    ptr,
                    size,
                    seed,
                    stream,
                };
                if x.is_multiple_of(4) {
                    mailbox.lock().unwrap().push(l);
                } else {
                    live.push(l);
                }
                if live.len() > 32 {
                    let l = live.swap_remove((x as usize >> 8) % live.len());
                    verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern");
                    if x.is_multiple_of(9) {
                        alloc.record_stream(l.ptr, 99).expect("record_stream");
                    }
                    alloc.free(l.ptr).expect("free of a live pointer");
                }
                let taken = mailbox.lock().unwrap().pop();
                if let Some(l) = taken {
                    verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern");
                    alloc.free(l.ptr).expect("cross-thread free");
                }
                if i.is_multiple_of(256) {
                    dev.complete_all();
                    alloc.process_events();
                }
            }
            live
        }));
    }
    let reclaimer = {
        let (dev, alloc, stop) = (dev.clone(), alloc.clone(), stop.clone());
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                dev.complete_all();
                alloc.empty_cache();
                alloc
                    .empty_pool_cache(shared)
                    .expect("empty the shared pool");
                thread::yield_now();
            }
        })
    };
    let cycler = {
        let (dev, alloc, stop) = (dev.clone(), alloc.clone(), stop.clone());
        thread::spawn(move || {
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                k += 1;
                let pool = PoolId(0, 100 + k % 3);
                alloc
                    .create_or_incref_pool(pool, PoolOptions::default())
                    .expect("create a short-lived pool");
                let ptrs: Vec<(u64, u64)> = (0..4)
                    .map(|j| {
                        let size = size_of(k * 31 + j);
                        let p = alloc.alloc_in(pool, size, 50 + j % 2).expect("alloc");
                        fill_probes(&dev, p, size, k << 8 | j);
                        (p, size)
                    })
                    .collect();
                alloc
                    .empty_pool_cache(pool)
                    .expect("empty the short-lived pool");
                for (j, &(p, size)) in ptrs.iter().enumerate() {
                    verify_probes(&dev, p, size, k << 8 | j as u64).expect("pattern");
                    alloc.free(p).expect("free in a short-lived pool");
                }
                alloc.release_pool(pool).expect("release");
            }
        })
    };
    let restorer = {
        let (dev, alloc, stop) = (dev.clone(), alloc.clone(), stop.clone());
        thread::spawn(move || {
            let mut rng = Rng(0xD1B5_4A32_D192_ED03);
            let mut live: Vec<Live> = Vec::new();
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rounds += 1;
                let x = rng.next();
                for j in 0..(x % 6) {
                    let size = size_of(x >> j);
                    let ptr = alloc.alloc_in(own, size, 70 + j % 2).expect("alloc");
                    fill_probes(&dev, ptr, size, rounds << 8 | j);
                    live.push(Live {
                        ptr,
                        size,
                        seed: rounds << 8 | j,
                        stream: 70 + j % 2,
                    });
                }
                let at_cp: BTreeSet<u64> = live.iter().map(|l| l.ptr).collect();
                let cp = alloc.checkpoint(own).expect("checkpoint");
                // Frees and allocations since the checkpoint.
                let mut made_since = BTreeSet::new();
                for j in 0..(x >> 8) % 5 {
                    if !live.is_empty() && j % 2 == 0 {
                        let l = live.swap_remove((x >> (16 + j)) as usize % live.len());
                        alloc.free(l.ptr).expect("free");
                        made_since.remove(&l.ptr);
                    } else {
                        let size = size_of(x >> (24 + j));
                        let ptr = alloc.alloc_in(own, size, 70).expect("alloc");
                        live.push(Live {
                            ptr,
                            size,
                            seed: 0,
                            stream: 70,
                        });
                        made_since.insert(ptr);
                    }
                }
                let delta = alloc.restore(own, &cp, &[]).expect("restore");
                let freed: BTreeSet<u64> = delta.freed.iter().map(|x| x.0).collect();
                let created: BTreeSet<u64> = delta.created.iter().map(|x| x.0).collect();
                // An address freed and taken again since is both freed and re-created.
                let now: BTreeSet<u64> = live.iter().map(|l| l.ptr).collect();
                let want_freed: BTreeSet<u64> = now.difference(&at_cp).copied().collect();
                assert!(want_freed.is_subset(&freed), "{delta:?}");
                assert!(freed.is_subset(&made_since), "{delta:?}");
                assert!(created.is_subset(&at_cp), "{delta:?}");
                assert!(
                    at_cp.difference(&now).all(|p| created.contains(p)),
                    "{delta:?}"
                );
                let back: BTreeSet<u64> = alloc
                    .live_allocations(own)
                    .unwrap()
                    .into_iter()
                    .map(|x| x.0)
                    .collect();
                assert_eq!(back, at_cp, "the pool's live set after the restore");
                // An address freed and allocated again since holds another allocation: the
                // restore frees that one and re-creates the checkpoint's.
                for p in made_since.intersection(&at_cp) {
                    assert!(
                        freed.contains(p) && created.contains(p),
                        "{p:#x}: {delta:?}"
                    );
                }
                drop(cp);
                // The caller owns the checkpoint's allocations again, at their sizes then.
                live = at_cp
                    .iter()
                    .map(|&ptr| {
                        let (_, size, _) = alloc.allocation_info(ptr).expect("live after restore");
                        let seed = rounds << 20 | (ptr >> 9 & 0xfffff);
                        fill_probes(&dev, ptr, size, seed);
                        Live {
                            ptr,
                            size,
                            seed,
                            stream: 70,
                        }
                    })
                    .collect();
                while live.len() > 12 {
                    let l = live.pop().unwrap();
                    alloc.free(l.ptr).expect("free");
                }
            }
            live
        })
    };
    thread::sleep(duration());
    stop.store(true, Ordering::Relaxed);
    let mut live = Vec::new();
    for h in handles {
        live.extend(h.join().expect("worker panicked"));
    }
    reclaimer.join().expect("reclaimer panicked");
    cycler.join().expect("cycler panicked");
    live.extend(restorer.join().expect("restorer panicked"));
    live.extend(mailbox.lock().unwrap().drain(..));
    settle(&dev, &alloc, live, &[shared, own], TOTAL);
}

#[test]
fn reclaim_release_and_restores_race_allocation_vmm() {
    everything_races(GrowthMode::Vmm);
}

#[test]
fn reclaim_release_and_restores_race_allocation_classic() {
    everything_races(GrowthMode::Classic);
}
