//! PyTorch's `garbage_collection_threshold`: cached whole segments go back before growth once
//! the device holds more than the threshold's share of its limit.

use std::sync::Arc;

use slotpool::core::{Allocator, Config, GrowthMode};
use slotpool::sim::{Backing, SimConfig, SimDevice};

use crate::common::MIB;

fn setup(limit: Option<u64>, threshold: Option<f64>) -> Allocator<SimDevice> {
    let dev = Arc::new(
        SimDevice::new(SimConfig {
            total_memory: 1 << 30,
            backing: Backing::Accounting,
            ..SimConfig::default()
        })
        .expect("sim device"),
    );
    Allocator::new(
        dev,
        Config {
            growth: GrowthMode::Classic,
            memory_limit: limit,
            gc_threshold: threshold,
            ..Config::default()
        },
    )
}

fn reserved(a: &Allocator<SimDevice>) -> u64 {
    a.stats().reserved_bytes.all().current as u64
}

fn checked(a: &Allocator<SimDevice>) {
    a.check_invariants().expect("invariants");
}

/// Four freed 40 MiB segments, then a 50 MiB request that none of them fits.
fn four_freed_then_larger(a: &Allocator<SimDevice>) {
    let ptrs: Vec<u64> = (0..4).map(|_| a.alloc(40 * MIB, 0).unwrap()).collect();
    checked(a);
    for p in ptrs {
        a.free(p).unwrap();
        checked(a);
    }
    assert_eq!(reserved(a), 160 * MIB);
    a.alloc(50 * MIB, 0).unwrap();
    checked(a);
}

#[test]
fn over_the_threshold_growth_releases_free_segments_first() {
    let a = setup(Some(256 * MIB), Some(0.5));
    four_freed_then_larger(&a);
    // 160 MiB held against 128 MiB kept: all four are as old, so one pass takes them all.
    assert_eq!(reserved(&a), 50 * MIB);
    assert_eq!(a.stats().num_device_free, 4);
}

#[test]
fn without_a_threshold_or_a_limit_nothing_is_collected() {
    for (limit, threshold) in [(Some(256 * MIB), None), (None, Some(0.5))] {
        let a = setup(limit, threshold);
        four_freed_then_larger(&a);
        assert_eq!(
            reserved(&a),
            210 * MIB,
            "limit {limit:?}, threshold {threshold:?}"
        );
        assert_eq!(a.stats().num_device_free, 0);
    }
}

#[test]
fn under_the_threshold_nothing_is_collected() {
    let a = setup(Some(1 << 30), Some(0.5));
    four_freed_then_larger(&a);
    assert_eq!(reserved(&a), 210 * MIB);
}

#[test]
fn the_oldest_segments_go_first_and_only_as_many_as_needed() {
    let a = setup(Some(260 * MIB), Some(0.5));
    // The small segment first: the allocations below then never grow (nor collect).
    let _small = a.alloc(4096, 0).unwrap();
    let old = a.alloc(40 * MIB, 0).unwrap();
    let young: Vec<u64> = (0..3).map(|_| a.alloc(40 * MIB, 0).unwrap()).collect();
    a.free(old).unwrap();
    // Allocations that search the free index age the freed segment (distinct sizes: no quick
    // cache hits).
    for i in 1..=20u64 {
        let p = a.alloc(i * 4096, 0).unwrap();
        a.free(p).unwrap();
        checked(&a);
    }
    for p in young {
        a.free(p).unwrap();
    }
    assert_eq!(reserved(&a), 162 * MIB);
    assert_eq!(a.stats().num_device_free, 0);
    // 162 MiB held, 130 MiB kept: the old segment (age 20 against an average of 5) is enough.
    a.alloc(50 * MIB, 0).unwrap();
    checked(&a);
    assert_eq!(reserved(&a), 172 * MIB);
    assert_eq!(a.stats().num_device_free, 1);
    // The three young segments are still cached: more 40 MiB requests do not grow.
    for _ in 0..3 {
        a.alloc(40 * MIB, 0).unwrap();
    }
    checked(&a);
    assert_eq!(reserved(&a), 172 * MIB);
}

#[test]
fn the_threshold_key_follows_pytorch_range() {
    assert_eq!(
        Config::parse("garbage_collection_threshold:0.6")
            .unwrap()
            .gc_threshold,
        Some(0.6)
    );
    for bad in ["0", "1", "1.5", "-0.1", "x", ""] {
        assert!(
            Config::parse(&format!("garbage_collection_threshold:{bad}")).is_err(),
            "{bad:?} accepted"
        );
    }
}
