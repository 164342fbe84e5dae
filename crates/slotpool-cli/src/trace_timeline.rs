//! What a trace itself says along a replay, on the replay's operation axis: PyTorch's reserved
//! bytes from the trace's segment events, and the capture and variant phases of its markers.
//!
//! PyTorch's reserved bytes are the running sum of `segment_alloc` and `segment_map` sizes minus
//! `segment_free` and `segment_unmap` sizes ([`Trace::torch_peak_reserved`] is its maximum). A
//! trace that records no releases (the CSV traces of benches/traces keep only `segment_alloc`)
//! gives a curve that only grows: [`TraceTimeline::torch_releases`] says which it is. A snapshot
//! covers its history window only, so segments that PyTorch held before the window began are
//! missing from the curve.
//!
//! [`Trace::torch_peak_reserved`]: crate::trace::Trace::torch_peak_reserved

use serde::Serialize;

use crate::replay::Timeline;
use crate::trace::{Action, TraceEvent};

/// The trace's side of a replay's timeline.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TraceTimeline {
    /// `(operation index, PyTorch reserved bytes)`, bucket maxima over the same buckets as the
    /// replay's timeline. Empty when the trace has no segment events.
    pub torch_reserved: Vec<(u64, u64)>,
    /// Whether the trace records segment releases (`segment_free`, `segment_unmap`).
    pub torch_releases: bool,
    /// Capture and variant phases, in order.
    pub phases: Vec<Phase>,
}

/// What a phase is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PhaseKind {
    /// From a `capture_begin` to its `capture_end` (or the end of the trace).
    Capture,
    /// From a `variant_begin` to the next one (or the end of the trace).
    Variant,
}

/// One phase: operations `start..end` of the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Phase {
    pub kind: PhaseKind,
    pub start: u64,
    pub end: u64,
    /// The variant's number (`variant_begin`'s size); 0 for a capture.
    pub variant: u64,
}

/// Builds a [`TraceTimeline`] while a replay runs.
pub(crate) struct TraceTimelineRecorder {
    timeline: Timeline,
    reserved: i128,
    segment_events: bool,
    releases: bool,
    phases: Vec<Phase>,
    open_capture: Option<usize>,
    open_variant: Option<usize>,
}

impl TraceTimelineRecorder {
    /// For a replay of `total_ops` operations keeping at most `points` points.
    pub(crate) fn new(total_ops: u64, points: usize) -> Self {
        TraceTimelineRecorder {
            timeline: Timeline::new(total_ops, points),
            reserved: 0,
            segment_events: false,
            releases: false,
            phases: Vec::new(),
            open_capture: None,
            open_variant: None,
        }
    }

    /// An event that is not one of the replay's operations, seen when `op` operations are done.
    pub(crate) fn event(&mut self, op: u64, e: &TraceEvent) {
        match e.action {
            Action::SegmentAlloc | Action::SegmentMap => {
                self.segment_events = true;
                self.reserved += i128::from(e.size);
            }
            Action::SegmentFree | Action::SegmentUnmap => {
                self.segment_events = true;
                self.releases = true;
                self.reserved -= i128::from(e.size);
            }
            Action::CaptureBegin => {
                self.close(op, PhaseKind::Capture);
                self.open_capture = Some(self.open(op, PhaseKind::Capture, 0));
            }
            Action::CaptureEnd => self.close(op, PhaseKind::Capture),
            Action::VariantBegin => {
                self.close(op, PhaseKind::Capture);
                self.close(op, PhaseKind::Variant);
                self.open_variant = Some(self.open(op, PhaseKind::Variant, e.size));
            }
            _ => {}
        }
    }

    fn open(&mut self, op: u64, kind: PhaseKind, variant: u64) -> usize {
        self.phases.push(Phase {
            kind,
            start: op,
            end: op,
            variant,
        });
        self.phases.len() - 1
    }

    fn close(&mut self, op: u64, kind: PhaseKind) {
        let open = match kind {
            PhaseKind::Capture => self.open_capture.take(),
            PhaseKind::Variant => self.open_variant.take(),
        };
        if let Some(i) = open {
            self.phases[i].end = op;
        }
    }

    /// After operation `op` of the replay.
    pub(crate) fn sample(&mut self, op: u64) {
        let reserved = u64::try_from(self.reserved.max(0)).unwrap_or(u64::MAX);
        self.timeline.record(op, reserved, 0);
    }

    /// The timeline, with open phases ending at `ops`.
    pub(crate) fn finish(mut self, ops: u64) -> TraceTimeline {
        self.close(ops, PhaseKind::Capture);
        self.close(ops, PhaseKind::Variant);
        let torch_reserved = if self.segment_events {
            self.timeline
                .finish()
                .into_iter()
                .map(|(op, r, _)| (op, r))
                .collect()
        } else {
            Vec::new()
        };
        TraceTimeline {
            torch_reserved,
            torch_releases: self.releases,
            phases: self.phases,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(action: Action, size: u64) -> TraceEvent {
        TraceEvent {
            action,
            addr: 0,
            size,
            stream: 0,
            line: 0,
        }
    }

    #[test]
    fn curve_and_phases() {
        let mut r = TraceTimelineRecorder::new(6, 100);
        r.event(0, &ev(Action::SegmentAlloc, 10));
        r.sample(0);
        r.event(1, &ev(Action::VariantBegin, 3));
        r.event(1, &ev(Action::CaptureBegin, 0));
        r.sample(1);
        r.event(2, &ev(Action::SegmentAlloc, 5));
        r.sample(2);
        r.event(3, &ev(Action::CaptureEnd, 0));
        r.event(3, &ev(Action::SegmentFree, 10));
        r.sample(3);
        r.event(4, &ev(Action::VariantBegin, 4));
        r.event(4, &ev(Action::CaptureBegin, 0));
        r.sample(4);
        let t = r.finish(5);
        assert_eq!(
            t.torch_reserved,
            [(0, 10), (1, 10), (2, 15), (3, 5), (4, 5)]
        );
        assert!(t.torch_releases);
        let p = |kind, start, end, variant| Phase {
            kind,
            start,
            end,
            variant,
        };
        use PhaseKind::*;
        assert_eq!(
            t.phases,
            [
                p(Variant, 1, 4, 3),
                p(Capture, 1, 3, 0),
                p(Variant, 4, 5, 4),
                p(Capture, 4, 5, 0)
            ]
        );
    }

    #[test]
    fn no_segment_events_no_curve() {
        let mut r = TraceTimelineRecorder::new(2, 100);
        r.sample(0);
        r.sample(1);
        let t = r.finish(2);
        assert!(t.torch_reserved.is_empty() && !t.torch_releases && t.phases.is_empty());
    }
}
