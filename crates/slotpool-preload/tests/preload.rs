//! `LD_PRELOAD=libslotpool_preload.so` end to end, on a machine without a GPU or driver.
//!
//! A tiny C program (`tests/c/preload_probe.c`) is linked against the real `libcudart.so.13` of
//! NVIDIA's `nvidia-cuda-runtime` wheel, which `scripts/fetch-cudart.sh` installs into
//! `target/cudart-wheel/` the first time (nothing is downloaded when it is there; without pip or
//! network the probe tests print why and pass without checking). The probe makes every
//! interposed call and prints its return codes; it runs:
//!
//! * without preload: the real runtime answers (no driver: 35 `cudaErrorInsufficientDriver`, or
//!   100 `cudaErrorNoDevice`);
//! * with the preload library and `SLOTPOOL_BACKEND=sim`: slotpool's simulated device serves every
//!   allocation (return code 0 where the real runtime failed, and `sp_allocation_info` knows the
//!   pointer), the pass-through cases still reach the real runtime, and `SLOTPOOL_LOG` gives one
//!   exit line;
//! * with `SLOTPOOL_BACKEND=cuda` (not available here), or without `libslotpool.so` beside the
//!   preload library: every call passes through unchanged and one warning says why.
//!
//! The two libraries are copied into one directory under the target directory first: that is
//! the installed layout, where the preload library finds `libslotpool.so` beside itself.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

/// The names the preload library exports: the interposed functions and nothing else.
const EXPORTS: [&str; 13] = [
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cudaDeviceEnablePeerAccess",
    "cudaFree",
    "cudaFreeAsync",
    "cudaFreeAsync_ptsz",
    "cudaMalloc",
    "cudaMallocAsync",
    "cudaMallocAsync_ptsz",
    "cudaMemcpy",
    "cudaMemcpyAsync",
    "cudaMemset",
    "cudaMemsetAsync",
];

// ------------------------------------------------------------------------------------------------
// Paths

/// `target/<profile>`: the test binary is `target/<profile>/deps/preload-<hash>`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("deps dir");
    deps.parent().expect("profile dir").to_path_buf()
}

/// The target directory (`target/`), above the profile directory.
fn target_dir() -> PathBuf {
    profile_dir().parent().expect("target dir").to_path_buf()
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A library cargo built: in the profile directory, or only in `deps/` (a dependency's cdylib).
fn built(name: &str) -> PathBuf {
    let dir = profile_dir();
    // `cargo test` relinks deps/ only; the copy beside it is as old as the last `cargo build`.
    [dir.join(name), dir.join("deps").join(name)]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .unwrap_or_else(|| {
            panic!(
                "{name} not found in {} or its deps/: build it with `cargo build -p \
                 slotpool-capi -p slotpool-preload` (the test's profile)",
                dir.display()
            )
        })
}

/// Scratch directory of this test binary's profile.
fn scratch() -> PathBuf {
    let profile = profile_dir();
    let name = profile.file_name().unwrap().to_string_lossy().into_owned();
    let dir = target_dir().join("preload-test").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Copies `from` to `dir/name` through a temporary name (a process that has the old copy mapped
/// keeps it; a concurrent test run never sees half a file).
fn install(from: &Path, dir: &Path, name: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let to = dir.join(name);
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    std::fs::copy(from, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", from.display()));
    std::fs::rename(&tmp, &to).unwrap();
    to
}

/// The installed layout: `lib/libslotpool_preload.so` beside `lib/libslotpool.so.0` (the
/// SONAME; `scripts/install.sh` installs that name).
fn installed() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("lib");
        let _ = std::fs::remove_file(dir.join("libslotpool.so"));
        install(&built("libslotpool.so"), &dir, "libslotpool.so.0");
        install(
            &built("libslotpool_preload.so"),
            &dir,
            "libslotpool_preload.so",
        )
    })
}

/// The preload library alone in a directory, without `libslotpool.so`.
fn lonely() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch().join("lonely");
        for name in ["libslotpool.so", "libslotpool.so.0"] {
            let _ = std::fs::remove_file(dir.join(name));
        }
        install(
            &built("libslotpool_preload.so"),
            &dir,
            "libslotpool_preload.so",
        )
    })
}

// ------------------------------------------------------------------------------------------------
// The probe

/// The probe program, or why it cannot be had here (no pip/network, no C compiler).
fn probe() -> Result<&'static PathBuf, &'static str> {
    static PROBE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PROBE
        .get_or_init(|| build_c("preload_probe"))
        .as_ref()
        .map_err(String::as_str)
}

/// The byte-checking program `tests/c/preload_bytes.c`, as [`probe`].
fn bytes_program() -> Result<&'static PathBuf, &'static str> {
    static PROGRAM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    PROGRAM
        .get_or_init(|| build_c("preload_bytes"))
        .as_ref()
        .map_err(String::as_str)
}

/// Builds `tests/c/<name>.c` against the wheel's real `libcudart.so.13`.
fn build_c(name: &str) -> Result<PathBuf, String> {
    let wheel = target_dir().join("cudart-wheel");
    let lib = wheel.join("nvidia/cu13/lib");
    if !lib.join("libcudart.so.13").is_file() {
        let script = repo_root().join("scripts/fetch-cudart.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(&wheel)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        if !out.status.success() || !lib.join("libcudart.so.13").is_file() {
            return Err(format!(
                "scripts/fetch-cudart.sh could not install the nvidia-cuda-runtime wheel (no pip \
                 or no network?): {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    }
    let source = repo_root().join(format!("tests/c/{name}.c"));
    let exe = scratch().join(format!("{name}.{}", std::process::id()));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .args(["-std=c11", "-O1", "-Wall", "-Wextra", "-Werror"])
        .arg(&source)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-l:libcudart.so.13")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-ldl", "-lpthread"])
        .output()
        .map_err(|e| format!("no C compiler ({cc}): {e}"))?;
    if !out.status.success() {
        // A compiler that runs but rejects the program is a bug here, not a missing tool.
        panic!(
            "compiling {} failed:\n{}",
            source.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let path = scratch().join(name);
    std::fs::rename(&exe, &path).unwrap();
    Ok(path)
}

/// Skips the calling test (prints why) when the probe cannot be built here.
macro_rules! probe_or_skip {
    () => {
        probe_or_skip!(probe)
    };
    ($program:ident) => {
        match $program() {
            Ok(p) => p,
            Err(why) => {
                eprintln!("SKIPPED: {why}");
                return;
            }
        }
    };
}

/// One line of the probe's output: `NAME key=value ...`.
type Fields = BTreeMap<String, String>;

#[derive(Debug)]
struct Run {
    lines: BTreeMap<String, Fields>,
    stderr: String,
}

impl Run {
    fn field(&self, line: &str, key: &str) -> &str {
        self.lines
            .get(line)
            .unwrap_or_else(|| panic!("no line {line:?} in the probe's output: {self:#?}"))
            .get(key)
            .unwrap_or_else(|| panic!("no {key}= on line {line:?}: {self:#?}"))
    }
    fn rc(&self, line: &str) -> i64 {
        self.field(line, "rc").parse().unwrap()
    }
    /// Lines of stderr written by the preload library.
    fn preload_lines(&self) -> Vec<&str> {
        self.stderr
            .lines()
            .filter(|l| l.starts_with("slotpool-preload:"))
            .collect()
    }
    fn warnings(&self) -> Vec<&str> {
        self.preload_lines()
            .into_iter()
            .filter(|l| l.contains("warning"))
            .collect()
    }
}

/// Runs the probe with `preload` (None: without) and the extra environment `env`.
fn run(probe: &Path, preload: Option<&Path>, env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(probe);
    // cargo puts its output directories on LD_LIBRARY_PATH for tests: without that, the loader's
    // search finds libslotpool.so only where a user's system would have it.
    for var in [
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "SLOTPOOL_BACKEND",
        "SLOTPOOL_CONF",
        "SLOTPOOL_LOG",
        "SLOTPOOL_LIBRARY",
        "SLOTPOOL_PRELOAD_SYNC_FREE",
    ] {
        cmd.env_remove(var);
    }
    if let Some(p) = preload {
        cmd.env("LD_PRELOAD", p);
    }
    cmd.envs(env.iter().copied());
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("run the probe");
    let stdout = String::from_utf8_lossy(&stdout).into_owned();
    let stderr = String::from_utf8_lossy(&stderr).into_owned();
    assert!(
        status.success(),
        "probe failed ({status}) with preload {preload:?} and {env:?}:\n{stdout}\n{stderr}"
    );
    let lines = stdout
        .lines()
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let name = words.next()?.to_owned();
            let fields = words
                .filter_map(|w| w.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect();
            Some((name, fields))
        })
        .collect();
    Run { lines, stderr }
}

/// The probe without preload, once per test binary.
fn baseline(probe: &Path) -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| run(probe, None, &[]))
}

/// True if the real runtime works here (a machine with a GPU): the no-driver checks then do not
/// apply.
fn gpu_here(base: &Run) -> bool {
    base.rc("malloc") == 0
}

/// The runtime-API lines of the probe and the driver lines, for pass-through comparisons.
const RUNTIME_LINES: [&str; 18] = [
    "threads",
    "free_null",
    "malloc",
    "malloc_zero",
    "free",
    "double_free",
    "malloc_again",
    "free_again",
    "free_foreign",
    "malloc_async",
    "free_async",
    "malloc_async_stream",
    "free_async_other_stream",
    "malloc_async_zero",
    "malloc_async_ptsz",
    "free_async_ptsz",
    "managed",
    "malloc_leaked",
];

// ------------------------------------------------------------------------------------------------
// Tests

#[test]
fn exports_only_the_interposed_functions_and_links_no_cuda() {
    let lib = built("libslotpool_preload.so");
    let Ok(nm) = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    else {
        eprintln!("SKIPPED: no nm (binutils) here");
        return;
    };
    assert!(nm.status.success(), "{nm:?}");
    let mut names: Vec<String> = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|n| n.split('@').next().unwrap().to_owned())
        .collect();
    names.sort();
    assert_eq!(names, EXPORTS, "exports of {}", lib.display());

    let readelf = Command::new("readelf")
        .arg("-d")
        .arg(&lib)
        .output()
        .expect("readelf (binutils, present with nm)");
    let dynamic = String::from_utf8_lossy(&readelf.stdout);
    for forbidden in ["libcudart", "libcuda.so", "libslotpool.so"] {
        assert!(
            !dynamic
                .lines()
                .any(|l| l.contains("(NEEDED)") && l.contains(forbidden)),
            "{} must not depend on {forbidden} at load time:\n{dynamic}",
            lib.display()
        );
    }
}

#[test]
fn without_preload_the_real_runtime_answers() {
    let probe = probe_or_skip!();
    let base = baseline(probe);
    assert_eq!(base.field("slotpool", "present"), "0");
    assert_eq!(base.field("driver", "present"), "0", "no libcuda here");
    assert!(base.preload_lines().is_empty(), "{}", base.stderr);
    if gpu_here(base) {
        eprintln!("a GPU is present: the no-driver expectations are not checked");
        return;
    }
    for line in RUNTIME_LINES {
        let rc = base.rc(line);
        assert!(
            rc == 35 || rc == 100,
            "{line}: expected the real runtime's no-driver error (35 or 100), got {rc}"
        );
    }
}

#[test]
fn sim_backend_serves_every_interposed_call() {
    let probe = probe_or_skip!();
    let base = baseline(probe);
    let sim = run(probe, Some(installed()), &[("SLOTPOOL_BACKEND", "sim")]);
    let ctx = format!("{sim:#?}");

    // slotpool was loaded and served, where the real runtime failed.
    assert_eq!(sim.field("slotpool", "present"), "1", "{ctx}");
    assert_eq!(sim.field("threads", "failed"), "0", "{ctx}");
    assert_eq!(sim.field("threads", "ok"), "2400", "{ctx}");
    for line in [
        "malloc",
        "malloc_async",
        "malloc_async_stream",
        "malloc_async_ptsz",
        "cu_mem_alloc",
    ] {
        assert_eq!(sim.rc(line), 0, "{line}: {ctx}");
        assert_eq!(sim.field(line, "owned"), "1", "{line}: {ctx}");
        assert_eq!(sim.field(line, "device"), "0", "{line}: {ctx}");
    }
    assert_eq!(sim.field("malloc", "requested"), "1048576");
    assert_eq!(sim.field("malloc_async", "requested"), "4096");
    assert_eq!(sim.field("malloc_async_stream", "requested"), "3145728");
    assert_eq!(sim.field("malloc_async_ptsz", "requested"), "8192");
    assert_eq!(sim.field("cu_mem_alloc", "requested"), "2097152");
    for line in [
        "free",
        "free_again",
        "free_async",
        "free_async_other_stream",
        "free_async_ptsz",
        "cu_mem_free",
        "malloc_leaked",
    ] {
        assert_eq!(sim.rc(line), 0, "{line}: {ctx}");
    }
    assert_eq!(sim.rc("malloc_async_then_free"), 0, "{ctx}");
    assert_eq!(sim.field("malloc_async_then_free", "free_rc"), "0", "{ctx}");
    // The cache: a freed block of the same size comes back at the same address.
    assert_eq!(sim.rc("malloc_again"), 0, "{ctx}");
    assert_eq!(sim.field("malloc_again", "same"), "1", "{ctx}");

    // Argument errors are answered here, in CUDA's codes.
    assert_eq!(sim.rc("malloc_null_out"), 1, "cudaErrorInvalidValue: {ctx}");
    assert_eq!(sim.rc("malloc_async_null_out"), 1, "{ctx}");
    assert_eq!(
        sim.rc("cu_mem_alloc_null_out"),
        1,
        "CUDA_ERROR_INVALID_VALUE: {ctx}"
    );

    // Pass-through cases reach the real runtime and get its answer.
    for line in [
        "free_null",
        "malloc_zero",
        "malloc_async_zero",
        "double_free",
        "free_foreign",
        "managed",
        "peer_access",
    ] {
        assert_eq!(sim.rc(line), base.rc(line), "{line} passes through: {ctx}");
    }
    // No SLOTPOOL_LOG: nothing on stderr from the preload library.
    assert!(sim.preload_lines().is_empty(), "{ctx}");
}

#[test]
fn exit_line_with_slotpool_log() {
    let probe = probe_or_skip!();
    let sim = run(
        probe,
        Some(installed()),
        &[("SLOTPOOL_BACKEND", "sim"), ("SLOTPOOL_LOG", "warn")],
    );
    let lines = sim.preload_lines();
    assert_eq!(lines.len(), 1, "one exit line: {}", sim.stderr);
    let line = lines[0];
    // The probe's served calls: 2400 in threads, then 8 allocations (one never freed) and 7 frees;
    // passed through: two zero-size allocations, a double free and a host pointer.
    assert!(line.contains("served by slotpool (sim backend"), "{line}");
    assert!(line.contains("libslotpool.so"), "{line}");
    assert!(
        line.contains("2408 allocs, 2407 frees, 0 out of memory"),
        "{line}"
    );
    if !gpu_here(baseline(probe)) {
        // With a GPU the managed allocation succeeds and its free passes through too.
        assert!(line.contains("passed through: 2 allocs, 2 frees"), "{line}");
    }
    assert!(line.contains("peak "), "{line}");
    // slotpool's own exact peaks: at least what the probe had live at once.
    let reserved: u64 = line
        .split("device 0: peak reserved ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no device 0 peak in {line}"));
    assert!(reserved > 0, "{line}");
    assert!(!line.contains("panic"), "{line}");
}

#[test]
fn unavailable_backend_passes_everything_through_with_one_warning() {
    let probe = probe_or_skip!();
    let base = baseline(probe);
    if gpu_here(base) {
        eprintln!("SKIPPED: a GPU is present, so the cuda backend is available");
        return;
    }
    let cuda = run(probe, Some(installed()), &[("SLOTPOOL_BACKEND", "cuda")]);
    let ctx = format!("{cuda:#?}");
    for line in RUNTIME_LINES {
        assert_eq!(cuda.rc(line), base.rc(line), "{line} passes through: {ctx}");
    }
    assert_eq!(cuda.field("threads", "ok"), "0", "{ctx}");
    assert_eq!(cuda.field("malloc", "owned"), "0", "{ctx}");
    // Only the NULL out-pointer is answered by the preload library itself.
    assert_eq!(cuda.rc("malloc_null_out"), 1, "{ctx}");
    // The driver entry points exist only as ours; with no real driver they answer
    // CUDA_ERROR_NOT_INITIALIZED.
    assert_eq!(cuda.rc("cu_mem_alloc"), 3, "{ctx}");
    assert_eq!(cuda.rc("cu_mem_free"), 3, "{ctx}");
    let warnings = cuda.warnings();
    assert_eq!(warnings.len(), 1, "exactly one warning: {}", cuda.stderr);
    assert!(
        warnings[0].contains("passes through") && warnings[0].contains("sp_init(\"cuda\")"),
        "the warning says why: {}",
        warnings[0]
    );
    assert_eq!(cuda.preload_lines().len(), 1, "{}", cuda.stderr);

    // With SLOTPOOL_LOG the exit line says it was inactive and what passed through.
    let logged = run(
        probe,
        Some(installed()),
        &[("SLOTPOOL_BACKEND", "cuda"), ("SLOTPOOL_LOG", "warn")],
    );
    let lines = logged.preload_lines();
    assert_eq!(lines.len(), 2, "warning + exit line: {}", logged.stderr);
    assert!(
        lines[1].contains("inactive") && lines[1].contains("passed through: 2410 allocs"),
        "{}",
        lines[1]
    );
}

#[test]
fn missing_libslotpool_passes_everything_through_with_one_warning() {
    let probe = probe_or_skip!();
    let base = baseline(probe);
    let alone = run(probe, Some(lonely()), &[("SLOTPOOL_BACKEND", "sim")]);
    let ctx = format!("{alone:#?}");
    assert_eq!(alone.field("slotpool", "present"), "0", "{ctx}");
    for line in RUNTIME_LINES {
        assert_eq!(
            alone.rc(line),
            base.rc(line),
            "{line} passes through: {ctx}"
        );
    }
    let warnings = alone.warnings();
    assert_eq!(warnings.len(), 1, "exactly one warning: {}", alone.stderr);
    assert!(
        warnings[0].contains("libslotpool.so could not be loaded"),
        "{}",
        warnings[0]
    );

    // SLOTPOOL_LIBRARY names it explicitly.
    let library = installed().with_file_name("libslotpool.so.0");
    let explicit = run(
        probe,
        Some(lonely()),
        &[
            ("SLOTPOOL_BACKEND", "sim"),
            ("SLOTPOOL_LIBRARY", library.to_str().unwrap()),
        ],
    );
    assert_eq!(explicit.rc("malloc"), 0, "{explicit:#?}");
    assert_eq!(explicit.field("malloc", "owned"), "1", "{explicit:#?}");
    assert!(explicit.warnings().is_empty(), "{}", explicit.stderr);
}

#[test]
fn sync_free_option_still_serves() {
    // SLOTPOOL_PRELOAD_SYNC_FREE=1 calls the real cudaDeviceSynchronize before a served free;
    // without a driver it fails, and that failure is what cudaFree returns (as the real one
    // returns an earlier asynchronous error), but the memory is freed all the same.
    let probe = probe_or_skip!();
    let base = baseline(probe);
    let run = run(
        probe,
        Some(installed()),
        &[
            ("SLOTPOOL_BACKEND", "sim"),
            ("SLOTPOOL_PRELOAD_SYNC_FREE", "1"),
        ],
    );
    assert_eq!(run.rc("malloc"), 0, "{run:#?}");
    if !gpu_here(base) {
        assert_eq!(run.rc("free"), base.rc("free"), "{run:#?}");
    }
    // Freed: the next allocation of that size reuses the block.
    assert_eq!(run.field("malloc_again", "same"), "1", "{run:#?}");
    // cudaFreeAsync never synchronises.
    assert_eq!(run.rc("free_async"), 0, "{run:#?}");
}

#[test]
fn sim_allocations_keep_their_bytes_through_cuda_copies() {
    // tests/c/preload_bytes.c fills every allocation through cudaMemset / cudaMemcpy (served on
    // simulated memory by the preload library), frees others from four threads, synchronises,
    // empties the cache and reads everything back; it exits 0 only when every byte matched. Run
    // in both growth modes, whose memory is organised differently (segments, mapped pages).
    let program = probe_or_skip!(bytes_program);
    for growth in ["vmm", "classic"] {
        let conf = format!("sim_bytes:1,sim_memory_mb:2048,growth:{growth}");
        let run = run(
            program,
            Some(installed()),
            &[("SLOTPOOL_BACKEND", "sim"), ("SLOTPOOL_CONF", &conf)],
        );
        let ctx = format!("{growth}: {run:#?}");
        assert_eq!(run.field("bytes", "failures"), "0", "{ctx}");
        let checks: u64 = run.field("bytes", "checks").parse().unwrap();
        let allocs: u64 = run.field("bytes", "allocs").parse().unwrap();
        assert!(checks > 10_000, "{ctx}");
        assert!(allocs > 500, "{ctx}");
        assert_eq!(run.field("bytes", "frees"), allocs.to_string(), "{ctx}");
    }
    // Without sim_bytes the simulator keeps no bytes: the copies pass through to the real
    // runtime (no driver here), so the program sees them fail.
    if !gpu_here(baseline(probe_or_skip!())) {
        let out = Command::new(program)
            .env_remove("LD_LIBRARY_PATH")
            .env("LD_PRELOAD", installed())
            .env("SLOTPOOL_BACKEND", "sim")
            .env("SLOTPOOL_CONF", "sim_memory_mb:2048")
            .output()
            .expect("run the byte program");
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("cudaMemset") && stderr.contains("rc 35"),
            "{stderr}"
        );
    }
}
