//! Cached memory is never unmapped or freed while work queued on a stream still touches it.
//!
//! `empty_cache` synchronises the device and then releases each shard's idle memory under the
//! shard's lock. A block freed onto its stream after that first synchronisation, with a kernel
//! still queued on the stream, must not be released: the shard synchronises again under its lock
//! (where nothing can become idle meanwhile). The simulated device records every unmap or
//! segment free of memory that queued work touches (`work_violations`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use slotpool::core::GrowthMode;

use crate::common::{MIB, check_all, race_duration, repeat_until, setup};

/// How long the racing threads run.
fn duration() -> Duration {
    race_duration(Duration::from_millis(400), Duration::from_secs(10))
}

/// The interleaving itself: between `empty_cache`'s synchronisation and its shard locks, another
/// thread's kernel on stream 1 uses a fresh block, which is then freed onto stream 1 with the
/// kernel still queued.
fn freed_after_the_synchronisation(growth: GrowthMode) {
    let (dev, alloc) = setup(growth, 1 << 30);
    let alloc = Arc::new(alloc);
    const SIZE: u64 = 8 * MIB;
    // Stream 1's shard exists and holds nothing.
    let p = alloc.alloc(SIZE, 1).unwrap();
    alloc.free(p).unwrap();
    alloc.empty_cache();
    assert_eq!(dev.physical_bytes(), 0);

    let ran = Arc::new(AtomicBool::new(false));
    let (a, d, r) = (alloc.clone(), dev.clone(), ran.clone());
    dev.after_next_synchronize(move || {
        let p = a.alloc(SIZE, 1).unwrap();
        d.launch_touching(1, p, SIZE);
        a.free(p).unwrap();
        r.store(true, Ordering::Release);
    });
    alloc.empty_cache();
    assert!(ran.load(Ordering::Acquire), "the other thread's step ran");
    assert_eq!(
        dev.work_violations(),
        0,
        "released under queued work: {:?}",
        dev.last_work_violation()
    );
    // Released all the same: the shard's own synchronisation completed the kernel first.
    assert!(dev.pending_touches().is_empty());
    assert_eq!(dev.physical_bytes(), 0);
    check_all(&dev, &alloc, &[]);
}

#[test]
fn a_block_freed_after_empty_cache_synchronised_is_not_released_under_its_work_vmm() {
    freed_after_the_synchronisation(GrowthMode::Vmm);
}

#[test]
fn a_block_freed_after_empty_cache_synchronised_is_not_released_under_its_work_classic() {
    freed_after_the_synchronisation(GrowthMode::Classic);
}

/// Free-running: threads on their own streams launch kernels over fresh blocks and free them
/// onto the stream at once (stream-ordered reuse), while another thread empties the cache.
fn kernels_race_empty_cache(growth: GrowthMode) {
    let (dev, alloc) = setup(growth, 1 << 30);
    let alloc = Arc::new(alloc);
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (1..=3u64)
        .map(|stream| {
            let (alloc, dev, stop, rounds) =
                (alloc.clone(), dev.clone(), stop.clone(), rounds.clone());
            thread::spawn(move || {
                let mut x = stream.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                while !stop.load(Ordering::Relaxed) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let size = [512 * 1024, 3 * MIB, 9 * MIB][(x % 3) as usize] + x % 4096;
                    let p = alloc.alloc(size, stream).unwrap();
                    dev.launch_touching(stream, p, size);
                    alloc.free(p).unwrap();
                    if x % 16 == 0 {
                        // The stream's work finishes now and then, as a GPU's does.
                        dev.complete(stream);
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let cleaner = {
        let alloc = alloc.clone();
        repeat_until(&stop, move || alloc.empty_cache())
    };
    thread::sleep(duration());
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let cleanings = cleaner.join().unwrap();
    assert!(cleanings > 10 && rounds.load(Ordering::Relaxed) > 100);
    assert_eq!(
        dev.work_violations(),
        0,
        "released under queued work: {:?}",
        dev.last_work_violation()
    );
    dev.complete_all();
    alloc.empty_cache();
    check_all(&dev, &alloc, &[]);
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn kernels_on_their_streams_race_empty_cache_vmm() {
    kernels_race_empty_cache(GrowthMode::Vmm);
}

#[test]
fn kernels_on_their_streams_race_empty_cache_classic() {
    kernels_race_empty_cache(GrowthMode::Classic);
}
