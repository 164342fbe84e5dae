//! The shadow model of a C ABI sequence: what is live (with its pool, sizes and byte pattern),
//! which checkpoints, deltas, variant groups, arenas and routes exist, and each pool's use count.
//! [`Model::step`] runs one operation through the C ABI and updates the model; [`Model::check`]
//! compares the library with it; a bad call must return its code with a message and leave the
//! statistics, the pools and the snapshot exactly as they were.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr::{null, null_mut};

use slotpool::*;

use crate::common::*;
use crate::ops::{Op, POOLS, STREAMS};

mod bad;
mod check;
mod pattern;
mod pressure;

use pattern::{fill, verify};
pub use pressure::CAPACITY;
use pressure::{Limits, WINDOWED};

/// Devices the sequence uses; pools, checkpoints, groups, arenas and routes live on device 0.
pub const DEVICES: i32 = 2;
const INVALID: sp_status = sp_status::SP_ERR_INVALID_ARGUMENT;
const STATE: sp_status = sp_status::SP_ERR_INVALID_STATE;
const UNKNOWN_PTR: sp_status = sp_status::SP_ERR_UNKNOWN_POINTER;
const UNKNOWN_POOL: sp_status = sp_status::SP_ERR_UNKNOWN_POOL;

#[derive(Clone, Debug)]
struct Live {
    /// Identity of the allocation: a re-created one keeps its id.
    id: u64,
    ptr: usize,
    dev: i32,
    /// Index into `Model::pools`; `None`: the default pool.
    pool: Option<usize>,
    requested: usize,
    rounded: usize,
    /// The stream it was allocated on.
    stream: u64,
    seed: u64,
}

impl Live {
    /// Whether only windows of it hold the pattern (a large allocation: host memory).
    fn windowed(&self) -> bool {
        self.requested >= WINDOWED
    }
}

struct Cp {
    handle: usize,
    pool: usize,
    live: Vec<Live>,
    /// `Model::ooms` when it was taken.
    ooms: u64,
}

struct Group {
    handle: usize,
    /// `Model::ooms` when it was created.
    ooms: u64,
    pool: usize,
    count: usize,
    base: Vec<Live>,
    active: bool,
}

struct Arena {
    id: u64,
    /// slot -> (address, size, seed); branch 0 only, so no two live slots alias.
    slots: BTreeMap<u32, (usize, usize, u64)>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Checkpoint,
    Delta,
    Group,
    Snapshot,
}

/// Every kind of handle.
const KINDS: [Kind; 4] = [Kind::Checkpoint, Kind::Delta, Kind::Group, Kind::Snapshot];

/// Everything a refused call must leave unchanged.
#[derive(PartialEq, Debug)]
struct State {
    device: Vec<sp_memory_stats>,
    pools: Vec<(sp_memory_stats, u64)>,
    snapshot: String,
}

pub struct Model {
    pools: [sp_pool_id; POOLS],
    uses: [u64; POOLS],
    arena_pool: sp_pool_id,
    live: Vec<Live>,
    /// Pointers freed earlier (some may be live again).
    freed: Vec<usize>,
    cps: Vec<Cp>,
    deltas: Vec<usize>,
    groups: Vec<Group>,
    /// Live `sp_snapshot` handles.
    snapshots: Vec<usize>,
    arenas: Vec<Arena>,
    /// (pool, stream; `None`: every allocation of device 0), oldest first.
    routes: Vec<(usize, Option<u64>)>,
    /// Freed handles.
    stale: Vec<(Kind, usize)>,
    next_id: u64,
    next_seed: u64,
    /// (allocations, requested, allocated bytes) of each device and of device 0's default pool
    /// when the sequence began: what sequences before it left behind (nothing, unless one failed).
    baseline: Vec<(i64, i64, i64)>,
    pub refused: u64,
    /// Limits the sequence set (see `pressure.rs`).
    limits: Limits,
    /// The vmm page size; `None`: classic growth.
    vmm_page: Option<usize>,
    /// Calls answered `SP_ERR_OUT_OF_MEMORY`.
    pub ooms: u64,
    /// Allocations the model knew must succeed under a limit.
    pub certain: u64,
    /// Restores and variant begins of checkpoints taken before an out-of-memory answer.
    pub after_pressure: u64,
    /// A checkpoint, variant group or arena was made on device 0 (see `Model::must`).
    retains: bool,
}

fn pool_id(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

/// Calls made on handles: `call % CALLS` picks one.
const CALLS: u8 = 17;

/// Calls `call` on handle `h` (0..=2: checkpoint free / restore / info; 3..=7: delta free /
/// freed / created / freed_count / created_count; 8..=10: group free / begin / end; 11..=16:
/// snapshot free / segment_count / segment / block / trace_count / trace); a count of 0 with a
/// message reads as `SP_ERR_INVALID_ARGUMENT`.
fn call_handle(call: u8, h: usize) -> sp_status {
    let (mut p, mut n) = (null_mut(), 0usize);
    let (mut dev, mut pool) = (0, pool_id(0));
    let mut seg = sp_segment_view::default();
    let mut block = sp_block_view::default();
    let mut event = sp_trace_event::default();
    let counted = |c: usize| {
        if c == 0 && !last_error().is_empty() {
            INVALID
        } else {
            sp_status::SP_OK
        }
    };
    // SAFETY: handles are tokens the library checks before use; out-pointers are valid.
    unsafe {
        match call % CALLS {
            0 => sp_checkpoint_free(h as *mut _),
            1 => sp_checkpoint_restore(h as *const _, null(), 0, null_mut()),
            2 => sp_checkpoint_info(h as *const _, &mut dev, &mut pool),
            3 => sp_delta_free(h as *mut _),
            4 => sp_delta_freed(h as *const _, 0, &mut p, &mut n),
            5 => sp_delta_created(h as *const _, 0, &mut p, &mut n),
            6 => counted(sp_delta_freed_count(h as *const _)),
            7 => counted(sp_delta_created_count(h as *const _)),
            8 => sp_variant_group_free(h as *mut _),
            9 => sp_variant_begin(h as *const _, 0, null_mut()),
            10 => sp_variant_end(h as *const _),
            11 => sp_snapshot_free(h as *mut _),
            12 => counted(sp_snapshot_segment_count(h as *const _)),
            13 => sp_snapshot_segment(h as *const _, 0, &mut seg),
            14 => sp_snapshot_block(h as *const _, 0, 0, &mut block),
            15 => counted(sp_snapshot_trace_count(h as *const _)),
            _ => sp_snapshot_trace(h as *const _, 0, &mut event),
        }
    }
}

/// The kind whose calls `call` makes.
fn call_kind(call: u8) -> Kind {
    match call % CALLS {
        0..=2 => Kind::Checkpoint,
        3..=7 => Kind::Delta,
        8..=10 => Kind::Group,
        _ => Kind::Snapshot,
    }
}

/// A call of `kind`, chosen by `pick`.
fn call_of(kind: Kind, pick: u8) -> u8 {
    let calls: Vec<u8> = (0..CALLS).filter(|&c| call_kind(c) == kind).collect();
    calls[pick as usize % calls.len()]
}

fn snapshot() -> String {
    let (mut json, mut len) = (null_mut(), 0);
    // SAFETY: valid out-pointers; the string is copied and freed at once.
    ok(unsafe { sp_snapshot_json(-1, &mut json, &mut len) });
    // SAFETY: `json` holds `len` bytes.
    let text = unsafe { std::slice::from_raw_parts(json.cast::<u8>(), len) };
    let text = String::from_utf8_lossy(text).into_owned();
    // SAFETY: returned by sp_snapshot_json.
    ok(unsafe { sp_string_free(json) });
    text
}

impl Model {
    /// A model for sequence number `case`, whose pools no other sequence uses.
    pub fn new(case: u64, vmm_page: Option<usize>) -> Model {
        let base = 1_000 + case * 8;
        let pools = std::array::from_fn(|i| pool_id(base + i as u64));
        for p in pools {
            let mut n = 0;
            // SAFETY: NULL options; valid out-pointer.
            ok(unsafe { sp_pool_create_or_incref(0, p, null(), &mut n) });
            assert_eq!(n, 1);
        }
        Model {
            pools,
            uses: [1; POOLS],
            arena_pool: pool_id(base + 7),
            live: Vec::new(),
            freed: Vec::new(),
            cps: Vec::new(),
            deltas: Vec::new(),
            groups: Vec::new(),
            snapshots: Vec::new(),
            arenas: Vec::new(),
            routes: Vec::new(),
            stale: Vec::new(),
            next_id: 1,
            next_seed: case << 32 | 1,
            baseline: check::baseline(),
            refused: 0,
            limits: Limits::default(),
            vmm_page,
            ooms: 0,
            certain: 0,
            after_pressure: 0,
            retains: false,
        }
    }

    fn seed(&mut self) -> u64 {
        self.next_seed += 1;
        self.next_seed
    }

    fn pool_live(&self, pool: usize) -> Vec<Live> {
        self.live
            .iter()
            .filter(|l| l.pool == Some(pool))
            .cloned()
            .collect()
    }

    /// A new allocation: checked with sp_allocation_info, filled with its own pattern.
    fn track(
        &mut self,
        p: *mut c_void,
        dev: i32,
        pool: Option<usize>,
        requested: usize,
        stream: u64,
    ) {
        assert!(!p.is_null());
        let (mut base, mut rounded, mut req, mut d) = (null_mut(), 0, 0, -1);
        // SAFETY: valid out-pointers.
        ok(unsafe { sp_allocation_info(p, &mut base, &mut rounded, &mut req, &mut d) });
        assert_eq!((base, req, d), (p, requested, dev));
        assert!(rounded >= requested);
        let seed = self.seed();
        fill(dev, p as usize, requested, seed, requested >= WINDOWED);
        self.freed.retain(|&f| f != p as usize);
        let id = self.next_id;
        self.next_id += 1;
        self.live.push(Live {
            id,
            ptr: p as usize,
            dev,
            pool,
            requested,
            rounded,
            stream,
            seed,
        });
    }

    fn state(&self) -> State {
        let mut pools: Vec<_> = self.pools.to_vec();
        pools.push(pool_id(0));
        State {
            device: (0..DEVICES).map(stats).collect(),
            pools: pools
                .iter()
                .map(|&p| {
                    let mut n = 0;
                    // SAFETY: valid out-pointer.
                    let s = unsafe { sp_pool_use_count(0, p, &mut n) };
                    if p.b != 0 {
                        ok(s);
                    }
                    (pool_stats(0, p), n)
                })
                .collect(),
            snapshot: snapshot(),
        }
    }

    /// Runs a call that must be refused with `want` and change nothing.
    #[track_caller]
    fn refuse(&mut self, want: sp_status, what: &str, call: impl FnOnce() -> sp_status) {
        let before = self.state();
        let got = call();
        assert_eq!(got, want, "{what}: {}", last_error());
        assert!(!last_error().is_empty(), "{what}: no message");
        let after = self.state();
        assert!(before == after, "{what} ({want:?}) changed the state");
        self.refused += 1;
    }

    /// The pool a `sp_alloc` on device 0 and `stream` goes to: the newest matching route's.
    fn routed(&self, stream: u64) -> Option<usize> {
        self.routes
            .iter()
            .rev()
            .find(|&&(_, s)| s.is_none_or(|s| s == stream))
            .map(|&(p, _)| p)
    }

    /// Applies a restore of `pool` to the live set `target`, given the delta the library
    /// returned (its freed and created pointers are checked against the model).
    fn apply_restore(&mut self, pool: usize, target: &[Live], delta: *mut sp_restore_delta) {
        let now = self.pool_live(pool);
        let entries = |freed: bool| -> Vec<usize> {
            let n = if freed {
                sp_delta_freed_count(delta)
            } else {
                sp_delta_created_count(delta)
            };
            let mut out: Vec<usize> = (0..n)
                .map(|i| {
                    let (mut p, mut s) = (null_mut(), 0);
                    // SAFETY: a live delta; valid out-pointers.
                    ok(unsafe {
                        if freed {
                            sp_delta_freed(delta, i, &mut p, &mut s)
                        } else {
                            sp_delta_created(delta, i, &mut p, &mut s)
                        }
                    });
                    p as usize
                })
                .collect();
            out.sort_unstable();
            out
        };
        let mut want_freed: Vec<usize> = now
            .iter()
            .filter(|l| !target.iter().any(|t| t.id == l.id))
            .map(|l| l.ptr)
            .collect();
        want_freed.sort_unstable();
        let created: Vec<Live> = target
            .iter()
            .filter(|t| !now.iter().any(|l| l.id == t.id))
            .cloned()
            .collect();
        let mut want_created: Vec<usize> = created.iter().map(|l| l.ptr).collect();
        want_created.sort_unstable();
        if !delta.is_null() {
            assert_eq!(entries(true), want_freed, "restore: freed");
            assert_eq!(entries(false), want_created, "restore: created");
        }
        self.live
            .retain(|l| l.pool != Some(pool) || target.iter().any(|t| t.id == l.id));
        self.freed.extend(want_freed);
        for mut l in created {
            // Re-created: its bytes are the caller's to set again.
            l.seed = self.seed();
            fill(0, l.ptr, l.requested, l.seed, l.windowed());
            self.freed.retain(|&f| f != l.ptr);
            self.live.push(l);
        }
    }

    /// Whether a restore of `pool` to `target` is one the model can predict: every one is (a
    /// block re-allocated at a checkpointed address is a different allocation, freed and
    /// re-created).
    fn restorable(&self, _pool: usize, _target: &[Live]) -> bool {
        true
    }

    fn keep_delta(&mut self, d: *mut sp_restore_delta) {
        if d.is_null() {
            return;
        }
        self.deltas.push(d as usize);
        if self.deltas.len() > 4 {
            let old = self.deltas.remove(0);
            // SAFETY: a live delta.
            ok(unsafe { sp_delta_free(old as *mut _) });
            self.stale.push((Kind::Delta, old));
        }
    }

    /// A live handle of `kind`, chosen by `pick`.
    fn handle_of(&self, kind: Kind, pick: u8) -> Option<usize> {
        let all: Vec<usize> = match kind {
            Kind::Checkpoint => self.cps.iter().map(|c| c.handle).collect(),
            Kind::Delta => self.deltas.clone(),
            Kind::Group => self.groups.iter().map(|g| g.handle).collect(),
            Kind::Snapshot => self.snapshots.clone(),
        };
        (!all.is_empty()).then(|| all[pick as usize % all.len()])
    }

    pub fn step(&mut self, op: &Op) {
        match *op {
            Op::Alloc { dev, size, stream } => {
                let dev = i32::from(dev) % DEVICES;
                let s = STREAMS[stream as usize];
                let pool = if dev == 0 { self.routed(s) } else { None };
                self.alloc_under_pressure(dev, pool, size, s, "sp_alloc", |p| {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_alloc(dev, size, s, p) }
                });
            }
            Op::PoolAlloc { pool, size, stream } => {
                let pool = pool as usize;
                let (id, s) = (self.pools[pool], STREAMS[stream as usize]);
                self.alloc_under_pressure(0, Some(pool), size, s, "sp_pool_alloc", |p| {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_pool_alloc(0, id, size, s, p) }
                });
            }
            Op::Free { pick } => {
                if self.live.is_empty() {
                    return;
                }
                let l = self.live.swap_remove(pick as usize % self.live.len());
                ok(sp_free(l.ptr as *mut c_void));
                self.freed.push(l.ptr);
            }
            Op::EmptyCache { all } => ok(sp_empty_cache(if all { -1 } else { 0 })),
            Op::PoolEmptyCache { pool } => {
                ok(sp_pool_empty_cache(0, self.pools[pool as usize]));
            }
            Op::Take { pool } => {
                if self.cps.len() >= 6 {
                    return;
                }
                let pool = pool as usize;
                let mut cp = null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { sp_checkpoint_take(0, self.pools[pool], &mut cp) });
                self.retains = true;
                let live = self.pool_live(pool);
                self.cps.push(Cp {
                    handle: cp as usize,
                    pool,
                    live,
                    ooms: self.ooms,
                });
            }
            Op::Restore { cp, keep } => {
                if self.cps.is_empty() {
                    return;
                }
                let c = &self.cps[cp as usize % self.cps.len()];
                let (pool, handle, target) = (c.pool, c.handle, c.live.clone());
                let pressed = c.ooms < self.ooms;
                if !self.restorable(pool, &target) {
                    return;
                }
                let now = self.pool_live(pool);
                let keep: Vec<*mut c_void> = target
                    .iter()
                    .filter(|t| now.iter().any(|l| l.id == t.id))
                    .enumerate()
                    .filter(|(i, _)| keep >> (i % 32) & 1 == 1)
                    .map(|(_, t)| t.ptr as *mut c_void)
                    .collect();
                let mut d = null_mut();
                let before = self.held();
                // SAFETY: a live handle; `keep` holds keep.len() pointers; valid out-pointer.
                let status = unsafe {
                    sp_checkpoint_restore(handle as *const _, keep.as_ptr(), keep.len(), &mut d)
                };
                if self.answered(status, before, None, 0, "sp_checkpoint_restore") {
                    self.after_pressure += u64::from(pressed);
                    self.apply_restore(pool, &target, d);
                    self.keep_delta(d);
                }
            }
            Op::CheckpointFree { cp } => {
                if self.cps.is_empty() {
                    return;
                }
                let c = self.cps.remove(cp as usize % self.cps.len());
                // SAFETY: a live handle.
                ok(unsafe { sp_checkpoint_free(c.handle as *mut _) });
                self.stale.push((Kind::Checkpoint, c.handle));
            }
            Op::DeltaFree { pick } => {
                if self.deltas.is_empty() {
                    return;
                }
                let d = self.deltas.remove(pick as usize % self.deltas.len());
                // SAFETY: a live handle.
                ok(unsafe { sp_delta_free(d as *mut _) });
                self.stale.push((Kind::Delta, d));
            }
            Op::GroupCreate { pool, count } => {
                if self.groups.len() >= 4 {
                    return;
                }
                let pool = pool as usize;
                let mut g = null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { sp_variant_group_create(0, self.pools[pool], count as usize, &mut g) });
                self.retains = true;
                let base = self.pool_live(pool);
                self.groups.push(Group {
                    handle: g as usize,
                    ooms: self.ooms,
                    pool,
                    count: count as usize,
                    base,
                    active: false,
                });
            }
            Op::Begin { g, k } => {
                if self.groups.is_empty() {
                    return;
                }
                let gr = &self.groups[g as usize % self.groups.len()];
                let (pool, handle, base) = (gr.pool, gr.handle, gr.base.clone());
                let pressed = gr.ooms < self.ooms;
                if gr.active || !self.restorable(pool, &base) {
                    return;
                }
                let k = k as usize % gr.count;
                let mut d = null_mut();
                let before = self.held();
                // SAFETY: a live handle; valid out-pointer.
                let status = unsafe { sp_variant_begin(handle as *const _, k, &mut d) };
                if self.answered(status, before, None, 0, "sp_variant_begin") {
                    self.after_pressure += u64::from(pressed);
                    self.apply_restore(pool, &base, d);
                    self.keep_delta(d);
                    let n = self.groups.len();
                    self.groups[g as usize % n].active = true;
                }
            }
            Op::End { g } => {
                let n = self.groups.len();
                if n == 0 || !self.groups[g as usize % n].active {
                    return;
                }
                let gr = &mut self.groups[g as usize % n];
                // SAFETY: a live handle.
                ok(unsafe { sp_variant_end(gr.handle as *const _) });
                gr.active = false;
            }
            Op::GroupFree { g } => {
                if self.groups.is_empty() {
                    return;
                }
                let gr = self.groups.remove(g as usize % self.groups.len());
                // SAFETY: a live handle.
                ok(unsafe { sp_variant_group_free(gr.handle as *mut _) });
                self.stale.push((Kind::Group, gr.handle));
            }
            Op::ArenaCreate => {
                if self.arenas.len() >= 3 {
                    return;
                }
                let mut id = 0;
                // SAFETY: valid out-pointer.
                ok(unsafe { sp_arena_create(0, self.arena_pool, 0, &mut id) });
                self.retains = true;
                self.arenas.push(Arena {
                    id,
                    slots: BTreeMap::new(),
                });
            }
            Op::ArenaAlloc { a, slot, size } => {
                if self.arenas.is_empty() {
                    return;
                }
                let i = a as usize % self.arenas.len();
                let slot = u32::from(slot);
                if self.arenas[i].slots.contains_key(&slot) {
                    return;
                }
                let mut p = null_mut();
                let before = self.held();
                let must = self.must(0, None, size).filter(|&m| !m);
                // SAFETY: valid out-pointer.
                let status = unsafe { sp_arena_alloc(0, self.arenas[i].id, 0, slot, size, &mut p) };
                if self.answered(status, before, must, 0, "sp_arena_alloc") {
                    let seed = self.seed();
                    fill(0, p as usize, size, seed, size >= WINDOWED);
                    self.arenas[i].slots.insert(slot, (p as usize, size, seed));
                }
            }
            Op::ArenaFree { a, slot } => {
                if self.arenas.is_empty() {
                    return;
                }
                let n = self.arenas.len();
                let ar = &mut self.arenas[a as usize % n];
                if ar.slots.remove(&u32::from(slot)).is_some() {
                    ok(sp_arena_free(0, ar.id, 0, u32::from(slot)));
                }
            }
            Op::ArenaDestroy { a } => {
                if self.arenas.is_empty() {
                    return;
                }
                let i = a as usize % self.arenas.len();
                if self.arenas[i].slots.is_empty() {
                    ok(sp_arena_destroy(0, self.arenas.remove(i).id));
                }
            }
            Op::Route { pool, stream, all } => {
                let pool = pool as usize;
                if self.routes.iter().any(|&(p, _)| p == pool) {
                    return;
                }
                let s = STREAMS[stream as usize];
                let kind = if all {
                    sp_route_kind::SP_ROUTE_ALL
                } else {
                    sp_route_kind::SP_ROUTE_STREAM
                };
                ok(sp_begin_allocate_to_pool(0, self.pools[pool], kind, s));
                self.uses[pool] += 1;
                self.routes.push((pool, (!all).then_some(s)));
            }
            Op::Unroute { pool } => {
                let pool = pool as usize;
                if let Some(i) = self.routes.iter().position(|&(p, _)| p == pool) {
                    ok(sp_end_allocate_to_pool(0, self.pools[pool]));
                    self.routes.remove(i);
                }
            }
            Op::Incref { pool } => {
                let pool = pool as usize;
                let mut n = 0;
                // SAFETY: NULL options; valid out-pointer.
                ok(unsafe { sp_pool_create_or_incref(0, self.pools[pool], null(), &mut n) });
                self.uses[pool] += 1;
                assert_eq!(n, self.uses[pool]);
            }
            Op::Release { pool } => {
                let pool = pool as usize;
                // Never to 0 here: a pool at 0 is forgotten once empty, at a moment the model
                // cannot name.
                if self.uses[pool] <= 1 {
                    return;
                }
                let mut n = 0;
                // SAFETY: valid out-pointer.
                ok(unsafe { sp_pool_release(0, self.pools[pool], &mut n) });
                self.uses[pool] -= 1;
                assert_eq!(n, self.uses[pool]);
            }
            Op::ResetPeaks => ok(sp_reset_peak_stats(-1)),
            Op::Limit { dev, headroom } => {
                self.set_device_limit(i32::from(dev) % DEVICES, headroom.map(|h| h as usize));
            }
            Op::PoolLimit { pool, headroom } => {
                self.set_pool_limit(pool as usize, headroom.map(|h| h as usize));
            }
            Op::SnapshotTake { traces } => {
                if self.snapshots.len() >= 4 {
                    return;
                }
                let mut h = null_mut();
                // SAFETY: valid out-pointer.
                ok(unsafe { sp_snapshot_take(-1, i32::from(traces), &mut h) });
                views::snapshot_agrees(h, &snapshot());
                self.snapshots.push(h as usize);
            }
            Op::SnapshotFree { pick } => {
                if self.snapshots.is_empty() {
                    return;
                }
                let h = self
                    .snapshots
                    .swap_remove(pick as usize % self.snapshots.len());
                // SAFETY: a live handle.
                ok(unsafe { sp_snapshot_free(h as *mut _) });
                self.stale.push((Kind::Snapshot, h));
            }
            Op::Bad(ref b) => self.bad(b),
        }
    }
}
