//! Pool ids (compatible with PyTorch's `MempoolId_t`) and pool settings.

use std::fmt;

/// A pool id: a pair of u64 as PyTorch's `MempoolId_t`. `{0,0}` is the default pool, `{n,0}`
/// capture-private pools, `{0,n}` user pools (`torch.cuda.MemPool`, `graph_pool_handle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct PoolId(pub u64, pub u64);

impl PoolId {
    /// Every device's default pool.
    pub const DEFAULT: PoolId = PoolId(0, 0);

    pub fn is_default(self) -> bool {
        self == PoolId::DEFAULT
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({}, {})", self.0, self.1)
    }
}

/// Settings of one pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolOptions {
    /// Never split cached blocks (classic segments only).
    pub no_split: bool,
    /// This pool's free blocks may serve other pools' requests when they run out of memory.
    pub use_on_oom: bool,
    /// Most physical bytes the pool may hold.
    pub limit: Option<u64>,
    /// The pool may be paused ([`crate::Allocator::pause_pool`]): every segment it grows, small
    /// ones included, is vmm memory, whatever the growth mode and the page size, since a
    /// classic (`cudaMalloc`) segment cannot give its memory back and keep its addresses.
    pub pausable: bool,
}
