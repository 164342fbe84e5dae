//! The byte patterns of live allocations: written at allocation (a large allocation's in
//! windows only, to spare host memory) and read back after every step.

use std::ffi::c_void;

use slotpool::*;
use slotpool_sim::pattern_byte;

use crate::common::*;

/// Bytes checked at each end and in the middle of a large allocation after every step (all of it
/// at the end of a sequence).
const WINDOW: usize = 4096;
/// The ranges of a `size`-byte allocation whose pattern is checked after a step.
pub(super) fn windows(size: usize, all: bool) -> Vec<(usize, usize)> {
    if all || size <= 3 * WINDOW {
        vec![(0, size)]
    } else {
        vec![(0, WINDOW), (size / 2, WINDOW), (size - WINDOW, WINDOW)]
    }
}

/// Writes the pattern of `seed` over `size` bytes at `ptr`, or over its windows only when
/// `windowed`.
pub(super) fn fill(dev: i32, ptr: usize, size: usize, seed: u64, windowed: bool) {
    if !windowed {
        ok(sp_sim_fill(dev, ptr as *mut c_void, size, seed));
        return;
    }
    for (off, len) in windows(size, false) {
        let buf: Vec<u8> = (0..len)
            .map(|i| pattern_byte(seed, (off + i) as u64))
            .collect();
        // SAFETY: `buf` holds `len` bytes.
        ok(unsafe { sp_sim_write(dev, (ptr + off) as *mut c_void, buf.as_ptr().cast(), len) });
    }
}

/// Checks that `size` bytes at `ptr` still hold the pattern of `seed` (a few windows of a large
/// allocation, or all of it).
#[track_caller]
pub(super) fn verify(dev: i32, ptr: usize, size: usize, seed: u64, all: bool, what: &str) {
    for (off, len) in windows(size, all) {
        let mut buf = vec![0u8; len];
        // SAFETY: `buf` holds `len` bytes.
        let s = unsafe {
            sp_sim_read(
                dev,
                (ptr + off) as *const c_void,
                buf.as_mut_ptr().cast(),
                len,
            )
        };
        assert_eq!(s, sp_status::SP_OK, "{what} {ptr:#x}: {}", last_error());
        if let Some(i) = (0..len).find(|&i| buf[i] != pattern_byte(seed, (off + i) as u64)) {
            panic!(
                "{what} {ptr:#x} ({size} bytes, seed {seed}) lost its bytes: byte {} is {:#04x}, \
                 expected {:#04x}",
                off + i,
                buf[i],
                pattern_byte(seed, (off + i) as u64)
            );
        }
    }
}
