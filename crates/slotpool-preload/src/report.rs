//! Process-wide counters and the one line printed at exit when `SLOTPOOL_LOG` is set.
//!
//! The counters are relaxed atomics, each on its own cache line. Live and peak bytes are kept
//! only while logging is on (a served free then asks slotpool for the size first); without
//! `SLOTPOOL_LOG` nothing reads them.
//!
//! The line is printed from a `.fini_array` entry of this library: it runs in `exit()` (after the
//! program's `atexit` handlers), whether or not the program freed its memory, and never calls
//! into slotpool or CUDA, so it cannot block on a lock held by a thread that `exit()` interrupted.
//! It does not run on `_exit()`, `abort()` or a fatal signal.

use std::io::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};

use crate::slotpool;

/// An atomic counter alone on its cache line (no false sharing between counters).
#[repr(align(64))]
struct Counter(AtomicU64);

impl Counter {
    const fn new() -> Self {
        Counter(AtomicU64::new(0))
    }
    #[inline]
    fn add(&self) {
        self.0.fetch_add(1, Relaxed);
    }
    fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

static SERVED_ALLOCS: Counter = Counter::new();
static SERVED_FREES: Counter = Counter::new();
static PASSED_ALLOCS: Counter = Counter::new();
static PASSED_FREES: Counter = Counter::new();
static OUT_OF_MEMORY: Counter = Counter::new();
static REFUSED_FREES: Counter = Counter::new();
static PANICS: Counter = Counter::new();
static PEER_REFUSED: Counter = Counter::new();

#[repr(align(64))]
struct Bytes {
    live: AtomicI64,
    peak: AtomicI64,
}
static BYTES: Bytes = Bytes {
    live: AtomicI64::new(0),
    peak: AtomicI64::new(0),
};

/// An allocation served by slotpool. `bytes`: the size asked for, when logging is on.
#[inline]
pub fn served_alloc(bytes: Option<usize>) {
    SERVED_ALLOCS.add();
    if let Some(b) = bytes {
        let b = i64::try_from(b).unwrap_or(i64::MAX);
        let now = BYTES.live.fetch_add(b, Relaxed).saturating_add(b);
        BYTES.peak.fetch_max(now, Relaxed);
    }
}

/// A free served by slotpool. `bytes`: the size the allocation asked for, when logging is on.
#[inline]
pub fn served_free(bytes: Option<usize>) {
    SERVED_FREES.add();
    if let Some(b) = bytes {
        BYTES
            .live
            .fetch_sub(i64::try_from(b).unwrap_or(i64::MAX), Relaxed);
    }
}

/// An allocation (non-NULL out-pointer, size > 0) handed to the real library.
#[inline]
pub fn passed_alloc() {
    PASSED_ALLOCS.add();
}

/// A free of a non-NULL pointer handed to the real library.
#[inline]
pub fn passed_free() {
    PASSED_FREES.add();
}

/// A free of slotpool memory that is not a live allocation (a double free) was refused.
#[cold]
pub fn refused_free() {
    REFUSED_FREES.add();
}

/// slotpool answered out of memory.
#[inline]
pub fn out_of_memory() {
    OUT_OF_MEMORY.add();
}

/// A panic was caught at an exported function.
#[cold]
pub fn panic_caught() {
    PANICS.add();
}

/// CUDA granted peer access but slotpool could not open its pages to the peer.
#[cold]
pub fn peer_refused() {
    PEER_REFUSED.add();
}

/// Formats a byte count for people (binary units, one decimal).
fn human(bytes: i64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes.max(0) as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The exit line, or `None` when this process never made an interposed call worth reporting.
pub fn summary() -> Option<String> {
    let state = slotpool::state();
    let (sa, sf, pa, pf) = (
        SERVED_ALLOCS.get(),
        SERVED_FREES.get(),
        PASSED_ALLOCS.get(),
        PASSED_FREES.get(),
    );
    if state.is_none() && sa + sf + pa + pf == 0 {
        return None;
    }
    let mut line = String::from("slotpool-preload: ");
    match state {
        Some(Ok(sp)) => {
            line.push_str(&format!(
                "served by slotpool ({} backend, {}): {sa} allocs, {sf} frees, {} out of memory, \
                 peak {} live; ",
                sp.backend,
                sp.path,
                OUT_OF_MEMORY.get(),
                human(BYTES.peak.load(Relaxed)),
            ));
            // Devices are numbered densely; the first one slotpool refuses ends the list.
            for d in 0..64 {
                match sp.peaks(d) {
                    Some((a, r)) if r > 0 => line.push_str(&format!(
                        "device {d}: peak reserved {r} B ({}), peak allocated {a} B; ",
                        human(r as i64)
                    )),
                    Some(_) => {}
                    None => break,
                }
            }
        }
        Some(Err(why)) => line.push_str(&format!("inactive ({why}); ")),
        None => line.push_str("inactive (no allocation call); "),
    }
    line.push_str(&format!("passed through: {pa} allocs, {pf} frees"));
    let refused = REFUSED_FREES.get();
    if refused > 0 {
        line.push_str(&format!(
            "; refused {refused} frees of slotpool memory that was not live (double frees)"
        ));
    }
    let peer = PEER_REFUSED.get();
    if peer > 0 {
        line.push_str(&format!(
            "; {peer} peer grants not extended to slotpool's pages (kernels on the peer cannot \
             read them)"
        ));
    }
    let panics = PANICS.get();
    if panics > 0 {
        line.push_str(&format!("; {panics} panics caught"));
    }
    Some(line)
}

/// Whether `SLOTPOOL_LOG` is set (to anything non-empty).
pub fn log_enabled() -> bool {
    std::env::var_os(slotpool_abi::env::LOG).is_some_and(|v| !v.is_empty())
}

/// Runs at `exit()` (see the module documentation).
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if log_enabled()
            && let Some(line) = summary()
        {
            let _ = writeln!(std::io::stderr().lock(), "{line}");
        }
    });
}

/// The exit hook, as an entry of this library's `.fini_array`.
#[used]
#[unsafe(link_section = ".fini_array")]
static AT_EXIT: extern "C" fn() = at_exit;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1024), "1.0 KiB");
        assert_eq!(human(3 << 20), "3.0 MiB");
        assert_eq!(human(5 << 30), "5.0 GiB");
        assert_eq!(human(-5), "-5 B");
    }
}
