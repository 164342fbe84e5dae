//! Streams, events and stream capture over the driver (`Device::create_event` and friends,
//! delegated here from `device.rs`; streams for tests and benches).

use std::ffi::c_uint;
use std::ptr;

use cudarc::driver::sys::{
    self, CUevent, CUevent_flags, CUresult, CUstream, CUstreamCaptureStatus,
};
use slotpool_core::{CaptureStatus, DeviceResult, EventHandle, StreamId};

use crate::device::CudaDevice;
use crate::error::{call, error_from, guard};

pub(crate) fn stream_of(stream: StreamId) -> CUstream {
    stream as usize as CUstream
}

pub(crate) fn event_of(event: EventHandle) -> CUevent {
    event.0 as usize as CUevent
}

impl CudaDevice {
    /// Creates a non-blocking stream on this device (`cuStreamCreate`), for tests and benches.
    pub fn create_stream(&self) -> DeviceResult<StreamId> {
        let _ctx = self.enter()?;
        let mut stream: CUstream = ptr::null_mut();
        // SAFETY: `stream` is a valid out-pointer; flag 1 is `CU_STREAM_NON_BLOCKING`.
        call("cuStreamCreate", || unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        })?;
        Ok(stream as usize as StreamId)
    }

    /// Destroys a stream made by [`CudaDevice::create_stream`] (`cuStreamDestroy_v2`).
    pub fn destroy_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the driver validates the handle; the caller passes a stream it created.
        call("cuStreamDestroy_v2", || unsafe {
            sys::cuStreamDestroy_v2(stream_of(stream))
        })
    }

    /// Blocks until all work queued on `stream` has completed (`cuStreamSynchronize`).
    pub fn synchronize_stream(&self, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: the driver validates the handle; 0 is the legacy default stream.
        call("cuStreamSynchronize", || unsafe {
            sys::cuStreamSynchronize(stream_of(stream))
        })
    }

    pub(crate) fn event_create(&self) -> DeviceResult<EventHandle> {
        let _ctx = self.enter()?;
        let mut event: CUevent = ptr::null_mut();
        let flags = CUevent_flags::CU_EVENT_DISABLE_TIMING as c_uint;
        // SAFETY: `event` is a valid out-pointer and `flags` a valid flag set.
        call("cuEventCreate", || unsafe {
            sys::cuEventCreate(&mut event, flags)
        })?;
        Ok(EventHandle(event as usize as u64))
    }

    pub(crate) fn event_destroy(&self, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: by the trait contract `event` came from `create_event` and is destroyed once.
        call("cuEventDestroy_v2", || unsafe {
            sys::cuEventDestroy_v2(event_of(event))
        })
    }

    pub(crate) fn event_record(&self, event: EventHandle, stream: StreamId) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; the driver validates the stream handle.
        call("cuEventRecord", || unsafe {
            sys::cuEventRecord(event_of(event), stream_of(stream))
        })
    }

    pub(crate) fn event_query(&self, event: EventHandle) -> DeviceResult<bool> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; `cuEventQuery` never blocks.
        let rc = guard(|| unsafe { sys::cuEventQuery(event_of(event)) })?;
        match rc {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(error_from("cuEventQuery", other)),
        }
    }

    pub(crate) fn event_synchronize(&self, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`.
        call("cuEventSynchronize", || unsafe {
            sys::cuEventSynchronize(event_of(event))
        })
    }

    pub(crate) fn ctx_synchronize(&self) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: no arguments; the primary context is current (`enter`).
        call("cuCtxSynchronize", || unsafe { sys::cuCtxSynchronize() })
    }

    pub(crate) fn stream_wait(&self, stream: StreamId, event: EventHandle) -> DeviceResult<()> {
        let _ctx = self.enter()?;
        // SAFETY: `event` came from `create_event`; the driver validates the stream; flags 0.
        call("cuStreamWaitEvent", || unsafe {
            sys::cuStreamWaitEvent(stream_of(stream), event_of(event), 0)
        })
    }

    pub(crate) fn stream_capture_status(&self, stream: StreamId) -> DeviceResult<CaptureStatus> {
        let _ctx = self.enter()?;
        let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        // SAFETY: `status` and `id` are valid out-pointers; the other outputs are optional and
        // passed as null, which the driver documents as "not requested".
        call("cuStreamGetCaptureInfo_v3", || unsafe {
            sys::cuStreamGetCaptureInfo_v3(
                stream_of(stream),
                &mut status,
                &mut id,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        })?;
        Ok(match status {
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active(id),
            CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_through_integers() {
        assert_eq!(stream_of(0), ptr::null_mut());
        assert_eq!(stream_of(0x1234) as usize, 0x1234);
        assert_eq!(event_of(EventHandle(0xdead_beef)) as usize, 0xdead_beef);
    }
}
