//! Stream capture: which streams capture, and the calls that capture forbids.

use std::collections::HashMap;

use slotpool_core::{CaptureStatus, DeviceError, DeviceResult, StreamId};

/// CUDA's `cudaErrorStreamCaptureInvalidated`.
const CAPTURE_INVALIDATED: i32 = 901;

/// One capture in progress.
#[derive(Clone, Copy, Debug)]
struct Capture {
    id: u64,
    invalidated: bool,
}

/// Capture state of every stream.
#[derive(Debug)]
pub(crate) struct Captures {
    /// Capturing streams only.
    active: HashMap<StreamId, Capture>,
    next_id: u64,
    /// Calls rejected because a capture was underway.
    pub(crate) violations: u64,
}

impl Default for Captures {
    fn default() -> Self {
        Captures {
            active: HashMap::new(),
            next_id: 1,
            violations: 0,
        }
    }
}

impl Captures {
    pub(crate) fn begin(&mut self, stream: StreamId) -> DeviceResult<u64> {
        if let Some(c) = self.active.get(&stream) {
            return Err(DeviceError::InvalidArgument(format!(
                "begin_capture({stream}): the stream is already capturing (capture {})",
                c.id
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        let invalidated = false;
        self.active.insert(stream, Capture { id, invalidated });
        Ok(id)
    }

    pub(crate) fn end(&mut self, stream: StreamId) -> DeviceResult<u64> {
        match self.active.remove(&stream) {
            None => Err(DeviceError::InvalidArgument(format!(
                "end_capture({stream}): the stream is not capturing"
            ))),
            Some(Capture {
                id,
                invalidated: true,
            }) => Err(DeviceError::Driver {
                code: CAPTURE_INVALIDATED,
                what: format!("cudaErrorStreamCaptureInvalidated: capture {id} was invalidated"),
            }),
            Some(c) => Ok(c.id),
        }
    }

    pub(crate) fn status(&self, stream: StreamId) -> CaptureStatus {
        match self.active.get(&stream) {
            None => CaptureStatus::None,
            Some(c) if c.invalidated => CaptureStatus::Invalidated,
            Some(c) => CaptureStatus::Active(c.id),
        }
    }

    /// True while any stream captures.
    pub(crate) fn any(&self) -> bool {
        !self.active.is_empty()
    }

    /// Counts a forbidden call, invalidates every capture, and returns the error for it.
    pub(crate) fn violate(&mut self, call: &'static str) -> DeviceError {
        self.violations += 1;
        for c in self.active.values_mut() {
            c.invalidated = true;
        }
        DeviceError::IllegalDuringCapture(call)
    }
}
