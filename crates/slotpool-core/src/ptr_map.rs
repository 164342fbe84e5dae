//! A sharded map from device address to the owner of the block there: frees on different
//! threads rarely touch the same lock (PyTorch shards its map 67 ways for the same reason).

use std::sync::Mutex;

use crossbeam_utils::CachePadded;
use rustc_hash::FxHashMap;

use crate::device::DevicePtr;
use crate::sync::lock;

const SHARDS: usize = 64;

type Part<V> = CachePadded<Mutex<FxHashMap<DevicePtr, V>>>;

/// Address → `V`, split over 64 cache-padded mutexes.
#[derive(Debug)]
pub struct PtrMap<V> {
    shards: Box<[Part<V>]>,
}

impl<V: Clone> Default for PtrMap<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V: Clone> PtrMap<V> {
    pub fn new() -> Self {
        PtrMap {
            shards: (0..SHARDS)
                .map(|_| CachePadded::new(Mutex::new(FxHashMap::default())))
                .collect(),
        }
    }

    #[inline]
    fn shard(&self, ptr: DevicePtr) -> &Mutex<FxHashMap<DevicePtr, V>> {
        // Blocks are 512 B aligned: mix the bits above that.
        let h = (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        &self.shards[(h >> 58) as usize]
    }

    pub fn insert(&self, ptr: DevicePtr, v: V) {
        lock(self.shard(ptr)).insert(ptr, v);
    }

    pub fn remove(&self, ptr: DevicePtr) -> Option<V> {
        lock(self.shard(ptr)).remove(&ptr)
    }

    pub fn get(&self, ptr: DevicePtr) -> Option<V> {
        lock(self.shard(ptr)).get(&ptr).cloned()
    }

    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
