//! Call counting and out-of-memory injection.

/// A kind of [`Device`](slotpool_core::Device) call, for call counts and fault injection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CallKind {
    /// `alloc_segment`.
    AllocSegment,
    /// `free_segment`.
    FreeSegment,
    /// `reserve`.
    Reserve,
    /// `release_reservation`.
    ReleaseReservation,
    /// `create_page`.
    CreatePage,
    /// `release_page`.
    ReleasePage,
    /// `map`.
    Map,
    /// `unmap`.
    Unmap,
    /// `create_event`.
    CreateEvent,
    /// `destroy_event`.
    DestroyEvent,
    /// `record_event`.
    RecordEvent,
    /// `query_event`.
    QueryEvent,
    /// `synchronize_event`.
    SynchronizeEvent,
    /// `stream_wait_event`.
    StreamWaitEvent,
    /// `alloc_host`.
    AllocHost,
    /// `free_host`.
    FreeHost,
    /// `copy_to_host`.
    CopyToHost,
    /// `copy_from_host`.
    CopyFromHost,
    /// `create_run`.
    CreateRun,
    /// `map_whole`.
    MapWhole,
    /// `unmap_range`.
    UnmapRange,
}

/// Number of [`CallKind`]s.
const KINDS: usize = CallKind::ALL.len();

impl CallKind {
    /// Every kind, in declaration order.
    pub const ALL: [CallKind; 21] = [
        CallKind::AllocSegment,
        CallKind::FreeSegment,
        CallKind::Reserve,
        CallKind::ReleaseReservation,
        CallKind::CreatePage,
        CallKind::ReleasePage,
        CallKind::Map,
        CallKind::Unmap,
        CallKind::CreateEvent,
        CallKind::DestroyEvent,
        CallKind::RecordEvent,
        CallKind::QueryEvent,
        CallKind::SynchronizeEvent,
        CallKind::StreamWaitEvent,
        CallKind::AllocHost,
        CallKind::FreeHost,
        CallKind::CopyToHost,
        CallKind::CopyFromHost,
        CallKind::CreateRun,
        CallKind::MapWhole,
        CallKind::UnmapRange,
    ];

    /// The `Device` method's name, e.g. `"free_segment"`.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::AllocSegment => "alloc_segment",
            CallKind::FreeSegment => "free_segment",
            CallKind::Reserve => "reserve",
            CallKind::ReleaseReservation => "release_reservation",
            CallKind::CreatePage => "create_page",
            CallKind::ReleasePage => "release_page",
            CallKind::Map => "map",
            CallKind::Unmap => "unmap",
            CallKind::CreateEvent => "create_event",
            CallKind::DestroyEvent => "destroy_event",
            CallKind::RecordEvent => "record_event",
            CallKind::QueryEvent => "query_event",
            CallKind::SynchronizeEvent => "synchronize_event",
            CallKind::StreamWaitEvent => "stream_wait_event",
            CallKind::AllocHost => "alloc_host",
            CallKind::FreeHost => "free_host",
            CallKind::CopyToHost => "copy_to_host",
            CallKind::CopyFromHost => "copy_from_host",
            CallKind::CreateRun => "create_run",
            CallKind::MapWhole => "map_whole",
            CallKind::UnmapRange => "unmap_range",
        }
    }
}

/// Per-kind call counts and pending injected failures.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// Calls made so far, failed ones included.
    calls: [u64; KINDS],
    /// Call numbers (1-based, per kind) that are to fail.
    fail_at: [Vec<u64>; KINDS],
    /// Kinds whose every call fails.
    fail_all: [bool; KINDS],
}

impl Faults {
    /// Counts one call of `kind`; true if it is to fail with `OutOfMemory`.
    pub(crate) fn begin(&mut self, kind: CallKind) -> bool {
        let k = kind as usize;
        self.calls[k] += 1;
        let n = self.calls[k];
        let before = self.fail_at[k].len();
        self.fail_at[k].retain(|&at| at != n);
        self.fail_all[k] || self.fail_at[k].len() != before
    }

    /// Makes the `nth` next call of `kind` fail (`nth == 1`: the very next one; 0 counts as 1).
    pub(crate) fn inject(&mut self, kind: CallKind, nth: u64) {
        let k = kind as usize;
        self.fail_at[k].push(self.calls[k].saturating_add(nth.max(1)));
    }

    /// Makes every call of `kind` fail, or stops doing so.
    pub(crate) fn fail_all(&mut self, kind: CallKind, on: bool) {
        self.fail_all[kind as usize] = on;
    }

    /// Calls of `kind` made so far.
    pub(crate) fn calls(&self, kind: CallKind) -> u64 {
        self.calls[kind as usize]
    }
}
