//! Out-pointer helpers shared by the C entry points.

use std::ptr::NonNull;

use crate::error::{Error, Result};

/// `p` as a `NonNull`, or an error naming the argument.
#[inline]
pub(crate) fn required<T>(p: *mut T, what: &str) -> Result<NonNull<T>> {
    NonNull::new(p).ok_or_else(|| Error::null(what))
}

/// Writes `v` through `p`.
///
/// # Safety
///
/// `p` must be valid for a write of `T` and suitably aligned.
#[inline]
pub(crate) unsafe fn put<T>(p: NonNull<T>, v: T) {
    // SAFETY: the caller guarantees that `p` is valid for a write of `T`.
    unsafe { p.as_ptr().write(v) }
}

/// Writes `v` through `p` unless `p` is NULL (an optional out-pointer: the value is not wanted).
///
/// # Safety
///
/// `p` must be NULL or valid for a write of `T` and suitably aligned.
#[inline]
pub(crate) unsafe fn put_opt<T>(p: *mut T, v: T) {
    if let Some(p) = NonNull::new(p) {
        // SAFETY: non-null, and valid for a write by the caller's guarantee.
        unsafe { put(p, v) };
    }
}
