//! `cuda_probe`: runs every `CudaDevice` operation once on device 0 (twice for the growth and
//! event steps: a cold and a warm pass) and prints one line per step:
//!
//! ```text
//! OK        12.3 us  alloc_segment 2 MiB  [0x7f...]
//! FAIL       0.4 us  map p0  driver error 1: cuMemMap: CUDA_ERROR_INVALID_VALUE (...)
//! INFO       3.1 us  unrelaxed free_segment during global capture  allowed, capture valid
//! ```
//!
//! INFO lines report driver behaviour worth knowing and are never failures. Exit status: 0 when
//! every step passed, 1 otherwise. Build with `cargo build --release -p slotpool-cuda --example
//! cuda_probe` and carry `target/release/examples/cuda_probe` to the GPU machine (it needs only
//! `libcuda.so.1` at run time). Optional argument: the device ordinal (default 0).

use std::fmt::Debug;
use std::process::ExitCode;
use std::ptr;
use std::time::Instant;

use cudarc::driver::sys::{self, CUresult, CUstream, CUstreamCaptureMode};
use slotpool_core::{CaptureStatus, Device, DeviceError, DeviceResult};
use slotpool_cuda::{CudaDevice, driver_present};

const MIB: u64 = 1 << 20;

struct Probe {
    failures: usize,
}

impl Probe {
    /// Runs `f`, prints OK (with `detail` of the value) or FAIL, and returns the value.
    fn step<T: Debug>(&mut self, name: &str, f: impl FnOnce() -> DeviceResult<T>) -> Option<T> {
        let start = Instant::now();
        let result = f();
        let us = start.elapsed().as_secs_f64() * 1e6;
        match result {
            Ok(v) => {
                let detail = format!("{v:?}");
                if detail.len() <= 60 && detail != "()" {
                    println!("OK   {us:>10.1} us  {name}  [{detail}]");
                } else {
                    println!("OK   {us:>10.1} us  {name}");
                }
                Some(v)
            }
            Err(e) => {
                self.failures += 1;
                println!("FAIL {us:>10.1} us  {name}  {e}");
                None
            }
        }
    }

    /// Like [`Probe::step`], but the step passes only when `f` returns `Ok(true)`.
    fn check(&mut self, name: &str, f: impl FnOnce() -> DeviceResult<bool>) {
        let start = Instant::now();
        let result = f();
        let us = start.elapsed().as_secs_f64() * 1e6;
        match result {
            Ok(true) => println!("OK   {us:>10.1} us  {name}"),
            Ok(false) => {
                self.failures += 1;
                println!("FAIL {us:>10.1} us  {name}  check failed");
            }
            Err(e) => {
                self.failures += 1;
                println!("FAIL {us:>10.1} us  {name}  {e}");
            }
        }
    }
}

fn info(us: f64, name: &str, text: &str) {
    println!("INFO {us:>10.1} us  {name}  {text}");
}

fn driver(what: &'static str, rc: CUresult) -> DeviceResult<()> {
    slotpool_cuda::error::check(what, rc)
}

fn memset(ptr: u64, value: u8, bytes: u64) -> DeviceResult<()> {
    // SAFETY: the primary context is current (`make_current`) and `ptr..ptr+bytes` is mapped
    // read/write by the steps before.
    driver("cuMemsetD8_v2", unsafe {
        sys::cuMemsetD8_v2(ptr, value, bytes as usize)
    })
}

fn all_bytes_are(ptr: u64, value: u8, bytes: u64) -> DeviceResult<bool> {
    let mut host = vec![0u8; bytes as usize];
    // SAFETY: `host` is writable for `bytes` bytes; the context is current and the device range is
    // mapped readable. The copy is synchronous.
    let rc = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, bytes as usize) };
    driver("cuMemcpyDtoH_v2", rc)?;
    Ok(host.iter().all(|&b| b == value))
}

fn begin_capture(stream: u64) -> DeviceResult<()> {
    let raw = stream as usize as CUstream;
    // SAFETY: `raw` is a live stream of the current context.
    driver("cuStreamBeginCapture_v2", unsafe {
        sys::cuStreamBeginCapture_v2(raw, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
    })
}

/// Ends the capture on `stream` and destroys the graph; `Ok(())` when the capture was valid.
fn end_capture(stream: u64) -> DeviceResult<()> {
    let raw = stream as usize as CUstream;
    let mut graph: sys::CUgraph = ptr::null_mut();
    // SAFETY: ends a capture begun on this thread; `graph` is a valid out-pointer.
    let rc = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
    if !graph.is_null() {
        // SAFETY: `graph` came from `cuStreamEndCapture` and is destroyed once.
        unsafe { sys::cuGraphDestroy(graph) };
    }
    driver("cuStreamEndCapture", rc)
}

/// Reserve, create two pages, map, write, unmap, remap one elsewhere, check it, release.
fn vmm_pass(p: &mut Probe, dev: &CudaDevice, pass: &str) {
    let page = dev.page_size();
    let Some(base) = p.step(&format!("{pass} reserve 4 pages"), || dev.reserve(4 * page)) else {
        return;
    };
    let p0 = p.step(&format!("{pass} create_page p0"), || dev.create_page());
    let p1 = p.step(&format!("{pass} create_page p1"), || dev.create_page());
    if let (Some(p0), Some(p1)) = (p0, p1) {
        let m0 = p.step(
            &format!("{pass} map p0 (cuMemMap + cuMemSetAccess)"),
            || dev.map(base, p0),
        );
        let m1 = p.step(&format!("{pass} map p1"), || dev.map(base + page, p1));
        if m0.is_some() && m1.is_some() {
            p.check(&format!("{pass} write + read back both pages"), || {
                dev.make_current()?;
                memset(base, 0x11, page)?;
                memset(base + page, 0x22, page)?;
                Ok(all_bytes_are(base, 0x11, page)? && all_bytes_are(base + page, 0x22, page)?)
            });
            p.step(&format!("{pass} unmap p0"), || dev.unmap(base));
            p.step(&format!("{pass} unmap p1"), || dev.unmap(base + page));
            if p.step(&format!("{pass} remap p1 at +2 pages"), || {
                dev.map(base + 2 * page, p1)
            })
            .is_some()
            {
                p.check(&format!("{pass} remapped p1 kept its content"), || {
                    dev.make_current()?;
                    all_bytes_are(base + 2 * page, 0x22, page)
                });
                p.step(&format!("{pass} unmap remapped p1"), || {
                    dev.unmap(base + 2 * page)
                });
            }
        }
    }
    if let Some(p0) = p0 {
        p.step(&format!("{pass} release_page p0"), || dev.release_page(p0));
    }
    if let Some(p1) = p1 {
        p.step(&format!("{pass} release_page p1"), || dev.release_page(p1));
    }
    p.step(&format!("{pass} release_reservation"), || {
        dev.release_reservation(base, 4 * page)
    });
}

fn event_pass(p: &mut Probe, dev: &CudaDevice, pass: &str) {
    let Some(ev) = p.step(&format!("{pass} create_event"), || dev.create_event()) else {
        return;
    };
    p.step(&format!("{pass} record_event on stream 0"), || {
        dev.record_event(ev, 0)
    });
    p.step(&format!("{pass} query_event"), || dev.query_event(ev));
    p.step(&format!("{pass} synchronize_event"), || {
        dev.synchronize_event(ev)
    });
    p.check(&format!("{pass} query_event after sync is true"), || {
        dev.query_event(ev)
    });
    p.step(&format!("{pass} stream_wait_event stream 0"), || {
        dev.stream_wait_event(0, ev)
    });
    p.step(&format!("{pass} destroy_event"), || dev.destroy_event(ev));
}

fn capture_steps(p: &mut Probe, dev: &CudaDevice) {
    let Some(stream) = p.step("create_stream (non-blocking)", || dev.create_stream()) else {
        return;
    };
    let page = dev.page_size();
    if p.step("make_current", || dev.make_current()).is_none() {
        return;
    }
    if p.step("begin global capture", || begin_capture(stream))
        .is_some()
    {
        let id = p.step("capture_status of capturing stream", || {
            dev.capture_status(stream)
        });
        if !matches!(id, Some(CaptureStatus::Active(_))) {
            p.failures += 1;
            println!("FAIL        0.0 us  capture_status is not Active: {id:?}");
        }
        let start = Instant::now();
        let legacy = dev.capture_status(0);
        info(
            start.elapsed().as_secs_f64() * 1e6,
            "capture_status(0) while a non-blocking stream captures",
            &format!("{legacy:?}"),
        );
        let seg = p.step("capture: alloc_segment 2 MiB (relaxed)", || {
            dev.alloc_segment(2 * MIB)
        });
        let base = p.step("capture: reserve 2 pages (relaxed)", || {
            dev.reserve(2 * page)
        });
        let pg = p.step("capture: create_page (relaxed)", || dev.create_page());
        let mapped = match (base, pg) {
            (Some(b), Some(g)) => p.step("capture: map (relaxed)", || dev.map(b, g)).is_some(),
            _ => false,
        };
        p.step("end capture: still valid", || end_capture(stream));
        if let (true, Some(b)) = (mapped, base) {
            p.step("unmap", || dev.unmap(b));
        }
        if let Some(g) = pg {
            p.step("release_page", || dev.release_page(g));
        }
        if let Some(b) = base {
            p.step("release_reservation", || {
                dev.release_reservation(b, 2 * page)
            });
        }
        if let Some(s) = seg {
            p.step("free_segment", || dev.free_segment(s, 2 * MIB));
        }
    }

    // Informational: what the calls that are NOT relaxed do during a global-mode capture on this
    // thread. Each runs in its own capture; the resource is made beforehand outside capture.
    let mut raw_ptr = 0u64;
    let raw_ok = unrelaxed(dev, stream, "raw cuMemAlloc_v2 (no relaxed mode)", || {
        // SAFETY: `raw_ptr` is a valid out-pointer; the context is current.
        driver("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut raw_ptr, (2 * MIB) as usize)
        })
    });
    if raw_ok {
        let _ = dev.free_segment(raw_ptr, 2 * MIB);
    }
    if let Ok(seg) = dev.alloc_segment(2 * MIB)
        && !unrelaxed(dev, stream, "free_segment", || {
            dev.free_segment(seg, 2 * MIB)
        })
    {
        let _ = dev.free_segment(seg, 2 * MIB);
    }
    if let Ok(base) = dev.reserve(page) {
        if let Ok(pg) = dev.create_page() {
            if dev.map(base, pg).is_ok() && !unrelaxed(dev, stream, "unmap", || dev.unmap(base)) {
                let _ = dev.unmap(base);
            }
            if !unrelaxed(dev, stream, "release_page", || dev.release_page(pg)) {
                let _ = dev.release_page(pg);
            }
        }
        if !unrelaxed(dev, stream, "release_reservation", || {
            dev.release_reservation(base, page)
        }) {
            let _ = dev.release_reservation(base, page);
        }
    }
    if let Ok(ev) = dev.create_event() {
        unrelaxed(dev, stream, "query_event (event not captured)", || {
            dev.query_event(ev).map(|_| ())
        });
        if !unrelaxed(dev, stream, "destroy_event", || dev.destroy_event(ev)) {
            let _ = dev.destroy_event(ev);
        }
    }
    p.step("destroy_stream", || dev.destroy_stream(stream));
}

/// Runs `f` inside a fresh global-mode capture on `stream` and reports what happened; returns
/// whether `f` succeeded.
fn unrelaxed(
    dev: &CudaDevice,
    stream: u64,
    name: &str,
    f: impl FnOnce() -> DeviceResult<()>,
) -> bool {
    if dev.make_current().is_err() || begin_capture(stream).is_err() {
        info(0.0, name, "could not begin capture");
        return false;
    }
    let start = Instant::now();
    let r = f();
    let us = start.elapsed().as_secs_f64() * 1e6;
    let end = end_capture(stream);
    let ok = r.is_ok();
    let call = match r {
        Ok(()) => "allowed".to_string(),
        Err(e) => format!("refused ({e})"),
    };
    let capture = match end {
        Ok(()) => "capture valid".to_string(),
        Err(e) => format!("capture broken ({e})"),
    };
    info(
        us,
        &format!("unrelaxed {name} during global capture"),
        &format!("{call}, {capture}"),
    );
    ok
}

fn main() -> ExitCode {
    let ordinal: i32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(0);
    let mut p = Probe { failures: 0 };
    p.check("driver_present (libcuda found)", || Ok(driver_present()));
    let Some(dev) = p.step(&format!("CudaDevice::new({ordinal})"), || {
        CudaDevice::new(ordinal)
    }) else {
        println!("SUMMARY: {} failures (no device)", p.failures);
        return ExitCode::FAILURE;
    };
    println!(
        "device {} '{}': driver {}, total {} MiB, page size {} KiB, vmm {}",
        dev.ordinal(),
        dev.name(),
        dev.driver_version(),
        dev.total_memory() / MIB,
        dev.page_size() >> 10,
        dev.vmm_supported()
    );
    p.step("free_memory (MiB)", || Ok(dev.free_memory() / MIB));
    for (pass, size) in [
        ("cold", 2 * MIB),
        ("warm", 2 * MIB),
        ("cold", 20 * MIB),
        ("warm", 20 * MIB),
    ] {
        if let Some(ptr) = p.step(&format!("{pass} alloc_segment {} MiB", size / MIB), || {
            dev.alloc_segment(size)
        }) {
            p.step(&format!("{pass} free_segment {} MiB", size / MIB), || {
                dev.free_segment(ptr, size)
            });
        }
    }
    if dev.vmm_supported() {
        vmm_pass(&mut p, &dev, "cold");
        vmm_pass(&mut p, &dev, "warm");
    }
    event_pass(&mut p, &dev, "cold");
    event_pass(&mut p, &dev, "warm");
    p.check("capture_status(0) is None", || {
        Ok(dev.capture_status(0)? == CaptureStatus::None)
    });
    p.check("alloc_segment(1 << 50) is OutOfMemory", || {
        Ok(matches!(
            dev.alloc_segment(1 << 50),
            Err(DeviceError::OutOfMemory)
        ))
    });
    if dev.vmm_supported() {
        capture_steps(&mut p, &dev);
    }
    println!("SUMMARY: {} failures", p.failures);
    if p.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
