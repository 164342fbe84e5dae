//! Routes: rules that send allocations to a pool, newest first (PyTorch's `captures_underway`
//! filters).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::device::StreamId;
use crate::pool::PoolId;

/// Which allocations a route takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RouteFilter {
    /// Every allocation (`_cuda_beginAllocateToPool` with no filter).
    All,
    /// Allocations made by one thread ([`current_thread_id`]; `torch.cuda.use_mem_pool`).
    Thread(u64),
    /// Allocations on one stream (`_cuda_beginAllocateCurrentStreamToPool`).
    Stream(StreamId),
    /// Allocations on a stream capturing into this capture id (`torch.cuda.graph`).
    Capture(u64),
}

/// One active route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Route {
    pub pool: PoolId,
    pub filter: RouteFilter,
}

static NEXT_THREAD_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_ID: Cell<u64> = const { Cell::new(0) };
}

/// A small unique id of the calling thread, for [`RouteFilter::Thread`].
pub fn current_thread_id() -> u64 {
    THREAD_ID
        .try_with(|c| {
            if c.get() == 0 {
                c.set(NEXT_THREAD_ID.fetch_add(1, Ordering::Relaxed));
            }
            c.get()
        })
        .unwrap_or(u64::MAX)
}
