//! `sp_pool_pause` / `sp_pool_resume` / `sp_pool_pause_info` on the sim backend: memory given
//! back and taken again at the same addresses, the paused status code, the statistics, and bad
//! input refused with nothing changed.

mod common;

use std::ffi::{CString, c_int, c_void};
use std::ptr::null_mut;

use common::*;
use slotpool::*;

const MIB: usize = 1 << 20;

fn named(name: &str, pausable: bool) -> sp_pool_id {
    let opts = sp_pool_options {
        pausable: c_int::from(pausable),
        ..Default::default()
    };
    let name = CString::new(name).unwrap();
    let mut id = sp_pool_id::default();
    // SAFETY: valid string, options and out-pointer.
    ok(unsafe { sp_pool_named(0, name.as_ptr(), &opts, &mut id) });
    id
}

fn alloc_in(id: sp_pool_id, size: usize) -> Result<*mut c_void, sp_status> {
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    match unsafe { sp_pool_alloc(0, id, size, 0, &mut p) } {
        sp_status::SP_OK => Ok(p),
        s => Err(s),
    }
}

fn info(id: sp_pool_id) -> (c_int, u64, u64) {
    let (mut paused, mut bytes, mut host) = (-1, 0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_pool_pause_info(0, id, &mut paused, &mut bytes, &mut host) });
    (paused, bytes, host)
}

/// `sp_pool_pause_info` with every out-pointer NULL.
fn no_info(id: sp_pool_id) -> sp_status {
    // SAFETY: NULL out-pointers are allowed.
    unsafe { sp_pool_pause_info(0, id, null_mut(), null_mut(), null_mut()) }
}

fn pool_stats(id: sp_pool_id) -> sp_memory_stats {
    let mut s = sp_memory_stats::default();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_stats_get(0, id, &mut s) });
    s
}

fn snapshot() -> String {
    let mut p = null_mut();
    // SAFETY: valid out-pointer; the string is copied and freed.
    unsafe {
        ok(sp_snapshot_json(0, &mut p, null_mut()));
        let s = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        ok(sp_string_free(p));
        s
    }
}

#[test]
fn pause_and_resume_through_the_c_abi() {
    let _g = exclusive(SHARED);
    // SAFETY: a NUL-terminated literal.
    assert_eq!(unsafe { sp_has_feature(c"pause".as_ptr()) }, 1);
    let kv = named("kv_cache", true);
    let small = alloc_in(kv, 4096).unwrap();
    let large = alloc_in(kv, 40 * MIB).unwrap();
    let reserved = pool_stats(kv).reserved_bytes.all.current;
    assert!(reserved > 0);
    assert_eq!(info(kv), (0, 0, 0));

    ok(sp_pool_pause(0, kv, SP_PAUSE_BACKUP));
    assert_eq!(info(kv), (1, reserved as u64, reserved as u64));
    let st = pool_stats(kv);
    assert_eq!(st.reserved_bytes.all.current, 0);
    assert_eq!(st.reserved_paused_bytes.all.current, reserved);
    assert_eq!(st.allocation.all.current, 2, "blocks kept");
    let mut dev = sp_memory_stats::default();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_memory_stats_get(0, &mut dev) });
    assert_eq!(dev.reserved_paused_bytes.all.current, reserved);
    assert!(snapshot().contains("\"is_paused\":true"));
    expect(
        alloc_in(kv, 4096).map(|_| ()).unwrap_err(),
        sp_status::SP_ERR_POOL_PAUSED,
    );
    assert!(last_error().contains("paused"), "{}", last_error());
    expect(sp_pool_pause(0, kv, 0), sp_status::SP_ERR_INVALID_STATE);
    // Freeing into a paused pool works.
    ok(sp_free(small));

    ok(sp_pool_resume(0, kv));
    // The backup's pinned buffer stays for the next pause while the pool is in use, through
    // empty-cache calls too (it is freed once the pool is released).
    assert_eq!(info(kv), (0, 0, reserved as u64));
    assert_eq!(pool_stats(kv).reserved_bytes.all.current, reserved);
    ok(sp_pool_empty_cache(0, kv));
    assert_eq!(info(kv), (0, 0, reserved as u64));
    expect(sp_pool_resume(0, kv), sp_status::SP_ERR_INVALID_STATE);
    let again = alloc_in(kv, 4096).unwrap();
    ok(sp_free(again));
    ok(sp_free(large));
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let _g = exclusive(SHARED);
    let plain = named("plain", false);
    let p = alloc_in(plain, 4096).unwrap();
    let kv = named("weights", true);
    let q = alloc_in(kv, 4 * MIB).unwrap();
    let before = (pool_stats(plain), pool_stats(kv), snapshot());
    let default_pool = sp_pool_id { a: 0, b: 0 };
    let unknown = sp_pool_id { a: 0, b: 424242 };
    for (status, want) in [
        (sp_pool_pause(0, kv, 2), sp_status::SP_ERR_INVALID_ARGUMENT),
        (
            sp_pool_pause(0, kv, 0x8000_0001),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        ),
        (
            sp_pool_pause(0, default_pool, 0),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        ),
        (sp_pool_pause(0, unknown, 0), sp_status::SP_ERR_UNKNOWN_POOL),
        (sp_pool_pause(99, kv, 0), sp_status::SP_ERR_INVALID_ARGUMENT),
        // Small blocks of a pool that is not pausable sit in classic segments (16 MiB pages).
        (sp_pool_pause(0, plain, 0), sp_status::SP_ERR_INVALID_STATE),
        (sp_pool_resume(0, kv), sp_status::SP_ERR_INVALID_STATE),
        (sp_pool_resume(0, unknown), sp_status::SP_ERR_UNKNOWN_POOL),
        (sp_pool_resume(-7, kv), sp_status::SP_ERR_INVALID_ARGUMENT),
        (no_info(unknown), sp_status::SP_ERR_UNKNOWN_POOL),
    ] {
        expect(status, want);
        assert!(!last_error().is_empty());
    }
    assert!(last_error().contains("unknown pool"), "{}", last_error());
    ok(no_info(kv));
    assert_eq!((pool_stats(plain), pool_stats(kv), snapshot()), before);
    ok(sp_free(p));
    ok(sp_free(q));
}
