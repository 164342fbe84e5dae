//! Work queued on streams that touches device memory, and physical memory freed under it.
//!
//! [`SimDevice::launch_touching`](crate::SimDevice::launch_touching) queues one unit of work on a
//! stream that reads and writes an address range, as a kernel does. The range stays in use until
//! that unit completes (a stream, event or device synchronisation, or auto-completion). Unmapping
//! a page or freeing a segment that pending work still touches is what makes a real GPU fault or
//! read another allocation's bytes: the call is made as the driver would make it, and recorded as
//! a violation that tests read with `work_violations` / `last_work_violation`.
//!
//! Work queued with plain `launch` touches nothing. With no touching work pending every check is
//! one test of an empty list.

use slotpool_core::{DevicePtr, StreamId};

use crate::streams::Streams;

/// A unit of work that touches `[start, end)`: pending while `unit` of `stream` is not complete.
#[derive(Clone, Copy, Debug)]
struct Touch {
    stream: StreamId,
    unit: u64,
    start: DevicePtr,
    end: DevicePtr,
}

/// Touching work that may still be pending, and the violations seen.
#[derive(Debug, Default)]
pub(crate) struct Work {
    touches: Vec<Touch>,
    pub(crate) violations: u64,
    pub(crate) last: Option<String>,
}

impl Work {
    /// Notes that unit `unit` of `stream` touches `len` bytes at `start`.
    pub(crate) fn touch(&mut self, stream: StreamId, unit: u64, start: DevicePtr, len: u64) {
        if len > 0 {
            self.touches.push(Touch {
                stream,
                unit,
                start,
                end: start.saturating_add(len),
            });
        }
    }

    /// Forgets touches whose unit completed.
    fn prune(&mut self, streams: &Streams) {
        self.touches
            .retain(|t| streams.completed(t.stream) < t.unit);
    }

    /// The pending touches, as `(stream, start, len)`, oldest first.
    pub(crate) fn pending(&mut self, streams: &Streams) -> Vec<(StreamId, DevicePtr, u64)> {
        self.prune(streams);
        self.touches
            .iter()
            .map(|t| (t.stream, t.start, t.end - t.start))
            .collect()
    }

    /// `call` freed the physical memory behind `len` bytes at `start`: a violation if pending
    /// work touches any of it.
    pub(crate) fn freed(&mut self, streams: &Streams, call: &str, start: DevicePtr, len: u64) {
        if self.touches.is_empty() {
            return;
        }
        self.prune(streams);
        let end = start.saturating_add(len);
        if let Some(t) = self.touches.iter().find(|t| t.start < end && start < t.end) {
            self.violations += 1;
            self.last = Some(format!(
                "{call} freed [{start:#x}, {end:#x}) while unit {} of stream {} (touching \
                 [{:#x}, {:#x})) was still queued",
                t.unit, t.stream, t.start, t.end
            ));
        }
    }
}
