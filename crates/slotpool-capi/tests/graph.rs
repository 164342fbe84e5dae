//! Checkpoint / restore, variant groups, arenas and live-set calls through the C ABI, on the sim
//! backend, with their bad-input paths: NULL, freed and foreign handles, other pools, stale
//! checkpoints, keep-live pointers the checkpoint lacks.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::*;
use slotpool::*;

const MIB: usize = 1 << 20;

fn pool(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

fn alloc_in(p: sp_pool_id, size: usize) -> *mut c_void {
    let mut out = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_alloc(SHARED, p, size, 0, &mut out) });
    out
}

#[test]
fn checkpoint_restore_round_trip_and_delta() {
    // sp_check_invariants needs the device to itself.
    let _quiet = exclusive(SHARED);
    let p = pool(9001);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let a = alloc_in(p, 3 * MIB);
    let mut cp = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_checkpoint_take(SHARED, p, &mut cp) });
    assert!(!cp.is_null());
    ok(sp_free(a));
    let b = alloc_in(p, 5 * MIB);
    let mut delta = null_mut();
    // SAFETY: live handle, empty keep list, valid out-pointer.
    ok(unsafe { sp_checkpoint_restore(cp, null(), 0, &mut delta) });
    assert_eq!(sp_delta_freed_count(delta), 1);
    assert_eq!(sp_delta_created_count(delta), 1);
    let (mut ptr, mut size) = (null_mut(), 0usize);
    // SAFETY: live handle, valid out-pointers.
    ok(unsafe { sp_delta_freed(delta, 0, &mut ptr, &mut size) });
    assert_eq!((ptr, size), (b, 5 * MIB));
    // SAFETY: as above.
    ok(unsafe { sp_delta_created(delta, 0, &mut ptr, &mut size) });
    assert_eq!((ptr, size), (a, 3 * MIB));
    // SAFETY: out of range index is an error, nothing written.
    expect(
        unsafe { sp_delta_created(delta, 1, &mut ptr, &mut size) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: NULL out-pointer is an error.
    expect(
        unsafe { sp_delta_freed(delta, 0, null_mut(), &mut size) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: live handle.
    ok(unsafe { sp_delta_free(delta) });
    // A freed handle is refused, not dereferenced.
    assert_eq!(sp_delta_freed_count(delta), 0);
    // SAFETY: the registry rejects the stale handle.
    expect(
        unsafe { sp_delta_free(delta) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // The live set is the checkpoint's.
    let live = [a];
    // SAFETY: one readable pointer.
    ok(unsafe { sp_pool_verify_live(SHARED, p, live.as_ptr(), 1) });
    // SAFETY: empty list is not the live set.
    expect(
        unsafe { sp_pool_verify_live(SHARED, p, null(), 0) },
        sp_status::SP_ERR_INVALID_STATE,
    );
    let mut n = 0usize;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_live_count(SHARED, p, &mut n) });
    assert_eq!(n, 1);
    // Keep-live pointer that the checkpoint lacks: refused, nothing changes.
    let c = alloc_in(p, MIB);
    let keep = [c];
    // SAFETY: one readable pointer; NULL delta is allowed.
    expect(
        unsafe { sp_checkpoint_restore(cp, keep.as_ptr(), 1, null_mut()) },
        sp_status::SP_ERR_INVALID_STATE,
    );
    assert!(last_error().contains("must stay live"), "{}", last_error());
    ok(sp_free(c));
    // The checkpoint names its device and pool; each out-pointer may be NULL.
    let (mut dev, mut id) = (-7, pool(1));
    // SAFETY: live handle, valid out-pointers.
    ok(unsafe { sp_checkpoint_info(cp, &mut dev, &mut id) });
    assert_eq!((dev, id), (SHARED, p));
    // SAFETY: live handle, NULL out-pointers.
    ok(unsafe { sp_checkpoint_info(cp, null_mut(), null_mut()) });
    let fake = 0x1234usize as *const sp_checkpoint;
    let (mut dev, mut id) = (-7, pool(1));
    for bad in [null(), fake] {
        // SAFETY: handles the registry refuses, valid out-pointers.
        expect(
            unsafe { sp_checkpoint_info(bad, &mut dev, &mut id) },
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert_eq!((dev, id), (-7, pool(1)), "nothing written");
    }
    // SAFETY: NULL handle.
    expect(
        unsafe { sp_checkpoint_restore(null(), null(), 0, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let fake = 0x1234usize as *const sp_checkpoint;
    expect(
        // SAFETY: a pointer that is not a handle is refused by the registry, never read.
        unsafe { sp_checkpoint_restore(fake, null(), 0, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: non-zero count with a NULL list.
    expect(
        unsafe { sp_checkpoint_restore(cp, null(), 3, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: live handle, then freed twice.
    ok(unsafe { sp_checkpoint_free(cp) });
    expect(
        // SAFETY: the freed handle is refused by the registry, never read.
        unsafe { sp_checkpoint_free(cp) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    ok(sp_free(a));
    ok(sp_check_invariants(SHARED));
    // SAFETY: NULL out-pointer; unknown pool.
    expect(
        unsafe { sp_checkpoint_take(SHARED, p, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let mut cp2 = null_mut();
    expect(
        // SAFETY: valid out-pointer.
        unsafe { sp_checkpoint_take(SHARED, pool(424242), &mut cp2) },
        sp_status::SP_ERR_UNKNOWN_POOL,
    );
    assert!(cp2.is_null());
}

/// The per-index readers' entries of both lists of a delta.
fn delta_by_index(delta: *const sp_restore_delta, created: bool) -> Vec<(*mut c_void, usize)> {
    let n = if created {
        sp_delta_created_count(delta)
    } else {
        sp_delta_freed_count(delta)
    };
    (0..n)
        .map(|i| {
            let (mut p, mut s) = (null_mut(), 0usize);
            // SAFETY: live handle, index in range, valid out-pointers.
            ok(unsafe {
                if created {
                    sp_delta_created(delta, i, &mut p, &mut s)
                } else {
                    sp_delta_freed(delta, i, &mut p, &mut s)
                }
            });
            (p, s)
        })
        .collect()
}

#[test]
fn delta_entries_reads_a_list_in_one_call() {
    // Another test of the device checks its invariants, which a growth under way breaks for a
    // moment.
    let _quiet = exclusive(SHARED);
    let p = pool(9002);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let old: Vec<_> = (1..=6).map(|i| alloc_in(p, i * MIB)).collect();
    let mut cp = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_checkpoint_take(SHARED, p, &mut cp) });
    for &a in &old[..3] {
        ok(sp_free(a));
    }
    let new: Vec<_> = (1..=4).map(|i| alloc_in(p, 7 * MIB + i * 4096)).collect();
    let mut delta = null_mut();
    // SAFETY: live handle, empty keep list, valid out-pointer.
    ok(unsafe { sp_checkpoint_restore(cp, null(), 0, &mut delta) });
    for (created, want) in [(false, new.len()), (true, 3)] {
        let by_index = delta_by_index(delta, created);
        assert_eq!(by_index.len(), want);
        let (mut ptrs, mut sizes, mut total) = (vec![null_mut(); want + 2], vec![0; want + 2], 0);
        // SAFETY: live handle, buffers of cap entries, valid total.
        ok(unsafe {
            sp_delta_entries(
                delta,
                created as i32,
                ptrs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                want + 2,
                &mut total,
            )
        });
        assert_eq!(total, want);
        let bulk: Vec<_> = ptrs
            .iter()
            .copied()
            .zip(sizes.iter().copied())
            .take(want)
            .collect();
        assert_eq!(bulk, by_index);
        assert!(
            ptrs[want..].iter().all(|p| p.is_null()),
            "nothing written past the total"
        );
        // A short buffer gets the first entries and the full length; sizes may be NULL.
        let mut short = [null_mut(); 2];
        // SAFETY: buffer of 2 entries, NULL sizes, valid total.
        ok(unsafe {
            sp_delta_entries(
                delta,
                created as i32,
                short.as_mut_ptr(),
                null_mut(),
                2,
                &mut total,
            )
        });
        assert_eq!(
            (total, &short[..]),
            (want, &[by_index[0].0, by_index[1].0][..])
        );
        // Length only.
        // SAFETY: no buffer with cap 0, valid total.
        ok(unsafe {
            sp_delta_entries(delta, created as i32, null_mut(), null_mut(), 0, &mut total)
        });
        assert_eq!(total, want);
    }
    let mut total = 77usize;
    // SAFETY: NULL buffer with cap > 0, and NULL total: both refused, nothing written.
    expect(
        unsafe { sp_delta_entries(delta, 0, null_mut(), null_mut(), 3, &mut total) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let mut one = [null_mut(); 1];
    // SAFETY: as above.
    expect(
        unsafe { sp_delta_entries(delta, 0, one.as_mut_ptr(), null_mut(), 1, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert_eq!((total, one[0]), (77, null_mut()));
    // SAFETY: live handle; then the freed handle and one of another kind are refused.
    ok(unsafe { sp_delta_free(delta) });
    for bad in [
        delta as *const sp_restore_delta,
        cp as *const sp_restore_delta,
    ] {
        // SAFETY: handles the registry refuses, never read.
        expect(
            unsafe { sp_delta_entries(bad, 0, one.as_mut_ptr(), null_mut(), 1, &mut total) },
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert_eq!((total, one[0]), (77, null_mut()), "nothing written");
    }
    // SAFETY: live handle.
    ok(unsafe { sp_checkpoint_free(cp) });
    for &a in &old[..3] {
        ok(sp_free(a));
    }
    for &a in &old[3..] {
        ok(sp_free(a));
    }
}

#[test]
fn variant_group_reuses_addresses() {
    let _quiet = exclusive(SHARED);
    let p = pool(9100);
    let mut g = null_mut();
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_variant_group_create(SHARED, p, 0, &mut g) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_variant_group_create(SHARED, p, 2, &mut g) });
    let mut firsts = Vec::new();
    for k in [1usize, 0, 1] {
        let mut d = null_mut();
        // SAFETY: live handle, valid out-pointer.
        ok(unsafe { sp_variant_begin(g, k, &mut d) });
        let x = alloc_in(p, (k + 1) * 4 * MIB);
        firsts.push(x);
        // SAFETY: live handles.
        unsafe {
            ok(sp_variant_end(g));
            ok(sp_delta_free(d));
        }
    }
    assert!(firsts.iter().all(|&x| x == firsts[0]), "{firsts:?}");
    // SAFETY: live handle; k out of range; end without begin.
    unsafe {
        expect(
            sp_variant_begin(g, 2, null_mut()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(sp_variant_end(g), sp_status::SP_ERR_INVALID_STATE);
        ok(sp_variant_group_free(g));
        expect(
            sp_variant_begin(g, 0, null_mut()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
    }
    ok(sp_check_invariants(SHARED));
}

#[test]
fn arenas_alias_slots() {
    let _quiet = exclusive(SHARED);
    let p = pool(9200);
    let mut ar = 0u64;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_arena_create(SHARED, p, 0, &mut ar) });
    ok(sp_arena_set_debug(SHARED, ar, 1));
    let (mut x, mut y) = (null_mut(), null_mut());
    // SAFETY: valid out-pointers.
    unsafe {
        ok(sp_arena_alloc(SHARED, ar, 0, 0, 2 * MIB, &mut x));
        expect(
            sp_arena_alloc(SHARED, ar, 1, 0, MIB, &mut y),
            sp_status::SP_ERR_INVALID_STATE,
        );
        assert!(y.is_null());
        ok(sp_arena_free(SHARED, ar, 0, 0));
        ok(sp_arena_alloc(SHARED, ar, 1, 0, MIB, &mut y));
    }
    assert_eq!(x, y, "slot 0 aliases across branches");
    expect(
        sp_arena_destroy(SHARED, ar),
        sp_status::SP_ERR_INVALID_STATE,
    );
    expect(
        sp_arena_free(SHARED, ar, 1, 5),
        sp_status::SP_ERR_INVALID_STATE,
    );
    ok(sp_arena_free(SHARED, ar, 1, 0));
    ok(sp_arena_destroy(SHARED, ar));
    expect(
        sp_arena_destroy(SHARED, ar),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: zero size is rejected.
    expect(
        unsafe { sp_arena_alloc(SHARED, 999, 0, 0, MIB, &mut x) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let mut left = 7usize;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_drain_pending_frees(SHARED, p, &mut left) });
    assert_eq!(left, 0);
    ok(sp_check_invariants(SHARED));
}

#[test]
fn history_appears_in_the_snapshot() {
    let _quiet = exclusive(SHARED);
    ok(sp_record_history(SHARED, 64));
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_alloc(SHARED, 3000, 0, &mut p) });
    ok(sp_free(p));
    ok(sp_record_history(SHARED, 0));
    let v = snapshot(SHARED);
    let trace = v["device_traces"][SHARED as usize].as_array().unwrap();
    let addr = p as u64;
    let actions: Vec<&str> = trace
        .iter()
        .filter(|e| e["addr"] == addr)
        .map(|e| e["action"].as_str().unwrap())
        .filter(|a| !a.starts_with("segment_"))
        .collect();
    assert_eq!(
        actions,
        ["alloc", "free_requested", "free_completed"],
        "{v}"
    );
    let alloc = trace
        .iter()
        .find(|e| e["action"] == "alloc" && e["addr"] == addr)
        .unwrap();
    assert_eq!(alloc["size"], 3000);
    ok(sp_clear_history(SHARED));
    expect(sp_record_history(99, 1), sp_status::SP_ERR_INVALID_ARGUMENT);
}

/// Events the trace callback received: (device, action, addr, size).
static TRACED: std::sync::Mutex<Vec<(i32, i32, u64, u64)>> = std::sync::Mutex::new(Vec::new());

unsafe extern "C" fn trace_into(event: *const sp_trace_event, user_data: *mut c_void) {
    // SAFETY: slotpool passes an event valid for the call.
    let e = unsafe { &*event };
    assert_eq!(user_data as usize, 0x5107, "user_data passed through");
    TRACED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((e.device, e.action.0, e.addr, e.size));
}

#[test]
fn the_trace_callback_sees_events_as_they_happen() {
    let _quiet = exclusive(SHARED);
    // SAFETY: `trace_into` is callable from any thread, does not call slotpool and cannot unwind
    // (an assertion failing inside it aborts the test, which is a failure too).
    ok(unsafe { sp_set_trace_callback(Some(trace_into), 0x5107 as *mut c_void) });
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_alloc(SHARED, 3000, 0, &mut p) });
    ok(sp_free(p));
    // Growth: with nothing cached, 40 MiB maps pages (or allocates a segment) first.
    ok(sp_empty_cache(SHARED));
    let mut big = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_alloc(SHARED, 40 * MIB, 0, &mut big) });
    ok(sp_free(big));
    // Every device has the callback.
    let mut q = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_alloc(SHARED + 1, 700, 0, &mut q) });
    // SAFETY: NULL detaches.
    ok(unsafe { sp_set_trace_callback(None, null_mut()) });
    ok(sp_free(q));
    let traced = std::mem::take(&mut *TRACED.lock().unwrap());
    let of = |addr: *mut c_void| -> Vec<(i32, i32, u64)> {
        traced
            .iter()
            .filter(|t| t.2 == addr as u64 && t.1 <= sp_trace_action::SP_TRACE_FREE_COMPLETED.0)
            .map(|&(d, a, _, s)| (d, a, s))
            .collect()
    };
    let (alloc, requested, completed) = (
        sp_trace_action::SP_TRACE_ALLOC.0,
        sp_trace_action::SP_TRACE_FREE_REQUESTED.0,
        sp_trace_action::SP_TRACE_FREE_COMPLETED.0,
    );
    assert_eq!(
        of(p),
        [
            (SHARED, alloc, 3000),
            (SHARED, requested, 3000),
            (SHARED, completed, 3000)
        ],
        "{traced:?}"
    );
    assert_eq!(of(q), [(SHARED + 1, alloc, 700)], "nothing after detaching");
    let big = big as u64;
    let grown: u64 = traced
        .iter()
        .filter(|t| {
            (t.1 == sp_trace_action::SP_TRACE_SEGMENT_ALLOC.0
                || t.1 == sp_trace_action::SP_TRACE_SEGMENT_MAP.0)
                && t.2 < big + 40 * MIB as u64
                && big < t.2 + t.3
        })
        .map(|t| t.3)
        .sum();
    assert!(
        grown >= 40 * MIB as u64,
        "growth under the block: {grown} B; {traced:?}"
    );
}

/// This thread's snapshot of `device` as JSON.
fn snapshot(device: i32) -> serde_json::Value {
    let (mut json, mut len) = (null_mut(), 0usize);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_snapshot_json(device, &mut json, &mut len) });
    // SAFETY: a NUL-terminated string from slotpool, freed below.
    let text = unsafe { std::ffi::CStr::from_ptr(json) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: the string came from sp_snapshot_json.
    ok(unsafe { sp_string_free(json) });
    serde_json::from_str(&text).unwrap()
}

#[test]
fn history_of_every_device_reaches_a_device_used_later() {
    // History is observable only through snapshots; the other history test reads SHARED's.
    let _quiet = exclusive(SHARED);
    // No other test of this binary uses LIMITED: its allocator is created below, after the call.
    let d = LIMITED;
    ok(sp_record_history(-1, 16));
    let p = alloc(d, 5000, 0);
    ok(sp_free(p));
    let count = |v: &serde_json::Value, action: &str| {
        v["device_traces"][d as usize]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["action"] == action && e["addr"] == p as u64)
            .count()
    };
    let v = snapshot(d);
    assert_eq!(
        (count(&v, "alloc"), count(&v, "free_requested")),
        (1, 1),
        "{v}"
    );
    ok(sp_record_history(-1, 0));
    let q = alloc(d, 5000, 0);
    ok(sp_free(q));
    let v = snapshot(d);
    assert_eq!(count(&v, "alloc"), 1, "recording stopped: {v}");
    ok(sp_clear_history(-1));
    let v = snapshot(-1);
    for trace in v["device_traces"].as_array().unwrap() {
        assert_eq!(trace.as_array().unwrap().len(), 0, "{v}");
    }
}

#[test]
fn mark_reusable_returns_the_block_to_its_pool() {
    // sp_check_invariants in the other tests needs the device to itself.
    let _quiet = exclusive(SHARED);
    let p = pool(9101);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let a = alloc_in(p, 6 * MIB);
    let mut size = 0u64;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_mark_reusable(a, &mut size) });
    assert_eq!(size, 6 * MIB as u64);
    // The pool serves the same addresses again; the old owner must not free a.
    let b = alloc_in(p, 6 * MIB);
    assert_eq!(b, a);
    // SAFETY: NULL size_out is allowed; bad pointers are errors that change nothing.
    expect(
        unsafe { sp_mark_reusable(null_mut(), null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    // SAFETY: as above.
    expect(
        unsafe { sp_mark_reusable((b as *mut u8).wrapping_add(512).cast(), null_mut()) },
        sp_status::SP_ERR_UNKNOWN_POINTER,
    );
    ok(sp_free(b));
    // SAFETY: NULL out-pointer is allowed.
    ok(unsafe { sp_pool_release(SHARED, p, null_mut()) });
}

#[test]
fn peer_access_given_before_a_device_is_used() {
    // No other test of this binary uses QUIET: its allocator is created by the alloc below, after
    // the grant, which it must start with.
    setup();
    let d = QUIET;
    ok(sp_enable_peer_access(d, SECOND));
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_alloc(d, 3 * MIB, 0, &mut p) });
    let peers = match runtime::runtime().unwrap().device(d).unwrap() {
        runtime::DevAlloc::Sim(a) => a.device().page_peers(p as u64),
        runtime::DevAlloc::Cuda(_) => unreachable!("sim backend"),
    };
    assert_eq!(peers, Some(vec![SECOND]));
    ok(sp_free(p));
}
