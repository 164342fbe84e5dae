//! Model check (loom) of the protocol between shard creation, shard retirement, checkpoints and
//! the segment registry. Run with
//! `RUSTFLAGS="--cfg loom" cargo test -p slotpool-core --release --test loom_shards`
//! (`scripts/test.sh` does, in its own target directory).
//!
//! The allocator's own locks are not swapped for loom's (the shard lock is a spin lock inside a
//! 128-byte-aligned cell, the thread's cached shard a thread-local, the registry holds `Weak`s,
//! which loom's `Arc` lacks): this is a model of the protocol with the same locks, the same lock
//! order and the same state transitions as `allocator/`, each step named after the code it
//! stands for:
//!
//! - `shard_for` / `refresh_shard` / `shard_for_slow`: the thread's cached shard while the
//!   table's generation is unchanged, else the table's (created if missing) under its lock;
//! - `alloc_on` + `Shard::alloc_uncached` + `register_segments`: lock the shard; a retired one
//!   answers `Retired` and the thread looks its (pool, stream) up again; else a segment is added
//!   and registered under the shard's lock;
//! - `with_registered_owner` + `Shard::free`: the registry (read lock) names the owner, whose
//!   lock is taken next;
//! - `empty_cache`: under `reclaim`, release each shard's free segments (unregistering them
//!   under the shard's lock; never while a live checkpoint marks it), then `drop_empty_shards`:
//!   under the table's lock, each shard's lock, retire and forget the empty, unmarked ones and
//!   bump the generation;
//! - `checkpoint` / `restore` / dropping a `Checkpoint`: under `reclaim`, mark each of the pool's
//!   shards; a restore needs every marked shard still in the table.
//!
//! The table is a `BTreeMap` where the allocator's is an `FxHashMap`: loom replays each
//! interleaving and needs the same iteration order every time (the order is no part of the
//! protocol). The registry's `Weak` owner is modelled as a strong reference plus the retired mark: a
//! segment whose owner is retired is one the real registry loses (its `Weak` dies with the
//! thread's cache, its shard is in no table, so statistics and `check_invariants` miss it).
//! The negative tests run the same model without the retired mark, and without keeping marked
//! shards, and require loom to find the failure each fix closes.
#![cfg(loom)]

use std::collections::BTreeMap;

use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::{Arc, Mutex, RwLock};
use loom::thread;

#[derive(Default)]
struct Shard {
    /// (address, live): one block per segment.
    segments: Vec<(u64, bool)>,
    retired: bool,
    /// Live checkpoints that marked this shard.
    marks: usize,
}

struct Cell {
    shard: Mutex<Shard>,
}

type CellRef = Arc<Cell>;

/// Which parts of the protocol are on.
#[derive(Clone, Copy)]
struct Protocol {
    /// Allocation checks the retired mark under the shard's lock.
    retired_mark: bool,
    /// `drop_empty_shards` keeps the shards a live checkpoint marked.
    keep_marked: bool,
}

const FIXED: Protocol = Protocol {
    retired_mark: true,
    keep_marked: true,
};

struct Allocator {
    protocol: Protocol,
    reclaim: Mutex<()>,
    shards: Mutex<BTreeMap<u64, CellRef>>,
    generation: AtomicU64,
    registry: RwLock<BTreeMap<u64, CellRef>>,
    next_addr: AtomicU64,
}

/// A thread's cached shard: (generation, key, shard).
#[derive(Default)]
struct Cache(Option<(u64, u64, CellRef)>);

impl Allocator {
    fn new(protocol: Protocol) -> Self {
        Allocator {
            protocol,
            reclaim: Mutex::new(()),
            shards: Mutex::new(BTreeMap::new()),
            generation: AtomicU64::new(0),
            registry: RwLock::new(BTreeMap::new()),
            next_addr: AtomicU64::new(1),
        }
    }

    fn shard_for_slow(&self, key: u64) -> CellRef {
        let mut table = self.shards.lock().unwrap();
        table
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Cell {
                    shard: Mutex::new(Shard::default()),
                })
            })
            .clone()
    }

    fn refresh_shard(&self, cache: &mut Cache, key: u64) -> CellRef {
        let generation = self.generation.load(Ordering::Acquire);
        let cell = self.shard_for_slow(key);
        cache.0 = Some((generation, key, cell.clone()));
        cell
    }

    fn shard_for(&self, cache: &mut Cache, key: u64) -> CellRef {
        let generation = self.generation.load(Ordering::Acquire);
        if let Some((g, k, cell)) = &cache.0
            && *g == generation
            && *k == key
        {
            return cell.clone();
        }
        self.refresh_shard(cache, key)
    }

    /// An allocation that grows the shard of `key` by a segment; returns its address.
    fn alloc(&self, cache: &mut Cache, key: u64) -> u64 {
        let mut cell = self.shard_for(cache, key);
        loop {
            let mut s = cell.shard.lock().unwrap();
            if self.protocol.retired_mark && s.retired {
                drop(s);
                cell = self.refresh_shard(cache, key);
                continue;
            }
            let addr = self.next_addr.fetch_add(1, Ordering::Relaxed);
            s.segments.push((addr, true));
            self.registry.write().unwrap().insert(addr, cell.clone());
            return addr;
        }
    }

    /// A free from any thread, through the registry.
    fn free(&self, addr: u64) {
        let cell = self
            .registry
            .read()
            .unwrap()
            .get(&addr)
            .cloned()
            .expect("a live pointer is registered");
        let mut s = cell.shard.lock().unwrap();
        assert!(
            !s.retired,
            "segment {addr} lives in a shard that no table has: its free fails"
        );
        let seg = s
            .segments
            .iter_mut()
            .find(|x| x.0 == addr)
            .expect("the owner holds the segment");
        assert!(seg.1, "double free in the model");
        seg.1 = false;
    }

    /// Release every free segment of unmarked shards (the OOM ladder's step 3: no shard is
    /// forgotten).
    fn release_cached(&self, _reclaim: &loom::sync::MutexGuard<'_, ()>) {
        let cells: Vec<CellRef> = self.shards.lock().unwrap().values().cloned().collect();
        for cell in cells {
            let mut s = cell.shard.lock().unwrap();
            if s.marks > 0 {
                continue;
            }
            let mut reg = self.registry.write().unwrap();
            s.segments.retain(|&(addr, live)| {
                if !live {
                    reg.remove(&addr);
                }
                live
            });
        }
    }

    fn drop_empty_shards(&self, _reclaim: &loom::sync::MutexGuard<'_, ()>) {
        let mut table = self.shards.lock().unwrap();
        let before = table.len();
        table.retain(|_, cell| {
            let mut s = cell.shard.lock().unwrap();
            if !s.segments.is_empty() || (self.protocol.keep_marked && s.marks > 0) {
                return true;
            }
            s.retired = true;
            false
        });
        if table.len() != before {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    fn empty_cache(&self) {
        let reclaim = self.reclaim.lock().unwrap();
        self.release_cached(&reclaim);
        self.drop_empty_shards(&reclaim);
    }

    /// Mark every shard; returns the marked shards.
    fn checkpoint(&self) -> Vec<CellRef> {
        let _reclaim = self.reclaim.lock().unwrap();
        let cells: Vec<CellRef> = self.shards.lock().unwrap().values().cloned().collect();
        for cell in &cells {
            cell.shard.lock().unwrap().marks += 1;
        }
        cells
    }

    fn restore(&self, marks: &[CellRef]) {
        let _reclaim = self.reclaim.lock().unwrap();
        let table = self.shards.lock().unwrap();
        for cell in marks {
            assert!(
                table.values().any(|c| Arc::ptr_eq(c, cell)),
                "a marked shard no longer exists"
            );
        }
    }

    fn drop_checkpoint(&self, marks: Vec<CellRef>) {
        for cell in marks {
            cell.shard.lock().unwrap().marks -= 1;
        }
    }

    /// `check_invariants` 1, the registry half: every registered segment's owner is in the
    /// table and holds it, and every segment of a shard in the table is registered.
    fn check(&self) {
        let table = self.shards.lock().unwrap();
        let reg = self.registry.read().unwrap();
        let mut in_shards = 0;
        for cell in table.values() {
            let s = cell.shard.lock().unwrap();
            assert!(!s.retired, "a retired shard in the table");
            for &(addr, _) in &s.segments {
                let owner = reg.get(&addr).expect("a shard's segment is registered");
                assert!(Arc::ptr_eq(owner, cell), "registered under another shard");
                in_shards += 1;
            }
        }
        assert_eq!(
            reg.len(),
            in_shards,
            "segments registered outside the table"
        );
    }
}

fn builder() -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    if std::env::var("LOOM_MAX_PREEMPTIONS").is_err() {
        b.preemption_bound = Some(if std::env::var("SLOTPOOL_HEAVY").as_deref() == Ok("1") {
            4
        } else {
            3
        });
    }
    b
}

/// One thread allocates on two new streams (new shards) and frees the first; another empties
/// the cache; the main thread then frees the second (a cross-thread free), empties the cache,
/// and the table and the registry must both be empty.
fn new_shards_race_empty_cache(protocol: Protocol) {
    builder().check(move || {
        let a = Arc::new(Allocator::new(protocol));
        let t1 = {
            let a = a.clone();
            thread::spawn(move || {
                let mut cache = Cache::default();
                let p = a.alloc(&mut cache, 1);
                let q = a.alloc(&mut cache, 2);
                a.free(p);
                q
            })
        };
        let t2 = {
            let a = a.clone();
            thread::spawn(move || a.empty_cache())
        };
        let q = t1.join().unwrap();
        t2.join().unwrap();
        a.check();
        a.free(q);
        a.empty_cache();
        a.check();
        assert!(a.shards.lock().unwrap().is_empty());
        assert!(a.registry.read().unwrap().is_empty());
    });
}

/// Two threads allocate on one stream while a third empties the cache: the shard may be
/// retired and made again between them, never with a segment outside the table.
fn one_shard_two_threads(protocol: Protocol) {
    builder().check(move || {
        let a = Arc::new(Allocator::new(protocol));
        let workers: Vec<_> = (0..2)
            .map(|_| {
                let a = a.clone();
                thread::spawn(move || {
                    let mut cache = Cache::default();
                    let p = a.alloc(&mut cache, 1);
                    a.free(p);
                })
            })
            .collect();
        a.empty_cache();
        for w in workers {
            w.join().unwrap();
        }
        a.check();
        a.empty_cache();
        a.check();
        assert!(a.registry.read().unwrap().is_empty());
    });
}

/// A shard emptied by reclaim (still in the table) is checkpointed and restored while another
/// thread empties the cache and a third allocates on it.
fn checkpoint_races_empty_cache(protocol: Protocol) {
    builder().check(move || {
        let a = Arc::new(Allocator::new(protocol));
        let mut cache = Cache::default();
        let p = a.alloc(&mut cache, 1);
        a.free(p);
        {
            let reclaim = a.reclaim.lock().unwrap();
            a.release_cached(&reclaim);
        }
        let t1 = {
            let a = a.clone();
            thread::spawn(move || {
                let cp = a.checkpoint();
                a.restore(&cp);
                a.drop_checkpoint(cp);
            })
        };
        let t2 = {
            let a = a.clone();
            thread::spawn(move || a.empty_cache())
        };
        let p = a.alloc(&mut cache, 1);
        t1.join().unwrap();
        t2.join().unwrap();
        a.check();
        a.free(p);
        a.empty_cache();
        a.check();
        assert!(a.shards.lock().unwrap().is_empty());
    });
}

#[test]
fn new_shards_race_empty_cache_safely() {
    new_shards_race_empty_cache(FIXED);
}

#[test]
fn one_shard_serves_two_threads_across_empty_cache() {
    one_shard_two_threads(FIXED);
}

#[test]
fn checkpoints_keep_their_shards_across_empty_cache() {
    checkpoint_races_empty_cache(FIXED);
}

/// Whether the model fails: loom reports the first failing interleaving as a panic.
fn fails(f: impl FnOnce() + std::panic::UnwindSafe) -> bool {
    std::panic::catch_unwind(f).is_err()
}

/// Without the retired mark (the protocol before it), loom finds the interleaving in which a
/// segment lands in a forgotten shard.
#[test]
fn without_the_retired_mark_a_segment_is_lost() {
    let old = Protocol {
        retired_mark: false,
        ..FIXED
    };
    assert!(fails(|| new_shards_race_empty_cache(old)));
}

/// Without keeping marked shards, loom finds the interleaving in which a restore's shard was
/// forgotten.
#[test]
fn without_keeping_marked_shards_a_checkpoint_goes_stale() {
    let old = Protocol {
        keep_marked: false,
        ..FIXED
    };
    assert!(fails(|| checkpoint_races_empty_cache(old)));
}
