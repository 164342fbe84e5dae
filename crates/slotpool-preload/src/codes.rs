//! Status codes on both sides of the forwarder, and how slotpool's answers become CUDA's.
//!
//! The rules are pure functions, so they are unit-tested here without a process to preload.

use std::ffi::c_int;

use slotpool_abi::sp_status;

// ------------------------------------------------------------------------------------------------
// CUDA (`cudaError_t` of the runtime API and `CUresult` of the driver API are both C enums, `int`)

/// `cudaSuccess` / `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: c_int = 0;
/// `cudaErrorInvalidValue` / `CUDA_ERROR_INVALID_VALUE`: the same number in both APIs.
pub const CUDA_ERROR_INVALID_VALUE: c_int = 1;
/// `cudaErrorMemoryAllocation` / `CUDA_ERROR_OUT_OF_MEMORY`: the same number in both APIs.
pub const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
/// `cudaErrorInitializationError` / `CUDA_ERROR_NOT_INITIALIZED`: returned when a call must pass
/// through but the real library cannot be found in the process (it is not loaded at all).
pub const CUDA_ERROR_NOT_INITIALIZED: c_int = 3;

/// `cudaStreamLegacy`: the legacy default stream as an explicit handle.
pub const STREAM_LEGACY: u64 = 0x1;
/// `cudaStreamPerThread` / `CU_STREAM_PER_THREAD`: the calling thread's default stream.
pub const STREAM_PER_THREAD: u64 = 0x2;

/// True for the handles that name a default stream rather than a created stream (0, legacy,
/// per-thread). They belong to no particular device: the current device is meant.
#[inline]
pub fn is_default_stream(stream: u64) -> bool {
    stream <= STREAM_PER_THREAD
}

/// The stream an allocation made through a `_ptsz` entry point (a program built with
/// `--default-stream per-thread`) is used on: there, stream 0 means the per-thread stream.
#[inline]
pub fn per_thread_stream(stream: u64) -> u64 {
    if stream == 0 {
        STREAM_PER_THREAD
    } else {
        stream
    }
}

// ------------------------------------------------------------------------------------------------
// slotpool (`sp_status` of include/slotpool.h)

// The numbers are slotpool-abi's; the `c_int` forms compare with what a C function pointer into
// `libslotpool.so` returns (any `int`, so never read as the enum).

/// `SP_OK`.
pub const SP_OK: c_int = sp_status::SP_OK.code();
/// `SP_ERR_INVALID_ARGUMENT`.
pub const SP_ERR_INVALID_ARGUMENT: c_int = sp_status::SP_ERR_INVALID_ARGUMENT.code();
/// `SP_ERR_OUT_OF_MEMORY`.
pub const SP_ERR_OUT_OF_MEMORY: c_int = sp_status::SP_ERR_OUT_OF_MEMORY.code();
/// `SP_ERR_UNKNOWN_POINTER`.
pub const SP_ERR_UNKNOWN_POINTER: c_int = sp_status::SP_ERR_UNKNOWN_POINTER.code();
/// `SP_ERR_INVALID_STATE`.
pub const SP_ERR_INVALID_STATE: c_int = sp_status::SP_ERR_INVALID_STATE.code();
/// `SP_ERR_SHUTDOWN`.
pub const SP_ERR_SHUTDOWN: c_int = sp_status::SP_ERR_SHUTDOWN.code();

/// What an allocation hook does with slotpool's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AllocOutcome {
    /// slotpool served the request: return success.
    Served,
    /// slotpool is out of memory (after freeing its cache, under its limits): return
    /// `cudaErrorMemoryAllocation` / `CUDA_ERROR_OUT_OF_MEMORY`.
    OutOfMemory,
    /// Anything else (a device slotpool does not know, an absurd size, a backend error, shut
    /// down): the real library answers, with its own error codes and its own bookkeeping.
    PassThrough,
}

/// The rule for `sp_alloc`'s status.
#[inline]
pub fn alloc_outcome(status: c_int) -> AllocOutcome {
    match status {
        SP_OK => AllocOutcome::Served,
        SP_ERR_OUT_OF_MEMORY => AllocOutcome::OutOfMemory,
        _ => AllocOutcome::PassThrough,
    }
}

/// What a free hook does with slotpool's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreeOutcome {
    /// slotpool freed it: return success.
    Freed,
    /// slotpool was shut down (`sp_shutdown`, typically by another front end at exit): it can no
    /// longer tell its pointers from others, so the free is accepted and does nothing. Handing a
    /// slotpool pointer to the real library could free a whole segment under live neighbours.
    AcceptedAfterShutdown,
    /// Not slotpool's pointer (or an error): the real library answers.
    PassThrough,
}

/// The rule for `sp_free`'s (and `sp_record_stream`'s) status.
#[inline]
pub fn free_outcome(status: c_int) -> FreeOutcome {
    match status {
        SP_OK => FreeOutcome::Freed,
        SP_ERR_SHUTDOWN => FreeOutcome::AcceptedAfterShutdown,
        _ => FreeOutcome::PassThrough,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_rules() {
        assert_eq!(alloc_outcome(SP_OK), AllocOutcome::Served);
        assert_eq!(
            alloc_outcome(SP_ERR_OUT_OF_MEMORY),
            AllocOutcome::OutOfMemory
        );
        for s in [
            SP_ERR_INVALID_ARGUMENT,
            SP_ERR_UNKNOWN_POINTER,
            4,
            SP_ERR_INVALID_STATE,
            6,
            7,
            8,
            SP_ERR_SHUTDOWN,
            10,
            11,
            -1,
            999,
        ] {
            assert_eq!(alloc_outcome(s), AllocOutcome::PassThrough, "status {s}");
        }
    }

    #[test]
    fn free_rules() {
        assert_eq!(free_outcome(SP_OK), FreeOutcome::Freed);
        assert_eq!(
            free_outcome(SP_ERR_SHUTDOWN),
            FreeOutcome::AcceptedAfterShutdown
        );
        for s in [SP_ERR_INVALID_ARGUMENT, SP_ERR_UNKNOWN_POINTER, 10, 7, -1] {
            assert_eq!(free_outcome(s), FreeOutcome::PassThrough, "status {s}");
        }
    }

    #[test]
    fn streams() {
        assert!(is_default_stream(0));
        assert!(is_default_stream(STREAM_LEGACY));
        assert!(is_default_stream(STREAM_PER_THREAD));
        assert!(!is_default_stream(0x7f00_0000_1000));
        assert_eq!(per_thread_stream(0), STREAM_PER_THREAD);
        assert_eq!(per_thread_stream(STREAM_LEGACY), STREAM_LEGACY);
        assert_eq!(per_thread_stream(0x1234_5000), 0x1234_5000);
    }

    #[test]
    fn runtime_and_driver_codes_agree() {
        // The hooks return these numbers from both APIs; CUDA's headers give both enums the same
        // values for them.
        assert_eq!(CUDA_ERROR_INVALID_VALUE, 1);
        assert_eq!(CUDA_ERROR_OUT_OF_MEMORY, 2);
        assert_eq!(CUDA_ERROR_NOT_INITIALIZED, 3);
    }
}
