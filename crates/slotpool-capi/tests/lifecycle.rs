//! Initialisation, lazy initialisation from the environment, shutdown and logging. Each scenario
//! needs a fresh process, so every test re-runs this test binary as a child with
//! `SLOTPOOL_TEST_SCENARIO` set; the `child` test then plays that scenario.

mod common;

use std::ffi::{CStr, c_char, c_void};
use std::process::{Command, Output};
use std::ptr::{self, null_mut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use slotpool::*;

const SCENARIO: &str = "SLOTPOOL_TEST_SCENARIO";

/// Runs scenario `name` in a child process with `env` (and without the slotpool variables of this
/// process); asserts that it passed and returns its output.
fn run_child(name: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, name)
        .env_remove("SLOTPOOL_BACKEND")
        .env_remove("SLOTPOOL_CONF")
        .env_remove("SLOTPOOL_LOG");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("spawn the test binary");
    assert!(
        out.status.success(),
        "scenario {name} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "scenario {name} did not run"
    );
    out
}

/// The child side: plays the scenario named by `SLOTPOOL_TEST_SCENARIO`; does nothing in the
/// parent test run.
#[test]
fn child() {
    let Ok(name) = std::env::var(SCENARIO) else {
        return;
    };
    match name.as_str() {
        "init_errors" => init_errors(),
        "explicit_init" => explicit_init(),
        "lazy_init" => lazy_init(),
        "vmm_page_size" => vmm_page_size(),
        "lazy_init_bad_env" => lazy_init_bad_env(),
        "auto_backend" => auto_backend(),
        "shutdown" => shutdown(),
        "shutdown_under_load" => shutdown_under_load(),
        "logging" => logging(),
        other => panic!("unknown scenario {other}"),
    }
}

fn initialized() -> bool {
    let mut v = -1;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_is_initialized(&mut v) });
    v == 1
}

fn device_count() -> i32 {
    let mut n = 0;
    // SAFETY: valid out-pointer.
    ok(unsafe { sp_device_count(&mut n) });
    n
}

fn backend_name() -> String {
    let mut name: *const c_char = ptr::null();
    // SAFETY: valid out-pointer; a static string comes back.
    ok(unsafe { sp_backend_name(&mut name) });
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(name) }
        .to_string_lossy()
        .into_owned()
}

// ------------------------------------------------------------------------------------------------
// Scenarios (child side)

fn init_errors() {
    // SAFETY: NUL-terminated literals or NULL throughout.
    unsafe {
        expect(
            sp_init(c"sim".as_ptr(), c"growth:vmm,bogus_key:1".as_ptr()),
            sp_status::SP_ERR_CONFIG,
        );
        assert!(last_error().contains("bogus_key"), "{}", last_error());
        assert!(
            !initialized(),
            "a rejected configuration initialised something"
        );
        expect(
            sp_init(c"sim".as_ptr(), c"sim_bogus:1".as_ptr()),
            sp_status::SP_ERR_CONFIG,
        );
        assert!(last_error().contains("sim_bogus"));
        expect(
            sp_init(c"sim".as_ptr(), c"max_split_size_mb:1".as_ptr()),
            sp_status::SP_ERR_CONFIG,
        );
        expect(
            sp_init(c"gpu".as_ptr(), ptr::null()),
            sp_status::SP_ERR_INVALID_ARGUMENT,
        );
        assert!(last_error().contains("gpu"));
        if !slotpool_cuda::driver_present() {
            expect(
                sp_init(c"cuda".as_ptr(), ptr::null()),
                sp_status::SP_ERR_BACKEND_UNAVAILABLE,
            );
            assert!(last_error().contains("libcuda"), "{}", last_error());
        }
        assert!(!initialized());
        // After all those failures a good call still works.
        ok(sp_init(c"sim".as_ptr(), c"sim_devices:2".as_ptr()));
        assert!(initialized());
        assert_eq!(device_count(), 2);
    }
}

fn explicit_init() {
    // SLOTPOOL_CONF=sim_devices:2,growth:classic,sim_memory_mb:1024 is set by the parent.
    // SAFETY: literals.
    ok(unsafe { sp_init(c"sim".as_ptr(), c"sim_devices:3".as_ptr()) });
    assert_eq!(device_count(), 3, "conf wins over SLOTPOOL_CONF");
    let (mut limit, mut total) = (0, 0);
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_memory_limit_get(0, &mut limit, &mut total) });
    assert_eq!(total, 1 << 30, "SLOTPOOL_CONF's sim_memory_mb applies");
    // Classic growth (from SLOTPOOL_CONF): a 1000-byte request reserves one 2 MiB segment.
    let p = alloc(0, 1000, 0);
    let s = stats(0);
    assert_eq!(s.reserved_bytes.all.current, 2 << 20);
    assert_eq!(s.segment.all.current, 1);
    ok(sp_free(p));
    // SAFETY: literals.
    expect(
        unsafe { sp_init(c"sim".as_ptr(), ptr::null()) },
        sp_status::SP_ERR_INVALID_STATE,
    );
}

fn lazy_init() {
    // SLOTPOOL_BACKEND=sim, SLOTPOOL_CONF=sim_devices:5 are set by the parent.
    assert!(!initialized());
    let p = alloc(4, 4096, 0); // the first call initialises
    assert!(initialized());
    assert_eq!(device_count(), 5);
    assert_eq!(backend_name(), "sim");
    ok(sp_free(p));
    // sp_init after lazy initialisation is refused.
    // SAFETY: literals.
    expect(
        unsafe { sp_init(c"sim".as_ptr(), ptr::null()) },
        sp_status::SP_ERR_INVALID_STATE,
    );
}

fn vmm_page_size() {
    // SLOTPOOL_CONF=vmm_page_mb:8 is set by the parent: the device is built with 8 MiB pages,
    // which large blocks take; small blocks take 2 MiB classic segments.
    let p = alloc(0, 1000, 0);
    assert_eq!(stats(0).reserved_bytes.all.current, 2 << 20);
    let q = alloc(0, 9 << 20, 0);
    assert_eq!(stats(0).reserved_bytes.large_pool.current, 16 << 20);
    ok(sp_free(q));
    ok(sp_free(p));
    ok(sp_check_invariants(0));
}

fn lazy_init_bad_env() {
    // SLOTPOOL_CONF=bogus:1 is set by the parent.
    let mut p = null_mut();
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_alloc(0, 64, 0, &mut p) },
        sp_status::SP_ERR_NOT_INITIALIZED,
    );
    let msg = last_error();
    assert!(
        msg.contains("bogus") && msg.contains("SLOTPOOL_CONF"),
        "{msg}"
    );
    assert!(!initialized());
    let mut n = 0;
    // SAFETY: valid out-pointer.
    expect(
        unsafe { sp_device_count(&mut n) },
        sp_status::SP_ERR_NOT_INITIALIZED,
    );
    assert!(sp_torch_malloc(64, 0, null_mut()).is_null());
    // An explicit init sees the same bad environment.
    // SAFETY: literals.
    expect(
        unsafe { sp_init(c"sim".as_ptr(), ptr::null()) },
        sp_status::SP_ERR_CONFIG,
    );
}

fn auto_backend() {
    // SAFETY: literals.
    ok(unsafe { sp_init(c"auto".as_ptr(), ptr::null()) });
    let name = backend_name();
    if slotpool_cuda::driver_present() {
        assert!(name == "cuda" || name == "sim", "{name}");
    } else {
        assert_eq!(name, "sim");
    }
    let p = alloc(0, 1 << 20, 0);
    ok(sp_free(p));
}

fn shutdown() {
    // SAFETY: literals.
    ok(unsafe { sp_init(c"sim".as_ptr(), c"sim_devices:2".as_ptr()) });
    let live = alloc(0, 1 << 20, 0);
    let cached = alloc(0, 4 << 20, 0);
    ok(sp_free(cached));
    let mut json: *mut c_char = null_mut();
    // SAFETY: valid out-pointers.
    ok(unsafe { sp_snapshot_json(0, &mut json, null_mut()) });
    ok(sp_shutdown());
    assert!(last_error().is_empty());

    let down = sp_status::SP_ERR_SHUTDOWN;
    let id = sp_pool_id { a: 0, b: 1 };
    let opts = sp_pool_options::default();
    let (mut p, mut i, mut u, mut sz) = (null_mut::<c_void>(), 0, 0u64, 0usize);
    let mut st = sp_memory_stats::default();
    let mut pid = sp_pool_id::default();
    let mut name: *const c_char = ptr::null();
    let mut j: *mut c_char = null_mut();
    // SAFETY: valid pointers and literals throughout.
    unsafe {
        expect(sp_shutdown(), down);
        assert!(last_error().contains("shut down"), "{}", last_error());
        expect(sp_init(c"sim".as_ptr(), ptr::null()), down);
        expect(sp_is_initialized(&mut i), down);
        expect(sp_backend_name(&mut name), down);
        expect(sp_device_count(&mut i), down);
        expect(sp_alloc(0, 64, 0, &mut p), down);
        assert!(p.is_null());
        expect(sp_free(live), down);
        expect(sp_record_stream(live, 1), down);
        expect(
            sp_allocation_info(live, &mut p, &mut sz, &mut sz, &mut i),
            down,
        );
        expect(sp_empty_cache(0), down);
        expect(sp_empty_cache(-1), down);
        expect(sp_set_memory_fraction(0, 0.5), down);
        expect(sp_set_memory_limit(0, 1 << 30), down);
        expect(sp_memory_limit_get(0, &mut u, &mut u), down);
        expect(sp_process_events(0), down);
        expect(sp_largest_free_block(0, &mut sz), down);
        expect(sp_pool_create_or_incref(0, id, &opts, &mut u), down);
        expect(sp_pool_named(0, c"x".as_ptr(), &opts, &mut pid), down);
        expect(sp_pool_release(0, id, &mut u), down);
        expect(sp_pool_use_count(0, id, &mut u), down);
        expect(sp_pool_set_options(0, id, &opts), down);
        expect(sp_pool_empty_cache(0, id), down);
        expect(sp_pool_alloc(0, id, 64, 0, &mut p), down);
        expect(
            sp_begin_allocate_to_pool(0, id, sp_route_kind::SP_ROUTE_ALL, 0),
            down,
        );
        expect(sp_end_allocate_to_pool(0, id), down);
        expect(sp_memory_stats_get(0, &mut st), down);
        expect(sp_pool_stats_get(0, id, &mut st), down);
        expect(sp_reset_peak_stats(0), down);
        expect(sp_reset_accumulated_stats(0), down);
        expect(sp_snapshot_json(0, &mut j, &mut sz), down);
        assert!(j.is_null());
        assert!(sp_torch_malloc(64, 0, null_mut()).is_null());
        sp_torch_free(live, 64, 0, null_mut());
        // Library-level queries and freeing strings keep working.
        let (mut a, mut b, mut c) = (0, 0, 0);
        ok(sp_version(&mut a, &mut b, &mut c));
        assert_eq!(sp_has_feature(c"sim".as_ptr()), 1);
        ok(sp_string_free(json));
    }
}

fn shutdown_under_load() {
    // SAFETY: literals.
    ok(unsafe { sp_init(c"sim".as_ptr(), c"sim_devices:2".as_ptr()) });
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut calls = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut p = null_mut();
                    // SAFETY: valid out-pointer.
                    let s = unsafe { sp_alloc(t % 2, 4096 * (1 + t as usize), t as u64, &mut p) };
                    match s {
                        sp_status::SP_OK => {
                            let f = sp_free(p);
                            assert!(
                                f == sp_status::SP_OK || f == sp_status::SP_ERR_SHUTDOWN,
                                "{f:?}"
                            );
                        }
                        sp_status::SP_ERR_SHUTDOWN => {}
                        other => panic!("unexpected {other:?}: {}", last_error()),
                    }
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    ok(sp_shutdown());
    std::thread::sleep(std::time::Duration::from_millis(20));
    stop.store(true, Ordering::Relaxed);
    let calls: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    assert!(calls > 0);
}

fn logging() {
    // SLOTPOOL_LOG=info is set by the parent (or not, for the quiet run).
    // SAFETY: literals.
    ok(unsafe { sp_init(c"sim".as_ptr(), ptr::null()) });
    ok(sp_shutdown());
}

// ------------------------------------------------------------------------------------------------
// Tests (parent side)

#[test]
fn init_errors_leave_nothing_initialised() {
    run_child("init_errors", &[]);
}

#[test]
fn explicit_init_merges_conf_over_the_environment() {
    run_child(
        "explicit_init",
        &[(
            "SLOTPOOL_CONF",
            "sim_devices:2,growth:classic,sim_memory_mb:1024",
        )],
    );
}

#[test]
fn vmm_page_size_is_a_device_option() {
    run_child("vmm_page_size", &[("SLOTPOOL_CONF", "vmm_page_mb:8")]);
}

#[test]
fn first_call_initialises_from_the_environment() {
    run_child(
        "lazy_init",
        &[
            ("SLOTPOOL_BACKEND", "sim"),
            ("SLOTPOOL_CONF", "sim_devices:5"),
        ],
    );
}

#[test]
fn bad_environment_gives_not_initialized() {
    run_child(
        "lazy_init_bad_env",
        &[("SLOTPOOL_BACKEND", "sim"), ("SLOTPOOL_CONF", "bogus:1")],
    );
}

#[test]
fn auto_backend_falls_back_to_sim() {
    run_child("auto_backend", &[]);
}

#[test]
fn after_shutdown_every_call_fails_cleanly() {
    run_child("shutdown", &[]);
}

#[test]
fn shutdown_while_other_threads_allocate() {
    run_child("shutdown_under_load", &[]);
}

#[test]
fn slotpool_log_turns_logging_on_and_only_then() {
    let loud = run_child("logging", &[("SLOTPOOL_LOG", "debug")]);
    let stderr = String::from_utf8_lossy(&loud.stderr);
    assert!(stderr.contains("slotpool initialised"), "{stderr}");
    assert!(stderr.contains("slotpool shut down"), "{stderr}");
    // stderr is a pipe here, not a terminal: no ANSI colour or style codes in the log.
    assert!(
        !stderr.contains('\x1b'),
        "escape codes in a piped log: {stderr:?}"
    );
    let quiet = run_child("logging", &[]);
    let stderr = String::from_utf8_lossy(&quiet.stderr);
    assert!(!stderr.contains("slotpool initialised"), "{stderr}");
}
