//! The C ABI's error type, the mapping of errors to status codes (the codes themselves are
//! slotpool-abi's), the per-thread last-error message, and [`ffi`], the guard every entry point
//! runs its body under.
//!
//! Every failure in this crate is an [`Error`]; [`Error::status`] is the one place where an error
//! becomes an `sp_status` code, and the `From` impls below are the one place where core and backend
//! errors become an [`Error`].

use std::cell::{Cell, RefCell};
use std::ffi::{CString, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};

use slotpool_core::{AllocError, ConfigError, DeviceError, PoolId};

pub use slotpool_abi::sp_status;

/// The name of the status code `status` (`"SP_OK"`, `"SP_ERR_OUT_OF_MEMORY"`, ...), as
/// `cudaGetErrorName` names a CUDA error; `"SP_ERR_UNRECOGNIZED"` for a value that is no code. A
/// static string: never NULL, never to be freed. Never initialises the library.
#[unsafe(no_mangle)]
pub extern "C" fn sp_status_name(status: c_int) -> *const c_char {
    sp_status::name_of(status).as_ptr()
}

/// Every way a C ABI call can fail.
#[derive(Clone, Debug, PartialEq)]
pub enum Error {
    InvalidArgument(String),
    OutOfMemory(String),
    UnknownPointer(u64),
    UnknownPool(PoolId),
    InvalidState(String),
    BackendUnavailable(String),
    Device(String),
    NotInitialized(String),
    Shutdown,
    Panic(String),
    Config(String),
    PoolPaused(PoolId),
}

impl Error {
    /// The status code of this error: the one mapping from errors to codes.
    pub fn status(&self) -> sp_status {
        match self {
            Error::InvalidArgument(_) => sp_status::SP_ERR_INVALID_ARGUMENT,
            Error::OutOfMemory(_) => sp_status::SP_ERR_OUT_OF_MEMORY,
            Error::UnknownPointer(_) => sp_status::SP_ERR_UNKNOWN_POINTER,
            Error::UnknownPool(_) => sp_status::SP_ERR_UNKNOWN_POOL,
            Error::InvalidState(_) => sp_status::SP_ERR_INVALID_STATE,
            Error::BackendUnavailable(_) => sp_status::SP_ERR_BACKEND_UNAVAILABLE,
            Error::Device(_) => sp_status::SP_ERR_DEVICE,
            Error::NotInitialized(_) => sp_status::SP_ERR_NOT_INITIALIZED,
            Error::Shutdown => sp_status::SP_ERR_SHUTDOWN,
            Error::Panic(_) => sp_status::SP_ERR_PANIC,
            Error::Config(_) => sp_status::SP_ERR_CONFIG,
            Error::PoolPaused(_) => sp_status::SP_ERR_POOL_PAUSED,
        }
    }

    /// A null-pointer error for the argument `what`.
    pub(crate) fn null(what: &str) -> Error {
        Error::InvalidArgument(format!("{what} is NULL"))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::InvalidArgument(m) => write!(f, "invalid argument: {m}"),
            Error::OutOfMemory(m) => write!(f, "out of memory: {m}"),
            Error::UnknownPointer(p) => write!(
                f,
                "unknown pointer {p:#x}: not allocated by slotpool, not the start of an \
                 allocation, or already freed"
            ),
            Error::UnknownPool(id) => write!(f, "unknown pool {id}"),
            Error::InvalidState(m) => write!(f, "invalid state: {m}"),
            Error::BackendUnavailable(m) => write!(f, "backend unavailable: {m}"),
            Error::Device(m) => write!(f, "device error: {m}"),
            Error::NotInitialized(m) => write!(f, "not initialised: {m}"),
            Error::Shutdown => write!(f, "slotpool was shut down (sp_shutdown)"),
            Error::Panic(m) => write!(f, "internal error (panic caught at the C boundary): {m}"),
            Error::Config(m) => write!(f, "{m}"),
            Error::PoolPaused(id) => {
                write!(f, "pool {id} is paused: resume it (sp_pool_resume) first")
            }
        }
    }
}

impl std::error::Error for Error {}

impl From<AllocError> for Error {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::OutOfMemory(report) => Error::OutOfMemory(report.to_string()),
            AllocError::InvalidSize(size) => {
                Error::InvalidArgument(format!("size {size}: must be between 1 and 2^56 bytes"))
            }
            AllocError::UnknownPointer(p) => Error::UnknownPointer(p),
            AllocError::UnknownPool(id) => Error::UnknownPool(*id),
            AllocError::InvalidArgument(m) => Error::InvalidArgument(*m),
            AllocError::InvalidState(m) => Error::InvalidState(*m),
            // A refused restore: the pool is not in a state the checkpoint can be applied to.
            e @ AllocError::CheckpointMismatch(_) => Error::InvalidState(e.to_string()),
            AllocError::PoolPaused(id) => Error::PoolPaused(*id),
            AllocError::Device(d) => (*d).into(),
        }
    }
}

impl From<DeviceError> for Error {
    fn from(e: DeviceError) -> Self {
        match e {
            DeviceError::OutOfMemory => Error::OutOfMemory(e.to_string()),
            DeviceError::Unavailable(why) => Error::BackendUnavailable(why),
            other => Error::Device(other.to_string()),
        }
    }
}

impl From<ConfigError> for Error {
    fn from(e: ConfigError) -> Self {
        Error::Config(e.to_string())
    }
}

/// Result of an internal call.
pub type Result<T> = std::result::Result<T, Error>;

thread_local! {
    /// The message of this thread's last failed call, NUL-terminated.
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// Whether `LAST_ERROR` holds a message (checked without touching the `RefCell`).
    static HAS_ERROR: Cell<bool> = const { Cell::new(false) };
}

/// Whether any thread ever recorded an error: until one does, a successful call has nothing to
/// clear and skips the thread-local lookup (`__tls_get_addr` in a shared library, on every call).
static ANY_ERROR: AtomicBool = AtomicBool::new(false);

/// Record `e` as this thread's last error.
pub(crate) fn set_last_error(e: &Error) {
    ANY_ERROR.store(true, Ordering::Relaxed);
    let text = e.to_string().replace('\0', "\\0");
    let msg = CString::new(text).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|c| *c.borrow_mut() = Some(msg));
    let _ = HAS_ERROR.try_with(|c| c.set(true));
}

/// Forget this thread's last error (a call succeeded).
#[inline]
fn clear_last_error() {
    if ANY_ERROR.load(Ordering::Relaxed) && HAS_ERROR.try_with(Cell::get).unwrap_or(false) {
        let _ = HAS_ERROR.try_with(|c| c.set(false));
        let _ = LAST_ERROR.try_with(|c| c.borrow_mut().take());
    }
}

/// This thread's last error message as a C string, or `""`. Valid until the next `sp_*` call on
/// this thread (other than `sp_last_error_message`).
pub(crate) fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|c| c.borrow().as_ref().map(|s| s.as_ptr()))
        .ok()
        .flatten()
        .unwrap_or(c"".as_ptr())
}

/// The message of a panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic payload".to_string()
    }
}

/// Runs the body of an entry point: a panic becomes [`Error::Panic`], an error becomes its status
/// code and this thread's last-error message, success clears the message.
#[inline]
pub fn ffi<F: FnOnce() -> Result<()>>(f: F) -> sp_status {
    let result = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(Error::Panic(panic_message(&*payload))),
    };
    match result {
        Ok(()) => {
            clear_last_error();
            sp_status::SP_OK
        }
        Err(e) => fail(&e),
    }
}

/// [`ffi`] for an entry point that returns a value rather than a status: `default` on an error
/// or a panic, whose message is recorded as by [`ffi`].
pub(crate) fn ffi_value<T>(default: T, f: impl FnOnce() -> Result<T>) -> T {
    let result = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => Err(Error::Panic(panic_message(&*payload))),
    };
    match result {
        Ok(v) => {
            clear_last_error();
            v
        }
        Err(e) => {
            fail(&e);
            default
        }
    }
}

/// Records `e` (and logs it at debug level) and returns its status.
#[cold]
pub(crate) fn fail(e: &Error) -> sp_status {
    tracing::debug!(error = %e, "slotpool call failed");
    set_last_error(e);
    e.status()
}

#[cfg(test)]
mod tests {
    use std::ffi::CStr;

    use super::*;

    fn last() -> String {
        // SAFETY: `last_error_ptr` returns a NUL-terminated string valid until the next call on
        // this thread; it is copied at once.
        unsafe { CStr::from_ptr(last_error_ptr()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn panic_becomes_status_and_message() {
        let s = ffi(|| panic!("boom {}", 42));
        assert_eq!(s, sp_status::SP_ERR_PANIC);
        assert!(last().contains("boom 42"), "{}", last());
        assert_eq!(ffi(|| Ok(())), sp_status::SP_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn every_error_maps_to_its_code() {
        let cases = [
            (Error::InvalidArgument("x".into()), 1),
            (Error::OutOfMemory("x".into()), 2),
            (Error::UnknownPointer(1), 3),
            (Error::UnknownPool(PoolId(1, 0)), 4),
            (Error::InvalidState("x".into()), 5),
            (Error::BackendUnavailable("x".into()), 6),
            (Error::Device("x".into()), 7),
            (Error::NotInitialized("x".into()), 8),
            (Error::Shutdown, 9),
            (Error::Panic("x".into()), 10),
            (Error::Config("x".into()), 11),
        ];
        for (e, code) in cases {
            assert_eq!(e.status() as i32, code, "{e}");
        }
        assert_eq!(
            Error::from(AllocError::InvalidSize(0)).status(),
            sp_status::SP_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            Error::from(AllocError::from(DeviceError::Unavailable("x".into()))).status(),
            sp_status::SP_ERR_BACKEND_UNAVAILABLE
        );
        assert_eq!(
            Error::from(DeviceError::OutOfMemory).status(),
            sp_status::SP_ERR_OUT_OF_MEMORY
        );
        assert_eq!(
            Error::from(DeviceError::Driver {
                code: 1,
                what: "x".into()
            })
            .status(),
            sp_status::SP_ERR_DEVICE
        );
        assert_eq!(
            Error::from(ConfigError("bad".into())).status(),
            sp_status::SP_ERR_CONFIG
        );
    }

    fn name(status: c_int) -> String {
        // SAFETY: `sp_status_name` returns a static NUL-terminated string for any value.
        unsafe { CStr::from_ptr(sp_status_name(status)) }
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn every_code_has_its_own_name() {
        assert_eq!(name(0), "SP_OK");
        assert_eq!(name(2), "SP_ERR_OUT_OF_MEMORY");
        for code in sp_status::ALL {
            assert_eq!(name(code.code()), format!("{code:?}"));
        }
        // Every code an error maps to is named.
        assert_eq!(name(Error::Shutdown.status() as c_int), "SP_ERR_SHUTDOWN");
        let past_the_last = sp_status::ALL.len() as c_int;
        for unknown in [-1, past_the_last, 1000, c_int::MIN, c_int::MAX] {
            assert_eq!(name(unknown), "SP_ERR_UNRECOGNIZED");
        }
    }

    #[test]
    fn messages_with_nul_survive() {
        set_last_error(&Error::InvalidArgument("a\0b".into()));
        assert!(last().contains("a\\0b"));
    }
}
