//! The device-wide allocated counter behind `max_memory_allocated`, and the leases that let
//! shards leave it alone.
//!
//! Shard statistics are exact per shard, but the sum of per-shard peaks overstates the device's
//! peak whenever several shards are active. So every shard also reports to one [`PeakCounter`],
//! whose running maximum is the device's peak. Writing that one cache line on every allocation
//! would make it the bottleneck of every thread, so a shard keeps bytes it freed counted there and
//! spends them on its next allocations:
//!
//! - up to `CREDIT_MAX` bytes as its *credit*, a plain field under the shard's lock (small
//!   pairs cost nothing more);
//! - beyond that, all of it as its [`Lease`], an atomic of its own that other shards may take back
//!   (large pairs cost one uncontended read-modify-write each way instead of one on the shared
//!   line).
//!
//! The counter therefore reads allocated bytes plus every credit and lease: an upper bound of the
//! allocated bytes. Before the counter records a new peak, the shard that pushed it there takes
//! every other shard's lease back, so a peak overstates the device's true one by at most the
//! other active shards' credits (as it did before leases), and bytes that one stream freed do not
//! count twice when another stream allocates them.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use crossbeam_utils::CachePadded;

/// Freed bytes a shard keeps as its credit (larger amounts go to its lease), so that alloc/free
/// loops of up to this size touch neither the shared counter nor the lease.
pub(crate) const CREDIT_MAX: i64 = 2 << 20;

/// Bytes one shard freed and keeps counted in the device's [`PeakCounter`], ready for its next
/// allocations. Only its shard adds to it (under the shard's lock); anyone may take it all.
#[derive(Debug, Default)]
pub struct Lease(CachePadded<AtomicI64>);

impl Lease {
    /// Take every byte of the lease.
    pub(crate) fn take(&self) -> i64 {
        self.0.swap(0, Ordering::Relaxed)
    }

    /// Add freed bytes (the owning shard only).
    pub(crate) fn give(&self, bytes: i64) {
        self.0.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes leased now.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A device-wide byte count with a peak: allocated bytes plus shards' credits and leases (see the
/// module documentation).
#[derive(Debug, Default)]
pub struct PeakCounter {
    current: AtomicI64,
    peak: AtomicI64,
    /// Every shard's lease, taken back before a new peak is recorded. Read-locked by takers, so
    /// that two shards reaching a peak at once take leases side by side; on its own line, away
    /// from `current`, which every shard out of credit and lease writes.
    leases: CachePadded<RwLock<Vec<Arc<Lease>>>>,
}

impl PeakCounter {
    /// Count `delta` bytes (a shard out of credit and lease, or one handing bytes back).
    pub fn add(&self, delta: i64) {
        let mut now = self.current.fetch_add(delta, Ordering::Relaxed) + delta;
        if delta > 0 && now > self.peak.load(Ordering::Relaxed) {
            // Bytes leased by other shards are not allocated: give them back before calling
            // this a peak (the caller's own lease is empty, or it would not be here).
            let taken = self.take_leases();
            if taken != 0 {
                now = self.current.fetch_sub(taken, Ordering::Relaxed) - taken;
            }
            // The adds are totally ordered, so the largest value any of them produced is the
            // peak of the running count.
            if now > self.peak.load(Ordering::Relaxed) {
                self.peak.fetch_max(now, Ordering::Relaxed);
            }
        }
    }

    pub fn current(&self) -> i64 {
        self.current.load(Ordering::Relaxed)
    }

    pub fn peak(&self) -> i64 {
        self.peak.load(Ordering::Relaxed).max(self.current())
    }

    /// Restart the peak from the count with no lease in it.
    pub fn reset_peak(&self) {
        let taken = self.take_leases();
        self.current.fetch_sub(taken, Ordering::Relaxed);
        self.peak.store(self.current(), Ordering::Relaxed);
    }

    /// A lease for a new shard.
    pub fn new_lease(&self) -> Arc<Lease> {
        let lease = Arc::new(Lease::default());
        self.leases
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(lease.clone());
        lease
    }

    /// Forget the lease of a shard that is going away, and stop counting its bytes.
    pub fn end_lease(&self, lease: &Arc<Lease>) {
        self.leases
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|l| !Arc::ptr_eq(l, lease));
        let bytes = lease.take();
        if bytes != 0 {
            self.current.fetch_sub(bytes, Ordering::Relaxed);
        }
    }

    /// Take every lease back. An empty lease is only read: the list holds every shard ever made
    /// (one per pool and stream), most of them idle, and a read-modify-write of each idle line
    /// would cost the taker one cache-line transfer per shard while other shards wait for bytes.
    fn take_leases(&self) -> i64 {
        self.leases
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|l| if l.get() != 0 { l.take() } else { 0 })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: i64 = 1 << 20;

    /// Two shards' accounting as `Shard::count_allocated` does it: a claim first spends the
    /// shard's own lease, then the counter.
    fn claim(c: &PeakCounter, lease: &Lease, bytes: i64) {
        let got = lease.take();
        if got >= bytes {
            lease.give(got - bytes);
        } else {
            c.add(bytes - got);
        }
    }

    #[test]
    fn freed_bytes_of_one_shard_do_not_count_twice_toward_the_peak() {
        let c = PeakCounter::default();
        let (a, b) = (c.new_lease(), c.new_lease());
        claim(&c, &a, 64 * MIB);
        a.give(64 * MIB); // freed on a, kept as a's lease
        assert_eq!((c.current(), c.peak()), (64 * MIB, 64 * MIB));
        claim(&c, &b, 64 * MIB);
        assert_eq!(c.peak(), 64 * MIB, "one 64 MiB block at a time");
        assert_eq!(a.get(), 0, "a's lease was taken back");
        assert_eq!(c.current(), 64 * MIB);
        // Both at once is a real peak.
        claim(&c, &a, 64 * MIB);
        assert_eq!(c.peak(), 128 * MIB);
    }

    #[test]
    fn a_lease_covers_its_shard_without_the_counter() {
        let c = PeakCounter::default();
        let a = c.new_lease();
        claim(&c, &a, 64 * MIB);
        for _ in 0..10 {
            a.give(64 * MIB);
            claim(&c, &a, 64 * MIB);
            assert_eq!(a.get(), 0);
        }
        assert_eq!((c.current(), c.peak()), (64 * MIB, 64 * MIB));
    }

    #[test]
    fn reset_and_end_hand_leases_back() {
        let c = PeakCounter::default();
        let (a, b) = (c.new_lease(), c.new_lease());
        claim(&c, &a, 8 * MIB);
        claim(&c, &b, 8 * MIB);
        a.give(8 * MIB);
        assert_eq!((c.current(), c.peak()), (16 * MIB, 16 * MIB));
        c.reset_peak();
        assert_eq!((c.current(), c.peak(), a.get()), (8 * MIB, 8 * MIB, 0));
        b.give(8 * MIB);
        c.end_lease(&b);
        assert_eq!((c.current(), b.get()), (0, 0));
        assert_eq!(c.leases.read().unwrap().len(), 1, "b's lease is forgotten");
    }
}
