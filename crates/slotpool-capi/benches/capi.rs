//! Host cost of the C ABI: `sp_alloc` + `sp_free` of 1 MiB on the sim backend against the core
//! `Allocator::alloc` + `free` it wraps (same configuration, same simulated device), in one run.
//!
//! `cargo bench -p slotpool-capi --bench capi`

use std::ffi::c_void;
use std::hint::black_box;
use std::ptr::null_mut;
use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use slotpool::*;
use slotpool_core::{Allocator, Config};
use slotpool_sim::{Backing, SimConfig, SimDevice};

const SIZE: usize = 1 << 20;
const STREAM: u64 = 0;

fn bench(c: &mut Criterion) {
    // SAFETY: NUL-terminated literals.
    let s = unsafe { sp_init(c"sim".as_ptr(), c"sim_devices:1".as_ptr()) };
    assert_eq!(s, sp_status::SP_OK);
    let core = Allocator::new(
        Arc::new(
            SimDevice::new(SimConfig {
                backing: Backing::Accounting,
                auto_complete: true,
                ..SimConfig::default()
            })
            .unwrap(),
        ),
        Config::default(),
    );
    // Warm both caches.
    let p = core.alloc(SIZE as u64, STREAM).unwrap();
    core.free(p).unwrap();
    let mut q: *mut c_void = null_mut();
    // SAFETY: valid out-pointer.
    let s = unsafe { sp_alloc(0, SIZE, STREAM, &mut q) };
    assert_eq!(s, sp_status::SP_OK);
    assert_eq!(sp_free(q), sp_status::SP_OK);

    let mut g = c.benchmark_group("alloc_free_1MiB");
    g.bench_function("core", |b| {
        b.iter(|| {
            let p = core.alloc(black_box(SIZE as u64), STREAM).unwrap();
            core.free(black_box(p)).unwrap();
        })
    });
    g.bench_function("capi", |b| {
        b.iter(|| {
            let mut p: *mut c_void = null_mut();
            // SAFETY: valid out-pointer.
            let s = unsafe { sp_alloc(0, black_box(SIZE), STREAM, &mut p) };
            debug_assert_eq!(s, sp_status::SP_OK);
            let s = sp_free(black_box(p));
            debug_assert_eq!(s, sp_status::SP_OK);
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
