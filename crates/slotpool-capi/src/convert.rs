//! Conversions between slotpool-abi's C types and slotpool-core's. Both are foreign to this
//! crate, so the conversions are the traits [`ToCore`] and [`ToC`] rather than `From`; each is
//! written once, and the struct-valued ones destructure exhaustively, so that a field added on
//! either side fails to compile here until the other side (and `slotpool.h`) gains it.

use std::ffi::c_int;

use slotpool_abi::{
    sp_block_state, sp_memory_stats, sp_pool_id, sp_pool_options, sp_route_kind, sp_stat,
    sp_stat_array, sp_trace_action, sp_trace_event,
};
use slotpool_core::block::BlockState;
use slotpool_core::{
    MemoryStats, PoolId, PoolOptions, RouteFilter, Stat, StatArray, TraceAction, TraceEntry,
};

use crate::error::{Error, Result};

/// A C value as the core's type.
pub(crate) trait ToCore {
    type Core;
    fn core(&self) -> Self::Core;
}

/// A core value as the C type.
pub(crate) trait ToC {
    type C;
    fn c(&self) -> Self::C;
}

impl ToCore for sp_pool_id {
    type Core = PoolId;
    fn core(&self) -> PoolId {
        PoolId(self.a, self.b)
    }
}

impl ToC for PoolId {
    type C = sp_pool_id;
    fn c(&self) -> sp_pool_id {
        sp_pool_id {
            a: self.0,
            b: self.1,
        }
    }
}

impl ToCore for sp_pool_options {
    type Core = PoolOptions;
    fn core(&self) -> PoolOptions {
        let sp_pool_options {
            no_split,
            use_on_oom,
            limit_bytes,
            pausable,
        } = *self;
        PoolOptions {
            no_split: no_split != 0,
            use_on_oom: use_on_oom != 0,
            limit: (limit_bytes != 0).then_some(limit_bytes),
            pausable: pausable != 0,
        }
    }
}

impl ToC for PoolOptions {
    type C = sp_pool_options;
    fn c(&self) -> sp_pool_options {
        let PoolOptions {
            no_split,
            use_on_oom,
            limit,
            pausable,
        } = self;
        sp_pool_options {
            no_split: c_int::from(*no_split),
            use_on_oom: c_int::from(*use_on_oom),
            limit_bytes: limit.unwrap_or(0),
            pausable: c_int::from(*pausable),
        }
    }
}

/// The core filter for a route of `kind` with argument `arg`; an unknown kind is refused.
pub(crate) fn route_filter(kind: sp_route_kind, arg: u64) -> Result<RouteFilter> {
    Ok(match kind {
        sp_route_kind::SP_ROUTE_ALL => RouteFilter::All,
        sp_route_kind::SP_ROUTE_CURRENT_THREAD => {
            RouteFilter::Thread(slotpool_core::current_thread_id())
        }
        sp_route_kind::SP_ROUTE_STREAM => RouteFilter::Stream(arg),
        sp_route_kind::SP_ROUTE_CAPTURE => RouteFilter::Capture(arg),
        sp_route_kind(other) => {
            return Err(Error::InvalidArgument(format!(
                "route kind {other}: expected SP_ROUTE_ALL (0), SP_ROUTE_CURRENT_THREAD (1), \
                 SP_ROUTE_STREAM (2) or SP_ROUTE_CAPTURE (3)"
            )));
        }
    })
}

impl ToC for TraceAction {
    type C = sp_trace_action;
    fn c(&self) -> sp_trace_action {
        match self {
            TraceAction::Alloc => sp_trace_action::SP_TRACE_ALLOC,
            TraceAction::FreeRequested => sp_trace_action::SP_TRACE_FREE_REQUESTED,
            TraceAction::FreeCompleted => sp_trace_action::SP_TRACE_FREE_COMPLETED,
            TraceAction::SegmentAlloc => sp_trace_action::SP_TRACE_SEGMENT_ALLOC,
            TraceAction::SegmentFree => sp_trace_action::SP_TRACE_SEGMENT_FREE,
            TraceAction::SegmentMap => sp_trace_action::SP_TRACE_SEGMENT_MAP,
            TraceAction::SegmentUnmap => sp_trace_action::SP_TRACE_SEGMENT_UNMAP,
            TraceAction::Oom => sp_trace_action::SP_TRACE_OOM,
        }
    }
}

/// The C event of entry `e` of device `device`.
pub(crate) fn trace_event(device: c_int, e: &TraceEntry) -> sp_trace_event {
    sp_trace_event {
        action: e.action.c(),
        device,
        addr: e.addr,
        size: e.size,
        stream: e.stream,
        time_us: e.time_us,
    }
}

impl ToC for BlockState {
    type C = sp_block_state;
    fn c(&self) -> sp_block_state {
        match self {
            BlockState::Free | BlockState::Cached => sp_block_state::SP_BLOCK_INACTIVE,
            BlockState::Allocated => sp_block_state::SP_BLOCK_ACTIVE_ALLOCATED,
            BlockState::PendingFree => sp_block_state::SP_BLOCK_ACTIVE_PENDING_FREE,
        }
    }
}

impl ToC for Stat {
    type C = sp_stat;
    fn c(&self) -> sp_stat {
        sp_stat {
            current: self.current,
            peak: self.peak,
            allocated: self.allocated(),
            freed: self.freed,
        }
    }
}

impl ToC for StatArray {
    type C = sp_stat_array;
    fn c(&self) -> sp_stat_array {
        sp_stat_array {
            all: self.all().c(),
            small_pool: self.small_pool().c(),
            large_pool: self.large_pool().c(),
        }
    }
}

impl ToC for MemoryStats {
    type C = sp_memory_stats;
    fn c(&self) -> sp_memory_stats {
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
        } = self;
        sp_memory_stats {
            allocation: allocation.c(),
            segment: segment.c(),
            active: active.c(),
            inactive_split: inactive_split.c(),
            allocated_bytes: allocated_bytes.c(),
            reserved_bytes: reserved_bytes.c(),
            active_bytes: active_bytes.c(),
            inactive_split_bytes: inactive_split_bytes.c(),
            requested_bytes: requested_bytes.c(),
            num_alloc_retries: *num_alloc_retries,
            num_ooms: *num_ooms,
            num_sync_all_streams: *num_sync_all_streams,
            num_device_alloc: *num_device_alloc,
            num_device_free: *num_device_free,
            oversize_allocations: oversize_allocations.c(),
            oversize_segments: oversize_segments.c(),
            max_split_size: *max_split_size,
            reserved_paused_bytes: reserved_paused_bytes.c(),
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
        let c = m.c();
        assert_eq!(c.allocation.small_pool.current, 3);
        assert_eq!(c.requested_bytes.large_pool.allocated, 700);
        assert_eq!(c.num_device_free, 5);
        assert_eq!(c.oversize_segments.peak, 2);
        assert_eq!(c.max_split_size, -1);
    }

    #[test]
    fn pool_options_convert_both_ways() {
        let o = sp_pool_options {
            no_split: 1,
            use_on_oom: 0,
            limit_bytes: 0,
            pausable: 1,
        }
        .core();
        assert!(o.no_split && !o.use_on_oom && o.limit.is_none() && o.pausable);
        assert_eq!(o.c().core(), o);
        let o = sp_pool_options {
            no_split: 0,
            use_on_oom: 7,
            limit_bytes: 4096,
            pausable: 0,
        }
        .core();
        assert!(!o.no_split && o.use_on_oom && o.limit == Some(4096));
        assert_eq!(o.c().use_on_oom, 1, "a flag reads back as 1");
        assert_eq!(o.c().core(), o);
        assert!(route_filter(sp_route_kind(9), 0).is_err());
        assert_eq!(
            route_filter(sp_route_kind::SP_ROUTE_STREAM, 5).unwrap(),
            RouteFilter::Stream(5)
        );
    }
}
