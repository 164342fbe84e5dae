//! Model test of arenas: random sequences of create / alloc / free / reserve / destroy over
//! several arenas, pools, branches and slots, with refused calls, injected device failures and
//! real out-of-memory, interleaved with ordinary allocations. After every step the allocator is
//! compared with a shadow model of each arena (slots, live (branch, slot) pairs and their sizes,
//! pages), its invariants are checked, reserved bytes must equal the arenas' pages plus the
//! shards' memory (in the statistics and the snapshot), a refused call must change no statistic,
//! and every live allocation must keep its bytes, except where the design lets another branch
//! alias it: slots of different branches share addresses, so an allocation's bytes are only
//! promised until another branch allocates an overlapping range.

use std::collections::BTreeMap;

use proptest::prelude::*;
use slotpool::core::{
    AllocError, Allocator, ArenaId, Config, GrowthMode, PoolId, PoolOptions, block::BlockState,
};
use slotpool::sim::{Backing, CallKind, SimConfig, SimDevice};

use crate::common::{Live, MIB, check_all, fill_probes, verify_probes};

const PAGE: u64 = 2 * MIB;
const TOTAL: u64 = 96 * MIB;
const CAPACITY: u64 = 48 * MIB;
const BRANCHES: u32 = 4;
const SLOTS: u32 = 6;
const MIN_BLOCK: u64 = 512;
/// Pools arenas live in: the default pool, one the test holds a use of throughout, and one whose
/// uses the sequence takes and gives back.
const POOLS: [PoolId; 3] = [PoolId::DEFAULT, PoolId(0, 61), PoolId(0, 62)];
const HELD: PoolId = POOLS[1];
const LOOSE: PoolId = POOLS[2];

#[derive(Clone, Debug)]
enum Op {
    Create {
        pool: usize,
        stream: u64,
    },
    Alloc {
        arena: usize,
        branch: u32,
        slot: u32,
        size: u64,
        fail: Fail,
    },
    Free {
        arena: usize,
        branch: u32,
        slot: u32,
    },
    Reserve {
        arena: usize,
        slot: u32,
        size: u64,
    },
    Destroy {
        arena: usize,
    },
    Debug {
        arena: usize,
        on: bool,
    },
    Plain {
        size: u64,
        held_pool: bool,
    },
    PlainFree {
        pick: usize,
    },
    LoosePool {
        take: bool,
    },
    EmptyCache,
}

/// A device failure injected for the duration of one arena allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fail {
    None,
    CreatePage,
    Map,
}

fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 1u64..=MIB,
        4 => MIB..=6 * MIB,
        1 => 8 * MIB..=20 * MIB,
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let fail =
        prop_oneof![6 => Just(Fail::None), 1 => Just(Fail::CreatePage), 1 => Just(Fail::Map)];
    prop_oneof![
        2 => (0..POOLS.len(), 0u64..3).prop_map(|(pool, stream)| Op::Create { pool, stream }),
        12 => (0..4usize, 0..BRANCHES, 0..SLOTS, size(), fail).prop_map(
            |(arena, branch, slot, size, fail)| Op::Alloc { arena, branch, slot, size, fail }),
        9 => (0..4usize, 0..BRANCHES, 0..SLOTS)
            .prop_map(|(arena, branch, slot)| Op::Free { arena, branch, slot }),
        1 => (0..4usize, 0..SLOTS, size()).prop_map(|(arena, slot, size)| Op::Reserve { arena, slot, size }),
        2 => (0..4usize).prop_map(|arena| Op::Destroy { arena }),
        1 => (0..4usize, any::<bool>()).prop_map(|(arena, on)| Op::Debug { arena, on }),
        3 => (size(), any::<bool>()).prop_map(|(size, held_pool)| Op::Plain { size, held_pool }),
        2 => any::<usize>().prop_map(|pick| Op::PlainFree { pick }),
        1 => any::<bool>().prop_map(|take| Op::LoosePool { take }),
        1 => Just(Op::EmptyCache),
    ]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Slot {
    offset: u64,
    size: u64,
}

/// One live arena allocation: requested size, pattern seed, and whether another branch has since
/// allocated over it (its bytes are then no longer promised).
#[derive(Clone, Copy, Debug)]
struct LiveSlot {
    size: u64,
    seed: u64,
    aliased: bool,
}

/// The shadow of one arena.
#[derive(Debug)]
struct Model {
    id: ArenaId,
    pool: PoolId,
    base: u64,
    end: u64,
    pages: u64,
    slots: BTreeMap<u32, Slot>,
    live: BTreeMap<(u32, u32), LiveSlot>,
    debug: bool,
    relocations: u64,
    overlaps: usize,
}

/// What the model expects of a placement.
enum Expect {
    Ok { slot: Slot, end: u64, moved: bool },
    Refused,
    Oom,
}

impl Model {
    fn round(size: u64) -> u64 {
        size.div_ceil(MIN_BLOCK) * MIN_BLOCK
    }

    /// Placement of `slot` for `size`, as docs/design.md describes it.
    fn place(&self, slot: u32, size: u64) -> Expect {
        let size = Self::round(size);
        let have = self.slots.get(&slot).copied();
        let (offset, moved) = match have {
            Some(s) if s.size >= size => (s.offset, false),
            Some(s) if s.offset + s.size == self.end => (s.offset, false),
            Some(_) => (self.end, true),
            None => (self.end, false),
        };
        if moved && self.live.keys().any(|&(_, s)| s == slot) {
            return Expect::Refused;
        }
        let size = size.max(have.map_or(0, |s| s.size));
        if offset + size > CAPACITY {
            return Expect::Oom;
        }
        Expect::Ok {
            slot: Slot { offset, size },
            end: self.end.max(offset + size),
            moved,
        }
    }

    /// Another branch's live allocation that `[offset, offset + len)` overlaps.
    fn clash(&self, branch: u32, offset: u64, len: u64) -> bool {
        self.live.iter().any(|(&(b, s), l)| {
            let o = self.slots[&s].offset;
            b != branch && o < offset + len && offset < o + l.size
        })
    }

    /// Mark every live allocation of another branch over `[offset, offset + len)` as aliased.
    fn alias(&mut self, branch: u32, offset: u64, len: u64) {
        let slots = &self.slots;
        for (&(b, s), l) in self.live.iter_mut() {
            let o = slots[&s].offset;
            if b != branch && o < offset + len && offset < o + l.size {
                l.aliased = true;
            }
        }
    }

    /// Live slots as the statistics count them: (allocations, bytes): one per slot live in any
    /// branch, of the largest size its branches asked for, rounded.
    fn held(&self) -> (i64, i64) {
        let mut largest: BTreeMap<u32, u64> = BTreeMap::new();
        for (&(_, s), l) in &self.live {
            let e = largest.entry(s).or_default();
            *e = (*e).max(l.size);
        }
        let bytes = largest.values().map(|&r| Self::round(r) as i64).sum();
        (largest.len() as i64, bytes)
    }
}

struct World {
    dev: std::sync::Arc<SimDevice>,
    a: Allocator<SimDevice>,
    arenas: Vec<Model>,
    plain: Vec<Live>,
    loose_uses: u64,
    seed: u64,
    last_peak: i64,
    /// The last refused call ran out of memory (and so may have reclaimed the cache).
    reclaimed: bool,
}

/// What a refused call must leave unchanged.
fn state(w: &World) -> (BTreeMap<String, i64>, u64, String, u64, usize) {
    (
        w.a.stats().to_flat_map(),
        w.a.held_bytes(),
        format!("{:?}", w.a.snapshot()),
        w.dev.physical_bytes(),
        w.dev.page_count(),
    )
}

impl World {
    fn new() -> World {
        let dev = std::sync::Arc::new(
            SimDevice::new(SimConfig {
                total_memory: TOTAL,
                page_size: PAGE,
                backing: Backing::Bytes,
                auto_complete: true,
            })
            .expect("sim"),
        );
        let config = Config {
            growth: GrowthMode::Vmm,
            vmm_reservation: Some(CAPACITY),
            ..Config::default()
        };
        let a = Allocator::new(dev.clone(), config);
        a.create_or_incref_pool(HELD, PoolOptions::default())
            .unwrap();
        World {
            dev,
            a,
            arenas: Vec::new(),
            plain: Vec::new(),
            loose_uses: 0,
            seed: 1,
            last_peak: 0,
            reclaimed: false,
        }
    }

    /// Unmapped pages in the device's pool.
    fn pool_pages(&self) -> u64 {
        // (A page may be mapped at several addresses: pooled pages are those mapped nowhere.)
        self.dev.unmapped_page_count() as u64
    }

    /// Whether the growth that `expect` needs fits (before the call): pooled pages first, then
    /// new ones within the device. `reclaims`: the call reclaims the device's cache when it
    /// runs out (an allocation), so growth that fits only beside the allocated bytes may or
    /// may not fit (`None`: the model does not know how much of the cache is reclaimable).
    fn fits(&self, i: usize, expect: &Expect, fail: Fail, reclaims: bool) -> Option<bool> {
        let Expect::Ok { end, .. } = *expect else {
            return Some(true);
        };
        let need = end.div_ceil(PAGE).saturating_sub(self.arenas[i].pages);
        if need == 0 {
            return Some(true);
        }
        let fresh = need.saturating_sub(self.pool_pages());
        match fail {
            Fail::Map => Some(false),
            // Reclaiming may free idle pages that need no creation.
            Fail::CreatePage if fresh > 0 => (!reclaims).then_some(false),
            _ if self.a.held_bytes() + fresh * PAGE <= TOTAL => Some(true),
            _ if reclaims && self.a.allocated_bytes() + fresh * PAGE <= TOTAL => None,
            _ => Some(false),
        }
    }

    fn arena_uses(&self, pool: PoolId) -> u64 {
        self.arenas.iter().filter(|m| m.pool == pool).count() as u64
    }

    fn step(&mut self, op: &Op) {
        let before = state(self);
        self.reclaimed = false;
        let refused = match *op {
            Op::Create { pool, stream } => {
                if self.arenas.len() >= 3 {
                    return;
                }
                let pool = POOLS[pool];
                let id = self.a.arena_create(pool, stream).unwrap();
                let base = self.a.arena_report(id).unwrap().base;
                self.arenas.push(Model {
                    id,
                    pool,
                    base,
                    end: 0,
                    pages: 0,
                    slots: BTreeMap::new(),
                    live: BTreeMap::new(),
                    debug: false,
                    relocations: 0,
                    overlaps: 0,
                });
                assert_eq!(self.a.arena_stream(id).unwrap(), stream);
                false
            }
            Op::Alloc {
                arena,
                branch,
                slot,
                size,
                fail,
            } => {
                if self.arenas.is_empty() {
                    return;
                }
                let i = arena % self.arenas.len();
                self.alloc(i, branch, slot, size, fail)
            }
            Op::Free {
                arena,
                branch,
                slot,
            } => {
                if self.arenas.is_empty() {
                    return;
                }
                let n = self.arenas.len();
                let m = &mut self.arenas[arena % n];
                let r = self.a.arena_free(m.id, branch, slot);
                match m.live.remove(&(branch, slot)) {
                    Some(_) => {
                        r.unwrap();
                        false
                    }
                    None => {
                        assert!(matches!(r, Err(AllocError::InvalidState(_))), "{r:?}");
                        true
                    }
                }
            }
            Op::Reserve { arena, slot, size } => {
                if self.arenas.is_empty() {
                    return;
                }
                let i = arena % self.arenas.len();
                let m = &self.arenas[i];
                let expect = m.place(slot, size);
                let fits = self.fits(i, &expect, Fail::None, false);
                let r = self.a.arena_reserve_slot(m.id, slot, size);
                self.settle(
                    i,
                    slot,
                    expect,
                    r.map(|off| self.arenas[i].base + off),
                    fits,
                )
            }
            Op::Destroy { arena } => {
                if self.arenas.is_empty() {
                    return;
                }
                let i = arena % self.arenas.len();
                let r = self.a.arena_destroy(self.arenas[i].id);
                if self.arenas[i].live.is_empty() {
                    r.unwrap();
                    let m = self.arenas.remove(i);
                    assert!(self.a.arena_report(m.id).is_err());
                    false
                } else {
                    assert!(matches!(r, Err(AllocError::InvalidState(_))), "{r:?}");
                    true
                }
            }
            Op::Debug { arena, on } => {
                if self.arenas.is_empty() {
                    return;
                }
                let n = self.arenas.len();
                let m = &mut self.arenas[arena % n];
                self.a.arena_set_debug(m.id, on).unwrap();
                m.debug = on;
                true
            }
            Op::Plain { size, held_pool } => {
                let r = if held_pool {
                    self.a.alloc_in(HELD, size, 0)
                } else {
                    self.a.alloc(size, 1)
                };
                match r {
                    Ok(ptr) => {
                        self.seed += 1;
                        fill_probes(&self.dev, ptr, size, self.seed);
                        self.plain.push(Live {
                            ptr,
                            size,
                            seed: self.seed,
                            stream: 0,
                        });
                    }
                    Err(e) => assert!(matches!(e, AllocError::OutOfMemory(_)), "{e}"),
                }
                false
            }
            Op::PlainFree { pick } => {
                if self.plain.is_empty() {
                    return;
                }
                let l = self.plain.swap_remove(pick % self.plain.len());
                self.a.free(l.ptr).unwrap();
                false
            }
            Op::LoosePool { take } => {
                if take {
                    let n = self
                        .a
                        .create_or_incref_pool(LOOSE, PoolOptions::default())
                        .unwrap();
                    self.loose_uses += 1;
                    assert_eq!(n, self.loose_uses + self.arena_uses(LOOSE));
                } else if self.loose_uses > 0 {
                    let n = self.a.release_pool(LOOSE).unwrap();
                    self.loose_uses -= 1;
                    assert_eq!(n, self.loose_uses + self.arena_uses(LOOSE));
                }
                false
            }
            Op::EmptyCache => {
                self.a.empty_cache();
                false
            }
        };
        if refused && self.reclaimed {
            // Out of memory reclaimed the device's cache first: the live figures stay.
            let live =
                |s: &(BTreeMap<String, i64>, u64, String, u64, usize)| -> Vec<(String, i64)> {
                    s.0.iter()
                        .filter(|(k, _)| {
                            k.ends_with(".current")
                                && [
                                    "allocation.",
                                    "allocated_bytes.",
                                    "requested_bytes.",
                                    "active",
                                ]
                                .iter()
                                .any(|p| k.starts_with(p))
                        })
                        .map(|(k, v)| (k.clone(), *v))
                        .collect()
                };
            assert_eq!(
                live(&before),
                live(&state(self)),
                "refused {op:?} changed live figures"
            );
        } else if refused {
            let after = state(self);
            assert!(
                before == after,
                "refused {op:?} changed the statistics or the state"
            );
        }
        self.check();
    }

    fn alloc(&mut self, i: usize, branch: u32, slot: u32, size: u64, fail: Fail) -> bool {
        let m = &self.arenas[i];
        let mut expect = if m.live.contains_key(&(branch, slot)) {
            Expect::Refused
        } else {
            m.place(slot, size)
        };
        let clash = match expect {
            Expect::Ok { slot: s, .. } => m.debug && m.clash(branch, s.offset, size),
            _ => false,
        };
        if clash {
            expect = Expect::Refused;
        }
        let kind = match fail {
            Fail::None => None,
            Fail::CreatePage => Some(CallKind::CreatePage),
            Fail::Map => Some(CallKind::Map),
        };
        if let Some(k) = kind {
            self.dev.fail_all(k, true);
        }
        let fits = self.fits(i, &expect, fail, true);
        let r = self.a.arena_alloc(m.id, branch, slot, size);
        if let Some(k) = kind {
            self.dev.fail_all(k, false);
        }
        if clash {
            self.arenas[i].overlaps += 1;
        }
        let ok = matches!(expect, Expect::Ok { .. });
        let refused = self.settle(i, slot, expect, r, fits);
        if ok && !refused {
            self.seed += 1;
            let m = &mut self.arenas[i];
            let off = m.slots[&slot].offset;
            m.alias(branch, off, size);
            m.live.insert(
                (branch, slot),
                LiveSlot {
                    size,
                    seed: self.seed,
                    aliased: false,
                },
            );
            fill_probes(&self.dev, m.base + off, size, self.seed);
        }
        refused
    }

    /// Compare a placement's result with the model's expectation and apply it; whether the call
    /// was refused (changed nothing).
    fn settle(
        &mut self,
        i: usize,
        slot: u32,
        expect: Expect,
        r: Result<u64, AllocError>,
        fits: Option<bool>,
    ) -> bool {
        let m = &self.arenas[i];
        match expect {
            Expect::Refused => {
                assert!(matches!(r, Err(AllocError::InvalidState(_))), "{r:?}");
                true
            }
            Expect::Oom => {
                assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
                self.reclaimed = true;
                true
            }
            Expect::Ok {
                slot: s,
                end,
                moved,
            } => {
                match (fits, &r) {
                    (Some(false), _) | (None, Err(_)) => {
                        assert!(matches!(r, Err(AllocError::OutOfMemory(_))), "{r:?}");
                        self.reclaimed = true;
                        return true;
                    }
                    _ => {}
                }
                let ptr = r.unwrap_or_else(|e| panic!("model expected success: {e}"));
                assert_eq!(ptr, m.base + s.offset, "slot {slot} at its offset");
                let m = &mut self.arenas[i];
                m.slots.insert(slot, s);
                m.end = end;
                m.pages = m.pages.max(end.div_ceil(PAGE));
                m.relocations += u64::from(moved);
                false
            }
        }
    }

    fn check(&mut self) {
        check_all(&self.dev, &self.a, &self.plain);
        let st = self.a.stats();
        let reserved = st.reserved_bytes.all();
        assert_eq!(
            reserved.current as u64 + self.pool_pages() * PAGE,
            self.a.held_bytes(),
            "reserved current + pooled pages = held"
        );
        assert!(reserved.peak >= reserved.current && reserved.peak >= self.last_peak);
        self.last_peak = reserved.peak;
        let snap = self.a.snapshot();
        let total: u64 = snap.iter().map(|s| s.size).sum();
        assert_eq!(total, reserved.current as u64, "snapshot = reserved");
        let mut arena_bytes = 0;
        let mut arena_alloc = 0;
        for m in &self.arenas {
            let r = self.a.arena_report(m.id).unwrap();
            assert_eq!(
                (
                    r.size,
                    r.mapped,
                    r.slots,
                    r.relocations,
                    r.live,
                    r.overlaps.len()
                ),
                (
                    m.end,
                    m.pages * PAGE,
                    m.slots.len(),
                    m.relocations,
                    m.live.len(),
                    m.overlaps
                ),
                "arena {:?}",
                m.id
            );
            arena_bytes += m.pages * PAGE;
            let (n, bytes) = m.held();
            arena_alloc += bytes;
            let seg = snap.iter().find(|s| s.addr == m.base);
            assert_eq!(seg.map(|s| s.size), (m.pages > 0).then_some(m.pages * PAGE));
            if let Some(seg) = seg {
                assert_eq!(seg.pool, m.pool);
                let allocated: Vec<_> = seg
                    .blocks
                    .iter()
                    .filter(|b| b.state == BlockState::Allocated)
                    .collect();
                assert_eq!(allocated.len() as i64, n);
                assert_eq!(allocated.iter().map(|b| b.size as i64).sum::<i64>(), bytes);
            }
            for (&(b, s), l) in &m.live {
                if !l.aliased {
                    let p = m.base + m.slots[&s].offset;
                    if let Err(e) = verify_probes(&self.dev, p, l.size, l.seed) {
                        panic!("branch {b} slot {s} lost its bytes: {e}");
                    }
                }
            }
        }
        let shard_reserved: u64 = snap
            .iter()
            .filter(|s| !self.arenas.iter().any(|m| m.base == s.addr))
            .map(|s| s.size)
            .sum();
        assert_eq!(
            reserved.current as u64,
            arena_bytes + shard_reserved,
            "reserved = arena pages + the rest"
        );
        let plain: u64 = self
            .plain
            .iter()
            .map(|l| self.a.allocation_info(l.ptr).unwrap().1)
            .sum();
        assert_eq!(
            st.allocated_bytes.all().current,
            arena_alloc + plain as i64,
            "allocated = live arena slots + the rest"
        );
        for pool in [HELD, LOOSE] {
            let uses = self.arena_uses(pool) + if pool == HELD { 1 } else { self.loose_uses };
            match self.a.pool_use_count(pool) {
                Ok(n) => assert_eq!(n, uses, "uses of {pool}"),
                Err(_) => assert_eq!(uses, 0, "{pool} forgotten while in use"),
            }
            if self.arena_uses(pool) > 0 {
                let ps = self.a.pool_stats(pool).unwrap();
                let mine: u64 = self
                    .arenas
                    .iter()
                    .filter(|m| m.pool == pool)
                    .map(|m| m.pages * PAGE)
                    .sum();
                assert!(ps.reserved_bytes.all().current as u64 >= mine);
            }
        }
    }

    /// Free and destroy everything: the device must end empty.
    fn finish(mut self) {
        for m in std::mem::take(&mut self.arenas) {
            for &(b, s) in m.live.keys() {
                self.a.arena_free(m.id, b, s).unwrap();
            }
            self.a.arena_destroy(m.id).unwrap();
        }
        for l in std::mem::take(&mut self.plain) {
            self.a.free(l.ptr).unwrap();
        }
        self.a.empty_cache();
        self.a.check_invariants().unwrap();
        assert_eq!(self.a.stats().reserved_bytes.all().current, 0);
        assert_eq!(self.dev.physical_bytes(), 0);
        assert_eq!(self.dev.contract_violations(), 0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(48), ..ProptestConfig::default() })]

    #[test]
    fn arenas_follow_their_model(ops in proptest::collection::vec(op(), 1..160)) {
        let mut w = World::new();
        for op in &ops {
            w.step(op);
        }
        w.finish();
    }
}
