//! Arenas through the C ABI under hostile use: a free touches only its own (branch, slot), a
//! refused or failed `sp_arena_alloc` changes no statistic and no snapshot, an arena keeps its
//! pool, and its pages are reserved bytes and snapshot segments.

mod common;

use std::ffi::c_void;
use std::ptr::{null, null_mut};

use common::*;
use slotpool::*;

const MIB: usize = 1 << 20;

fn pool(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

fn create(device: i32, p: sp_pool_id) -> u64 {
    let mut ar = 0u64;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_arena_create(device, p, 0, &mut ar) });
    ar
}

fn arena_alloc(device: i32, ar: u64, branch: u32, slot: u32, size: usize) -> sp_status {
    let mut out = null_mut::<c_void>();
    // SAFETY: valid out-pointer.
    let s = unsafe { sp_arena_alloc(device, ar, branch, slot, size, &mut out) };
    assert_eq!(s == sp_status::SP_OK, !out.is_null(), "out set iff success");
    s
}

fn use_count(device: i32, p: sp_pool_id) -> u64 {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_use_count(device, p, &mut n) });
    n
}

/// The snapshot of `device` as JSON.
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

/// The snapshot's segments of pool `p`.
fn segments_of(device: i32, p: sp_pool_id) -> Vec<serde_json::Value> {
    snapshot(device)["segments"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["segment_pool_id"] == serde_json::json!([p.a, p.b]))
        .cloned()
        .collect()
}

/// Everything a refused call must leave as it was: device and pool statistics and the snapshot.
fn observed(device: i32, p: sp_pool_id) -> (sp_memory_stats, sp_memory_stats, serde_json::Value) {
    (stats(device), pool_stats(device, p), snapshot(device))
}

#[test]
fn a_free_of_one_branch_leaves_the_other_live() {
    let _g = exclusive(QUIET);
    let p = pool(7100);
    let ar = create(QUIET, p);
    ok(arena_alloc(QUIET, ar, 0, 0, 4 * MIB));
    ok(arena_alloc(QUIET, ar, 1, 0, 4 * MIB));
    ok(sp_arena_free(QUIET, ar, 1, 0));
    let before = observed(QUIET, p);
    expect(
        arena_alloc(QUIET, ar, 0, 0, 4 * MIB),
        sp_status::SP_ERR_INVALID_STATE,
    );
    expect(sp_arena_destroy(QUIET, ar), sp_status::SP_ERR_INVALID_STATE);
    expect(
        sp_arena_free(QUIET, ar, 1, 0),
        sp_status::SP_ERR_INVALID_STATE,
    );
    assert!(!last_error().is_empty());
    assert_eq!(observed(QUIET, p), before, "refused calls changed state");
    ok(sp_arena_free(QUIET, ar, 0, 0));
    ok(sp_arena_destroy(QUIET, ar));
    ok(sp_check_invariants(QUIET));
}

#[test]
fn a_refused_alloc_changes_nothing() {
    let _g = exclusive(QUIET);
    let p = pool(7200);
    let ar = create(QUIET, p);
    ok(arena_alloc(QUIET, ar, 0, 0, MIB));
    let before = observed(QUIET, p);
    expect(
        arena_alloc(QUIET, ar, 0, 0, 64 * MIB),
        sp_status::SP_ERR_INVALID_STATE,
    );
    expect(
        arena_alloc(QUIET, ar, 0, 1, 0),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    expect(
        arena_alloc(QUIET, ar + 1000, 0, 1, MIB),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert_eq!(observed(QUIET, p), before, "a refused alloc changed state");
    ok(sp_arena_free(QUIET, ar, 0, 0));
    ok(sp_arena_destroy(QUIET, ar));
    ok(sp_check_invariants(QUIET));
}

/// The device's page size: what the first byte of an arena reserves.
fn page_size(device: i32) -> usize {
    let before = stats(device).reserved_bytes.all.current;
    let ar = create(device, pool(7000));
    ok(arena_alloc(device, ar, 0, 0, 1));
    let page = stats(device).reserved_bytes.all.current - before;
    ok(sp_arena_free(device, ar, 0, 0));
    ok(sp_arena_destroy(device, ar));
    ok(sp_empty_cache(device));
    assert!(page > 0, "an arena slot reserves a page");
    page as usize
}

#[test]
fn an_alloc_out_of_memory_maps_nothing() {
    let _g = exclusive(LIMITED);
    let page = page_size(LIMITED);
    ok(sp_set_memory_limit(LIMITED, 3 * page as u64));
    let p = pool(7300);
    let ar = create(LIMITED, p);
    ok(arena_alloc(LIMITED, ar, 0, 0, MIB));
    let before = observed(LIMITED, p);
    // Two more pages fit under the limit, the third does not.
    expect(
        arena_alloc(LIMITED, ar, 0, 1, 4 * page),
        sp_status::SP_ERR_OUT_OF_MEMORY,
    );
    let mut after = observed(LIMITED, p);
    // Counted as an allocation's refusal is: one retry after reclaiming the cache, one OOM.
    assert_eq!(
        (after.0.num_alloc_retries, after.0.num_ooms),
        (before.0.num_alloc_retries + 1, before.0.num_ooms + 1)
    );
    after.0.num_alloc_retries = before.0.num_alloc_retries;
    after.0.num_ooms = before.0.num_ooms;
    assert_eq!(after, before, "the failed alloc kept pages");
    ok(sp_check_invariants(LIMITED));
    // All that the limit leaves is still there to take.
    ok(arena_alloc(LIMITED, ar, 0, 1, 3 * page - MIB));
    assert_eq!(
        stats(LIMITED).reserved_bytes.all.current,
        3 * page as i64,
        "the arena holds the whole limit"
    );
    ok(sp_arena_free(LIMITED, ar, 0, 0));
    ok(sp_arena_free(LIMITED, ar, 0, 1));
    ok(sp_arena_destroy(LIMITED, ar));
    ok(sp_empty_cache(LIMITED));
    ok(sp_check_invariants(LIMITED));
    ok(sp_set_memory_limit(LIMITED, 0));
}

#[test]
fn an_arena_keeps_its_pool_alive() {
    let _g = exclusive(QUIET);
    let p = pool(7400);
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(QUIET, p, null(), null_mut()) });
    let ar = create(QUIET, p);
    assert_eq!(use_count(QUIET, p), 2, "the arena holds a use");
    ok(arena_alloc(QUIET, ar, 0, 0, 8 * MIB));
    ok(sp_arena_free(QUIET, ar, 0, 0));
    // SAFETY: NULL count is allowed.
    ok(unsafe { sp_pool_release(QUIET, p, null_mut()) });
    ok(sp_empty_cache(QUIET));
    assert_eq!(
        use_count(QUIET, p),
        1,
        "the pool lives while its arena does"
    );
    // SAFETY: NULL options and count are allowed.
    ok(unsafe { sp_pool_create_or_incref(QUIET, p, null(), null_mut()) });
    ok(sp_arena_destroy(QUIET, ar));
    ok(sp_check_invariants(QUIET));
    assert_eq!(use_count(QUIET, p), 1);
    assert_eq!(pool_stats(QUIET, p).reserved_bytes.all.current, 0);
    // The pool's budget is whole: a limit of two pages admits two pages.
    let page = page_size(QUIET);
    let opts = sp_pool_options {
        limit_bytes: 2 * page as u64,
        ..Default::default()
    };
    // SAFETY: valid options.
    ok(unsafe { sp_pool_set_options(QUIET, p, &opts) });
    let mut x = null_mut();
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_pool_alloc(QUIET, p, 2 * page, 0, &mut x) });
    ok(sp_free(x));
    // SAFETY: NULL count is allowed.
    ok(unsafe { sp_pool_release(QUIET, p, null_mut()) });
    ok(sp_empty_cache(QUIET));
    ok(sp_check_invariants(QUIET));
}

#[test]
fn arena_pages_are_reserved_bytes_and_snapshot_segments() {
    let _g = exclusive(QUIET);
    ok(sp_empty_cache(QUIET));
    let page = page_size(QUIET);
    let p = pool(7500);
    let base = stats(QUIET);
    let ar = create(QUIET, p);
    ok(arena_alloc(QUIET, ar, 0, 0, 3 * MIB));
    ok(arena_alloc(QUIET, ar, 1, 0, 3 * MIB));
    let s = stats(QUIET);
    let grew = s.reserved_bytes.all.current - base.reserved_bytes.all.current;
    assert_eq!(
        grew as usize,
        (3 * MIB).div_ceil(page) * page,
        "pages reserved"
    );
    assert!(s.reserved_bytes.all.peak >= s.reserved_bytes.all.current);
    assert_eq!(pool_stats(QUIET, p).reserved_bytes.all.current, grew);
    assert_eq!(
        pool_stats(QUIET, p).allocated_bytes.all.current,
        3 * MIB as i64
    );
    let segs = segments_of(QUIET, p);
    assert_eq!(segs.len(), 1, "{segs:?}");
    assert_eq!(segs[0]["total_size"], grew);
    assert_eq!(segs[0]["allocated_size"], 3 * MIB);
    ok(sp_arena_free(QUIET, ar, 0, 0));
    ok(sp_arena_free(QUIET, ar, 1, 0));
    assert_eq!(segments_of(QUIET, p)[0]["allocated_size"], 0);
    ok(sp_arena_destroy(QUIET, ar));
    assert!(segments_of(QUIET, p).is_empty());
    assert_eq!(
        stats(QUIET).reserved_bytes.all.current,
        base.reserved_bytes.all.current
    );
    ok(sp_empty_cache(QUIET));
    ok(sp_check_invariants(QUIET));
}
