//! Tests on a real GPU. Each test returns early, printing "skipped: no GPU", when
//! `CudaDevice::new(0)` fails (no driver, no device), so they pass on machines without a GPU.
//!
//! A few steps drive the driver directly through `cudarc::driver::sys` (memset, copy, begin/end
//! capture) to check what the backend did; those calls are made with the device's primary context
//! current ([`CudaDevice::make_current`]) and are not part of the backend.
//!
//! The tests hold one lock while they run: a global-mode capture in one test makes CUDA refuse
//! (and the refusal invalidates the capture) `cuMemFree`, `cuEventQuery`, synchronous copies and
//! the like on every other thread, so the tests must not overlap.

use std::ptr;
use std::sync::{Mutex, MutexGuard, PoisonError};

use cudarc::driver::sys::{self, CUcontext, CUresult, CUstream, CUstreamCaptureMode};
use slotpool_core::{CaptureStatus, Device, DeviceError};
use slotpool_cuda::CudaDevice;

static SERIAL: Mutex<()> = Mutex::new(());

/// Device 0 and the lock that keeps GPU tests from overlapping; `None` (test skipped) without a GPU.
fn device() -> Option<(MutexGuard<'static, ()>, CudaDevice)> {
    let lock = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    match CudaDevice::new(0) {
        Ok(dev) => Some((lock, dev)),
        Err(err) => {
            println!("skipped: no GPU ({err})");
            None
        }
    }
}

/// As [`device`], and skipped as well when the device has no virtual memory management.
fn vmm_device() -> Option<(MutexGuard<'static, ()>, CudaDevice)> {
    let (lock, dev) = device()?;
    if !dev.vmm_supported() {
        println!("skipped: no VMM support");
        return None;
    }
    Some((lock, dev))
}

fn current_context() -> usize {
    let mut ctx: CUcontext = ptr::null_mut();
    // SAFETY: `ctx` is a valid out-pointer; the driver is loaded (a CudaDevice exists).
    let rc = unsafe { sys::cuCtxGetCurrent(&mut ctx) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    ctx as usize
}

fn memset(ptr: u64, value: u8, bytes: usize) {
    // SAFETY: the caller made the context current and `ptr..ptr+bytes` is mapped read/write.
    let rc = unsafe { sys::cuMemsetD8_v2(ptr, value, bytes) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
}

fn read(ptr: u64, bytes: usize) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `host` is writable for `bytes` bytes; the caller made the context current and
    // `ptr..ptr+bytes` is mapped read/write. The copy is synchronous.
    let rc = unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), ptr, bytes) };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);
    host
}

#[test]
fn reports_device_properties() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    println!(
        "device {} '{}', driver {}, total {} B, free {} B, page {} B, vmm {}",
        dev.ordinal(),
        dev.name(),
        dev.driver_version(),
        dev.total_memory(),
        dev.free_memory(),
        dev.page_size(),
        dev.vmm_supported()
    );
    assert!(dev.total_memory() > 0);
    assert!(dev.free_memory() > 0 && dev.free_memory() <= dev.total_memory());
    assert!(dev.page_size().is_power_of_two());
}

#[test]
fn alloc_and_free_segments() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    for size in [2u64 << 20, 20 << 20, 512] {
        let ptr = dev.alloc_segment(size).expect("alloc_segment");
        assert_ne!(ptr, 0);
        dev.make_current().expect("make_current");
        memset(ptr, 0x5a, size as usize);
        assert!(read(ptr, size as usize).iter().all(|&b| b == 0x5a));
        dev.free_segment(ptr, size).expect("free_segment");
    }
}

#[test]
fn out_of_memory_is_an_error_not_a_panic() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    assert_eq!(dev.alloc_segment(1 << 50), Err(DeviceError::OutOfMemory));
}

#[test]
fn vmm_reserve_map_unmap_remap_release() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    let page = dev.page_size();
    let bytes = page as usize;
    let base = dev.reserve(4 * page).expect("reserve");
    assert_eq!(base % page, 0);
    let p0 = dev.create_page().expect("create_page 0");
    let p1 = dev.create_page().expect("create_page 1");
    dev.map(base, p0).expect("map p0");
    dev.map(base + page, p1).expect("map p1");

    dev.make_current().expect("make_current");
    memset(base, 0x11, bytes);
    memset(base + page, 0x22, bytes);
    assert!(read(base, 2 * bytes)[..bytes].iter().all(|&b| b == 0x11));

    dev.unmap(base).expect("unmap p0");
    dev.unmap(base + page).expect("unmap p1");
    // Mapping a page where one is already mapped fails with an error, not a panic.
    dev.map(base + 2 * page, p1).expect("remap p1");
    assert!(dev.map(base + 2 * page, p0).is_err());
    // The physical page keeps its content at its new address.
    assert!(read(base + 2 * page, bytes).iter().all(|&b| b == 0x22));
    dev.unmap(base + 2 * page).expect("unmap remapped p1");

    dev.release_page(p0).expect("release p0");
    dev.release_page(p1).expect("release p1");
    dev.release_reservation(base, 4 * page)
        .expect("release_reservation");
}

/// Page aliasing on real pages: one physical page mapped at two addresses of a reservation at
/// once (`cuMemMap` of a handle that is already mapped) shows the same bytes at both, and is
/// released once both mappings are gone.
#[test]
fn one_page_mapped_at_two_addresses_shares_its_bytes() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    let page = dev.page_size();
    let bytes = page as usize;
    let base = dev.reserve(4 * page).expect("reserve");
    let p = dev.create_page().expect("create_page");
    dev.map(base, p).expect("map at slot 0");
    dev.map_run(base + 2 * page, &[p]).expect("alias at slot 2");
    dev.make_current().expect("make_current");
    memset(base, 0x3c, bytes);
    assert!(read(base + 2 * page, bytes).iter().all(|&b| b == 0x3c));
    memset(base + 2 * page, 0x7e, bytes);
    assert!(read(base, bytes).iter().all(|&b| b == 0x7e));
    dev.unmap(base).expect("unmap slot 0");
    assert!(read(base + 2 * page, bytes).iter().all(|&b| b == 0x7e));
    dev.unmap(base + 2 * page).expect("unmap slot 2");
    dev.release_page(p).expect("release");
    dev.release_reservation(base, 4 * page)
        .expect("release_reservation");
}

#[test]
fn peers_and_access_refresh() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    let page = dev.page_size();
    let base = dev.reserve(2 * page).expect("reserve");
    let p0 = dev.create_page().expect("create_page");
    dev.map(base, p0).expect("map");
    // This device itself: nothing to add. A device that does not exist: an error, no panic.
    dev.add_peer(0).expect("add_peer(self)");
    assert!(dev.add_peer(1 << 20).is_err());
    // Re-applying the access list to a mapped page works and keeps the page usable.
    dev.refresh_access(base, page)
        .expect("refresh_access on a mapped page");
    dev.make_current().expect("make_current");
    memset(base, 0x5a, page as usize);
    assert!(read(base, page as usize).iter().all(|&b| b == 0x5a));
    // An unmapped range is refused by the driver, as an error.
    assert!(dev.refresh_access(base + page, page).is_err());
    // With a second device that can reach this one, it becomes a peer of the mapped page.
    if let Ok(other) = CudaDevice::new(1) {
        match dev.add_peer(1) {
            Ok(()) => {
                dev.refresh_access(base, page)
                    .expect("refresh_access with a peer");
                other.make_current().expect("make_current(1)");
                // The page is intact from device 1's context (a copy only: it shows the access
                // list took, not a kernel's view, which needs a kernel).
                assert!(read(base, page as usize).iter().all(|&b| b == 0x5a));
                dev.make_current().expect("make_current(0)");
            }
            Err(e) => println!("device 1 cannot reach device 0: {e}"),
        }
    }
    dev.unmap(base).expect("unmap");
    dev.release_page(p0).expect("release_page");
    dev.release_reservation(base, 2 * page)
        .expect("release_reservation");
}

#[test]
fn a_run_maps_all_its_pages_or_none() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    let page = dev.page_size();
    let bytes = page as usize;
    let base = dev.reserve(6 * page).expect("reserve");
    let p: Vec<_> = (0..5)
        .map(|_| dev.create_page().expect("create_page"))
        .collect();
    // Three pages, one access call: all of them usable.
    dev.map_run(base, &p[..3]).expect("map_run");
    dev.make_current().expect("make_current");
    memset(base, 0x33, 3 * bytes);
    assert!(read(base, 3 * bytes).iter().all(|&b| b == 0x33));
    // A run whose second page lands on a mapped page fails and leaves its first page unmapped.
    dev.map(base + 4 * page, p[4]).expect("map p4");
    assert!(dev.map_run(base + 3 * page, &p[3..5]).is_err());
    dev.map(base + 3 * page, p[3])
        .expect("the failed run left page 3 unmapped");
    for i in 0..5 {
        dev.unmap(base + i * page).expect("unmap");
    }
    for h in p {
        dev.release_page(h).expect("release_page");
    }
    dev.release_reservation(base, 6 * page)
        .expect("release_reservation");
}

#[test]
fn larger_pages_are_multiples_of_the_granularity() {
    let Some((_serial, mut dev)) = vmm_device() else {
        return;
    };
    let granularity = dev.page_size();
    assert!(matches!(
        dev.set_page_size(granularity + granularity / 2),
        Err(DeviceError::InvalidArgument(_))
    ));
    assert!(dev.set_page_size(0).is_err());
    assert_eq!(
        dev.page_size(),
        granularity,
        "a refused size changes nothing"
    );
    dev.set_page_size(4 * granularity).expect("4 x granularity");
    let page = dev.page_size();
    assert_eq!(page, 4 * granularity);
    let base = dev.reserve(2 * page).expect("reserve");
    assert_eq!(base % page, 0);
    let p = dev.create_page().expect("create a large page");
    dev.map(base + page, p).expect("map it");
    dev.make_current().expect("make_current");
    // The whole large page is backed: its last byte is writable.
    memset(base + page, 0x33, page as usize);
    assert!(
        read(base + 2 * page - 4096, 4096)
            .iter()
            .all(|&b| b == 0x33)
    );
    dev.unmap(base + page).expect("unmap");
    dev.release_page(p).expect("release");
    dev.release_reservation(base, 2 * page)
        .expect("release_reservation");
}

#[test]
fn events_on_the_null_stream() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    let ev = dev.create_event().expect("create_event");
    // A fresh event counts as completed.
    assert_eq!(dev.query_event(ev), Ok(true));
    dev.record_event(ev, 0).expect("record_event");
    dev.query_event(ev).expect("query_event");
    dev.synchronize_event(ev).expect("synchronize_event");
    assert_eq!(dev.query_event(ev), Ok(true));
    dev.stream_wait_event(0, ev).expect("stream_wait_event");
    dev.synchronize_stream(0).expect("synchronize_stream");
    dev.destroy_event(ev).expect("destroy_event");
}

#[test]
fn null_stream_is_not_capturing() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    assert_eq!(dev.capture_status(0), Ok(CaptureStatus::None));
}

#[test]
fn caller_context_is_restored() {
    let Some((_serial, dev)) = device() else {
        return;
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            // A fresh thread has no current context, and keeps none after backend calls.
            assert_eq!(current_context(), 0);
            let ptr = dev.alloc_segment(2 << 20).expect("alloc_segment");
            assert_eq!(current_context(), 0);
            dev.free_segment(ptr, 2 << 20).expect("free_segment");
            let ev = dev.create_event().expect("create_event");
            dev.destroy_event(ev).expect("destroy_event");
            assert_eq!(current_context(), 0);
            // With the primary context current, it stays current.
            dev.make_current().expect("make_current");
            let primary = current_context();
            assert_ne!(primary, 0);
            assert!(dev.free_memory() > 0);
            assert_eq!(current_context(), primary);
        });
    });
}

#[test]
fn growth_during_global_capture_keeps_the_capture_valid() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    let stream = dev.create_stream().expect("create_stream");
    dev.make_current().expect("make_current");
    let raw = stream as usize as CUstream;
    // SAFETY: `raw` is a live stream of the current context.
    let rc = unsafe {
        sys::cuStreamBeginCapture_v2(raw, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL)
    };
    assert_eq!(rc, CUresult::CUDA_SUCCESS);

    let status = dev.capture_status(stream);
    let page = dev.page_size();
    let seg = dev.alloc_segment(2 << 20);
    // Another thread (in the default global mode) grows memory while this thread captures.
    let other_thread = std::thread::scope(|s| {
        s.spawn(|| -> Result<_, DeviceError> {
            let base = dev.reserve(page)?;
            let pg = dev.create_page()?;
            dev.map(base, pg)?;
            let seg = dev.alloc_segment(2 << 20)?;
            Ok((base, pg, seg))
        })
        .join()
        .unwrap_or_else(|_| Err(DeviceError::InvalidArgument("thread panicked".into())))
    });
    let base = dev.reserve(2 * page);
    let pg = dev.create_page();
    let mapped = match (&base, &pg) {
        (Ok(base), Ok(pg)) => dev.map(*base, *pg),
        _ => Err(DeviceError::InvalidArgument(
            "no reservation or page".into(),
        )),
    };
    let status_after = dev.capture_status(stream);

    let mut graph: sys::CUgraph = ptr::null_mut();
    // SAFETY: ends the capture begun above on the same thread; `graph` is a valid out-pointer.
    let end = unsafe { sys::cuStreamEndCapture(raw, &mut graph) };
    if !graph.is_null() {
        // SAFETY: `graph` was returned by `cuStreamEndCapture` and is destroyed once.
        unsafe { sys::cuGraphDestroy(graph) };
    }
    let status_end = dev.capture_status(stream);

    // Clean up before asserting, so that a failure leaks nothing.
    if let (Ok(()), Ok(base)) = (&mapped, &base) {
        dev.unmap(*base).expect("unmap");
    }
    if let Ok(pg) = pg {
        dev.release_page(pg).expect("release_page");
    }
    if let Ok(base) = base {
        dev.release_reservation(base, 2 * page)
            .expect("release_reservation");
    }
    if let Ok(seg) = seg {
        dev.free_segment(seg, 2 << 20).expect("free_segment");
    }
    if let Ok((base, pg, seg)) = other_thread {
        dev.unmap(base).expect("unmap (other thread)");
        dev.release_page(pg).expect("release_page (other thread)");
        dev.release_reservation(base, page)
            .expect("release_reservation (other thread)");
        dev.free_segment(seg, 2 << 20)
            .expect("free_segment (other thread)");
    }
    dev.destroy_stream(stream).expect("destroy_stream");

    assert!(matches!(status, Ok(CaptureStatus::Active(_))), "{status:?}");
    assert_eq!(status_after, status, "the capture id must not change");
    assert!(seg.is_ok(), "alloc_segment during capture: {seg:?}");
    assert!(mapped.is_ok(), "map during capture: {mapped:?}");
    assert!(
        other_thread.is_ok(),
        "growth on another thread during capture: {other_thread:?}"
    );
    assert_eq!(
        end,
        CUresult::CUDA_SUCCESS,
        "the capture must still be valid"
    );
    assert_eq!(status_end, Ok(CaptureStatus::None));
}

/// CUDA IPC of vmm pages, exporter and importer in one process (`pidfd_getfd` on itself): the
/// imported range shows the exported pages' bytes in order, writes go both ways, the exported
/// descriptor is made once per page, and the memory outlives the exporter's release.
#[test]
fn exported_pages_map_elsewhere_with_their_content() {
    let Some((_serial, dev)) = vmm_device() else {
        return;
    };
    if !dev.shareable() {
        println!("skipped: no POSIX file-descriptor handles");
        return;
    }
    let page = dev.page_size();
    let bytes = page as usize;
    let base = dev.reserve(2 * page).expect("reserve");
    let pages = [
        dev.create_page().expect("page 0"),
        dev.create_page().expect("page 1"),
    ];
    dev.map_run(base, &pages).expect("map");
    dev.make_current().expect("make_current");
    memset(base, 0x31, bytes);
    memset(base + page, 0x32, bytes);
    let fds: Vec<i32> = pages
        .iter()
        .map(|&p| dev.export_page(p).expect("export"))
        .collect();
    assert_eq!(
        dev.export_page(pages[0]).unwrap(),
        fds[0],
        "one descriptor a page"
    );
    let pid = std::process::id() as i32;
    let other = dev.import_pages(pid, &fds, page).expect("import");
    assert_ne!(other, base);
    let seen = read(other, 2 * bytes);
    assert!(
        seen[..bytes].iter().all(|&b| b == 0x31),
        "page 0 at the import"
    );
    assert!(
        seen[bytes..].iter().all(|&b| b == 0x32),
        "page 1 at the import"
    );
    memset(other + page, 0x44, 16);
    assert_eq!(
        read(base + page, 16),
        vec![0x44; 16],
        "a write through the import"
    );
    // The exporter lets go of its pages: the import keeps the memory alive.
    dev.unmap(base).expect("unmap 0");
    dev.unmap(base + page).expect("unmap 1");
    for p in pages {
        dev.release_page(p).expect("release");
    }
    dev.release_reservation(base, 2 * page)
        .expect("release_reservation");
    assert!(read(other, 16).iter().all(|&b| b == 0x31));
    dev.close_import(other).expect("close_import");
    assert!(dev.close_import(other).is_err(), "closed twice");
    // Bad input maps nothing.
    assert!(dev.import_pages(pid, &[], page).is_err());
    assert!(dev.import_pages(pid, &[fds[0]], page + 1).is_err());
    assert!(
        dev.import_pages(pid, &[fds[0]], page).is_err(),
        "a descriptor closed when its page was released"
    );
}
