//! Builds `tests/c/smoke.c` (gcc, C11, also linked statically against `libslotpool.a`) and
//! `tests/c/smoke.cpp` (g++, C++17) against the `libslotpool.so` cargo built for this test run,
//! and runs them on the sim backend. Skipped, with a message, where no C compiler exists.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

fn out_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("c-programs");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn run_ok(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    text
}

/// Runs a test program on the sim backend with two devices, initialised lazily from the
/// environment.
fn run_program(exe: &Path, lib_dir: &Path) -> String {
    let mut cmd = Command::new(exe);
    cmd.env("SLOTPOOL_BACKEND", "sim")
        .env("SLOTPOOL_CONF", "sim_devices:2,sim_memory_mb:8192")
        .env("LD_LIBRARY_PATH", lib_dir)
        .env_remove("SLOTPOOL_LOG");
    if !slotpool_cuda::driver_present() {
        cmd.env("SLOTPOOL_TEST_NO_CUDA", "1");
    }
    run_ok(&mut cmd, &exe.display().to_string())
}

#[test]
fn smoke_c_against_the_shared_library() {
    if !have_tool("cc") {
        return;
    }
    let lib = lib_dir();
    assert!(
        lib.join("libslotpool.so").exists(),
        "libslotpool.so not built"
    );
    let exe = out_dir().join("smoke_c");
    run_ok(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-o"])
            .arg(&exe)
            .arg("-I")
            .arg(repo_root().join("include"))
            .arg(repo_root().join("tests/c/smoke.c"))
            .arg("-L")
            .arg(&lib)
            .arg("-lslotpool"),
        "cc smoke.c",
    );
    // The program records the SONAME, not the file cargo wrote.
    if have_tool("readelf") {
        let dynamic = run_ok(Command::new("readelf").arg("-d").arg(&exe), "readelf -d");
        assert!(
            dynamic.contains("Shared library: [libslotpool.so.0]"),
            "{dynamic}"
        );
    }
    let out = run_program(&exe, &soname_dir());
    assert!(out.contains("checks passed"), "{out}");
    println!("{out}");
}

#[test]
fn smoke_cpp_against_the_shared_library() {
    if !have_tool("c++") {
        return;
    }
    let lib = lib_dir();
    let exe = out_dir().join("smoke_cpp");
    run_ok(
        Command::new("c++")
            .args([
                "-std=c++17",
                "-Wall",
                "-Wextra",
                "-Werror",
                "-pedantic",
                "-pthread",
                "-o",
            ])
            .arg(&exe)
            .arg("-I")
            .arg(repo_root().join("include"))
            .arg(repo_root().join("tests/c/smoke.cpp"))
            .arg("-L")
            .arg(&lib)
            .arg("-lslotpool"),
        "c++ smoke.cpp",
    );
    let out = run_program(&exe, &soname_dir());
    assert!(out.contains("all checks passed"), "{out}");
}

#[test]
fn smoke_c_against_the_static_library() {
    if !have_tool("cc") {
        return;
    }
    let lib = lib_dir();
    let archive = lib.join("libslotpool.a");
    assert!(archive.exists(), "libslotpool.a not built");
    let exe = out_dir().join("smoke_c_static");
    run_ok(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg("-I")
            .arg(repo_root().join("include"))
            .arg(repo_root().join("tests/c/smoke.c"))
            .arg(&archive)
            .args(["-lpthread", "-ldl", "-lm", "-lrt", "-lgcc_s", "-lc"]),
        "cc smoke.c libslotpool.a",
    );
    // No libslotpool.so needed at run time.
    let out = run_program(&exe, Path::new("/nonexistent"));
    assert!(out.contains("checks passed"), "{out}");
}

/// `tests/c/bytes.c`: every live allocation keeps its bytes across frees of others, reuse,
/// empty_cache, restores, variant groups and arenas, on the sim with host-backed bytes, in both
/// growth modes.
#[test]
fn live_allocations_keep_their_bytes() {
    if !have_tool("cc") {
        return;
    }
    let lib = lib_dir();
    let exe = out_dir().join("bytes_c");
    run_ok(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-o"])
            .arg(&exe)
            .arg("-I")
            .arg(repo_root().join("include"))
            .arg(repo_root().join("tests/c/bytes.c"))
            .arg("-L")
            .arg(&lib)
            .arg("-lslotpool"),
        "cc bytes.c",
    );
    for growth in [
        "growth:vmm,vmm_page_mb:2",
        "growth:vmm,vmm_page_mb:16",
        "growth:classic",
    ] {
        let out = run_ok(
            Command::new(&exe)
                .env(
                    "SLOTPOOL_CONF",
                    format!("sim_bytes:1,sim_memory_mb:1024,{growth}"),
                )
                .env("LD_LIBRARY_PATH", soname_dir())
                .env_remove("SLOTPOOL_LOG"),
            &format!("bytes ({growth})"),
        );
        assert!(out.contains("checks passed"), "{growth}: {out}");
    }
}

/// The host-cost harnesses of `benches/c/` (run on the H200 by `benches/gpu/run.sh host_abi`)
/// build warning-free and run to their JSON line on the sim backend, with counts small enough
/// for a debug build: a harness broken here would otherwise show only on a GPU machine.
#[test]
fn bench_harnesses_build_and_run_on_the_sim() {
    if !have_tool("cc") {
        return;
    }
    let lib = lib_dir().join("libslotpool.so");
    assert!(lib.exists(), "libslotpool.so not built");
    let build = |name: &str| {
        let exe = out_dir().join(name);
        run_ok(
            Command::new("cc")
                .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
                .arg(&exe)
                .arg(repo_root().join(format!("benches/c/{name}.c")))
                .args(["-ldl", "-lm"]),
            &format!("cc {name}.c"),
        );
        exe
    };
    // pair_dlopen's rounds are fixed (15 x 10^6 pairs): built, not run here.
    build("pair_dlopen");
    let mixed = build("mixed_dlopen");
    let out = run_ok(
        Command::new(&mixed).arg(&lib).args(["sim", "2000"]),
        "mixed_dlopen",
    );
    assert!(out.contains("\"peak_reserved\":"), "{out}");
    let threads = build("threads_dlopen");
    for fresh in ["0", "1", "2"] {
        let out = run_ok(
            Command::new(&threads)
                .arg(&lib)
                .args(["4096", "sim", "2", "300"])
                .env("FRESH", fresh),
            "threads_dlopen",
        );
        assert!(
            out.contains(&format!("\"fresh\": {fresh},"))
                && out.contains("\"speedup_vs_1t_beside_spinners\":"),
            "{out}"
        );
    }
}

/// `examples/c/pool_checkpoint.c`, the C program of `examples/`, builds warning-free with the
/// command its header gives and runs to its end on the sim backend.
#[test]
fn the_c_example_builds_and_runs() {
    if !have_tool("cc") {
        return;
    }
    let lib = lib_dir();
    let exe = out_dir().join("pool_checkpoint");
    run_ok(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic", "-o"])
            .arg(&exe)
            .arg("-I")
            .arg(repo_root().join("include"))
            .arg(repo_root().join("examples/c/pool_checkpoint.c"))
            .arg("-L")
            .arg(&lib)
            .arg("-lslotpool"),
        "cc pool_checkpoint.c",
    );
    let out = run_program(&exe, &soname_dir());
    assert!(
        out.contains("re-created 1") && out.ends_with("ok\n"),
        "{out}"
    );
}
