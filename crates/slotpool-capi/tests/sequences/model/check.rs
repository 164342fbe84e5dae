//! The library against the model after every step, and the end of a sequence: everything the
//! sequence made is freed and every device is back to no allocations.

use std::ffi::c_void;
use std::ptr::null_mut;

use slotpool::*;

use super::{DEVICES, Live, Model, WINDOWED, pool_id, verify};
use crate::common::*;

/// (count, requested bytes, rounded bytes) of `live`.
fn totals<'a>(live: impl Iterator<Item = &'a Live>) -> (i64, i64, i64) {
    live.fold((0, 0, 0), |(n, r, a), l| {
        (n + 1, r + l.requested as i64, a + l.rounded as i64)
    })
}

fn current(s: &sp_memory_stats) -> (i64, i64, i64) {
    (
        s.allocation.all.current,
        s.requested_bytes.all.current,
        s.allocated_bytes.all.current,
    )
}

/// The totals of each device and of device 0's default pool now.
pub(super) fn baseline() -> Vec<(i64, i64, i64)> {
    let mut b: Vec<_> = (0..DEVICES).map(|d| current(&stats(d))).collect();
    b.push(current(&pool_stats(0, pool_id(0))));
    b
}

/// `want` on top of `base`.
fn plus(base: (i64, i64, i64), want: (i64, i64, i64)) -> (i64, i64, i64) {
    (base.0 + want.0, base.1 + want.1, base.2 + want.2)
}

#[track_caller]
fn same_totals(s: &sp_memory_stats, want: (i64, i64, i64), what: &str) {
    let got = current(s);
    assert_eq!(
        got, want,
        "{what}: (allocations, requested, allocated bytes) differ from the model"
    );
}

impl Model {
    /// (count, requested bytes, rounded bytes) of the live arena slots (branch 0 only, so each
    /// live slot is one allocation of its requested size, rounded to 512 bytes).
    pub(super) fn arena_totals(&self) -> (i64, i64, i64) {
        self.arenas.iter().flat_map(|a| a.slots.values()).fold(
            (0, 0, 0),
            |(n, r, a), &(_, size, _)| {
                (n + 1, r + size as i64, a + size.div_ceil(512) as i64 * 512)
            },
        )
    }

    /// Compares the library with the model: invariants, device and pool statistics, live sets,
    /// use counts and the bytes of every live allocation and arena slot (`all`: every byte).
    pub fn check(&self, all: bool) {
        for dev in 0..DEVICES {
            let s = sp_check_invariants(dev);
            assert_eq!(s, sp_status::SP_OK, "device {dev}: {}", last_error());
            let live = self.live.iter().filter(|l| l.dev == dev);
            let mut want = plus(self.baseline[dev as usize], totals(live));
            if dev == 0 {
                want = plus(want, self.arena_totals());
            }
            same_totals(&stats(dev), want, &format!("device {dev}"));
        }
        let default = self.live.iter().filter(|l| l.dev == 0 && l.pool.is_none());
        let want = plus(self.baseline[DEVICES as usize], totals(default));
        same_totals(&pool_stats(0, pool_id(0)), want, "default pool");
        for (i, &p) in self.pools.iter().enumerate() {
            let live = self.pool_live(i);
            same_totals(&pool_stats(0, p), totals(live.iter()), &format!("pool {i}"));
            let (mut n, mut uses) = (0, 0);
            // SAFETY: valid out-pointers.
            unsafe {
                ok(sp_pool_live_count(0, p, &mut n));
                ok(sp_pool_use_count(0, p, &mut uses));
            }
            assert_eq!(n, live.len(), "pool {i}: live count");
            assert_eq!(uses, self.uses[i], "pool {i}: use count");
            let list: Vec<*mut c_void> = live.iter().map(|l| l.ptr as *mut c_void).collect();
            // SAFETY: `list` holds list.len() pointers.
            let s = unsafe { sp_pool_verify_live(0, p, list.as_ptr(), list.len()) };
            assert_eq!(s, sp_status::SP_OK, "pool {i}: {}", last_error());
        }
        for (i, &p) in self.pools.iter().enumerate() {
            live_allocations_agree(p, &self.pool_live(i), &format!("pool {i}"));
            let mut o = sp_pool_options {
                no_split: 9,
                ..sp_pool_options::default()
            };
            // SAFETY: valid out-pointer.
            ok(unsafe { sp_pool_options_get(0, p, &mut o) });
            let want = sp_pool_options {
                limit_bytes: self.limits.pool[i].unwrap_or(0) as u64,
                ..sp_pool_options::default()
            };
            assert_eq!(
                o, want,
                "pool {i}: created with NULL options, a limit set since"
            );
        }
        for c in &self.cps {
            let (mut dev, mut pool) = (-1, pool_id(0));
            // SAFETY: a live handle; valid out-pointers.
            ok(unsafe { sp_checkpoint_info(c.handle as *const _, &mut dev, &mut pool) });
            assert_eq!((dev, pool), (0, self.pools[c.pool]), "checkpoint info");
        }
        self.check_limits();
        for l in &self.live {
            verify(
                l.dev,
                l.ptr,
                l.requested,
                l.seed,
                all && !l.windowed(),
                "allocation",
            );
        }
        for a in &self.arenas {
            for (&slot, &(p, size, seed)) in &a.slots {
                verify(
                    0,
                    p,
                    size,
                    seed,
                    all && size < WINDOWED,
                    &format!("arena {} slot {slot}", a.id),
                );
            }
        }
    }

    /// Frees everything the sequence made, checking each step, and that nothing is left.
    pub fn finish(mut self) {
        self.check(true);
        self.lift_limits();
        for (pool, _) in std::mem::take(&mut self.routes) {
            ok(sp_end_allocate_to_pool(0, self.pools[pool]));
        }
        for d in std::mem::take(&mut self.deltas) {
            // SAFETY: a live handle.
            ok(unsafe { sp_delta_free(d as *mut _) });
        }
        for h in std::mem::take(&mut self.snapshots) {
            // SAFETY: a live handle.
            ok(unsafe { sp_snapshot_free(h as *mut _) });
        }
        for c in std::mem::take(&mut self.cps) {
            // SAFETY: a live handle.
            ok(unsafe { sp_checkpoint_free(c.handle as *mut _) });
        }
        for g in std::mem::take(&mut self.groups) {
            // SAFETY: a live handle.
            ok(unsafe { sp_variant_group_free(g.handle as *mut _) });
        }
        for a in std::mem::take(&mut self.arenas) {
            for &slot in a.slots.keys() {
                ok(sp_arena_free(0, a.id, 0, slot));
            }
            ok(sp_arena_destroy(0, a.id));
        }
        while let Some(l) = self.live.pop() {
            ok(sp_free(l.ptr as *mut c_void));
        }
        self.check(true);
        for (i, &p) in self.pools.iter().enumerate() {
            for _ in 0..self.uses[i] {
                // SAFETY: NULL count is allowed.
                ok(unsafe { sp_pool_release(0, p, null_mut()) });
            }
        }
        ok(sp_empty_cache(-1));
        for dev in 0..DEVICES {
            ok(sp_check_invariants(dev));
            let want = self.baseline[dev as usize];
            same_totals(&stats(dev), want, &format!("device {dev} at the end"));
        }
    }

    /// After a failed step: undoes what it can, ignoring errors, so that the sequences proptest
    /// runs next (shrinking the failure) start from a device without this one's routes and
    /// allocations.
    pub fn abandon(&mut self) {
        for dev in 0..DEVICES {
            sp_set_memory_limit(dev, 0);
        }
        for &p in &self.pools {
            // SAFETY: a valid options struct.
            unsafe { sp_pool_set_options(0, p, &sp_pool_options::default()) };
        }
        for (pool, _) in std::mem::take(&mut self.routes) {
            sp_end_allocate_to_pool(0, self.pools[pool]);
        }
        // SAFETY: handles are checked by the library; NULL counts are allowed.
        unsafe {
            for d in std::mem::take(&mut self.deltas) {
                sp_delta_free(d as *mut _);
            }
            for h in std::mem::take(&mut self.snapshots) {
                sp_snapshot_free(h as *mut _);
            }
            for c in std::mem::take(&mut self.cps) {
                sp_checkpoint_free(c.handle as *mut _);
            }
            for g in std::mem::take(&mut self.groups) {
                sp_variant_group_free(g.handle as *mut _);
            }
        }
        for a in std::mem::take(&mut self.arenas) {
            for &slot in a.slots.keys() {
                sp_arena_free(0, a.id, 0, slot);
            }
            sp_arena_destroy(0, a.id);
        }
        for l in std::mem::take(&mut self.live) {
            sp_free(l.ptr as *mut c_void);
        }
    }
}

/// `sp_pool_live_allocations` of pool `p` against the model's `live`: the total, every entry,
/// lowest address first, and a call with too little room writing only what fits.
fn live_allocations_agree(p: sp_pool_id, live: &[Live], what: &str) {
    let mut want: Vec<(usize, u64, u64, u64)> = live
        .iter()
        .map(|l| (l.ptr, l.rounded as u64, l.requested as u64, l.stream))
        .collect();
    want.sort_unstable();
    let mut total = usize::MAX;
    // SAFETY: cap 0 with NULL out; valid total.
    ok(unsafe { sp_pool_live_allocations(0, p, null_mut(), 0, &mut total) });
    assert_eq!(total, want.len(), "{what}: live allocations");
    let blank = sp_allocation {
        ptr: null_mut(),
        size: 0,
        requested_size: 0,
        stream: 0,
    };
    let mut out = vec![blank; want.len() + 1];
    // SAFETY: `out` holds out.len() entries.
    ok(unsafe { sp_pool_live_allocations(0, p, out.as_mut_ptr(), out.len(), &mut total) });
    assert_eq!(total, want.len());
    let got: Vec<(usize, u64, u64, u64)> = out[..total]
        .iter()
        .map(|a| (a.ptr as usize, a.size, a.requested_size, a.stream))
        .collect();
    assert_eq!(
        got, want,
        "{what}: (ptr, size, requested, stream) of each live allocation"
    );
    assert_eq!(out[total], blank, "{what}: written past the total");
    if total > 1 {
        let mut short = vec![blank; total];
        let cap = total / 2;
        // SAFETY: `short` holds at least `cap` entries.
        ok(unsafe { sp_pool_live_allocations(0, p, short.as_mut_ptr(), cap, &mut total) });
        assert_eq!(total, want.len(), "{what}: the total, also when truncated");
        assert_eq!(&short[..cap], &out[..cap]);
        assert!(
            short[cap..].iter().all(|a| *a == blank),
            "{what}: written past cap"
        );
    }
}
