//! The driver's time in a replay: backend calls priced at the H200's per-call costs.
//!
//! The costs are host time per call, medians, measured on one NVIDIA H200 (driver 580.159, CUDA
//! 13.0, 2026-11-29) by a probe that creates, maps, opens, unmaps and releases 2 MiB pages one at
//! a time (`nvcc -O2 -arch=sm_90`, `cuMemCreate` / `cuMemMap` / `cuMemSetAccess` / `cuMemUnmap` /
//! `cuMemRelease`, `cuMemAlloc` / `cuMemFree`, `cuMemAddressReserve`, `cuEventRecord` /
//! `cuEventQuery`):
//!
//! | call | cost |
//! |---|---|
//! | `cuMemCreate` of a page | 8.5 us |
//! | `cuMemMap` + `cuMemSetAccess` of a page | 24 us (0.75 + 23) |
//! | `cuMemUnmap` | 16 us |
//! | `cuMemRelease` | 10 us |
//! | `cuMemAlloc` / `cuMemFree` (2 or 20 MiB) | 33 us / 34 us (29-38) |
//! | `cuMemAddressReserve` (even of 169 GB) | 15 us |
//! | `cuEventRecord` / `cuEventQuery` | 0.2 us / 0.2 us |
//!
//! The cost of a page call does not depend on the page size (2 to 128 MiB: about 33 us to
//! create, map and open one), so one `map` is priced the same whatever the page. Calls the probe
//! did not time (`cuMemAddressFree`, event creation, synchronisation) are priced at 0.

use std::collections::BTreeMap;

use serde::Serialize;

/// Modeled host time of one backend call of `kind` (the replay's call names), in microseconds.
pub fn call_cost_us(kind: &str) -> f64 {
    match kind {
        "create_page" => 8.5,
        "map" => 24.0,
        "unmap" => 16.0,
        "release_page" => 10.0,
        "alloc_segment" => 33.0,
        "free_segment" => 34.0,
        "reserve" => 15.0,
        "record_event" | "query_event" => 0.2,
        _ => 0.0,
    }
}

/// Modeled driver time of a set of calls, ms.
pub fn driver_ms(calls: &BTreeMap<String, u64>) -> f64 {
    calls
        .iter()
        .map(|(k, &n)| call_cost_us(k) * n as f64)
        .fold(0.0, |a, b| a + b) // (an empty `sum` of floats is -0.0)
        / 1e3
}

/// Modeled driver time of part of a replay, split into growth to a new peak of physical memory
/// (one creation and one mapping per page or segment that raised the peak: what every allocator
/// pays) and churn (everything else: pages moved, re-mapped or released and created again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DriverTime {
    pub total_ms: f64,
    pub growth_ms: f64,
    pub churn_ms: f64,
}

impl DriverTime {
    /// `calls` made while the peak of physical memory rose by `peak_growth` bytes, on a device of
    /// `page_size`-byte pages.
    pub fn of(calls: &BTreeMap<String, u64>, peak_growth: u64, page_size: u64) -> DriverTime {
        let total_ms = driver_ms(calls);
        let pages = peak_growth.div_ceil(page_size.max(1)) as f64;
        let growth_ms =
            (pages * (call_cost_us("create_page") + call_cost_us("map")) / 1e3).min(total_ms);
        DriverTime {
            total_ms,
            growth_ms,
            churn_ms: total_ms - growth_ms,
        }
    }
}

/// `after - before`, kind by kind (kinds with no calls left out).
pub fn calls_since(
    after: &BTreeMap<String, u64>,
    before: &BTreeMap<String, u64>,
) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(k, &n)| (k.clone(), n - before.get(k).copied().unwrap_or(0).min(n)))
        .filter(|&(_, n)| n > 0)
        .collect()
}

/// The replay table's rows for the driver's time: (label, value).
pub fn table_rows(r: &crate::ReplayReport) -> Vec<(&'static str, String)> {
    let row = |calls: &BTreeMap<String, u64>, t: &DriverTime| {
        let n: u64 = calls.values().sum();
        format!(
            "{:.1} ms ({} calls; growth {:.1} ms, churn {:.1} ms)",
            t.total_ms, n, t.growth_ms, t.churn_ms
        )
    };
    vec![
        ("driver time", row(&r.backend_calls, &r.driver_time)),
        (
            "driver time, 2nd half",
            row(&r.backend_calls_second_half, &r.driver_time_second_half),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls(v: &[(&str, u64)]) -> BTreeMap<String, u64> {
        v.iter().map(|&(k, n)| (k.to_string(), n)).collect()
    }

    #[test]
    fn prices_calls_and_splits_growth_from_churn() {
        let c = calls(&[
            ("create_page", 10),
            ("map", 30),
            ("unmap", 20),
            ("reserve", 1),
        ]);
        let t = DriverTime::of(&c, 10 << 21, 2 << 20);
        assert!((t.total_ms - (0.085 + 0.72 + 0.32 + 0.015)).abs() < 1e-9);
        assert!((t.growth_ms - 0.325).abs() < 1e-9);
        assert!((t.churn_ms - (t.total_ms - 0.325)).abs() < 1e-9);
        // Growth never exceeds what was spent.
        let t = DriverTime::of(&calls(&[("map", 1)]), 100 << 21, 2 << 20);
        assert_eq!(t.churn_ms, 0.0);
        assert!((t.growth_ms - 0.024).abs() < 1e-9);
    }

    #[test]
    fn calls_since_subtracts_by_kind() {
        let a = calls(&[("map", 5), ("unmap", 2), ("reserve", 1)]);
        let b = calls(&[("map", 3), ("reserve", 1)]);
        assert_eq!(calls_since(&a, &b), calls(&[("map", 2), ("unmap", 2)]));
    }
}
