//! The allocation history: a ring of trace entries in PyTorch's snapshot format
//! (`torch.cuda.memory._record_memory_history`), recorded only while enabled.
//!
//! The hot path pays one relaxed load while recording is off.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::device::{DevicePtr, StreamId};
use crate::sync::lock;

/// What happened (PyTorch's trace entry `action`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed out; `size` is the requested size.
    Alloc,
    /// The user freed a block.
    FreeRequested,
    /// The block went back to the free index (at once, or after cross-stream events).
    FreeCompleted,
    /// A classic segment was allocated.
    SegmentAlloc,
    /// A classic segment was freed.
    SegmentFree,
    /// A vmm page was mapped (`size` is the page size).
    SegmentMap,
    /// A vmm page was unmapped.
    SegmentUnmap,
    /// An allocation failed; `addr` is 0 and `size` the rounded request.
    Oom,
}

/// One trace entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TraceEntry {
    pub action: TraceAction,
    pub addr: DevicePtr,
    pub size: u64,
    pub stream: StreamId,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

/// A bounded ring of trace entries, oldest first.
#[derive(Debug, Default)]
pub struct TraceRing {
    enabled: AtomicBool,
    ring: Mutex<(VecDeque<TraceEntry>, usize)>,
}

impl TraceRing {
    /// True while recording.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Start recording into a ring of `max_entries` (0 stops; entries are kept until `clear`).
    pub fn set(&self, max_entries: usize) {
        let mut g = lock(&self.ring);
        if max_entries > 0 {
            g.1 = max_entries;
            while g.0.len() > max_entries {
                g.0.pop_front();
            }
        }
        self.enabled.store(max_entries > 0, Ordering::Relaxed);
    }

    /// Forget every entry.
    pub fn clear(&self) {
        lock(&self.ring).0.clear();
    }

    /// Record one entry if recording (one relaxed load when not).
    #[inline(always)]
    pub fn record(&self, action: TraceAction, addr: DevicePtr, size: u64, stream: StreamId) {
        if self.enabled() {
            self.record_entry(action, addr, size, stream);
        }
    }

    #[cold]
    #[inline(never)]
    fn record_entry(&self, action: TraceAction, addr: DevicePtr, size: u64, stream: StreamId) {
        let time_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut g = lock(&self.ring);
        if g.1 == 0 || !self.enabled() {
            return;
        }
        if g.0.len() == g.1 {
            g.0.pop_front();
        }
        g.0.push_back(TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us,
        });
    }

    /// The entries, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        lock(&self.ring).0.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_only_while_enabled_and_wraps() {
        let r = TraceRing::default();
        r.record(TraceAction::Alloc, 1, 2, 3);
        assert!(r.entries().is_empty());
        r.set(2);
        for a in 1..=3 {
            r.record(TraceAction::Alloc, a, 512, 0);
        }
        let e = r.entries();
        assert_eq!(
            e.iter().map(|x| x.addr).collect::<Vec<_>>(),
            vec![2, 3],
            "oldest dropped"
        );
        r.set(0);
        r.record(TraceAction::Oom, 0, 1, 0);
        assert_eq!(r.entries().len(), 2, "kept after stopping, nothing new");
        r.clear();
        assert!(r.entries().is_empty());
    }
}
