//! Helpers shared by the test binaries of slotpool-capi.
#![allow(dead_code)]

use std::ffi::{CStr, c_void};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, Once, PoisonError};

use slotpool::*;

pub mod views;

/// Devices of the main test binary: 0 shared by every test, 1 for multi-device tests (one of
/// which checks the allocator's invariants, so they need it to themselves), 2 for tests that
/// need the device-wide state to themselves (statistics, routes, snapshot), 3 for memory-limit
/// tests. Tests on 1, 2 and 3 hold [`exclusive`]; a test holding two takes QUIET before SECOND.
pub const SHARED: i32 = 0;
pub const SECOND: i32 = 1;
pub const QUIET: i32 = 2;
pub const LIMITED: i32 = 3;
pub const DEVICES: i32 = 4;

static INIT: Once = Once::new();
static LOCKS: [Mutex<()>; 4] = [const { Mutex::new(()) }; 4];

/// Initialises the library once for this test binary: sim backend, 4 devices of 4 GiB.
pub fn setup() {
    INIT.call_once(|| {
        // SAFETY: both arguments are NUL-terminated literals.
        let s = unsafe {
            sp_init(
                c"sim".as_ptr(),
                c"sim_devices:4,sim_memory_mb:4096".as_ptr(),
            )
        };
        assert_eq!(s, sp_status::SP_OK, "{}", last_error());
    });
}

/// Exclusive use of `device` for the rest of the test.
pub fn exclusive(device: i32) -> MutexGuard<'static, ()> {
    setup();
    LOCKS[device as usize]
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
}

/// This thread's last error message.
pub fn last_error() -> String {
    // SAFETY: `sp_last_error_message` never returns NULL; the string is copied at once.
    unsafe { CStr::from_ptr(sp_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Asserts `status` is `want`, showing the message otherwise.
#[track_caller]
pub fn expect(status: sp_status, want: sp_status) {
    assert_eq!(status, want, "message: {}", last_error());
}

/// Asserts success.
#[track_caller]
pub fn ok(status: sp_status) {
    expect(status, sp_status::SP_OK);
}

/// `sp_alloc`, asserting success.
#[track_caller]
pub fn alloc(device: i32, size: usize, stream: u64) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    // SAFETY: `p` is a valid out-pointer.
    ok(unsafe { sp_alloc(device, size, stream, &mut p) });
    assert!(!p.is_null());
    p
}

/// `sp_memory_stats_get`, asserting success.
#[track_caller]
pub fn stats(device: i32) -> sp_memory_stats {
    let mut s = sp_memory_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { sp_memory_stats_get(device, &mut s) });
    s
}

/// `sp_pool_stats_get`, asserting success.
#[track_caller]
pub fn pool_stats(device: i32, id: sp_pool_id) -> sp_memory_stats {
    let mut s = sp_memory_stats::default();
    // SAFETY: `s` is a valid out-pointer.
    ok(unsafe { sp_pool_stats_get(device, id, &mut s) });
    s
}

/// Where `cargo test` leaves the `libslotpool.so` and `libslotpool.a` it built for this run:
/// `target/<profile>/deps`, beside the test binary (`target/<profile>/libslotpool.so` is only
/// refreshed by `cargo build`).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent().expect("target/<profile>/deps").to_path_buf()
}

/// A directory where the loader finds the library built for this test run under its SONAME
/// (`libslotpool.so.0`, a link to cargo's `libslotpool.so`), as it does in an installed prefix:
/// a program linked with `-lslotpool` asks for that name at run time.
pub fn soname_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("soname-lib");
    std::fs::create_dir_all(&dir).unwrap();
    let link = dir.join("libslotpool.so.0");
    let tmp = dir.join(format!(".libslotpool.so.0.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(lib_dir().join("libslotpool.so"), &tmp).unwrap();
    std::fs::rename(&tmp, &link).unwrap();
    dir
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Whether a C compiler is on the PATH; prints why a test is skipped otherwise.
pub fn have_tool(tool: &str) -> bool {
    let found = std::process::Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("SKIPPED: `{tool}` not found on PATH");
    }
    found
}
