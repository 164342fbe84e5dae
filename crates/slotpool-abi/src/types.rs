//! The `#[repr(C)]` structs and enums of `include/slotpool.h`, field for field, with their layout
//! pinned by const asserts below. C enums that slotpool reads from the caller are `int` newtypes
//! (any value C passes is defined; unknown ones are refused by slotpool-capi).

use std::ffi::{c_int, c_void};
use std::mem::{offset_of, size_of};

/// A pool id, layout-compatible with PyTorch's `MempoolId_t` (`std::pair<uint64_t, uint64_t>`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_pool_id {
    pub a: u64,
    pub b: u64,
}

/// Settings of a pool (`MemPool(use_on_oom=, no_split=)` plus a byte limit and pausing).
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

/// Which allocations a route takes (`sp_route_kind` in C).
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

/// PyTorch's `DeviceStats`: every field of slotpool-core's `MemoryStats`, in the same order.
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

/// The backend calls a device's allocator made so far, by kind (`sp_backend_calls_get`; the
/// allocator's own count, slotpool-core's `BackendCalls`). `map` counts pages: a run of n pages
/// mapped at once is n. `synchronize` counts event and device synchronisations.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_backend_calls {
    pub alloc_segment: u64,
    pub free_segment: u64,
    pub reserve: u64,
    pub release_reservation: u64,
    pub create_page: u64,
    pub release_page: u64,
    pub map: u64,
    pub unmap: u64,
    pub create_event: u64,
    pub record_event: u64,
    pub query_event: u64,
    pub synchronize: u64,
}

/// What an allocator event was (`sp_trace_action` in C): PyTorch's trace actions.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
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

/// One allocator event, as an `sp_trace_callback` and `sp_snapshot_trace` give it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
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

/// One live allocation (`sp_pool_live_allocations`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct sp_allocation {
    pub ptr: *mut c_void,
    /// The block's (rounded) size.
    pub size: u64,
    /// The size asked for.
    pub requested_size: u64,
    pub stream: u64,
}

/// A block's state in a snapshot (`sp_block_state` in C; written by slotpool, never read).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_block_state(pub c_int);

impl sp_block_state {
    /// Free (`"inactive"` in the JSON snapshot).
    pub const SP_BLOCK_INACTIVE: sp_block_state = sp_block_state(0);
    /// Live (`"active_allocated"`).
    pub const SP_BLOCK_ACTIVE_ALLOCATED: sp_block_state = sp_block_state(1);
    /// Freed, waiting for other streams' work (`"active_pending_free"`).
    pub const SP_BLOCK_ACTIVE_PENDING_FREE: sp_block_state = sp_block_state(2);
}

/// One segment of a snapshot (`sp_snapshot_segment`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_segment_view {
    pub device: c_int,
    /// Serves large requests (`segment_type` `"large"`; 0: `"small"`).
    pub is_large: c_int,
    /// Part of a vmm reservation.
    pub is_expandable: c_int,
    /// Always 0.
    pub reserved0: c_int,
    pub address: u64,
    pub total_size: u64,
    pub stream: u64,
    /// `segment_pool_id`.
    pub pool: sp_pool_id,
    pub block_count: usize,
}

/// One block of a snapshot's segment (`sp_snapshot_block`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct sp_block_view {
    pub address: u64,
    pub size: u64,
    pub requested_size: u64,
    pub state: sp_block_state,
}

// Layout of the C structs; `tests/header.rs` compares every size and offset with the header's,
// and `tests/c/smoke.c` asserts the same numbers with `_Static_assert`.
const _: () = {
    assert!(size_of::<sp_pool_id>() == 16);
    assert!(offset_of!(sp_pool_id, b) == 8);
    assert!(size_of::<sp_pool_options>() == 24);
    assert!(offset_of!(sp_pool_options, use_on_oom) == 4);
    assert!(offset_of!(sp_pool_options, limit_bytes) == 8);
    assert!(offset_of!(sp_pool_options, pausable) == 16);
    assert!(size_of::<sp_route_kind>() == size_of::<c_int>());
    assert!(size_of::<sp_stat>() == 32);
    assert!(size_of::<sp_stat_array>() == 96);
    assert!(size_of::<sp_memory_stats>() == 1072);
    assert!(offset_of!(sp_memory_stats, num_alloc_retries) == 864);
    assert!(offset_of!(sp_memory_stats, max_split_size) == 968);
    assert!(offset_of!(sp_memory_stats, reserved_paused_bytes) == 976);
    assert!(size_of::<sp_backend_calls>() == 12 * 8);
    assert!(size_of::<sp_trace_action>() == size_of::<c_int>());
    assert!(size_of::<sp_trace_event>() == 40);
    assert!(offset_of!(sp_trace_event, addr) == 8);
    assert!(offset_of!(sp_trace_event, time_us) == 32);
    assert!(size_of::<sp_allocation>() == 32);
    assert!(offset_of!(sp_allocation, stream) == 24);
    assert!(size_of::<sp_block_state>() == size_of::<c_int>());
    assert!(size_of::<sp_segment_view>() == 64);
    assert!(offset_of!(sp_segment_view, address) == 16);
    assert!(offset_of!(sp_segment_view, pool) == 40);
    assert!(offset_of!(sp_segment_view, block_count) == 56);
    assert!(size_of::<sp_block_view>() == 32);
    assert!(offset_of!(sp_block_view, state) == 24);
};
