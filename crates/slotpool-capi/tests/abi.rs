//! The C ABI called from Rust through the rlib, on the sim backend: every call's success path and
//! every kind of bad input (null out-pointers, unknown and foreign pointers, double free, zero and
//! absurd sizes, unknown devices and pools, bad options).
//!
//! Lifecycle scenarios that need a fresh process (lazy init, init errors, shutdown, logging) are in
//! `lifecycle.rs`.

mod common;

use std::ffi::{CStr, c_char, c_void};
use std::ptr::{self, null_mut};

use common::*;
use slotpool::*;

const MIB: usize = 1 << 20;
const NO_POOL: sp_pool_id = sp_pool_id { a: 7777, b: 7777 };

fn pool(b: u64) -> sp_pool_id {
    sp_pool_id { a: 0, b }
}

/// A fake device pointer that no allocator handed out.
fn bogus(addr: usize) -> *mut c_void {
    addr as *mut c_void
}

#[test]
fn version_features_and_backend() {
    setup();
    let (mut a, mut b, mut c) = (-1, -1, -1);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_version(&mut a, &mut b, &mut c) });
    assert_eq!(
        format!("{a}.{b}.{c}"),
        env!("CARGO_PKG_VERSION"),
        "sp_version vs the crate"
    );
    // SAFETY: NULL is rejected before any write.
    expect(
        unsafe { sp_version(null_mut(), &mut b, &mut c) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert!(last_error().contains("major"), "{}", last_error());
    // SAFETY: NUL-terminated literals or NULL.
    unsafe {
        assert_eq!(sp_has_feature(c"sim".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"cuda".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"vmm".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"checkpoint".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"traces".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"vmm_ipc".as_ptr()), 1);
        assert_eq!(sp_has_feature(c"ipc".as_ptr()), 0);
        assert_eq!(sp_has_feature(c"no such thing".as_ptr()), 0);
        assert_eq!(sp_has_feature(ptr::null()), 0);
    }
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_device_count(&mut n) });
    assert_eq!(n, DEVICES);
    let mut init = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_is_initialized(&mut init) });
    assert_eq!(init, 1);
    let mut name: *const c_char = ptr::null();
    // SAFETY: valid out-pointer; the result is a static string.
    ok(unsafe { sp_backend_name(&mut name) });
    // SAFETY: a static NUL-terminated string.
    assert_eq!(unsafe { CStr::from_ptr(name) }, c"sim");
}

#[test]
fn second_init_is_refused_and_bad_arguments_are_named() {
    setup();
    // SAFETY: literals.
    unsafe {
        expect(
            sp_init(c"sim".as_ptr(), ptr::null()),
            sp_status::SP_ERR_INVALID_STATE,
        );
        assert!(last_error().contains("already initialised"));
        expect(
            sp_init(c"sim".as_ptr(), c"bogus_key:1".as_ptr()),
            sp_status::SP_ERR_CONFIG,
        );
        assert!(last_error().contains("bogus_key"), "{}", last_error());
        expect(
            sp_init(c"tpu".as_ptr(), ptr::null()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(last_error().contains("tpu"));
    }
}

#[test]
fn last_error_is_per_thread_and_cleared_by_success() {
    setup();
    expect(sp_free(null_mut()), sp_status::SP_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("ptr is NULL"), "{}", last_error());
    std::thread::spawn(|| assert_eq!(last_error(), ""))
        .join()
        .unwrap();
    let p = alloc(SHARED, 100, 0);
    assert_eq!(last_error(), "");
    ok(sp_free(p));
}

#[test]
fn alloc_on_two_streams_and_reuse_on_the_same_stream() {
    setup();
    let a = alloc(SHARED, MIB, 101);
    let b = alloc(SHARED, 1000, 102);
    assert_ne!(a, b);
    let (mut base, mut size, mut req, mut dev) = (null_mut(), 0usize, 0usize, -1);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_allocation_info(b, &mut base, &mut size, &mut req, &mut dev) });
    assert_eq!((base, size, req, dev), (b, 1024, 1000, SHARED));
    ok(sp_record_stream(a, 102));
    ok(sp_free(a));
    ok(sp_free(b));
    // Same stream, same size: the cached block comes back.
    let c = alloc(SHARED, 1000, 102);
    assert_eq!(c, b);
    ok(sp_free(c));
}

#[test]
fn record_stream_defers_reuse_until_events_complete() {
    // With auto-completion the event completes at once, so the block is reusable after
    // process_events; the call sequence is what is checked here.
    setup();
    let a = alloc(SHARED, 4096, 201);
    ok(sp_record_stream(a, 202));
    ok(sp_record_stream(a, 202));
    ok(sp_free(a));
    ok(sp_process_events(SHARED));
    ok(sp_process_events(-1));
    let b = alloc(SHARED, 4096, 201);
    ok(sp_free(b));
}

#[test]
fn devices_are_separate_and_frees_find_their_device() {
    let _g = exclusive(SECOND);
    let a = alloc(SHARED, 3 * MIB, 0);
    let b = alloc(SECOND, 3 * MIB, 0);
    let (mut base, mut size, mut req, mut dev) = (null_mut(), 0usize, 0usize, -1);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_allocation_info(b, &mut base, &mut size, &mut req, &mut dev) });
    assert_eq!(dev, SECOND);
    // SAFETY: as above.
    ok(unsafe { sp_allocation_info(a, &mut base, &mut size, &mut req, &mut dev) });
    assert_eq!(dev, SHARED);
    ok(sp_free(b));
    ok(sp_free(a));
}

#[test]
fn segment_info_names_the_segment_and_its_kind() {
    setup();
    // The library's defaults: 16 MiB vmm pages, so a small block grows by a classic 2 MiB
    // segment and a large one by a vmm reservation.
    let small = alloc(SHARED, 100 * 1024, 0);
    let large = alloc(SHARED, 40 * MIB, 0);
    for (p, want_vmm) in [(small, 0), (large, 1)] {
        let (mut base, mut size, mut vmm) = (null_mut(), 0usize, -1);
        // SAFETY: valid out-pointers.
        ok(unsafe { sp_segment_info(p, &mut base, &mut size, &mut vmm) });
        assert_eq!(vmm, want_vmm, "{p:?}");
        let (b, p) = (base as usize, p as usize);
        assert!(b <= p && p < b + size, "{p:#x} outside {b:#x}+{size}");
    }
    let (mut base, mut size, mut vmm) = (null_mut(), 0usize, -1);
    // SAFETY: valid out-pointers or NULL, which is rejected before any write.
    unsafe {
        expect(
            sp_segment_info(small, null_mut(), &mut size, &mut vmm),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_segment_info(null_mut(), &mut base, &mut size, &mut vmm),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        let inside = (small as *mut u8).wrapping_add(512) as *mut c_void;
        expect(
            sp_segment_info(inside, &mut base, &mut size, &mut vmm),
            sp_status::SP_ERR_UNKNOWN_POINTER,
        );
    }
    assert_eq!(
        (base, size, vmm),
        (null_mut(), 0, -1),
        "a refused call writes nothing"
    );
    ok(sp_free(small));
    ok(sp_free(large));
}

/// CUDA IPC of vmm memory on the sim backend: bad input is refused with nothing written, a
/// classic block is sent to cudaIpcGetMemHandle, a short fds array reports the page count, and
/// the simulated device refuses to export or map (it has no other process to share with).
#[test]
fn ipc_export_and_open_refuse_bad_input() {
    setup();
    let small = alloc(SHARED, 100 * 1024, 0);
    let large = alloc(SHARED, 40 * MIB, 0);
    let (mut count, mut page, mut offset) = (usize::MAX, 0usize, 0usize);
    let mut fds = [-1i32; 16];
    // SAFETY: valid out-pointers and an fds array of 16, or NULL where the call must refuse.
    unsafe {
        expect(
            sp_ipc_export(
                large,
                fds.as_mut_ptr(),
                16,
                null_mut(),
                &mut page,
                &mut offset,
            ),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_export(
                null_mut(),
                fds.as_mut_ptr(),
                16,
                &mut count,
                &mut page,
                &mut offset,
            ),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_export(large, null_mut(), 8, &mut count, &mut page, &mut offset),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert_eq!(count, usize::MAX, "a refused call writes nothing");
        expect(
            sp_ipc_export(
                bogus(0x5000_0000),
                fds.as_mut_ptr(),
                16,
                &mut count,
                &mut page,
                &mut offset,
            ),
            sp_status::SP_ERR_UNKNOWN_POINTER,
        );
        expect(
            sp_ipc_export(
                small,
                fds.as_mut_ptr(),
                16,
                &mut count,
                &mut page,
                &mut offset,
            ),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(
            last_error().contains("cudaIpcGetMemHandle"),
            "{}",
            last_error()
        );
        // A size query: no room, the page count comes back (40 MiB over the default pages).
        expect(
            sp_ipc_export(large, null_mut(), 0, &mut count, &mut page, &mut offset),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        let pages = (40 << 20) / slotpool_core::Config::default().vmm_page_size.unwrap();
        assert!((pages..=pages + 1).contains(&(count as u64)), "{count}");
        expect(
            sp_ipc_export(
                large,
                fds.as_mut_ptr(),
                16,
                &mut count,
                &mut page,
                &mut offset,
            ),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE,
        );
        assert!(last_error().contains("simulated"), "{}", last_error());
        assert_eq!(fds, [-1; 16], "nothing exported");
        let mut base = null_mut();
        expect(
            sp_ipc_open(SHARED, 1, fds.as_ptr(), 0, 16 * MIB, &mut base),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_open(SHARED, 1, ptr::null(), 1, 16 * MIB, &mut base),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_open(SHARED, 1, fds.as_ptr(), 1, 16 * MIB, null_mut()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_open(999, 1, fds.as_ptr(), 1, 16 * MIB, &mut base),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_open(SHARED, 1, fds.as_ptr(), 1, 16 * MIB, &mut base),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE,
        );
        assert!(base.is_null());
        expect(
            sp_ipc_close(SHARED, null_mut()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_ipc_close(SHARED, bogus(0x5000_0000)),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE,
        );
    }
    ok(sp_free(small));
    ok(sp_free(large));
}

#[test]
fn null_out_pointers_are_rejected() {
    setup();
    let p = alloc(SHARED, 64, 0);
    let invalid = sp_status::SP_ERR_INVALID_ARGUMENT;
    let (mut v, mut sz, mut u, mut i) = (null_mut(), 0usize, 0u64, 0);
    // SAFETY: every pointer is NULL or valid; NULL ones are rejected before any write.
    unsafe {
        expect(sp_alloc(SHARED, 64, 0, null_mut()), invalid);
        expect(sp_pool_alloc(SHARED, pool(0), 64, 0, null_mut()), invalid);
        expect(sp_device_count(null_mut()), invalid);
        expect(sp_is_initialized(null_mut()), invalid);
        expect(sp_backend_name(null_mut()), invalid);
        expect(sp_largest_free_block(SHARED, null_mut()), invalid);
        expect(sp_memory_stats_get(SHARED, null_mut()), invalid);
        expect(sp_pool_stats_get(SHARED, pool(0), null_mut()), invalid);
        expect(sp_pool_use_count(SHARED, pool(0), null_mut()), invalid);
        expect(sp_snapshot_json(SHARED, null_mut(), null_mut()), invalid);
        expect(sp_memory_limit_get(SHARED, null_mut(), &mut u), invalid);
        expect(sp_memory_limit_get(SHARED, &mut u, null_mut()), invalid);
        expect(
            sp_pool_named(SHARED, c"x".as_ptr(), ptr::null(), null_mut()),
            invalid,
        );
        expect(sp_pool_set_options(SHARED, pool(0), ptr::null()), invalid);
        assert!(last_error().contains("opts"));
        expect(
            sp_allocation_info(p, null_mut(), &mut sz, &mut sz, &mut i),
            invalid,
        );
        expect(
            sp_allocation_info(p, &mut v, null_mut(), &mut sz, &mut i),
            invalid,
        );
        expect(
            sp_allocation_info(p, &mut v, &mut sz, null_mut(), &mut i),
            invalid,
        );
        expect(
            sp_allocation_info(p, &mut v, &mut sz, &mut sz, null_mut()),
            invalid,
        );
    }
    // The allocation is untouched by all of that.
    ok(sp_free(p));
}

#[test]
fn bad_pointers_change_nothing() {
    let _g = exclusive(QUIET);
    let p = alloc(QUIET, 5000, 0);
    let before = stats(QUIET);
    let host = Box::new(0u64);
    let host_ptr = &*host as *const u64 as *mut c_void;
    let interior = (p as usize + 512) as *mut c_void;
    let unknown = sp_status::SP_ERR_UNKNOWN_POINTER;
    for q in [bogus(0x1234), bogus(usize::MAX), host_ptr, interior] {
        expect(sp_free(q), unknown);
        assert!(last_error().contains("unknown pointer"), "{}", last_error());
        expect(sp_record_stream(q, 3), unknown);
        let (mut b, mut s, mut r, mut d) = (null_mut(), 0usize, 0usize, 0);
        // SAFETY: valid out-pointers.
        expect(
            unsafe { sp_allocation_info(q, &mut b, &mut s, &mut r, &mut d) },
            unknown,
        );
    }
    expect(sp_free(null_mut()), sp_status::SP_ERR_INVALID_ARGUMENT);
    expect(
        sp_record_stream(null_mut(), 0),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert_eq!(stats(QUIET), before, "bad pointers changed the statistics");
    ok(sp_free(p));
    // Double free: detected, nothing changes.
    let after_free = stats(QUIET);
    expect(sp_free(p), unknown);
    assert!(last_error().contains(&format!("{:#x}", p as usize)));
    assert_eq!(stats(QUIET), after_free);
    // sp_torch_free of garbage: no crash, no change, a message.
    sp_torch_free(bogus(0x9999), 16, QUIET, null_mut());
    assert!(last_error().contains("unknown pointer"));
    assert_eq!(stats(QUIET), after_free);
}

#[test]
fn zero_and_absurd_sizes() {
    let _g = exclusive(QUIET);
    ok(sp_empty_cache(QUIET));
    let before = stats(QUIET);
    for size in [0usize, usize::MAX, (1usize << 56) + 1] {
        let mut p = bogus(0xdead);
        // SAFETY: valid out-pointer.
        expect(
            unsafe { sp_alloc(QUIET, size, 0, &mut p) },
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(p.is_null(), "out must be NULL after a failure");
        assert!(last_error().contains("size"), "{}", last_error());
        let mut p = bogus(0xdead);
        // SAFETY: valid out-pointer.
        expect(
            unsafe { sp_pool_alloc(QUIET, pool(0), size, 0, &mut p) },
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(p.is_null());
    }
    // Large but legal: out of memory (4 GiB devices), with the report in the message.
    let mut p = bogus(0xdead);
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_alloc(QUIET, 1 << 50, 0, &mut p) },
        sp_status::SP_ERR_OUT_OF_MEMORY,
    );
    assert!(p.is_null());
    let msg = last_error();
    assert!(msg.contains("out of memory"), "{msg}");
    // Counted as an out-of-memory (PyTorch's num_ooms), and nothing else changed.
    let after_huge = stats(QUIET);
    assert_eq!(after_huge.num_ooms, before.num_ooms + 1);
    assert_eq!(
        sp_memory_stats {
            num_ooms: before.num_ooms,
            ..after_huge
        },
        before
    );
    let before = after_huge;
    // Larger than the free memory but not than the device: the core's OOM path and report.
    let held = alloc(QUIET, 3 << 30, 0);
    let mut p = bogus(0xdead);
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_alloc(QUIET, 2 << 30, 0, &mut p) },
        sp_status::SP_ERR_OUT_OF_MEMORY,
    );
    assert!(p.is_null());
    let msg = last_error();
    assert!(
        msg.contains("out of memory") && msg.contains("reserved"),
        "{msg}"
    );
    ok(sp_free(held));
    ok(sp_empty_cache(QUIET));
    let after = stats(QUIET);
    assert_eq!(after.num_ooms, before.num_ooms + 1);
    assert_eq!(
        after.allocated_bytes.all.current,
        before.allocated_bytes.all.current
    );
    assert_eq!(after.reserved_bytes.all.current, 0);
    assert!(sp_torch_malloc(-5, QUIET, null_mut()).is_null());
    assert!(last_error().contains("negative"));
    assert!(sp_torch_malloc(0, QUIET, null_mut()).is_null());
}

#[test]
fn unknown_devices_are_rejected() {
    setup();
    let invalid = sp_status::SP_ERR_INVALID_ARGUMENT;
    for d in [DEVICES, 1000, i32::MAX, i32::MIN, -2] {
        let mut p = null_mut();
        let mut sz = 0usize;
        let mut u = 0u64;
        let mut st = sp_memory_stats::default();
        let mut id = sp_pool_id::default();
        let mut json: *mut c_char = null_mut();
        // SAFETY: valid out-pointers and literals.
        unsafe {
            expect(sp_alloc(d, 64, 0, &mut p), invalid);
            assert!(last_error().contains("device"), "{}", last_error());
            expect(sp_pool_alloc(d, pool(1), 64, 0, &mut p), invalid);
            expect(sp_largest_free_block(d, &mut sz), invalid);
            expect(sp_memory_stats_get(d, &mut st), invalid);
            expect(sp_memory_peaks(d, &mut u, &mut u), invalid);
            expect(sp_pool_stats_get(d, pool(0), &mut st), invalid);
            expect(sp_snapshot_json(d, &mut json, &mut sz), invalid);
            expect(sp_memory_limit_get(d, &mut u, &mut u), invalid);
            expect(
                sp_pool_create_or_incref(d, pool(1), ptr::null(), &mut u),
                invalid,
            );
            expect(
                sp_pool_named(d, c"x".as_ptr(), ptr::null(), &mut id),
                invalid,
            );
            expect(sp_pool_release(d, pool(1), &mut u), invalid);
            expect(sp_pool_use_count(d, pool(1), &mut u), invalid);
        }
        expect(sp_empty_cache(d), invalid);
        expect(sp_process_events(d), invalid);
        expect(sp_reset_peak_stats(d), invalid);
        expect(sp_reset_accumulated_stats(d), invalid);
        expect(sp_set_memory_fraction(d, 0.5), invalid);
        expect(sp_set_memory_limit(d, 1 << 30), invalid);
        expect(sp_pool_empty_cache(d, pool(1)), invalid);
        expect(
            sp_begin_allocate_to_pool(d, pool(1), sp_route_kind::SP_ROUTE_ALL, 0),
            invalid,
        );
        expect(sp_end_allocate_to_pool(d, pool(1)), invalid);
        assert!(sp_torch_malloc(64, d, null_mut()).is_null());
    }
}

#[test]
fn unknown_pools_are_rejected() {
    setup();
    let unknown = sp_status::SP_ERR_UNKNOWN_POOL;
    let mut u = 0u64;
    let mut p = null_mut();
    let mut st = sp_memory_stats::default();
    let opts = sp_pool_options::default();
    // SAFETY: valid pointers.
    unsafe {
        expect(sp_pool_use_count(SHARED, NO_POOL, &mut u), unknown);
        assert!(last_error().contains("7777"), "{}", last_error());
        expect(sp_pool_release(SHARED, NO_POOL, &mut u), unknown);
        expect(sp_pool_set_options(SHARED, NO_POOL, &opts), unknown);
        expect(sp_pool_stats_get(SHARED, NO_POOL, &mut st), unknown);
        expect(sp_pool_alloc(SHARED, NO_POOL, 64, 0, &mut p), unknown);
        assert!(p.is_null());
    }
    expect(sp_pool_empty_cache(SHARED, NO_POOL), unknown);
    expect(
        sp_end_allocate_to_pool(SHARED, NO_POOL),
        sp_status::SP_ERR_INVALID_STATE,
    );
}

#[test]
fn pool_lifecycle() {
    setup();
    let id = pool(1001);
    let opts = sp_pool_options {
        no_split: 0,
        use_on_oom: 1,
        limit_bytes: 0,
        pausable: 0,
    };
    let mut n = 0u64;
    // SAFETY: valid pointers throughout.
    unsafe {
        ok(sp_pool_create_or_incref(SHARED, id, &opts, &mut n));
        assert_eq!(n, 1);
        ok(sp_pool_create_or_incref(SHARED, id, ptr::null(), &mut n));
        assert_eq!(n, 2);
        ok(sp_pool_create_or_incref(
            SHARED,
            id,
            ptr::null(),
            null_mut(),
        ));
        ok(sp_pool_use_count(SHARED, id, &mut n));
        assert_eq!(n, 3);
        ok(sp_pool_release(SHARED, id, null_mut()));
        ok(sp_pool_release(SHARED, id, &mut n));
        assert_eq!(n, 1);

        let mut p = null_mut();
        ok(sp_pool_alloc(SHARED, id, 3 * MIB, 17, &mut p));
        let s = pool_stats(SHARED, id);
        assert_eq!(s.allocation.all.current, 1);
        assert_eq!(s.requested_bytes.all.current, 3 * MIB as i64);
        let limited = sp_pool_options {
            no_split: 1,
            use_on_oom: 0,
            limit_bytes: 64 << 20,
            pausable: 0,
        };
        ok(sp_pool_set_options(SHARED, id, &limited));
        let mut big = null_mut();
        expect(
            sp_pool_alloc(SHARED, id, 128 << 20, 17, &mut big),
            sp_status::SP_ERR_OUT_OF_MEMORY,
        );
        ok(sp_free(p));
        ok(sp_pool_empty_cache(SHARED, id));
        assert_eq!(pool_stats(SHARED, id).reserved_bytes.all.current, 0);

        ok(sp_pool_release(SHARED, id, &mut n));
        assert_eq!(n, 0);
        expect(
            sp_pool_release(SHARED, id, &mut n),
            sp_status::SP_ERR_INVALID_STATE,
        );
        // The default pool cannot be created or released.
        expect(
            sp_pool_create_or_incref(SHARED, pool(0), ptr::null(), &mut n),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_pool_release(SHARED, pool(0), &mut n),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        ok(sp_pool_use_count(SHARED, pool(0), &mut n));
        assert_eq!(n, 1);
    }
}

#[test]
fn named_pools() {
    setup();
    let mut a = sp_pool_id::default();
    let mut b = sp_pool_id::default();
    let mut n = 0u64;
    // SAFETY: valid pointers and NUL-terminated strings.
    unsafe {
        ok(sp_pool_named(
            SHARED,
            c"activations".as_ptr(),
            ptr::null(),
            &mut a,
        ));
        ok(sp_pool_named(
            SHARED,
            c"activations".as_ptr(),
            ptr::null(),
            &mut b,
        ));
        assert_eq!(a, b);
        assert_eq!(a.a, 0);
        assert!(a.b >= 1 << 63);
        ok(sp_pool_use_count(SHARED, a, &mut n));
        assert_eq!(n, 2);
        let mut other = sp_pool_id::default();
        ok(sp_pool_named(
            SHARED,
            c"weights".as_ptr(),
            ptr::null(),
            &mut other,
        ));
        assert_ne!(other, a);
        expect(
            sp_pool_named(SHARED, ptr::null(), ptr::null(), &mut b),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        expect(
            sp_pool_named(SHARED, c"".as_ptr(), ptr::null(), &mut b),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        let not_utf8 = [0xffu8, 0xfe, 0];
        expect(
            sp_pool_named(SHARED, not_utf8.as_ptr().cast(), ptr::null(), &mut b),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(last_error().contains("UTF-8"));
    }
}

#[test]
fn routes_send_allocations_to_pools() {
    let _g = exclusive(QUIET);
    let kind = sp_route_kind::SP_ROUTE_STREAM;
    let rp = pool(2001);
    ok(sp_begin_allocate_to_pool(QUIET, rp, kind, 9));
    expect(
        sp_begin_allocate_to_pool(QUIET, rp, kind, 9),
        sp_status::SP_ERR_INVALID_STATE,
    );
    let on_route = alloc(QUIET, 2048, 9);
    let off_route = alloc(QUIET, 2048, 8);
    assert_eq!(pool_stats(QUIET, rp).allocation.all.current, 1);
    ok(sp_end_allocate_to_pool(QUIET, rp));
    expect(
        sp_end_allocate_to_pool(QUIET, rp),
        sp_status::SP_ERR_INVALID_STATE,
    );
    ok(sp_free(on_route));
    ok(sp_free(off_route));

    // Every allocation.
    let all = pool(2002);
    ok(sp_begin_allocate_to_pool(
        QUIET,
        all,
        sp_route_kind::SP_ROUTE_ALL,
        0,
    ));
    let p = alloc(QUIET, 4096, 33);
    assert_eq!(pool_stats(QUIET, all).allocation.all.current, 1);
    ok(sp_free(p));
    ok(sp_end_allocate_to_pool(QUIET, all));

    // This thread only.
    let th = pool(2003);
    ok(sp_begin_allocate_to_pool(
        QUIET,
        th,
        sp_route_kind::SP_ROUTE_CURRENT_THREAD,
        0,
    ));
    let mine = alloc(QUIET, 4096, 0);
    let theirs = std::thread::spawn(|| alloc(QUIET, 4096, 0) as usize)
        .join()
        .unwrap();
    assert_eq!(pool_stats(QUIET, th).allocation.all.current, 1);
    ok(sp_end_allocate_to_pool(QUIET, th));
    ok(sp_free(mine));
    ok(sp_free(theirs as *mut c_void));

    // A capture id no stream is capturing into: nothing matches.
    let cap = pool(2004);
    ok(sp_begin_allocate_to_pool(
        QUIET,
        cap,
        sp_route_kind::SP_ROUTE_CAPTURE,
        77,
    ));
    let p = alloc(QUIET, 4096, 0);
    assert_eq!(pool_stats(QUIET, cap).allocation.all.current, 0);
    ok(sp_end_allocate_to_pool(QUIET, cap));
    ok(sp_free(p));

    // Bad kinds and the default pool are refused; nothing is routed afterwards.
    expect(
        sp_begin_allocate_to_pool(QUIET, pool(2005), sp_route_kind(99), 0),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert!(last_error().contains("route kind 99"));
    expect(
        sp_begin_allocate_to_pool(QUIET, pool(0), sp_route_kind::SP_ROUTE_ALL, 0),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let mut n = 0;
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_pool_use_count(QUIET, pool(2005), &mut n) },
        sp_status::SP_ERR_UNKNOWN_POOL,
    );
    for id in [rp, all, th, cap] {
        // SAFETY: valid out-pointer.
        ok(unsafe { sp_pool_release(QUIET, id, &mut n) });
        assert_eq!(n, 0);
    }
    ok(sp_empty_cache(QUIET));
}

#[test]
fn statistics_follow_pytorch() {
    let _g = exclusive(QUIET);
    ok(sp_empty_cache(QUIET));
    ok(sp_reset_accumulated_stats(QUIET));
    ok(sp_reset_peak_stats(QUIET));
    let p = alloc(QUIET, 1000, 0);
    let q = alloc(QUIET, 3 * MIB, 0);
    let s = stats(QUIET);
    assert_eq!(s.allocation.all.current, 2);
    assert_eq!(s.allocation.small_pool.current, 1);
    assert_eq!(s.allocation.large_pool.current, 1);
    assert_eq!(s.allocated_bytes.small_pool.current, 1024);
    assert_eq!(s.allocated_bytes.large_pool.current, 3 * MIB as i64);
    assert_eq!(s.requested_bytes.all.current, 1000 + 3 * MIB as i64);
    assert!(s.reserved_bytes.all.current >= s.allocated_bytes.all.current);
    assert_eq!(s.max_split_size, -1);
    ok(sp_free(q));
    let s = stats(QUIET);
    assert_eq!(s.allocated_bytes.all.current, 1024);
    assert_eq!(s.allocated_bytes.all.peak, 1024 + 3 * MIB as i64);
    assert_eq!(s.allocated_bytes.all.freed, 3 * MIB as i64);
    ok(sp_reset_peak_stats(QUIET));
    assert_eq!(stats(QUIET).allocated_bytes.all.peak, 1024);
    ok(sp_reset_accumulated_stats(QUIET));
    let s = stats(QUIET);
    assert_eq!(
        (s.allocated_bytes.all.allocated, s.allocated_bytes.all.freed),
        (0, 0)
    );
    let mut largest = 0usize;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_largest_free_block(QUIET, &mut largest) });
    assert!(largest >= 3 * MIB, "largest free block {largest}");
    ok(sp_free(p));
    ok(sp_empty_cache(QUIET));
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_largest_free_block(QUIET, &mut largest) });
    assert_eq!(largest, 0);
    assert_eq!(stats(QUIET).reserved_bytes.all.current, 0);
    // Every device: SECOND too, whose invariant check (in another test) must not see a
    // credit settled or a segment released halfway through.
    let _second = exclusive(SECOND);
    ok(sp_reset_peak_stats(-1));
    ok(sp_reset_accumulated_stats(-1));
    ok(sp_empty_cache(-1));
}

#[test]
fn memory_limits_and_fractions() {
    let _g = exclusive(LIMITED);
    let (mut limit, mut total) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_memory_limit_get(LIMITED, &mut limit, &mut total) });
    assert_eq!((limit, total), (4 << 30, 4 << 30));
    ok(sp_set_memory_limit(LIMITED, 64 << 20));
    let mut p = bogus(1);
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_alloc(LIMITED, 128 * MIB, 0, &mut p) },
        sp_status::SP_ERR_OUT_OF_MEMORY,
    );
    assert!(p.is_null());
    assert!(last_error().contains("out of memory"));
    let small = alloc(LIMITED, 32 * MIB, 0);
    ok(sp_free(small));
    ok(sp_set_memory_limit(LIMITED, 0));
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_memory_limit_get(LIMITED, &mut limit, &mut total) });
    assert_eq!(limit, total);
    for bad in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
        expect(
            sp_set_memory_fraction(LIMITED, bad),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
    }
    ok(sp_set_memory_fraction(LIMITED, 0.25));
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_memory_limit_get(LIMITED, &mut limit, &mut total) });
    assert_eq!(limit, total / 4);
    ok(sp_set_memory_fraction(LIMITED, 1.0));
    ok(sp_empty_cache(LIMITED));
}

#[test]
fn snapshot_has_pytorch_shape() {
    let _g = exclusive(QUIET);
    let small = alloc(QUIET, 1000, 0);
    let large = alloc(QUIET, 5 * MIB, 4);
    let mut json: *mut c_char = null_mut();
    let mut len = 0usize;
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_snapshot_json(QUIET, &mut json, &mut len) });
    assert!(!json.is_null());
    // SAFETY: slotpool returned a NUL-terminated string of `len` bytes; copied before freeing.
    let text = unsafe { CStr::from_ptr(json) }.to_str().unwrap().to_owned();
    assert_eq!(text.len(), len);
    // SAFETY: returned by sp_snapshot_json, freed once.
    ok(unsafe { sp_string_free(json) });
    // SAFETY: NULL is accepted.
    ok(unsafe { sp_string_free(null_mut()) });

    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let traces = v["device_traces"].as_array().unwrap();
    assert_eq!(traces.len(), DEVICES as usize);
    // The configuration in effect, as text that parses back to it.
    assert_eq!(v["allocator_settings"]["backend"], "sim", "{text}");
    let conf = v["allocator_settings"]["conf"].as_str().unwrap();
    let (config, _) = runtime::parse_conf("", conf).unwrap();
    assert_eq!(config.to_string(), conf);
    assert!(
        conf.starts_with("growth:") && conf.contains("vmm_slack_percent:"),
        "{conf}"
    );
    let segments = v["segments"].as_array().unwrap();
    assert!(!segments.is_empty());
    let mut found = 0;
    for seg in segments {
        for key in [
            "device",
            "address",
            "total_size",
            "allocated_size",
            "active_size",
            "requested_size",
            "stream",
            "segment_type",
            "segment_pool_id",
            "is_expandable",
            "frames",
            "blocks",
        ] {
            assert!(seg.get(key).is_some(), "segment lacks {key}: {seg}");
        }
        assert_eq!(seg["device"], QUIET);
        let blocks = seg["blocks"].as_array().unwrap();
        let total: u64 = blocks.iter().map(|b| b["size"].as_u64().unwrap()).sum();
        assert_eq!(
            total,
            seg["total_size"].as_u64().unwrap(),
            "blocks tile {seg}"
        );
        for b in blocks {
            let state = b["state"].as_str().unwrap();
            assert!(
                ["active_allocated", "active_pending_free", "inactive"].contains(&state),
                "{state}"
            );
            let addr = b["address"].as_u64().unwrap();
            if addr == small as u64 {
                assert_eq!(state, "active_allocated");
                assert_eq!(b["requested_size"], 1000);
                assert_eq!(seg["segment_type"], "small");
                assert_eq!(seg["stream"], 0);
                found += 1;
            }
            if addr == large as u64 {
                assert_eq!(b["requested_size"], 5 * MIB);
                assert_eq!(seg["segment_type"], "large");
                assert_eq!(seg["stream"], 4);
                assert_eq!(seg["segment_pool_id"], serde_json::json!([0, 0]));
                found += 1;
            }
        }
    }
    assert_eq!(found, 2, "both allocations appear: {text}");

    // Every device, and the error paths.
    // SAFETY: valid out-pointers; len may be NULL.
    ok(unsafe { sp_snapshot_json(-1, &mut json, null_mut()) });
    // SAFETY: returned by sp_snapshot_json.
    ok(unsafe { sp_string_free(json) });
    ok(sp_free(small));
    ok(sp_free(large));
    ok(sp_empty_cache(QUIET));
}

#[test]
fn torch_pluggable_pair() {
    let _g = exclusive(SECOND);
    let stream = 0x5555 as *mut c_void;
    let p = sp_torch_malloc(MIB as isize, SECOND, stream);
    assert!(!p.is_null(), "{}", last_error());
    let (mut b, mut s, mut r, mut d) = (null_mut(), 0usize, 0usize, -1);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_allocation_info(p, &mut b, &mut s, &mut r, &mut d) });
    assert_eq!((r, d), (MIB, SECOND));
    sp_torch_free(p, MIB as isize, SECOND, stream);
    expect(sp_free(p), sp_status::SP_ERR_UNKNOWN_POINTER);
    sp_torch_free(null_mut(), 0, 0, null_mut());
}

#[test]
fn many_threads_alloc_and_free_concurrently() {
    // The invariant check at the end needs its device to itself: other tests use SHARED at the
    // same time, so only SECOND (held) is checked.
    let _g = exclusive(SECOND);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            std::thread::spawn(move || {
                let mut live: Vec<usize> = Vec::new();
                let mut seed = 0x9E37_79B9u64 ^ t;
                for i in 0..3000 {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    let device = (seed % 2) as i32; // SHARED or SECOND
                    let size = 1 + (seed >> 8) as usize % (4 * MIB);
                    let stream = t % 3;
                    if live.len() > 16 || (i % 3 == 2 && !live.is_empty()) {
                        let k = (seed as usize >> 3) % live.len();
                        ok(sp_free(live.swap_remove(k) as *mut c_void));
                    } else {
                        live.push(alloc(device, size, stream) as usize);
                    }
                }
                live
            })
        })
        .collect();
    // Free everything on another thread than the one that allocated it.
    let leftovers: Vec<usize> = threads
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    for p in leftovers {
        ok(sp_free(p as *mut c_void));
    }
    // The allocator behind the ABI is consistent.
    let check = match runtime::runtime().unwrap().device(SECOND).unwrap() {
        runtime::DevAlloc::Sim(a) => a.check_invariants(),
        runtime::DevAlloc::Cuda(a) => a.check_invariants(),
    };
    check.unwrap();
}

#[test]
fn device_peaks_are_exact_across_streams() {
    setup();
    let _g = exclusive(QUIET);
    let d = QUIET;
    let (mut a0, mut r0) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_memory_peaks(d, &mut a0, &mut r0) });
    ok(sp_reset_peak_stats(d));
    for stream in 1..=3u64 {
        let mut p = null_mut();
        // SAFETY: valid out-pointer.
        ok(unsafe { sp_alloc(d, 8 << 20, stream, &mut p) });
        ok(sp_free(p));
    }
    let (mut a, mut r) = (0u64, 0u64);
    // SAFETY: valid out-pointers; NULL ones are allowed.
    unsafe {
        ok(sp_memory_peaks(d, &mut a, &mut r));
        ok(sp_memory_peaks(d, null_mut(), null_mut()));
    }
    assert_eq!(
        a,
        8 << 20,
        "one 8 MiB allocation at a time, on three streams"
    );
    assert!(r >= a);
}

#[test]
fn peer_access_reaches_pages_mapped_before_and_after() {
    // SECOND to itself (the other SECOND tests check nothing of peers; exclusive for the
    // invariant check of the concurrent test).
    let _g = exclusive(SECOND);
    let page_peers = |d: i32, p: *mut c_void| match runtime::runtime().unwrap().device(d).unwrap() {
        runtime::DevAlloc::Sim(a) => a.device().page_peers(p as u64),
        runtime::DevAlloc::Cuda(_) => unreachable!("sim backend"),
    };
    let p = alloc(SECOND, 3 * MIB, 0);
    ok(sp_enable_peer_access(SECOND, SHARED));
    assert_eq!(
        page_peers(SECOND, p),
        Some(vec![SHARED]),
        "a page mapped before"
    );
    let q = alloc(SECOND, 5 * MIB, 3);
    assert_eq!(
        page_peers(SECOND, q),
        Some(vec![SHARED]),
        "a page mapped after"
    );
    ok(sp_enable_peer_access(SECOND, SECOND)); // itself: nothing to do
    expect(
        sp_enable_peer_access(SECOND, DEVICES),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    expect(
        sp_enable_peer_access(-1, 0),
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert!(last_error().contains("device -1"), "{}", last_error());
    ok(sp_free(p));
    ok(sp_free(q));
}

/// `sp_backend_calls_get` counts what the device's allocator asked of its backend: a first
/// large allocation reserves and maps pages; NULL is refused with nothing written.
#[test]
fn backend_calls_are_counted_by_kind() {
    let _q = exclusive(QUIET);
    let mut before = sp_backend_calls::default();
    // SAFETY: a valid out-pointer.
    ok(unsafe { sp_backend_calls_get(QUIET, &mut before) });
    let p = alloc(QUIET, 64 * MIB, 0);
    let mut after = sp_backend_calls::default();
    // SAFETY: a valid out-pointer.
    ok(unsafe { sp_backend_calls_get(QUIET, &mut after) });
    assert!(after.map >= before.map + 16, "{after:?}");
    assert!(after.create_page > before.create_page || after.map > before.map);
    ok(sp_free(p));
    // SAFETY: NULL is refused.
    expect(
        unsafe { sp_backend_calls_get(QUIET, null_mut()) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    let mut none = sp_backend_calls::default();
    // SAFETY: a valid out-pointer.
    expect(
        unsafe { sp_backend_calls_get(99, &mut none) },
        sp_status::SP_ERR_INVALID_ARGUMENT,
    );
    assert_eq!(none, sp_backend_calls::default(), "nothing written");
}
