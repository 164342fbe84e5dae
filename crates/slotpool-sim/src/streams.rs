//! Streams and events that complete when the test says so.
//!
//! Each stream counts units of work `submitted` and `completed` (`completed <= submitted`, never
//! decreasing). An event recorded on a stream snapshots `(stream, submitted)` and is complete once
//! the stream's `completed` reaches the snapshot. `stream_wait_event` queues one unit, a wait
//! marker: completing it first completes the event's stream up to the event's snapshot. So work
//! and events queued after a wait never complete before the awaited event, as on CUDA.

use std::collections::HashMap;

use slotpool_core::{DeviceError, DeviceResult, EventHandle, StreamId};

/// A wait marker: unit `unit` of its stream needs `stream` completed up to `upto`.
#[derive(Clone, Copy, Debug)]
struct Wait {
    unit: u64,
    stream: StreamId,
    upto: u64,
}

/// One stream's progress.
#[derive(Debug, Default)]
struct Stream {
    submitted: u64,
    completed: u64,
    /// Wait markers not yet completed, in unit order.
    waits: Vec<Wait>,
}

/// Every stream and live event.
#[derive(Debug)]
pub(crate) struct Streams {
    streams: HashMap<StreamId, Stream>,
    /// Live events -> their last record `(stream, snapshot)`, if any.
    events: HashMap<EventHandle, Option<(StreamId, u64)>>,
    next_event: u64,
    /// Complete all work the moment it is queued.
    auto_complete: bool,
    pub(crate) synchronizations: u64,
    pub(crate) stream_waits: u64,
}

impl Streams {
    pub(crate) fn new(auto_complete: bool) -> Self {
        Streams {
            streams: HashMap::new(),
            events: HashMap::new(),
            next_event: 1,
            auto_complete,
            synchronizations: 0,
            stream_waits: 0,
        }
    }

    pub(crate) fn submitted(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |s| s.submitted)
    }

    pub(crate) fn completed(&self, stream: StreamId) -> u64 {
        self.streams.get(&stream).map_or(0, |s| s.completed)
    }

    pub(crate) fn live_events(&self) -> usize {
        self.events.len()
    }

    pub(crate) fn auto_complete(&self) -> bool {
        self.auto_complete
    }

    /// Turning auto-completion on completes everything queued so far.
    pub(crate) fn set_auto_complete(&mut self, on: bool) {
        self.auto_complete = on;
        if on {
            self.complete_all();
        }
    }

    /// Queues one unit of work on `stream`.
    pub(crate) fn launch(&mut self, stream: StreamId) {
        let s = self.streams.entry(stream).or_default();
        s.submitted += 1;
        let upto = s.submitted;
        if self.auto_complete {
            self.complete_to(stream, upto);
        }
    }

    /// Completes everything queued on `stream` so far.
    pub(crate) fn complete(&mut self, stream: StreamId) {
        self.complete_to(stream, self.submitted(stream));
    }

    pub(crate) fn complete_all(&mut self) {
        let ids: Vec<StreamId> = self.streams.keys().copied().collect();
        for id in ids {
            self.complete(id);
        }
    }

    /// Completes `stream` up to unit `target`, and first whatever its wait markers need.
    fn complete_to(&mut self, stream: StreamId, target: u64) {
        let mut todo = vec![(stream, target)];
        while let Some((id, target)) = todo.pop() {
            let s = self.streams.entry(id).or_default();
            let target = target.min(s.submitted);
            if s.completed >= target {
                continue;
            }
            s.completed = target;
            s.waits.retain(|w| {
                let passed = w.unit <= target;
                if passed {
                    todo.push((w.stream, w.upto));
                }
                !passed
            });
        }
    }

    /// The event's last record, or why the handle is not a live event.
    fn event(&self, call: &str, event: EventHandle) -> DeviceResult<Option<(StreamId, u64)>> {
        match self.events.get(&event) {
            Some(record) => Ok(*record),
            None if (1..self.next_event).contains(&event.0) => Err(DeviceError::InvalidArgument(
                format!("{call}: event {} was already destroyed", event.0),
            )),
            None => Err(DeviceError::InvalidArgument(format!(
                "{call}: event {} was never created",
                event.0
            ))),
        }
    }

    pub(crate) fn create_event(&mut self) -> EventHandle {
        let event = EventHandle(self.next_event);
        self.next_event += 1;
        self.events.insert(event, None);
        event
    }

    pub(crate) fn destroy_event(&mut self, event: EventHandle) -> DeviceResult<()> {
        self.event(&format!("destroy_event({})", event.0), event)?;
        self.events.remove(&event);
        Ok(())
    }

    pub(crate) fn record_event(
        &mut self,
        event: EventHandle,
        stream: StreamId,
    ) -> DeviceResult<()> {
        self.event(&format!("record_event({}, {stream})", event.0), event)?;
        let snapshot = self.submitted(stream);
        self.events.insert(event, Some((stream, snapshot)));
        Ok(())
    }

    /// True once the event's last record has completed (or if it was never recorded).
    pub(crate) fn query_event(&self, event: EventHandle) -> DeviceResult<bool> {
        let record = self.event(&format!("query_event({})", event.0), event)?;
        Ok(record.is_none_or(|(stream, upto)| self.completed(stream) >= upto))
    }

    pub(crate) fn synchronize_event(&mut self, event: EventHandle) -> DeviceResult<()> {
        let record = self.event(&format!("synchronize_event({})", event.0), event)?;
        if let Some((stream, upto)) = record {
            self.complete_to(stream, upto);
        }
        self.synchronizations += 1;
        Ok(())
    }

    pub(crate) fn stream_wait_event(
        &mut self,
        stream: StreamId,
        event: EventHandle,
    ) -> DeviceResult<()> {
        let call = format!("stream_wait_event({stream}, {})", event.0);
        let record = self.event(&call, event)?;
        let s = self.streams.entry(stream).or_default();
        s.submitted += 1;
        if let Some((on, upto)) = record {
            let unit = s.submitted;
            s.waits.push(Wait {
                unit,
                stream: on,
                upto,
            });
        }
        let upto = s.submitted;
        self.stream_waits += 1;
        if self.auto_complete {
            self.complete_to(stream, upto);
        }
        Ok(())
    }
}
