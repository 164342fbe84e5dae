//! The replay driver: runs a trace's allocation workload against a [`ReplayTarget`].
//!
//! The workload is the trace's `alloc` events and its frees, in order (PyTorch's semantics: a
//! block returns to the pool at `free_completed`). A trace without any `free_completed` (a
//! snapshot recorded with `skip_actions=["free_completed"]`) is replayed with its `free_requested`
//! events instead; the choice is made once per trace and reported as `free_action`.
//!
//! Trace addresses are only names: each is mapped to the pointer the target returned. A free of an
//! address that is not live (never allocated in the window of the trace, or freed twice) is
//! counted in `skipped_frees` and skipped; an alloc of an address that is still live is counted in
//! `duplicate_allocs` and the old block is freed first. An error from the target (out of memory)
//! stops the replay with a [`ReplayError`] naming the trace and the event's place.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use rustc_hash::FxHashMap;
use serde::Serialize;
use thiserror::Error;

use crate::driver_time::{DriverTime, calls_since};
use crate::trace::{Action, Location, Trace, TraceFormat};
use crate::trace_timeline::{TraceTimeline, TraceTimelineRecorder};

/// An allocator driven by [`replay`].
pub trait ReplayTarget {
    /// Allocate `size` requested bytes on `stream`; returns the device address.
    fn alloc(&mut self, size: u64, stream: u64) -> Result<u64, String>;
    /// Free a pointer that `alloc` returned.
    fn free(&mut self, ptr: u64) -> Result<(), String>;
    /// Current (allocated bytes, reserved/physical bytes) after the last operation.
    fn sample(&self) -> (u64, u64);
    /// Backend calls made so far, by name (for targets that count them).
    fn backend_calls(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// The physical page size of the target's device, for [`DriverTime`] (2 MiB unless told).
    fn page_size(&self) -> u64 {
        2 << 20
    }
}

impl<T: ReplayTarget + ?Sized> ReplayTarget for Box<T> {
    fn alloc(&mut self, size: u64, stream: u64) -> Result<u64, String> {
        (**self).alloc(size, stream)
    }
    fn free(&mut self, ptr: u64) -> Result<(), String> {
        (**self).free(ptr)
    }
    fn sample(&self) -> (u64, u64) {
        (**self).sample()
    }
    fn backend_calls(&self) -> Vec<(String, u64)> {
        (**self).backend_calls()
    }
    fn page_size(&self) -> u64 {
        (**self).page_size()
    }
}

/// Default number of points kept in [`ReplayReport::timeline`].
pub const DEFAULT_TIMELINE_POINTS: usize = 2000;

/// How often (in operations) the progress callback is called.
const PROGRESS_EVERY: u64 = 1 << 14;

/// Options of [`replay`].
pub struct ReplayOptions<'a> {
    /// A label for the target, copied into the report (`vmm`, `classic`, ...).
    pub mode: String,
    /// Called as `progress(done, total)` with counts of workload operations, every few thousand
    /// operations and once at the end.
    pub progress: Option<&'a dyn Fn(u64, u64)>,
    /// At most this many points in the timeline (at least 1).
    pub timeline_points: usize,
}

impl Default for ReplayOptions<'_> {
    fn default() -> Self {
        ReplayOptions {
            mode: String::new(),
            progress: None,
            timeline_points: DEFAULT_TIMELINE_POINTS,
        }
    }
}

impl fmt::Debug for ReplayOptions<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayOptions")
            .field("mode", &self.mode)
            .field("progress", &self.progress.map(|_| "Fn(u64, u64)"))
            .field("timeline_points", &self.timeline_points)
            .finish()
    }
}

/// What a replay measured. Sizes are bytes; `GB` in the CLI means 1e9 bytes.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// Short trace name (file name without `.trace.csv.gz`).
    pub trace: String,
    /// The trace file as given.
    pub source: String,
    pub format: TraceFormat,
    /// The target's label ([`ReplayOptions::mode`]).
    pub mode: String,
    /// Events in the trace, of every action.
    pub events: u64,
    /// `alloc` calls made on the target.
    pub allocs: u64,
    /// `free` calls made on the target for trace frees (implicit frees of duplicate allocs are
    /// not counted here).
    pub frees: u64,
    /// `free_completed` or `free_requested`: which trace events were replayed as frees.
    pub free_action: Action,
    /// Frees of trace addresses that were not live, skipped.
    pub skipped_frees: u64,
    /// Allocs of trace addresses that were still live; the old block was freed first.
    pub duplicate_allocs: u64,
    /// Allocations still live when the trace ended.
    pub live_at_end: u64,
    /// Peak of the sum of requested sizes of live allocations.
    pub peak_requested: u64,
    /// Peak of the target's allocated bytes (sampled after every operation).
    pub peak_allocated: u64,
    /// Peak of the target's reserved bytes (sampled after every operation).
    pub peak_reserved: u64,
    /// `peak_reserved / peak_allocated` (0 when nothing was allocated).
    pub ratio: f64,
    /// What PyTorch reserved according to the trace's segment events (see
    /// [`Trace::torch_peak_reserved`]); 0 when the trace has none.
    pub torch_peak_reserved: u64,
    /// PyTorch's allocated bytes as far as the trace tells: peak of the live sizes rounded up to
    /// 512 B (PyTorch's `round_size` without `roundup_power2_divisions`; it ignores blocks that
    /// PyTorch hands out unsplit, so it can be slightly below PyTorch's own figure).
    pub torch_peak_allocated: u64,
    /// `torch_peak_reserved / torch_peak_allocated` (0 when either is 0).
    pub torch_ratio: f64,
    /// Median host time of one target `alloc` call, ns.
    pub ns_per_alloc: u64,
    /// Median host time of one target `free` call, ns.
    pub ns_per_free: u64,
    /// 99th percentile of the host time of one target `alloc` call, ns.
    pub ns_per_alloc_p99: u64,
    /// Backend calls during the replay (segment, page, map and event calls), by name; one `map`
    /// per page mapped.
    pub backend_calls: BTreeMap<String, u64>,
    /// The backend calls made while the second half of the trace's events replayed (the steady
    /// state of a training loop), by name.
    pub backend_calls_second_half: BTreeMap<String, u64>,
    /// Modeled driver time of [`ReplayReport::backend_calls`] at the H200's per-call costs
    /// ([`crate::driver_time`]), split into growth to a new peak and churn.
    pub driver_time: DriverTime,
    /// The same for [`ReplayReport::backend_calls_second_half`].
    pub driver_time_second_half: DriverTime,
    /// 99th percentile of the host time of one target `free` call, ns.
    pub ns_per_free_p99: u64,
    /// Wall time of the whole replay loop, ms.
    pub replay_ms: f64,
    /// `(operation index, allocated, reserved)`, at most [`ReplayOptions::timeline_points`]
    /// points; each is the maximum over a bucket of consecutive operations, so peaks show.
    /// Left out of [`ReplayReport::to_json`].
    pub timeline: Vec<(u64, u64, u64)>,
    /// PyTorch's reserved bytes and the capture and variant phases, on the same operation axis.
    /// Left out of [`ReplayReport::to_json`].
    pub trace_timeline: TraceTimeline,
}

impl ReplayReport {
    /// One JSON object with every field except the timeline.
    pub fn to_json(&self) -> String {
        self.json(false)
    }

    /// One JSON object with every field, the timeline included.
    pub fn to_json_with_timeline(&self) -> String {
        self.json(true)
    }

    fn json(&self, timeline: bool) -> String {
        match serde_json::to_value(self) {
            Ok(mut value) => {
                if !timeline && let Some(obj) = value.as_object_mut() {
                    obj.remove("timeline");
                    obj.remove("trace_timeline");
                }
                value.to_string()
            }
            Err(e) => serde_json::json!({ "error": e.to_string() }).to_string(),
        }
    }
}

/// Why a replay stopped.
#[derive(Debug, Error)]
pub enum ReplayError {
    #[error(
        "{trace}: {at}: alloc of {size} bytes on stream {stream} failed: {message} \
         (allocated {allocated} B, reserved {reserved} B before the call)"
    )]
    Alloc {
        trace: String,
        at: Location,
        size: u64,
        stream: u64,
        message: String,
        allocated: u64,
        reserved: u64,
    },
    #[error("{trace}: {at}: free of {ptr:#x} (trace address {addr:#x}) failed: {message}")]
    Free {
        trace: String,
        at: Location,
        addr: u64,
        ptr: u64,
        message: String,
    },
}

#[derive(Clone, Copy)]
struct Live {
    ptr: u64,
    size: u64,
}

/// PyTorch's `round_size` without `roundup_power2_divisions`: at least 512, a multiple of 512.
fn torch_round(size: u64) -> u64 {
    size.max(1).div_ceil(512).saturating_mul(512)
}

/// Downsampling of (op, allocated, reserved) samples into at most `points` bucket maxima.
pub(crate) struct Timeline {
    bucket: u64,
    current: Option<(u64, u64, u64)>,
    points: Vec<(u64, u64, u64)>,
}

impl Timeline {
    pub(crate) fn new(total_ops: u64, points: usize) -> Self {
        let points = points.max(1) as u64;
        Timeline {
            bucket: total_ops.div_ceil(points).max(1),
            current: None,
            points: Vec::with_capacity(points.min(total_ops.max(1)) as usize),
        }
    }

    pub(crate) fn record(&mut self, op: u64, allocated: u64, reserved: u64) {
        let start = op - op % self.bucket;
        match &mut self.current {
            Some((s, a, r)) if *s == start => {
                *a = (*a).max(allocated);
                *r = (*r).max(reserved);
            }
            cur => {
                if let Some(p) = cur.take() {
                    self.points.push(p);
                }
                *cur = Some((start, allocated, reserved));
            }
        }
    }

    pub(crate) fn finish(mut self) -> Vec<(u64, u64, u64)> {
        if let Some(p) = self.current.take() {
            self.points.push(p);
        }
        self.points
    }
}

fn elapsed_ns(start: Instant) -> u32 {
    u32::try_from(start.elapsed().as_nanos()).unwrap_or(u32::MAX)
}

/// The value at quantile `q` (0..=1) of `v` (reordered in place); 0 for an empty vector.
fn quantile(v: &mut [u32], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let idx = ((v.len() - 1) as f64 * q).round() as usize;
    let idx = idx.min(v.len() - 1);
    let (_, x, _) = v.select_nth_unstable(idx);
    u64::from(*x)
}

/// Replays `trace`'s alloc/free workload on `target`.
pub fn replay<T: ReplayTarget + ?Sized>(
    trace: &Trace,
    target: &mut T,
    opts: &ReplayOptions<'_>,
) -> Result<ReplayReport, ReplayError> {
    let n_alloc = trace.count(Action::Alloc) as u64;
    let n_completed = trace.count(Action::FreeCompleted) as u64;
    let (free_action, n_free) = if n_completed > 0 {
        (Action::FreeCompleted, n_completed)
    } else {
        (
            Action::FreeRequested,
            trace.count(Action::FreeRequested) as u64,
        )
    };
    let total_ops = n_alloc + n_free;

    let mut live: FxHashMap<u64, Live> = FxHashMap::default();
    live.reserve((n_alloc as usize).min(1 << 20));
    let mut alloc_ns: Vec<u32> = Vec::with_capacity(n_alloc as usize);
    let mut free_ns: Vec<u32> = Vec::with_capacity(n_free as usize);
    let mut timeline = Timeline::new(total_ops, opts.timeline_points);
    let mut trace_timeline = TraceTimelineRecorder::new(total_ops, opts.timeline_points);

    let (mut allocs, mut frees, mut skipped_frees, mut duplicate_allocs) = (0u64, 0u64, 0u64, 0u64);
    let (mut requested, mut peak_requested) = (0u64, 0u64);
    let (mut torch_alloc, mut torch_peak_alloc) = (0u64, 0u64);
    let (mut peak_allocated, mut peak_reserved) = (0u64, 0u64);
    let mut op = 0u64;
    let trace_name = || trace.source.clone();

    let mut half = HalfMark::new(trace.events.len());
    let started = Instant::now();
    for (i, e) in trace.events.iter().enumerate() {
        half.observe(i, &*target, peak_reserved);
        if e.action == Action::Alloc {
            if let Some(old) = live.remove(&e.addr) {
                duplicate_allocs += 1;
                target.free(old.ptr).map_err(|message| ReplayError::Free {
                    trace: trace_name(),
                    at: trace.location(e.line),
                    addr: e.addr,
                    ptr: old.ptr,
                    message,
                })?;
                requested -= old.size;
                torch_alloc -= torch_round(old.size);
            }
            let t0 = Instant::now();
            let result = target.alloc(e.size, e.stream);
            let dt = elapsed_ns(t0);
            let ptr = result.map_err(|message| {
                let (allocated, reserved) = target.sample();
                ReplayError::Alloc {
                    trace: trace_name(),
                    at: trace.location(e.line),
                    size: e.size,
                    stream: e.stream,
                    message,
                    allocated,
                    reserved,
                }
            })?;
            alloc_ns.push(dt);
            allocs += 1;
            live.insert(e.addr, Live { ptr, size: e.size });
            requested += e.size;
            peak_requested = peak_requested.max(requested);
            torch_alloc += torch_round(e.size);
            torch_peak_alloc = torch_peak_alloc.max(torch_alloc);
        } else if e.action == free_action {
            let Some(block) = live.remove(&e.addr) else {
                skipped_frees += 1;
                continue;
            };
            let t0 = Instant::now();
            let result = target.free(block.ptr);
            let dt = elapsed_ns(t0);
            result.map_err(|message| ReplayError::Free {
                trace: trace_name(),
                at: trace.location(e.line),
                addr: e.addr,
                ptr: block.ptr,
                message,
            })?;
            free_ns.push(dt);
            frees += 1;
            requested -= block.size;
            torch_alloc -= torch_round(block.size);
        } else {
            trace_timeline.event(op, e);
            continue;
        }

        let (allocated, reserved) = target.sample();
        peak_allocated = peak_allocated.max(allocated);
        peak_reserved = peak_reserved.max(reserved);
        timeline.record(op, allocated, reserved);
        trace_timeline.sample(op);
        op += 1;
        if op.is_multiple_of(PROGRESS_EVERY)
            && let Some(progress) = opts.progress
        {
            progress(op, total_ops);
        }
    }
    let replay_ms = started.elapsed().as_secs_f64() * 1e3;
    if let Some(progress) = opts.progress {
        progress(total_ops, total_ops);
    }

    let ratio = if peak_allocated == 0 {
        0.0
    } else {
        peak_reserved as f64 / peak_allocated as f64
    };
    let torch_peak_reserved = trace.torch_peak_reserved();
    let torch_ratio = if torch_peak_alloc == 0 || torch_peak_reserved == 0 {
        0.0
    } else {
        torch_peak_reserved as f64 / torch_peak_alloc as f64
    };
    let (backend_calls, backend_calls_second_half, driver_time, driver_time_second_half) =
        half.finish(&*target, peak_reserved);
    Ok(ReplayReport {
        backend_calls,
        backend_calls_second_half,
        driver_time,
        driver_time_second_half,
        trace: trace.name(),
        source: trace.source.clone(),
        format: trace.format,
        mode: opts.mode.clone(),
        events: trace.events.len() as u64,
        allocs,
        frees,
        free_action,
        skipped_frees,
        duplicate_allocs,
        live_at_end: live.len() as u64,
        peak_requested,
        peak_allocated,
        peak_reserved,
        ratio,
        torch_peak_reserved,
        torch_peak_allocated: torch_peak_alloc,
        torch_ratio,
        ns_per_alloc: quantile(&mut alloc_ns, 0.5),
        ns_per_free: quantile(&mut free_ns, 0.5),
        ns_per_alloc_p99: quantile(&mut alloc_ns, 0.99),
        ns_per_free_p99: quantile(&mut free_ns, 0.99),
        replay_ms,
        timeline: timeline.finish(),
        trace_timeline: trace_timeline.finish(op),
    })
}

/// The backend calls and the peak of physical memory when the second half of a trace's events
/// begins, for the second half's figures.
struct HalfMark {
    at: usize,
    calls: Option<BTreeMap<String, u64>>,
    peak: u64,
}

impl HalfMark {
    fn new(events: usize) -> Self {
        HalfMark {
            at: events / 2,
            calls: None,
            peak: 0,
        }
    }

    /// Before event `i` replays: take the mark at the half.
    fn observe<T: ReplayTarget + ?Sized>(&mut self, i: usize, target: &T, peak_reserved: u64) {
        if i == self.at && self.calls.is_none() {
            self.calls = Some(target.backend_calls().into_iter().collect());
            self.peak = peak_reserved;
        }
    }

    /// (every call, the second half's calls, and their driver times).
    fn finish<T: ReplayTarget + ?Sized>(
        self,
        target: &T,
        peak_reserved: u64,
    ) -> (
        BTreeMap<String, u64>,
        BTreeMap<String, u64>,
        DriverTime,
        DriverTime,
    ) {
        let all: BTreeMap<String, u64> = target.backend_calls().into_iter().collect();
        let second = calls_since(&all, &self.calls.unwrap_or_else(|| all.clone()));
        let ps = target.page_size();
        let time = DriverTime::of(&all, peak_reserved, ps);
        let time_second = DriverTime::of(&second, peak_reserved.saturating_sub(self.peak), ps);
        (all, second, time, time_second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_keeps_bucket_maxima_and_bounds_points() {
        let mut t = Timeline::new(10_000, 100);
        for op in 0..10_000u64 {
            let v = if op == 5_555 { 1_000_000 } else { op % 7 };
            t.record(op, v, v * 2);
        }
        let pts = t.finish();
        assert!(pts.len() <= 100, "{} points", pts.len());
        assert!(pts.iter().any(|p| p.1 == 1_000_000 && p.2 == 2_000_000));
        assert!(pts.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn timeline_small_keeps_everything() {
        let mut t = Timeline::new(3, 2000);
        for op in 0..3 {
            t.record(op, op, op);
        }
        assert_eq!(t.finish(), vec![(0, 0, 0), (1, 1, 1), (2, 2, 2)]);
    }

    #[test]
    fn quantiles() {
        assert_eq!(quantile(&mut [], 0.5), 0);
        assert_eq!(quantile(&mut [5, 1, 3], 0.5), 3);
        assert_eq!(quantile(&mut [5, 1, 3, 100], 0.99), 100);
    }

    #[test]
    fn torch_rounding() {
        assert_eq!(torch_round(0), 512);
        assert_eq!(torch_round(1), 512);
        assert_eq!(torch_round(512), 512);
        assert_eq!(torch_round(513), 1024);
    }
}
