//! Threads on distinct and shared streams hammer one allocator (blocks up to 3 MiB, beyond a
//! shard's credit, and peak resets from one thread); afterwards every invariant and every
//! allocation's bytes are checked.

use std::sync::Arc;
use std::thread;

use slotpool::core::GrowthMode;

use crate::common::{Live, MIB, check_all, fill_probes, setup, verify_probes};

fn stress(growth: GrowthMode) {
    let (dev, alloc) = setup(growth, 1 << 30);
    let alloc = Arc::new(alloc);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (dev, alloc) = (dev.clone(), alloc.clone());
            thread::spawn(move || {
                // Threads 0 and 1 share stream 1; 2 and 3 have their own.
                let stream = if t < 2 { 1 } else { 10 + t };
                let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ t;
                let mut live: Vec<Live> = Vec::new();
                for i in 0..3000u64 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if live.len() < 24 && (!x.is_multiple_of(3) || live.is_empty()) {
                        let size = match x % 10 {
                            0 => 2 * MIB + x % MIB,
                            1..=3 => 64 * 1024 + x % (512 * 1024),
                            _ => 1 + x % 8192,
                        };
                        let ptr = alloc.alloc(size, stream).expect("alloc");
                        let seed = t << 32 | i;
                        fill_probes(&dev, ptr, size, seed);
                        live.push(Live {
                            ptr,
                            size,
                            seed,
                            stream,
                        });
                    } else {
                        let l = live.swap_remove((x as usize / 7) % live.len());
                        verify_probes(&dev, l.ptr, l.size, l.seed).expect("pattern intact");
                        if x.is_multiple_of(5) {
                            alloc.record_stream(l.ptr, 99).expect("record_stream");
                        }
                        alloc.free(l.ptr).expect("free");
                    }
                    if i % 500 == 0 {
                        dev.complete_all();
                        alloc.process_events();
                    }
                    // Peak resets take every shard's lease back while the others spend and
                    // refill theirs (invariant 5 afterwards: nothing lost or counted twice).
                    if t == 3 && i % 250 == 0 {
                        alloc.reset_peak_stats();
                    }
                }
                live
            })
        })
        .collect();
    let mut live = Vec::new();
    for t in threads {
        live.extend(t.join().expect("thread panicked"));
    }
    check_all(&dev, &alloc, &live);
    let st = alloc.stats();
    assert!(st.allocated_bytes.all().peak >= st.allocated_bytes.all().current);
    for l in &live {
        alloc.free(l.ptr).expect("free");
    }
    dev.complete_all();
    alloc.empty_cache();
    check_all(&dev, &alloc, &[]);
    assert_eq!(dev.physical_bytes(), 0);
}

#[test]
fn threads_on_shared_and_distinct_streams_vmm() {
    stress(GrowthMode::Vmm);
}

#[test]
fn threads_on_shared_and_distinct_streams_classic() {
    stress(GrowthMode::Classic);
}

/// A trace sink attached and detached from one thread while others allocate: no deadlock and no
/// lost invariant, and every entry a sink receives is whole (a worker's stream, its sizes).
#[test]
fn trace_sink_toggled_while_threads_allocate() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use slotpool::core::{TraceAction, TraceEntry, TraceSink};

    let (dev, alloc) = setup(GrowthMode::Vmm, 1 << 30);
    let alloc = Arc::new(alloc);
    let seen: Arc<Mutex<Vec<TraceEntry>>> = Arc::new(Mutex::new(Vec::new()));
    let (started, stop) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let sink = |seen: &Arc<Mutex<Vec<TraceEntry>>>| -> TraceSink {
        let seen = seen.clone();
        Arc::new(move |e: &TraceEntry| seen.lock().unwrap().push(*e))
    };
    let workers: Vec<_> = (0..3u64)
        .map(|t| {
            let (alloc, started) = (alloc.clone(), started.clone());
            thread::spawn(move || {
                while !started.load(Ordering::Acquire) {
                    thread::yield_now();
                }
                for i in 0..4000u64 {
                    let size = 512 * (1 + (i * 7 + t) % 300);
                    let p = alloc.alloc(size, 20 + t).expect("alloc");
                    alloc.free(p).expect("free");
                }
            })
        })
        .collect();
    let toggler = {
        let (alloc, seen, started, stop) =
            (alloc.clone(), seen.clone(), started.clone(), stop.clone());
        thread::spawn(move || {
            // On until the first entry arrives, then on and off as fast as it goes.
            alloc.set_trace_sink(Some(sink(&seen)));
            started.store(true, Ordering::Release);
            while seen.lock().unwrap().is_empty() {
                thread::yield_now();
            }
            let mut on = true;
            while !stop.load(Ordering::Relaxed) {
                on = !on;
                alloc.set_trace_sink(on.then(|| sink(&seen)));
                thread::yield_now();
            }
            alloc.set_trace_sink(None);
        })
    };
    for w in workers {
        w.join().expect("worker");
    }
    stop.store(true, Ordering::Relaxed);
    toggler.join().expect("toggler");
    check_all(&dev, &alloc, &[]);
    let seen = seen.lock().unwrap();
    assert!(!seen.is_empty(), "the sink saw nothing");
    for e in seen.iter() {
        assert!((20..23).contains(&e.stream), "{e:?}: not a worker's stream");
        if e.action == TraceAction::Alloc {
            assert!(
                e.size % 512 == 0 && (512..=300 * 512).contains(&e.size),
                "{e:?}: not a size a worker asked for"
            );
        }
    }
}
