//! Memory pressure: device memory limits and pool limits set just above what is held, large
//! allocations up to the device's capacity, and the calls that may then run out of memory
//! (allocations, arena slots, restores, variant begins).
//!
//! The model cannot predict fragmentation, so where it cannot know it accepts success or
//! `SP_ERR_OUT_OF_MEMORY`; what it checks exactly:
//!
//! * an allocation whose bytes alone exceed the limit, the pool's limit or the device fails;
//! * with vmm growth, an allocation that fits beside an upper bound of what the live
//!   allocations pin once every cache is reclaimed succeeds (the out-of-memory ladder frees
//!   every pool's cache before it gives up);
//! * on `SP_ERR_OUT_OF_MEMORY` nothing changed: the statistics' allocation counts, requested
//!   and allocated bytes of every device and pool, and the snapshot's live blocks; the message
//!   splits the reserved bytes, each byte once, into allocated, cached in private pools and
//!   unallocated, with the allocated bytes the model's and a reserved figure within the limit
//!   and at least what the pools hold;
//! * after every step (in `check`) reserved bytes stay within the device's limit (current, and
//!   the peak since the limit was set) and each pool's (current).

use std::ptr::null_mut;

use serde_json::Value;
use slotpool::*;

use super::{DEVICES, Model, snapshot};
use crate::common::*;
use crate::ops::POOLS;

/// Memory of each simulated device: large allocations reach it.
pub const CAPACITY: usize = 384 << 20;
/// Allocations of at least this many bytes get their pattern in windows only (host memory).
pub const WINDOWED: usize = 8 << 20;
const GIB: f64 = (1u64 << 30) as f64;
/// Half a unit of the message's last printed digit (GiB with two decimals).
const PRINTED: f64 = 0.005;

/// Limits the sequence set, in bytes.
#[derive(Default)]
pub struct Limits {
    pub device: [Option<usize>; DEVICES as usize],
    pub pool: [Option<usize>; POOLS],
}

/// What an out-of-memory answer must leave as it was.
#[derive(PartialEq, Debug)]
pub struct Held {
    /// (allocations, requested, allocated bytes) of each device and pool.
    totals: Vec<(i64, i64, i64)>,
    /// (device, address, size, requested) of every live block in the snapshot.
    live_blocks: Vec<(u64, u64, u64, u64)>,
}

fn totals(s: &sp_memory_stats) -> (i64, i64, i64) {
    (
        s.allocation.all.current,
        s.requested_bytes.all.current,
        s.allocated_bytes.all.current,
    )
}

/// The live blocks of the snapshot, in its order.
fn live_blocks() -> Vec<(u64, u64, u64, u64)> {
    let v: Value = serde_json::from_str(&snapshot()).expect("snapshot JSON");
    let mut out = Vec::new();
    for seg in v["segments"].as_array().expect("segments") {
        let dev = seg["device"].as_u64().unwrap();
        for b in seg["blocks"].as_array().expect("blocks") {
            if b["state"] == "active_allocated" {
                let n = |k: &str| b[k].as_u64().unwrap();
                out.push((dev, n("address"), n("size"), n("requested_size")));
            }
        }
    }
    out
}

/// The number printed before `" GiB"` + `after` in `msg`.
fn gib_before(msg: &str, after: &str) -> f64 {
    let key = format!(" GiB{after}");
    let end = msg
        .find(&key)
        .unwrap_or_else(|| panic!("no {key:?} in the message {msg:?}"));
    let start = msg[..end].rfind(' ').map_or(0, |i| i + 1);
    msg[start..end]
        .parse()
        .unwrap_or_else(|_| panic!("no number before {key:?} in {msg:?}"))
}

impl Model {
    /// Bytes of device `dev` handed out now (the model's, with what earlier sequences left).
    pub(super) fn allocated(&self, dev: i32) -> usize {
        let mut n = self.baseline[dev as usize].2 as usize
            + self
                .live
                .iter()
                .filter(|l| l.dev == dev)
                .map(|l| l.rounded)
                .sum::<usize>();
        if dev == 0 {
            n += self.arena_totals().2 as usize;
        }
        n
    }

    fn pool_allocated(&self, pool: usize) -> usize {
        self.pool_live(pool).iter().map(|l| l.rounded).sum()
    }

    /// What an out-of-memory answer must not change.
    pub(super) fn held(&self) -> Held {
        let mut t: Vec<_> = (0..DEVICES).map(|d| totals(&stats(d))).collect();
        for &p in self.pools.iter().chain([&super::pool_id(0)]) {
            t.push(totals(&pool_stats(0, p)));
        }
        Held {
            totals: t,
            live_blocks: live_blocks(),
        }
    }

    /// Physical bytes a live allocation of `rounded` bytes can keep once every cache is
    /// reclaimed, with vmm growth: the pages it overlaps, or a small segment.
    fn pins(&self, rounded: usize) -> usize {
        let page = self.vmm_page.expect("vmm growth");
        if page > 2 << 20 && rounded <= 1 << 20 {
            2 << 20
        } else {
            (rounded.div_ceil(page) + 1) * page
        }
    }

    /// Whether an allocation of `size` bytes on `dev` (in `pool`) must fail: its bytes alone
    /// do not fit. `Some(true)`: must succeed (vmm growth, nothing the bound does not cover);
    /// `Some(false)`: must fail; `None`: the model cannot know.
    pub(super) fn must(&self, dev: i32, pool: Option<usize>, size: usize) -> Option<bool> {
        let cap = self.limits.device[dev as usize].map_or(CAPACITY, |l| l.min(CAPACITY));
        let pool_limit = pool.and_then(|p| self.limits.pool[p]);
        if self.allocated(dev) + size > cap
            || pool
                .zip(pool_limit)
                .is_some_and(|(p, l)| self.pool_allocated(p) + size > l)
        {
            return Some(false);
        }
        // The bound covers live allocations only: vmm growth, nothing left by earlier
        // sequences, and on device 0 no checkpoint, variant group or arena made so far (restored
        // and arena memory is retained by its pool, out of the reclaim's reach).
        if self.vmm_page.is_none()
            || self.baseline[dev as usize].0 != 0
            || (dev == 0 && self.retains)
        {
            return None;
        }
        let bound =
            |it: &mut dyn Iterator<Item = usize>| -> usize { it.map(|r| self.pins(r)).sum() };
        let new = self.pins(size.next_multiple_of(512));
        let device = bound(&mut self.live.iter().filter(|l| l.dev == dev).map(|l| l.rounded));
        let fits_pool = pool.zip(pool_limit).is_none_or(|(p, l)| {
            bound(&mut self.pool_live(p).iter().map(|l| l.rounded)) + new <= l
        });
        (device + new <= cap && fits_pool).then_some(true)
    }

    /// Checks the answer `status` of a call that may run out of memory, given what was held
    /// before it and what the model knows (`must`). True: it succeeded.
    #[track_caller]
    pub(super) fn answered(
        &mut self,
        status: sp_status,
        before: Held,
        must: Option<bool>,
        dev: i32,
        what: &str,
    ) -> bool {
        if must == Some(true) {
            self.certain += 1;
        }
        match status {
            sp_status::SP_OK => {
                assert_ne!(must, Some(false), "{what}: succeeded beyond the limit");
                true
            }
            sp_status::SP_ERR_OUT_OF_MEMORY => {
                let msg = last_error();
                assert_ne!(must, Some(true), "{what}: out of memory with room: {msg}");
                assert_eq!(
                    before,
                    self.held(),
                    "{what}: out of memory changed the state"
                );
                self.check_oom_message(dev, &msg, what);
                self.ooms += 1;
                false
            }
            other => panic!("{what}: {other:?}: {}", last_error()),
        }
    }

    /// The message of an out-of-memory answer on `dev`: every reserved byte counted once, the
    /// reserved figure within the limit and equal to the device's, allocated bytes the model's.
    #[track_caller]
    fn check_oom_message(&self, dev: i32, msg: &str, what: &str) {
        let reserved = gib_before(msg, " reserved of a");
        let limit = gib_before(msg, " limit");
        let allocated = gib_before(msg, " allocated,");
        let private = gib_before(msg, " cached in private pools");
        let unallocated = gib_before(msg, " reserved but unallocated");
        assert!(
            (allocated + private + unallocated - reserved).abs() <= 3.0 * PRINTED + 1e-9,
            "{what}: the parts do not add up to the reserved bytes: {msg}"
        );
        assert!(reserved <= limit + PRINTED, "{what}: over the limit: {msg}");
        let s = stats(dev);
        let dev_reserved = s.reserved_bytes.all.current as f64 / GIB;
        let dev_allocated = self.allocated(dev) as f64 / GIB;
        // The report counts the device's page pool (pages no pool holds) as reserved; the
        // statistics' current reserved bytes are the pools' only.
        assert!(
            reserved + PRINTED + 1e-9 >= dev_reserved,
            "{what}: reserved {reserved} GiB, the pools hold {dev_reserved} GiB: {msg}"
        );
        assert!(
            (allocated - dev_allocated).abs() <= PRINTED + 1e-9,
            "{what}: allocated {allocated} GiB, the model has {dev_allocated} GiB: {msg}"
        );
        if let Some(l) = self.limits.device[dev as usize] {
            assert!(
                (limit - l as f64 / GIB).abs() <= PRINTED + 1e-9,
                "{what}: {msg}"
            );
        }
    }

    /// Sets device `dev`'s limit `headroom` bytes above what it holds now (`None`: removes
    /// it), and starts its peaks afresh so that they are checked against it.
    pub(super) fn set_device_limit(&mut self, dev: i32, headroom: Option<usize>) {
        // Right after the reset the peak is the physical memory held, which is also the pages
        // of the device's page pool (no pool's reserved bytes count them).
        ok(sp_reset_peak_stats(dev));
        let reserved = stats(dev).reserved_bytes.all.peak as usize;
        let limit = headroom.map(|h| (reserved + h).min(CAPACITY));
        ok(sp_set_memory_limit(dev, limit.unwrap_or(0) as u64));
        let (mut got, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        ok(unsafe { sp_memory_limit_get(dev, &mut got, &mut total) });
        assert_eq!(total as usize, CAPACITY);
        assert_eq!(got as usize, limit.unwrap_or(CAPACITY), "limit in force");
        self.limits.device[dev as usize] = limit;
    }

    /// Sets pool `pool`'s limit `headroom` bytes above what it reserves now (`None`: removes it).
    pub(super) fn set_pool_limit(&mut self, pool: usize, headroom: Option<usize>) {
        let reserved = pool_stats(0, self.pools[pool]).reserved_bytes.all.current as usize;
        let limit = headroom.map(|h| reserved + h);
        let opts = sp_pool_options {
            limit_bytes: limit.unwrap_or(0) as u64,
            ..sp_pool_options::default()
        };
        // SAFETY: a valid options struct.
        ok(unsafe { sp_pool_set_options(0, self.pools[pool], &opts) });
        self.limits.pool[pool] = limit;
    }

    /// Reserved bytes within every limit in force: the device's now and at their peak since the
    /// limit was set (an exact peak), each pool's now (a pool's peak is the sum of its shards'
    /// peaks, not a peak of the sum).
    pub(super) fn check_limits(&self) {
        for dev in 0..DEVICES {
            let r = stats(dev).reserved_bytes.all;
            let cap = self.limits.device[dev as usize].unwrap_or(CAPACITY);
            assert!(
                r.current as usize <= cap && r.peak as usize <= cap,
                "device {dev}: reserved {} (peak {}) over the limit {cap}",
                r.current,
                r.peak
            );
        }
        for (i, limit) in self.limits.pool.iter().enumerate() {
            if let Some(l) = *limit {
                let r = pool_stats(0, self.pools[i]).reserved_bytes.all;
                assert!(
                    r.current as usize <= l,
                    "pool {i}: reserved {} over its limit {l}",
                    r.current
                );
            }
        }
    }

    /// Removes every limit (the end of a sequence).
    pub(super) fn lift_limits(&mut self) {
        for dev in 0..DEVICES {
            if self.limits.device[dev as usize].is_some() {
                self.set_device_limit(dev, None);
            }
        }
        for pool in 0..POOLS {
            if self.limits.pool[pool].is_some() {
                self.set_pool_limit(pool, None);
            }
        }
    }

    /// Allocates `size` bytes on `dev` and `stream` through `call` (`sp_alloc` or
    /// `sp_pool_alloc`), into `pool` as the model routes it; tracks it if it succeeded.
    pub(super) fn alloc_under_pressure(
        &mut self,
        dev: i32,
        pool: Option<usize>,
        size: usize,
        stream: u64,
        what: &str,
        call: impl FnOnce(*mut *mut std::ffi::c_void) -> sp_status,
    ) {
        let must = self.must(dev, pool, size);
        let before = self.held();
        let mut p = null_mut();
        let status = call(&mut p);
        if self.answered(status, before, must, dev, what) {
            self.track(p, dev, pool, size, stream);
        } else {
            assert!(p.is_null(), "{what}: out of memory left a pointer");
        }
    }
}
