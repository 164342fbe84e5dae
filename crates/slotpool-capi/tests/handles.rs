//! Handles of the three kinds (checkpoint, restore delta, variant group) under hostile use: a
//! handle of one kind where another is expected, a freed handle, a freed handle whose slot was
//! reused, a made-up value. Each is `SP_ERR_INVALID_ARGUMENT` with a message and changes nothing.
//! Also the pointer lists whose length would make the library allocate unbounded host memory or
//! form an invalid slice, and `sp_has_feature` against `docs/c-api.md`.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::*;
use slotpool::*;

const MIB: usize = 1 << 20;
const INVALID: sp_status = sp_status::SP_ERR_INVALID_ARGUMENT;

fn pool(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

fn alloc_in(p: sp_pool_id, size: usize) -> *mut c_void {
    let mut out = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_alloc(SHARED, p, size, 0, &mut out) });
    out
}

fn checkpoint(p: sp_pool_id) -> *mut sp_checkpoint {
    let mut cp = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_checkpoint_take(SHARED, p, &mut cp) });
    assert!(!cp.is_null());
    cp
}

fn group(p: sp_pool_id, n: usize) -> *mut sp_variant_group {
    let mut g = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_variant_group_create(SHARED, p, n, &mut g) });
    assert!(!g.is_null());
    g
}

/// A restore of `p` to `cp` that frees one allocation made since, so the delta is not empty.
fn delta(p: sp_pool_id, cp: *const sp_checkpoint) -> *mut sp_restore_delta {
    alloc_in(p, MIB);
    let mut d = null_mut();
    // SAFETY: a live handle; valid out-pointer.
    ok(unsafe { sp_checkpoint_restore(cp, null(), 0, &mut d) });
    assert!(!d.is_null());
    assert!(sp_delta_freed_count(d) >= 1);
    d
}

/// The device's statistics, the pool's live count and the snapshot: what a refused call must
/// leave as it was.
fn state(p: sp_pool_id) -> (sp_memory_stats, usize, String) {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_live_count(SHARED, p, &mut n) });
    let (mut json, mut len) = (null_mut(), 0);
    // SAFETY: valid out-pointers; the string is copied and freed at once.
    ok(unsafe { sp_snapshot_json(SHARED, &mut json, &mut len) });
    // SAFETY: `json` holds `len` bytes.
    let text = unsafe { std::slice::from_raw_parts(json.cast::<u8>(), len) };
    let text = String::from_utf8_lossy(text).into_owned();
    // SAFETY: returned by sp_snapshot_json.
    ok(unsafe { sp_string_free(json) });
    (stats(SHARED), n, text)
}

/// `status` is `SP_ERR_INVALID_ARGUMENT` and the message says `what`.
#[track_caller]
fn refused(status: sp_status, what: &str) {
    expect(status, INVALID);
    let m = last_error();
    assert!(m.contains(what), "message {m:?} lacks {what:?}");
}

#[test]
fn a_handle_of_one_kind_is_refused_where_another_is_expected() {
    let _only = exclusive(SHARED);
    let p = pool(31_001);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let cp = checkpoint(p);
    let d = delta(p, cp);
    let g = group(pool(31_002), 2);
    let s = snapshot();
    let before = state(p);
    let as_cp = |x: *mut c_void| x as *mut sp_checkpoint;
    let as_d = |x: *mut c_void| x as *mut sp_restore_delta;
    let as_g = |x: *mut c_void| x as *mut sp_variant_group;
    let as_s = |x: *mut c_void| x as *mut sp_snapshot;
    let (cpv, dv, gv, sv) = (
        cp.cast::<c_void>(),
        d.cast::<c_void>(),
        g.cast::<c_void>(),
        s.cast::<c_void>(),
    );
    for other in [dv, gv, sv] {
        let (mut dev, mut id) = (-7, pool(1));
        // SAFETY: every call below gets a value that is a live handle of another kind; the
        // registry refuses it before anything is read through it.
        unsafe {
            refused(sp_checkpoint_free(as_cp(other)), "not a checkpoint");
            refused(
                sp_checkpoint_restore(as_cp(other), null(), 0, null_mut()),
                "not a checkpoint",
            );
            refused(
                sp_checkpoint_info(as_cp(other), &mut dev, &mut id),
                "not a checkpoint",
            );
        }
        assert_eq!((dev, id), (-7, pool(1)), "nothing written");
    }
    for other in [cpv, dv, gv] {
        snapshot_refused(as_s(other), "not a snapshot");
    }
    for other in [cpv, gv, sv] {
        // SAFETY: as above.
        unsafe {
            refused(sp_delta_free(as_d(other)), "not a restore delta");
            let (mut ptr, mut size) = (null_mut(), 0);
            refused(
                sp_delta_freed(as_d(other), 0, &mut ptr, &mut size),
                "not a restore delta",
            );
            refused(
                sp_delta_created(as_d(other), 0, &mut ptr, &mut size),
                "not a restore delta",
            );
        }
        assert_eq!(sp_delta_freed_count(as_d(other)), 0);
        assert!(
            last_error().contains("not a restore delta"),
            "{}",
            last_error()
        );
        assert_eq!(sp_delta_created_count(as_d(other)), 0);
    }
    for other in [cpv, dv, sv] {
        // SAFETY: as above.
        unsafe {
            refused(sp_variant_group_free(as_g(other)), "not a variant group");
            refused(
                sp_variant_begin(as_g(other), 0, null_mut()),
                "not a variant group",
            );
            refused(sp_variant_end(as_g(other)), "not a variant group");
        }
    }
    assert_eq!(state(p), before, "refused calls changed the state");
    // Each handle still works as its own kind.
    assert_eq!(sp_delta_freed_count(d), 1);
    assert_eq!(last_error(), "");
    // SAFETY: live handles of the right kinds.
    unsafe {
        ok(sp_variant_begin(g, 1, null_mut()));
        ok(sp_variant_end(g));
        ok(sp_checkpoint_restore(cp, null(), 0, null_mut()));
        ok(sp_delta_free(d));
        ok(sp_checkpoint_free(cp));
        ok(sp_variant_group_free(g));
        assert!(sp_snapshot_segment_count(s) >= 1);
        ok(sp_snapshot_free(s));
    }
    ok(sp_check_invariants(SHARED));
}

/// A snapshot of the shared device.
fn snapshot() -> *mut sp_snapshot {
    let mut s = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_snapshot_take(SHARED, 1, &mut s) });
    assert!(!s.is_null());
    s
}

/// Every snapshot call refuses `s` with a message containing `what` and writes nothing.
#[track_caller]
fn snapshot_refused(s: *mut sp_snapshot, what: &str) {
    let mut seg = sp_segment_view {
        device: -7,
        ..sp_segment_view::default()
    };
    let mut block = sp_block_view {
        address: 7,
        state: sp_block_state(-1),
        ..sp_block_view::default()
    };
    let mut event = sp_trace_event {
        action: sp_trace_action(-1),
        device: -7,
        ..sp_trace_event::default()
    };
    let (seg0, block0, event0) = (seg, block, event);
    // SAFETY: `s` is checked by the registry before use; out-pointers are valid.
    unsafe {
        refused(sp_snapshot_segment(s, 0, &mut seg), what);
        refused(sp_snapshot_block(s, 0, 0, &mut block), what);
        refused(sp_snapshot_trace(s, 0, &mut event), what);
        assert_eq!(sp_snapshot_segment_count(s), 0);
        assert!(last_error().contains(what), "{}", last_error());
        assert_eq!(sp_snapshot_trace_count(s), 0);
        assert!(last_error().contains(what), "{}", last_error());
        refused(sp_snapshot_free(s), what);
    }
    assert_eq!(
        (seg, block, event),
        (seg0, block0, event0),
        "nothing written"
    );
}

#[test]
fn a_freed_handle_stays_refused_after_its_slot_is_reused() {
    let _only = exclusive(SHARED);
    let p = pool(31_003);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let a = alloc_in(p, 2 * MIB);
    let old = checkpoint(p);
    // SAFETY: a live handle.
    ok(unsafe { sp_checkpoint_free(old) });
    // Many new checkpoints: whatever the old handle's storage was, some reuse it.
    let fresh: Vec<_> = (0..64).map(|_| checkpoint(p)).collect();
    assert!(
        !fresh.contains(&old),
        "a new checkpoint has the value of a freed one"
    );
    let b = alloc_in(p, 3 * MIB);
    let before = state(p);
    // SAFETY: a freed handle is refused, never read.
    unsafe {
        refused(sp_checkpoint_restore(old, null(), 0, null_mut()), "freed");
        refused(sp_checkpoint_free(old), "freed");
    }
    assert_eq!(state(p), before);
    // The same for the other kinds.
    let d = delta(p, fresh[0]);
    // SAFETY: live, then freed handles.
    unsafe {
        ok(sp_delta_free(d));
        assert_eq!(sp_delta_freed_count(d), 0);
        refused(sp_delta_free(d), "freed");
        let g = group(pool(31_004), 2);
        ok(sp_variant_group_free(g));
        refused(sp_variant_begin(g, 0, null_mut()), "freed");
        refused(sp_variant_group_free(g), "freed");
        let s = snapshot();
        ok(sp_snapshot_free(s));
        // Whatever a new snapshot's slot is, the old handle stays dead.
        let again = snapshot();
        assert_ne!(again, s);
        snapshot_refused(s, "freed");
        ok(sp_snapshot_free(again));
    }
    for cp in fresh {
        // SAFETY: live handles.
        ok(unsafe { sp_checkpoint_free(cp) });
    }
    let _ = (a, b);
    ok(sp_check_invariants(SHARED));
}

#[test]
fn made_up_handles_are_refused() {
    setup();
    for v in [
        1usize,
        0x1234,
        8,
        usize::MAX,
        usize::MAX - 7,
        0x7f00_0000_0000,
        1 << 63,
    ] {
        // SAFETY: values that are not handles are refused, never read.
        unsafe {
            expect(
                sp_checkpoint_restore(v as *const sp_checkpoint, null(), 0, null_mut()),
                INVALID,
            );
            expect(sp_checkpoint_free(v as *mut sp_checkpoint), INVALID);
            expect(sp_delta_free(v as *mut sp_restore_delta), INVALID);
            expect(
                sp_variant_begin(v as *const sp_variant_group, 0, null_mut()),
                INVALID,
            );
            expect(sp_variant_end(v as *const sp_variant_group), INVALID);
            expect(sp_variant_group_free(v as *mut sp_variant_group), INVALID);
        }
        assert_eq!(sp_delta_created_count(v as *const sp_restore_delta), 0);
        snapshot_refused(v as *mut sp_snapshot, "never returned by slotpool");
    }
    // NULL: the _free functions accept it, the others refuse it.
    // SAFETY: NULL handles.
    unsafe {
        ok(sp_checkpoint_free(null_mut()));
        ok(sp_delta_free(null_mut()));
        ok(sp_variant_group_free(null_mut()));
        ok(sp_snapshot_free(null_mut()));
        refused(sp_variant_end(null()), "NULL");
        refused(sp_checkpoint_info(null(), null_mut(), null_mut()), "NULL");
        let mut seg = sp_segment_view::default();
        refused(sp_snapshot_segment(null(), 0, &mut seg), "NULL");
    }
    assert_eq!(sp_snapshot_segment_count(null()), 0);
}

#[test]
fn a_handle_freed_on_another_thread_while_in_use_is_never_read_after_free() {
    let _only = exclusive(SHARED);
    let p = pool(31_005);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    for _ in 0..200 {
        let cp = checkpoint(p) as usize;
        let user = std::thread::spawn(move || {
            // SAFETY: a handle that another thread may free meanwhile: either call succeeds or
            // it is refused as freed.
            let s = unsafe { sp_checkpoint_restore(cp as *const _, null(), 0, null_mut()) };
            assert!(
                s == sp_status::SP_OK || s == INVALID,
                "{s:?}: {}",
                last_error()
            );
        });
        // SAFETY: a live handle (its concurrent use holds its own reference).
        ok(unsafe { sp_checkpoint_free(cp as *mut _) });
        user.join().unwrap();
    }
    ok(sp_check_invariants(SHARED));
}

#[test]
fn pointer_lists_too_long_for_any_device_are_refused() {
    let _only = exclusive(SHARED);
    let p = pool(31_006);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(SHARED, p, null(), null_mut()) });
    let a = alloc_in(p, MIB);
    let cp = checkpoint(p);
    let keep = [a];
    let before = state(p);
    for n in [
        1usize << 40,
        1 << 61,
        usize::MAX,
        (isize::MAX as usize) / 8 + 1,
    ] {
        // SAFETY: a list whose length no device can have is refused before it is read.
        unsafe {
            refused(
                sp_checkpoint_restore(cp, keep.as_ptr(), n, null_mut()),
                "entries",
            );
            refused(sp_pool_verify_live(SHARED, p, keep.as_ptr(), n), "entries");
        }
        assert_eq!(state(p), before);
    }
    // The right length still works.
    // SAFETY: one readable pointer.
    unsafe {
        ok(sp_pool_verify_live(SHARED, p, keep.as_ptr(), 1));
        ok(sp_checkpoint_restore(cp, keep.as_ptr(), 1, null_mut()));
        ok(sp_checkpoint_free(cp));
    }
    ok(sp_free(a));
}

/// The names `docs/c-api.md` says `sp_has_feature` returns 1 for, and the names it says return 0.
fn documented_features() -> (Vec<String>, Vec<String>) {
    let doc = std::fs::read_to_string(repo_root().join("docs/c-api.md")).unwrap();
    let quoted = |s: &str| -> Vec<String> {
        s.split('"')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    };
    let para = |start: &str| -> Option<String> {
        let at = doc.find(start)?;
        let rest = &doc[at..];
        let end = rest
            .find("\n* ")
            .or_else(|| rest.find("\n\n"))
            .unwrap_or(rest.len());
        Some(rest[..end].to_string())
    };
    let on = para("`sp_has_feature(name)` returns 1 for").expect("the feature list");
    let off = para("It returns 0 for")
        .map(|p| quoted(&p))
        .unwrap_or_default();
    (quoted(&on), off)
}

#[test]
fn has_feature_agrees_with_the_docs_and_the_header() {
    let (on, off) = documented_features();
    let built: Vec<&str> = FEATURES
        .iter()
        .filter(|&&(_, on)| on)
        .map(|&(n, _)| n)
        .collect();
    for name in &built {
        assert!(on.iter().any(|n| n == name), "docs/c-api.md omits {name:?}");
    }
    for name in &on {
        let c = std::ffi::CString::new(name.as_str()).unwrap();
        // SAFETY: a NUL-terminated string.
        assert_eq!(unsafe { sp_has_feature(c.as_ptr()) }, 1, "{name}");
    }
    for name in &off {
        let c = std::ffi::CString::new(name.as_str()).unwrap();
        // SAFETY: a NUL-terminated string.
        let on = unsafe { sp_has_feature(c.as_ptr()) };
        assert_eq!(on, 0, "docs/c-api.md says {name:?} is not supported");
    }
    let header = std::fs::read_to_string(repo_root().join("include/slotpool.h")).unwrap();
    let at = header.find("int sp_has_feature").unwrap();
    let comment = &header[header[..at].rfind("/**").unwrap()..at];
    for name in &built {
        assert!(
            comment.contains(&format!("\"{name}\"")),
            "slotpool.h omits {name:?}"
        );
    }
    // SAFETY: NULL and a NUL-terminated string.
    unsafe {
        assert_eq!(sp_has_feature(null()), 0);
        assert_eq!(sp_has_feature(c"no_such_feature".as_ptr()), 0);
    }
}

#[test]
fn sim_bytes_are_refused_on_a_device_that_keeps_only_accounts() {
    // It allocates on the shared device, whose statistics other tests compare.
    let _only = exclusive(SHARED);
    let p = alloc(SHARED, MIB, 0);
    let mut buf = [0u8; 4];
    // SAFETY: a host buffer of 4 bytes; the device range is checked by slotpool.
    unsafe {
        expect(
            sp_sim_read(SHARED, p, buf.as_mut_ptr().cast(), 4),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE,
        );
        assert!(last_error().contains("sim_bytes:1"), "{}", last_error());
        expect(
            sp_sim_write(SHARED, p, buf.as_ptr().cast(), 4),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE,
        );
    }
    expect(
        sp_sim_fill(SHARED, p, 4, 1),
        sp_status::SP_ERR_BACKEND_UNAVAILABLE,
    );
    expect(sp_sim_fill(99, p, 4, 1), INVALID);
    ok(sp_free(p));
}
