//! Random sequences of C ABI calls, valid ones interleaved with bad ones (handles of the wrong
//! kind, freed handles, made-up handles, freed and interior pointers, NULL, huge counts, unknown
//! pools, arenas and devices), over several pools, streams, checkpoints, variant groups, arenas,
//! routes and two devices. After every step the library is compared with a shadow model
//! (`model.rs`): `sp_check_invariants`, device and pool statistics, live sets, use counts and the
//! bytes of every live allocation (the sim keeps bytes: `sim_bytes:1`); every bad call must
//! return its documented code with a message and leave the statistics and the snapshot exactly as
//! they were. Under memory pressure (device and pool limits set just above what is held,
//! allocations up to the device's memory; `model/pressure.rs`) a call may also run out of memory:
//! the model checks what it can know (nothing changed, the report adds up, the limits hold) and
//! restores checkpoints and variant groups taken before the pressure.
//!
//! Each growth mode runs in a child process of this binary (the library is initialised once per
//! process). A short run by default; `PROPTEST_CASES` sets the number of sequences
//! (`SLOTPOOL_HEAVY=1 ./scripts/test.sh` raises it).

#[path = "../common/mod.rs"]
mod common;
mod model;
mod ops;

use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use slotpool::*;

const CONF: &str = "SLOTPOOL_SEQUENCE_CONF";
/// Sequences per growth mode without `PROPTEST_CASES`.
const CASES: u32 = 16;

/// Runs the sequences in a child process initialised with `conf`.
fn run_child(conf: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CONF, conf)
        .env_remove("SLOTPOOL_BACKEND")
        .env_remove("SLOTPOOL_CONF")
        .env_remove("SLOTPOOL_LOG")
        .output()
        .expect("spawn the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "sequences ({conf}) failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = stdout
        .find("sequences:")
        .map_or("", |i| stdout[i..].lines().next().unwrap_or(""));
    println!("{conf}: {summary}");
}

#[test]
fn sequences_vmm_2mib_pages() {
    run_child("growth:vmm,vmm_page_mb:2");
}

#[test]
fn sequences_vmm_16mib_pages() {
    run_child("growth:vmm,vmm_page_mb:16");
}

#[test]
fn sequences_classic() {
    run_child("growth:classic");
}

/// The child side: runs the sequences; does nothing in the parent test run.
#[test]
fn child() {
    let Ok(conf) = std::env::var(CONF) else {
        return;
    };
    let vmm_page = conf.contains("growth:vmm").then(|| {
        let mb: usize = conf
            .split("vmm_page_mb:")
            .nth(1)
            .and_then(|v| v.split(',').next()?.parse().ok())
            .expect("vmm_page_mb in the configuration");
        mb << 20
    });
    let conf = format!(
        "sim_devices:2,sim_memory_mb:{},sim_bytes:1,{conf}",
        model::CAPACITY >> 20
    );
    let c = std::ffi::CString::new(conf).unwrap();
    // SAFETY: NUL-terminated strings.
    common::ok(unsafe { sp_init(c"sim".as_ptr(), c.as_ptr()) });
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let case = AtomicU64::new(0);
    let (steps, refused) = (AtomicU64::new(0), AtomicU64::new(0));
    let (ooms, certain, pressed) = (AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0));
    let result = runner.run(&prop::collection::vec(ops::op(), 1..120), |seq| {
        let mut m = model::Model::new(case.fetch_add(1, Ordering::Relaxed), vmm_page);
        let run = catch_unwind(AssertUnwindSafe(|| {
            for op in &seq {
                m.step(op);
                m.check(false);
            }
        }));
        if let Err(panic) = run {
            m.abandon();
            resume_unwind(panic);
        }
        steps.fetch_add(seq.len() as u64, Ordering::Relaxed);
        refused.fetch_add(m.refused, Ordering::Relaxed);
        ooms.fetch_add(m.ooms, Ordering::Relaxed);
        certain.fetch_add(m.certain, Ordering::Relaxed);
        pressed.fetch_add(m.after_pressure, Ordering::Relaxed);
        m.finish();
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "sequences: {} cases, {} steps, {} refused calls checked, {} out of memory, {} \
         allocations known to fit, {} restores after out of memory",
        case.load(Ordering::Relaxed),
        steps.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
        ooms.load(Ordering::Relaxed),
        certain.load(Ordering::Relaxed),
        pressed.load(Ordering::Relaxed)
    );
}
