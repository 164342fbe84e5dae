//! `#[repr(C)]` mirrors of the structs in `slotpool.h`, with their layout pinned by const asserts
//! (the C test program pins the same numbers with `_Static_assert`).

#![allow(non_camel_case_types)]

use std::ffi::c_int;
use std::mem::{offset_of, size_of};

use slotpool_core::{
    MemoryStats, PoolId, PoolOptions, RouteFilter, Stat, StatArray, TraceAction, TraceEntry,
};

use crate::error::{Error, Result};

/// A pool id, PyTorch's `MempoolId_t`: `{0,0}` the default pool, `{n,0}` capture-private pools,
/// `{0,n}` user pools, `{0, 2^63 + n}` pools created by name.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_pool_id {
    pub a: u64,
    pub b: u64,
}

impl From<sp_pool_id> for PoolId {
    fn from(id: sp_pool_id) -> PoolId {
        PoolId(id.a, id.b)
    }
}

impl From<PoolId> for sp_pool_id {
    fn from(id: PoolId) -> sp_pool_id {
        sp_pool_id { a: id.0, b: id.1 }
    }
}

/// Settings of a pool (`MemPool(use_on_oom=, no_split=)` plus a byte limit).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_pool_options {
    /// Non-zero: never split cached blocks of this pool.
    pub no_split: c_int,
    /// Non-zero: this pool's free blocks may serve other pools when they run out of memory.
    pub use_on_oom: c_int,
    /// Most physical bytes the pool may hold; 0 means no limit.
    pub limit_bytes: u64,
    /// Non-zero: the pool may be paused (`sp_pool_pause`): all its memory is vmm memory.
    pub pausable: c_int,
}

impl From<&sp_pool_options> for PoolOptions {
    fn from(o: &sp_pool_options) -> PoolOptions {
        PoolOptions {
            no_split: o.no_split != 0,
            use_on_oom: o.use_on_oom != 0,
            limit: (o.limit_bytes != 0).then_some(o.limit_bytes),
            pausable: o.pausable != 0,
        }
    }
}

/// Which allocations a route takes (`sp_route_kind` in C). A plain `int` on the Rust side, so that
/// any value C passes is defined; unknown values are rejected with `SP_ERR_INVALID_ARGUMENT`.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct sp_route_kind(pub c_int);

impl sp_route_kind {
    /// Every allocation on the device.
    pub const SP_ROUTE_ALL: sp_route_kind = sp_route_kind(0);
    /// Allocations made by the calling thread.
    pub const SP_ROUTE_CURRENT_THREAD: sp_route_kind = sp_route_kind(1);
    /// Allocations on the stream `arg`.
    pub const SP_ROUTE_STREAM: sp_route_kind = sp_route_kind(2);
    /// Allocations on a stream that is capturing into the capture id `arg`.
    pub const SP_ROUTE_CAPTURE: sp_route_kind = sp_route_kind(3);

    /// The core filter for this kind and argument.
    pub(crate) fn filter(self, arg: u64) -> Result<RouteFilter> {
        Ok(match self {
            Self::SP_ROUTE_ALL => RouteFilter::All,
            Self::SP_ROUTE_CURRENT_THREAD => {
                RouteFilter::Thread(slotpool_core::current_thread_id())
            }
            Self::SP_ROUTE_STREAM => RouteFilter::Stream(arg),
            Self::SP_ROUTE_CAPTURE => RouteFilter::Capture(arg),
            sp_route_kind(other) => {
                return Err(Error::InvalidArgument(format!(
                    "route kind {other}: expected SP_ROUTE_ALL (0), SP_ROUTE_CURRENT_THREAD (1), \
                     SP_ROUTE_STREAM (2) or SP_ROUTE_CAPTURE (3)"
                )));
            }
        })
    }
}

/// One statistic (`current`, `peak` since the last peak reset, totals since the last
/// accumulated reset).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_stat {
    pub current: i64,
    pub peak: i64,
    pub allocated: i64,
    pub freed: i64,
}

/// A statistic broken down as PyTorch does.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_stat_array {
    pub all: sp_stat,
    pub small_pool: sp_stat,
    pub large_pool: sp_stat,
}

/// PyTorch's `DeviceStats`: every field of core's `MemoryStats`, in the same order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_memory_stats {
    pub allocation: sp_stat_array,
    pub segment: sp_stat_array,
    pub active: sp_stat_array,
    pub inactive_split: sp_stat_array,
    pub allocated_bytes: sp_stat_array,
    pub reserved_bytes: sp_stat_array,
    pub active_bytes: sp_stat_array,
    pub inactive_split_bytes: sp_stat_array,
    pub requested_bytes: sp_stat_array,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub oversize_allocations: sp_stat,
    pub oversize_segments: sp_stat,
    pub max_split_size: i64,
    /// Bytes of paused pools, given back to the driver and mapped again by the resume.
    pub reserved_paused_bytes: sp_stat_array,
}

/// What an allocator event was (`sp_trace_action` in C): PyTorch's trace actions.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct sp_trace_action(pub c_int);

impl sp_trace_action {
    pub const SP_TRACE_ALLOC: sp_trace_action = sp_trace_action(0);
    pub const SP_TRACE_FREE_REQUESTED: sp_trace_action = sp_trace_action(1);
    pub const SP_TRACE_FREE_COMPLETED: sp_trace_action = sp_trace_action(2);
    pub const SP_TRACE_SEGMENT_ALLOC: sp_trace_action = sp_trace_action(3);
    pub const SP_TRACE_SEGMENT_FREE: sp_trace_action = sp_trace_action(4);
    pub const SP_TRACE_SEGMENT_MAP: sp_trace_action = sp_trace_action(5);
    pub const SP_TRACE_SEGMENT_UNMAP: sp_trace_action = sp_trace_action(6);
    pub const SP_TRACE_OOM: sp_trace_action = sp_trace_action(7);
}

impl From<TraceAction> for sp_trace_action {
    fn from(a: TraceAction) -> sp_trace_action {
        match a {
            TraceAction::Alloc => Self::SP_TRACE_ALLOC,
            TraceAction::FreeRequested => Self::SP_TRACE_FREE_REQUESTED,
            TraceAction::FreeCompleted => Self::SP_TRACE_FREE_COMPLETED,
            TraceAction::SegmentAlloc => Self::SP_TRACE_SEGMENT_ALLOC,
            TraceAction::SegmentFree => Self::SP_TRACE_SEGMENT_FREE,
            TraceAction::SegmentMap => Self::SP_TRACE_SEGMENT_MAP,
            TraceAction::SegmentUnmap => Self::SP_TRACE_SEGMENT_UNMAP,
            TraceAction::Oom => Self::SP_TRACE_OOM,
        }
    }
}

/// One allocator event, as an `sp_trace_callback` receives it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct sp_trace_event {
    pub action: sp_trace_action,
    pub device: c_int,
    /// The block, segment or page; 0 for an OOM.
    pub addr: u64,
    /// Requested bytes for alloc / free events, the segment's or page's size, the rounded
    /// request of an OOM.
    pub size: u64,
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
}

impl sp_trace_event {
    pub(crate) fn new(device: c_int, e: &TraceEntry) -> sp_trace_event {
        sp_trace_event {
            action: e.action.into(),
            device,
            addr: e.addr,
            size: e.size,
            stream: e.stream,
            time_us: e.time_us,
        }
    }
}

// Layout of the C structs; `tests/c/smoke.c` asserts the same numbers.
const _: () = {
    assert!(size_of::<sp_trace_action>() == size_of::<c_int>());
    assert!(size_of::<sp_trace_event>() == 40);
    assert!(offset_of!(sp_trace_event, addr) == 8);
    assert!(offset_of!(sp_trace_event, time_us) == 32);
    assert!(size_of::<sp_pool_id>() == 16);
    assert!(offset_of!(sp_pool_id, b) == 8);
    assert!(size_of::<sp_pool_options>() == 24);
    assert!(offset_of!(sp_pool_options, pausable) == 16);
    assert!(offset_of!(sp_pool_options, use_on_oom) == 4);
    assert!(offset_of!(sp_pool_options, limit_bytes) == 8);
    assert!(size_of::<sp_route_kind>() == size_of::<c_int>());
    assert!(size_of::<sp_stat>() == 32);
    assert!(offset_of!(sp_stat, peak) == 8);
    assert!(offset_of!(sp_stat, allocated) == 16);
    assert!(offset_of!(sp_stat, freed) == 24);
    assert!(size_of::<sp_stat_array>() == 96);
    assert!(offset_of!(sp_stat_array, small_pool) == 32);
    assert!(offset_of!(sp_stat_array, large_pool) == 64);
    assert!(size_of::<sp_memory_stats>() == 1072);
    assert!(offset_of!(sp_memory_stats, reserved_paused_bytes) == 976);
    assert!(offset_of!(sp_memory_stats, segment) == 96);
    assert!(offset_of!(sp_memory_stats, requested_bytes) == 768);
    assert!(offset_of!(sp_memory_stats, num_alloc_retries) == 864);
    assert!(offset_of!(sp_memory_stats, num_device_free) == 896);
    assert!(offset_of!(sp_memory_stats, oversize_allocations) == 904);
    assert!(offset_of!(sp_memory_stats, oversize_segments) == 936);
    assert!(offset_of!(sp_memory_stats, max_split_size) == 968);
};

impl From<&Stat> for sp_stat {
    fn from(s: &Stat) -> sp_stat {
        sp_stat {
            current: s.current,
            peak: s.peak,
            allocated: s.allocated(),
            freed: s.freed,
        }
    }
}

impl From<&StatArray> for sp_stat_array {
    fn from(a: &StatArray) -> sp_stat_array {
        sp_stat_array {
            all: (&a.all()).into(),
            small_pool: a.small_pool().into(),
            large_pool: a.large_pool().into(),
        }
    }
}

impl From<&MemoryStats> for sp_memory_stats {
    fn from(s: &MemoryStats) -> sp_memory_stats {
        // Exhaustive on purpose: a field added to `MemoryStats` fails to compile here until the C
        // struct (and `slotpool.h`) gains it too.
        let MemoryStats {
            allocation,
            segment,
            active,
            inactive_split,
            allocated_bytes,
            reserved_bytes,
            active_bytes,
            inactive_split_bytes,
            requested_bytes,
            reserved_paused_bytes,
            num_alloc_retries,
            num_ooms,
            num_sync_all_streams,
            num_device_alloc,
            num_device_free,
            oversize_allocations,
            oversize_segments,
            max_split_size,
        } = s;
        sp_memory_stats {
            allocation: allocation.into(),
            segment: segment.into(),
            active: active.into(),
            inactive_split: inactive_split.into(),
            allocated_bytes: allocated_bytes.into(),
            reserved_bytes: reserved_bytes.into(),
            active_bytes: active_bytes.into(),
            inactive_split_bytes: inactive_split_bytes.into(),
            requested_bytes: requested_bytes.into(),
            num_alloc_retries: *num_alloc_retries,
            num_ooms: *num_ooms,
            num_sync_all_streams: *num_sync_all_streams,
            num_device_alloc: *num_device_alloc,
            num_device_free: *num_device_free,
            oversize_allocations: oversize_allocations.into(),
            oversize_segments: oversize_segments.into(),
            max_split_size: *max_split_size,
            reserved_paused_bytes: reserved_paused_bytes.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_mirror_copies_every_field() {
        let mut m = MemoryStats::default();
        m.allocation.update(true, 3);
        m.requested_bytes.update(false, 700);
        m.num_device_free = 5;
        m.oversize_segments.update(2);
        m.max_split_size = -1;
        let c = sp_memory_stats::from(&m);
        assert_eq!(c.allocation.small_pool.current, 3);
        assert_eq!(c.requested_bytes.large_pool.allocated, 700);
        assert_eq!(c.num_device_free, 5);
        assert_eq!(c.oversize_segments.peak, 2);
        assert_eq!(c.max_split_size, -1);
    }

    #[test]
    fn pool_options_convert() {
        let o = PoolOptions::from(&sp_pool_options {
            no_split: 1,
            use_on_oom: 0,
            limit_bytes: 0,
            pausable: 1,
        });
        assert!(o.no_split && !o.use_on_oom && o.limit.is_none() && o.pausable);
        let o = PoolOptions::from(&sp_pool_options {
            no_split: 0,
            use_on_oom: 7,
            limit_bytes: 4096,
            pausable: 0,
        });
        assert!(!o.no_split && o.use_on_oom && o.limit == Some(4096));
        assert!(sp_route_kind(9).filter(0).is_err());
        assert_eq!(
            sp_route_kind::SP_ROUTE_STREAM.filter(5).unwrap(),
            RouteFilter::Stream(5)
        );
    }
}
