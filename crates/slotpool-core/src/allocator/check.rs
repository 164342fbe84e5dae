//! The allocator's invariants across shards, and a text dump of its state.

use crate::device::Device;
use crate::pool::PoolId;
use crate::sync::lock;
use rustc_hash::FxHashMap;
use std::sync::Arc;

use super::Allocator;

impl<D: Device> Allocator<D> {
    /// Check the whole state (call it while no other thread uses the allocator: it visits the
    /// shards one at a time): every shard's invariants, then
    ///
    /// 1. the segment registry holds exactly the shards' segments, each with its shard (every
    ///    shard's own live map is its invariant 8), and no shard in the table is retired;
    /// 2. no two segments of any shards overlap;
    /// 3. physical bytes held equal classic segments + mapped pages + cached pages;
    /// 4. each pool's budget equals what its shards hold;
    /// 5. the device-wide allocated counter equals the shards' allocated bytes plus their credits
    ///    and leases, plus the arenas' live slots (each arena's own invariants are checked too).
    pub fn check_invariants(&self) -> Result<(), String> {
        let _reclaim = lock(&self.reclaim);
        let ps = self.shared.page_size;
        let shards = self.all_shards();
        let mut ranges = Vec::new();
        let mut held = self.shared.pages.len() as u64 * ps + self.shared.pages.run_bytes();
        let mut per_pool: FxHashMap<PoolId, u64> = FxHashMap::default();
        let mut allocated = 0i64;
        for (pool, bytes) in self.arena_bytes() {
            held += bytes;
            *per_pool.entry(pool).or_default() += bytes;
        }
        allocated += self.check_arenas()?;
        for (&(pool, stream), cell) in &shards {
            let s = lock(&cell.shard);
            if s.is_retired() {
                return Err(format!(
                    "1: shard {pool}/{stream} is retired but in the table"
                ));
            }
            s.check_invariants(ps)
                .map_err(|e| format!("shard {pool}/{stream}: invariant {e}"))?;
            let reserved = s.stats().reserved_bytes.all().current as u64;
            allocated += s.counted_allocated();
            held += reserved;
            *per_pool.entry(pool).or_default() += reserved;
            let reg = self.segments.read();
            for (_, seg) in s.segments() {
                ranges.push((seg.addr, seg.addr + seg.size));
                match reg.get(&seg.addr) {
                    Some((end, owner))
                        if *end == seg.addr + seg.size
                            && owner.upgrade().is_some_and(|c| Arc::ptr_eq(&c, cell)) => {}
                    _ => {
                        return Err(format!(
                            "1: segment {:#x} of shard {pool}/{stream} is not registered",
                            seg.addr
                        ));
                    }
                }
            }
        }
        let registered = self.segments.read().len();
        if registered != ranges.len() {
            return Err(format!(
                "1: {registered} segments registered, {} in shards",
                ranges.len()
            ));
        }
        ranges.sort_unstable();
        if ranges.windows(2).any(|w| w[0].1 > w[1].0) {
            return Err("2: segments of different shards overlap".into());
        }
        if held != self.shared.budget.held() {
            return Err(format!(
                "3: {} bytes held by the budget, {held} counted",
                self.shared.budget.held()
            ));
        }
        if allocated != self.shared.allocated.current() {
            return Err(format!(
                "5: device-wide allocated {} vs {allocated} in shards",
                self.shared.allocated.current()
            ));
        }
        let pools = lock(&self.pools);
        for (id, e) in pools.iter() {
            let have = per_pool.get(id).copied().unwrap_or(0);
            if !id.is_default() && e.budget.held() != have {
                return Err(format!(
                    "4: pool {id} budget {} vs {have} held",
                    e.budget.held()
                ));
            }
        }
        Ok(())
    }

    /// A text dump of every shard's segments, blocks and statistics, in a stable order: tests
    /// compare two dumps to show that a refused call changed nothing.
    pub fn state_dump(&self) -> String {
        use std::fmt::Write;
        let shards = self.all_shards();
        let mut keys: Vec<_> = shards.keys().copied().collect();
        keys.sort_unstable();
        let mut out = String::new();
        for k in keys {
            let s = lock(&shards[&k].shard);
            let _ = writeln!(out, "shard {}/{}: {:?}", k.0, k.1, s.stats());
            let mut segs: Vec<_> = s.segments().collect();
            segs.sort_by_key(|(_, seg)| seg.addr);
            for (sid, seg) in segs {
                let _ = writeln!(
                    out,
                    " segment {:#x}+{} small={}",
                    seg.addr, seg.size, seg.small
                );
                for (_, b) in s.segment_blocks(sid) {
                    let _ = writeln!(
                        out,
                        "  block {:#x}+{} {:?} req={} uses={:?}",
                        b.addr, b.size, b.state, b.requested, b.stream_uses
                    );
                }
            }
        }
        out.push_str(&self.arena_dump());
        let _ = writeln!(
            out,
            "held {} pages {}",
            self.shared.budget.held(),
            self.shared.pages.len()
        );
        out
    }
}
