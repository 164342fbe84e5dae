//! Driver results to [`DeviceError`] values, in one place; and the panic guard around cudarc.
//!
//! cudarc resolves every driver symbol lazily and **panics** when `libcuda` or a symbol is missing.
//! Every call into `cudarc::driver::sys` in this crate therefore goes through [`guard`] (directly, or
//! through the crate-private `call`), which turns such a panic into [`DeviceError::Unavailable`].

use std::any::Any;
use std::ffi::CStr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys::{self, CUresult};
use slotpool_core::{DeviceError, DeviceResult};

/// Set once a [`crate::CudaDevice`] has found `libcuda`; until then no driver function is called,
/// not even `cuGetErrorName` (the error mapping then falls back to the binding's own names).
static DRIVER_LOADED: AtomicBool = AtomicBool::new(false);

/// Records that `libcuda` was found, so that [`error_from`] may ask the driver for error names.
pub(crate) fn mark_driver_loaded() {
    DRIVER_LOADED.store(true, Ordering::Release);
}

/// Runs `f`, turning a panic (cudarc's "Missing symbol ..." or "Unable to dynamically load ...")
/// into [`DeviceError::Unavailable`]. `f` is run at most once; nothing escapes as a panic.
pub fn guard<T>(f: impl FnOnce() -> T) -> Result<T, DeviceError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        DeviceError::Unavailable(format!(
            "CUDA driver call panicked: {}",
            panic_message(&*payload)
        ))
    })
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "unknown panic payload"
    }
}

/// Runs one driver call `what` under [`guard`] and maps its result with [`check`].
pub(crate) fn call(what: &'static str, f: impl FnOnce() -> CUresult) -> DeviceResult<()> {
    check(what, guard(f)?)
}

/// `Ok(())` for `CUDA_SUCCESS`, otherwise the [`DeviceError`] for `code` returned by `what`.
pub fn check(what: &'static str, code: CUresult) -> DeviceResult<()> {
    if code == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(error_from(what, code))
    }
}

/// The [`DeviceError`] for a failed driver call `what` that returned `code`:
///
/// * `CUDA_ERROR_OUT_OF_MEMORY` → [`DeviceError::OutOfMemory`];
/// * the stream-capture errors that mean "not allowed while capturing"
///   (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, `_INVALIDATED`, `_IMPLICIT`, `_WRONG_THREAD`) →
///   [`DeviceError::IllegalDuringCapture`] naming the call;
/// * everything else → [`DeviceError::Driver`] with the numeric code and
///   `"<call>: <CUDA_ERROR_NAME> (<description>)"`.
pub fn error_from(what: &'static str, code: CUresult) -> DeviceError {
    match code {
        CUresult::CUDA_ERROR_OUT_OF_MEMORY => DeviceError::OutOfMemory,
        CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
        | CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
        | CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
        | CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => {
            DeviceError::IllegalDuringCapture(what)
        }
        _ => DeviceError::Driver {
            code: code_of(code),
            what: format!("{what}: {}", describe(code)),
        },
    }
}

/// The numeric value of a `CUresult` (as in `cuda.h`).
pub fn code_of(code: CUresult) -> i32 {
    // `CUresult` is `#[repr(u32)]`; every value defined by CUDA fits in an i32.
    code as u32 as i32
}

/// `"CUDA_ERROR_NAME (description)"`, from the driver when it is loaded, else from the binding.
pub fn describe(code: CUresult) -> String {
    let name = driver_string(code, StringKind::Name).unwrap_or_else(|| format!("{code:?}"));
    match driver_string(code, StringKind::Description) {
        Some(desc) => format!("{name} ({desc})"),
        None => name,
    }
}

#[derive(Clone, Copy)]
enum StringKind {
    Name,
    Description,
}

/// `cuGetErrorName` / `cuGetErrorString`, or `None` when the driver is not loaded or does not know
/// the code.
fn driver_string(code: CUresult, kind: StringKind) -> Option<String> {
    if !DRIVER_LOADED.load(Ordering::Acquire) {
        return None;
    }
    let mut text: *const std::ffi::c_char = std::ptr::null();
    let rc = guard(|| match kind {
        // SAFETY: `text` is a valid out-pointer for the duration of the call; the driver stores a
        // pointer to a static NUL-terminated string in it, or leaves it alone on failure.
        StringKind::Name => unsafe { sys::cuGetErrorName(code, &mut text) },
        // SAFETY: as above, for `cuGetErrorString`.
        StringKind::Description => unsafe { sys::cuGetErrorString(code, &mut text) },
    })
    .ok()?;
    if rc != CUresult::CUDA_SUCCESS || text.is_null() {
        return None;
    }
    // SAFETY: on success the driver returned a non-null pointer to a static, NUL-terminated string
    // that lives as long as the driver library stays loaded (cudarc never unloads it).
    let s = unsafe { CStr::from_ptr(text) };
    Some(s.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok() {
        assert_eq!(check("cuX", CUresult::CUDA_SUCCESS), Ok(()));
    }

    #[test]
    fn out_of_memory_maps_to_out_of_memory() {
        assert_eq!(
            check("cuMemAlloc_v2", CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Err(DeviceError::OutOfMemory)
        );
    }

    #[test]
    fn capture_errors_map_to_illegal_during_capture() {
        for code in [
            CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT,
            CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD,
        ] {
            assert_eq!(
                error_from("cuMemFree_v2", code),
                DeviceError::IllegalDuringCapture("cuMemFree_v2")
            );
        }
    }

    #[test]
    fn other_errors_carry_code_call_and_name() {
        match error_from("cuMemMap", CUresult::CUDA_ERROR_INVALID_VALUE) {
            DeviceError::Driver { code, what } => {
                assert_eq!(code, 1);
                assert!(what.starts_with("cuMemMap: "), "{what}");
                assert!(what.contains("CUDA_ERROR_INVALID_VALUE"), "{what}");
            }
            other => panic!("unexpected {other:?}"),
        }
        match error_from("cuEventQuery", CUresult::CUDA_ERROR_NOT_READY) {
            DeviceError::Driver { code, .. } => assert_eq!(code, 600),
            other => panic!("unexpected {other:?}"),
        }
        match error_from("cuInit", CUresult::CUDA_ERROR_UNKNOWN) {
            DeviceError::Driver { code, .. } => assert_eq!(code, 999),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn guard_turns_panics_into_unavailable() {
        assert_eq!(guard(|| 7), Ok(7));
        match guard(|| -> u32 { panic!("Missing symbol cuFoo") }) {
            Err(DeviceError::Unavailable(why)) => {
                assert!(why.contains("Missing symbol cuFoo"), "{why}")
            }
            other => panic!("unexpected {other:?}"),
        }
        let owned = String::from("owned message");
        match guard(move || -> u32 { std::panic::panic_any(owned) }) {
            Err(DeviceError::Unavailable(why)) => assert!(why.contains("owned message"), "{why}"),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn call_maps_a_closure_result() {
        assert_eq!(
            call("cuX", || CUresult::CUDA_ERROR_OUT_OF_MEMORY),
            Err(DeviceError::OutOfMemory)
        );
        assert_eq!(call("cuX", || CUresult::CUDA_SUCCESS), Ok(()));
    }
}
