//! The allocation history: a ring of trace entries in PyTorch's snapshot format
//! (`torch.cuda.memory._record_memory_history`), recorded only while enabled, and a *sink* that
//! sees every entry as it happens (PyTorch's `attachAllocatorTraceTracker`, through which NCCL
//! registers segments).
//!
//! The hot path pays one relaxed load while neither is on.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
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

/// Called with every trace entry as it is made, under the lock of the shard that made it: it
/// must not call the allocator (as PyTorch's trace trackers must not call PyTorch).
pub type TraceSink = Arc<dyn Fn(&TraceEntry) + Send + Sync>;

/// A bounded ring of trace entries, oldest first, and the sink.
#[derive(Default)]
pub struct TraceRing {
    /// Recording, or a sink attached: the one load of the hot path.
    active: AtomicBool,
    recording: AtomicBool,
    ring: Mutex<(VecDeque<TraceEntry>, usize)>,
    /// A leaf lock: the sink is cloned out of it before it is called.
    sink: RwLock<Option<TraceSink>>,
}

impl std::fmt::Debug for TraceRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceRing")
            .field("recording", &self.enabled())
            .field("sink", &self.has_sink())
            .finish_non_exhaustive()
    }
}

impl TraceRing {
    /// True while recording into the ring.
    #[inline]
    pub fn enabled(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    fn has_sink(&self) -> bool {
        self.sink
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    fn update_active(&self) {
        self.active
            .store(self.enabled() || self.has_sink(), Ordering::Relaxed);
    }

    /// Attach `sink` (replacing any), or detach with `None`.
    pub fn set_sink(&self, sink: Option<TraceSink>) {
        *self.sink.write().unwrap_or_else(|e| e.into_inner()) = sink;
        self.update_active();
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
        self.recording.store(max_entries > 0, Ordering::Relaxed);
        drop(g);
        self.update_active();
    }

    /// Forget every entry.
    pub fn clear(&self) {
        lock(&self.ring).0.clear();
    }

    /// Record one entry if recording, and hand it to the sink (one relaxed load when neither).
    #[inline(always)]
    pub fn record(&self, action: TraceAction, addr: DevicePtr, size: u64, stream: StreamId) {
        if self.active.load(Ordering::Relaxed) {
            self.record_entry(action, addr, size, stream);
        }
    }

    #[cold]
    #[inline(never)]
    fn record_entry(&self, action: TraceAction, addr: DevicePtr, size: u64, stream: StreamId) {
        let entry = TraceEntry {
            action,
            addr,
            size,
            stream,
            time_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
        };
        let sink = self.sink.read().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(sink) = sink {
            sink(&entry);
        }
        if !self.enabled() {
            return;
        }
        let mut g = lock(&self.ring);
        if g.1 == 0 || !self.enabled() {
            return;
        }
        if g.0.len() == g.1 {
            g.0.pop_front();
        }
        g.0.push_back(entry);
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

    #[test]
    fn the_sink_sees_every_entry_whether_or_not_recording() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let r = TraceRing::default();
        let s = seen.clone();
        r.set_sink(Some(Arc::new(move |e: &TraceEntry| {
            s.lock().unwrap().push((e.action, e.addr))
        })));
        r.record(TraceAction::SegmentAlloc, 1, 2, 0);
        r.set(4);
        r.record(TraceAction::Alloc, 2, 2, 0);
        assert_eq!(
            r.entries().len(),
            1,
            "only the entry made while recording is kept"
        );
        r.set(0);
        r.set_sink(None);
        r.record(TraceAction::SegmentFree, 3, 2, 0);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(TraceAction::SegmentAlloc, 1), (TraceAction::Alloc, 2)]
        );
        assert!(
            !r.active.load(Ordering::Relaxed),
            "nothing left to do on the hot path"
        );
    }
}
