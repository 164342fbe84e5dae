//! The bad calls of a sequence: each is refused with its documented code and a message, and
//! changes nothing (checked by [`Model::refuse`]). A bad call that the model's state cannot
//! make (no live handle of the kind asked for, say) is skipped.

use std::ffi::c_void;
use std::ptr::null_mut;

use slotpool::*;

use crate::common::ok;

use super::{
    CALLS, INVALID, KINDS, Kind, Model, STATE, UNKNOWN_POOL, UNKNOWN_PTR, call_handle, call_kind,
    call_of, pool_id,
};
use crate::ops::Bad;

impl Model {
    /// Whether `addr` starts a live allocation or an arena slot.
    fn is_live(&self, addr: usize) -> bool {
        self.live.iter().any(|l| l.ptr == addr)
            || self
                .arenas
                .iter()
                .any(|a| a.slots.values().any(|&(p, _, _)| p == addr))
    }

    pub(super) fn bad(&mut self, b: &Bad) {
        match *b {
            Bad::FreeFreed { pick } => {
                let dead: Vec<usize> = self
                    .freed
                    .iter()
                    .copied()
                    .filter(|&p| !self.is_live(p))
                    .collect();
                if let Some(&p) = dead.get(pick as usize % dead.len().max(1)) {
                    self.refuse(UNKNOWN_PTR, "free of a freed pointer", || {
                        sp_free(p as *mut c_void)
                    });
                }
            }
            Bad::FreeInterior { pick } => {
                if self.live.is_empty() {
                    return;
                }
                let l = &self.live[pick as usize % self.live.len()];
                let p = l.ptr + 1 + (pick as usize % l.rounded.max(2).saturating_sub(1));
                self.refuse(UNKNOWN_PTR, "free of an interior pointer", || {
                    sp_free(p as *mut c_void)
                });
            }
            Bad::FreeNull => self.refuse(INVALID, "free of NULL", || sp_free(null_mut())),
            Bad::FreeRandom { addr } => {
                if addr == 0 || self.is_live(addr as usize) {
                    return;
                }
                self.refuse(UNKNOWN_PTR, "free of a random address", || {
                    sp_free(addr as *mut c_void)
                });
            }
            Bad::WrongKind { kind, pick, call } => {
                let kind = KINDS[kind as usize % KINDS.len()];
                let Some(h) = self.handle_of(kind, pick) else {
                    return;
                };
                let others: Vec<u8> = (0..CALLS).filter(|&c| call_kind(c) != kind).collect();
                let c = others[call as usize % others.len()];
                self.refuse(INVALID, &format!("{kind:?} handle to call {c}"), || {
                    call_handle(c, h)
                });
            }
            Bad::Stale { pick, call } => {
                if self.stale.is_empty() {
                    return;
                }
                let (kind, h) = self.stale[pick as usize % self.stale.len()];
                let c = call_of(kind, call);
                self.refuse(
                    INVALID,
                    &format!("freed {kind:?} handle to call {c}"),
                    || call_handle(c, h),
                );
            }
            Bad::MadeUp { value, call } => {
                let v = value as usize;
                if v == 0
                    || self.stale.iter().any(|&(_, h)| h == v)
                    || KINDS
                        .iter()
                        .any(|&k| (0..=255).any(|i| self.handle_of(k, i) == Some(v)))
                {
                    return;
                }
                self.refuse(
                    INVALID,
                    &format!("made-up handle {v:#x} to call {call}"),
                    || call_handle(call, v),
                );
            }
            Bad::HugeKeep { cp, log } => {
                if self.cps.is_empty() {
                    return;
                }
                let c = &self.cps[cp as usize % self.cps.len()];
                let h = c.handle;
                let keep = [null_mut::<c_void>()];
                self.refuse(INVALID, &format!("restore with n_keep 2^{log}"), || {
                    // SAFETY: the length is refused before the list is read.
                    unsafe {
                        sp_checkpoint_restore(h as *const _, keep.as_ptr(), 1 << log, null_mut())
                    }
                });
            }
            Bad::HugeVerify { pool, log } => {
                let p = self.pools[pool as usize % self.pools.len()];
                let list = [null_mut::<c_void>()];
                self.refuse(INVALID, &format!("verify_live with n 2^{log}"), || {
                    // SAFETY: the length is refused before the list is read.
                    unsafe { sp_pool_verify_live(0, p, list.as_ptr(), 1 << log) }
                });
            }
            Bad::KeepNotInCheckpoint { cp, pick } => {
                if self.cps.is_empty() {
                    return;
                }
                let c = &self.cps[cp as usize % self.cps.len()];
                let (h, pool) = (c.handle, c.pool);
                let extra: Vec<usize> = self
                    .pool_live(pool)
                    .iter()
                    .filter(|l| !c.live.iter().any(|t| t.id == l.id))
                    .map(|l| l.ptr)
                    .collect();
                let Some(&p) = extra.get(pick as usize % extra.len().max(1)) else {
                    return;
                };
                let keep = [p as *mut c_void];
                self.refuse(
                    STATE,
                    "restore keeping a pointer the checkpoint lacks",
                    || {
                        // SAFETY: one readable pointer; a live handle.
                        unsafe {
                            sp_checkpoint_restore(h as *const _, keep.as_ptr(), 1, null_mut())
                        }
                    },
                );
            }
            Bad::SnapshotOutOfRange { pick, what } => {
                let Some(h) = self.handle_of(Kind::Snapshot, pick) else {
                    return;
                };
                let s = h as *const sp_snapshot;
                let n = sp_snapshot_segment_count(s);
                let mut seg = sp_segment_view::default();
                let mut block = sp_block_view::default();
                let last = n.saturating_sub(1);
                let blocks = if n == 0 {
                    0
                } else {
                    // SAFETY: a live handle; valid out-pointer.
                    ok(unsafe { sp_snapshot_segment(s, last, &mut seg) });
                    seg.block_count
                };
                let before = (seg, block);
                // SAFETY: a live handle; each call is refused before writing.
                let call = || unsafe {
                    match what % 5 {
                        0 => sp_snapshot_segment(s, n, &mut seg),
                        1 => sp_snapshot_block(s, n, 0, &mut block),
                        2 => sp_snapshot_block(s, last, blocks, &mut block),
                        3 => sp_snapshot_trace(s, sp_snapshot_trace_count(s), null_mut()),
                        _ => sp_snapshot_segment(s, 0, null_mut()),
                    }
                };
                self.refuse(INVALID, &format!("snapshot reader {}", what % 5), call);
                assert_eq!((seg, block), before, "a refused reader wrote its output");
            }
            Bad::PoolReaderRefused { pool, what } => {
                let id = if what % 2 == 0 {
                    self.pools[pool as usize % self.pools.len()]
                } else {
                    pool_id((1 << 40) + u64::from(pool))
                };
                let mut total = 7usize;
                let mut opts = sp_pool_options::default();
                let want = if what % 2 == 0 { INVALID } else { UNKNOWN_POOL };
                self.refuse(want, &format!("pool reader {}", what % 4), || {
                    // SAFETY: NULL out-pointers are refused; valid ones otherwise.
                    unsafe {
                        match what % 4 {
                            0 => sp_pool_live_allocations(0, id, null_mut(), 4, &mut total),
                            1 => sp_pool_live_allocations(0, id, null_mut(), 0, &mut total),
                            2 => sp_pool_options_get(0, id, null_mut()),
                            _ => sp_pool_options_get(0, id, &mut opts),
                        }
                    }
                });
                assert_eq!(total, 7, "a refused call wrote the total");
                assert_eq!(opts, sp_pool_options::default());
            }
            Bad::VerifyWrong { pool } => {
                let pool = pool as usize % self.pools.len();
                let mut list: Vec<*mut c_void> = self
                    .pool_live(pool)
                    .iter()
                    .map(|l| l.ptr as *mut c_void)
                    .collect();
                if list.pop().is_none() {
                    list.push(0x1000 as *mut c_void);
                }
                let id = self.pools[pool];
                self.refuse(STATE, "verify_live with a wrong list", || {
                    // SAFETY: `list` holds list.len() pointers.
                    unsafe { sp_pool_verify_live(0, id, list.as_ptr(), list.len()) }
                });
            }
            Bad::AllocSize { zero } => {
                let size = if zero { 0 } else { 1 << 57 };
                let mut p = null_mut();
                self.refuse(INVALID, &format!("alloc of {size} bytes"), || {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_alloc(0, size, 0, &mut p) }
                });
                assert!(p.is_null());
            }
            Bad::AllocDevice { dev } => {
                let mut p = null_mut();
                self.refuse(INVALID, &format!("alloc on device {dev}"), || {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_alloc(dev, 4096, 0, &mut p) }
                });
            }
            Bad::PoolAllocUnknown { b } => {
                let mut p = null_mut();
                self.refuse(UNKNOWN_POOL, "alloc in an unknown pool", || {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_pool_alloc(0, pool_id(b), 4096, 0, &mut p) }
                });
            }
            Bad::ArenaUnknown { id } => {
                let mut p = null_mut();
                self.refuse(INVALID, "alloc in an unknown arena", || {
                    // SAFETY: valid out-pointer.
                    unsafe { sp_arena_alloc(0, id, 0, 0, 4096, &mut p) }
                });
                self.refuse(INVALID, "free in an unknown arena", || {
                    sp_arena_free(0, id, 0, 0)
                });
                self.refuse(INVALID, "destroy of an unknown arena", || {
                    sp_arena_destroy(0, id)
                });
            }
            Bad::ArenaAllocLive { a, slot } => {
                let Some((id, slot, size)) = self.live_slot(a, slot) else {
                    return;
                };
                let mut p = null_mut();
                // The same size, and a larger one (which must not grow the slot either).
                for size in [size, 2 * size] {
                    self.refuse(STATE, "alloc of a live arena slot", || {
                        // SAFETY: valid out-pointer.
                        unsafe { sp_arena_alloc(0, id, 0, slot, size, &mut p) }
                    });
                }
            }
            Bad::ArenaFreeNotLive { a, slot } => {
                if self.arenas.is_empty() {
                    return;
                }
                let ar = &self.arenas[a as usize % self.arenas.len()];
                let slot = u32::from(slot) + 6 * u32::from(slot % 2);
                if ar.slots.contains_key(&slot) {
                    return;
                }
                let id = ar.id;
                self.refuse(STATE, "free of an arena slot not live", || {
                    sp_arena_free(0, id, 0, slot)
                });
            }
            Bad::ArenaDestroyLive { a } => {
                let Some((id, _, _)) = self.live_slot(a, 0) else {
                    return;
                };
                self.refuse(STATE, "destroy of an arena with live slots", || {
                    sp_arena_destroy(0, id)
                });
            }
            Bad::BeginActive { g } | Bad::EndInactive { g } => {
                if self.groups.is_empty() {
                    return;
                }
                let gr = &self.groups[g as usize % self.groups.len()];
                let h = gr.handle;
                match (b, gr.active) {
                    (Bad::BeginActive { .. }, true) => {
                        self.refuse(STATE, "begin with a variant active", || {
                            // SAFETY: a live handle.
                            unsafe { sp_variant_begin(h as *const _, 0, null_mut()) }
                        });
                    }
                    (Bad::EndInactive { .. }, false) => {
                        self.refuse(STATE, "end with no variant active", || {
                            // SAFETY: a live handle.
                            unsafe { sp_variant_end(h as *const _) }
                        });
                    }
                    _ => {}
                }
            }
            Bad::BeginOutOfRange { g, k } => {
                if self.groups.is_empty() {
                    return;
                }
                let gr = &self.groups[g as usize % self.groups.len()];
                let (h, k) = (gr.handle, gr.count + k as usize % 4);
                self.refuse(INVALID, "begin of a variant out of range", || {
                    // SAFETY: a live handle.
                    unsafe { sp_variant_begin(h as *const _, k, null_mut()) }
                });
            }
            Bad::UnrouteNone => {
                let id = pool_id(1 << 41);
                self.refuse(STATE, "end of a route never begun", || {
                    sp_end_allocate_to_pool(0, id)
                });
            }
            Bad::ReleaseUnknown { b } => {
                self.refuse(UNKNOWN_POOL, "release of an unknown pool", || {
                    // SAFETY: NULL count is allowed.
                    unsafe { sp_pool_release(0, pool_id(b), null_mut()) }
                });
            }
            Bad::ReleaseDefault => {
                self.refuse(INVALID, "release of the default pool", || {
                    // SAFETY: NULL count is allowed.
                    unsafe { sp_pool_release(0, pool_id(0), null_mut()) }
                });
            }
            Bad::RouteTwice { pool } => {
                let pool = pool as usize % self.pools.len();
                if !self.routes.iter().any(|&(p, _)| p == pool) {
                    return;
                }
                let id = self.pools[pool];
                self.refuse(STATE, "a second route to a pool", || {
                    sp_begin_allocate_to_pool(0, id, sp_route_kind::SP_ROUTE_STREAM, 3)
                });
            }
            Bad::SimUnmapped { addr } => {
                let buf = [0u8; 16];
                self.refuse(INVALID, "sim write to unmapped memory", || {
                    // SAFETY: `buf` holds 16 bytes; the device range is checked.
                    unsafe { sp_sim_write(0, addr as *mut c_void, buf.as_ptr().cast(), 16) }
                });
            }
            Bad::SimHuge { pick } => {
                if self.live.is_empty() {
                    return;
                }
                let l = &self.live[pick as usize % self.live.len()];
                let (dev, p) = (l.dev, l.ptr);
                let mut buf = [0u8; 16];
                self.refuse(INVALID, "sim read of 2^60 bytes", || {
                    // SAFETY: the length is refused before `buf` is written.
                    unsafe {
                        sp_sim_read(dev, p as *const c_void, buf.as_mut_ptr().cast(), 1 << 60)
                    }
                });
            }
        }
    }

    /// A live slot of an arena chosen by `a` (the first at or after `slot`, else any): its
    /// arena's id, the slot and its size.
    fn live_slot(&self, a: u8, slot: u8) -> Option<(u64, u32, usize)> {
        if self.arenas.is_empty() {
            return None;
        }
        let ar = &self.arenas[a as usize % self.arenas.len()];
        let (&s, &(_, size, _)) = ar
            .slots
            .range(u32::from(slot)..)
            .next()
            .or_else(|| ar.slots.iter().next())?;
        Some((ar.id, s, size))
    }
}
