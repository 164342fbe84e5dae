//! Statistics with PyTorch's `memory_stats()` keys and meanings.

use std::collections::BTreeMap;

use serde::Serialize;

/// One statistic: current value, peak since the last reset, and totals since the last reset.
///
/// The total added is derived, not counted: it is `current - base + freed`, where `base` is the
/// current value when the totals were last reset. An increment then stores one field (two at a
/// new peak) instead of three, on the path every allocation takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stat {
    pub current: i64,
    pub peak: i64,
    pub freed: i64,
    /// `current` when the totals were last reset.
    base: i64,
}

impl Stat {
    /// A statistic with these four values.
    pub fn new(current: i64, peak: i64, allocated: i64, freed: i64) -> Stat {
        Stat {
            current,
            peak,
            freed,
            base: current - allocated + freed,
        }
    }

    /// The total added since the last reset of totals.
    #[inline]
    pub fn allocated(&self) -> i64 {
        self.current - self.base + self.freed
    }

    /// Add `amount` (may be negative), tracking the peak and the totals.
    #[inline]
    pub fn update(&mut self, amount: i64) {
        if amount > 0 {
            self.inc(amount);
        } else {
            self.dec(-amount);
        }
    }

    /// [`Stat::update`] by `amount >= 0`, without the sign test (the hot paths know the sign).
    #[inline]
    pub fn inc(&mut self, amount: i64) {
        debug_assert!(amount >= 0);
        self.current += amount;
        // A branch, not a max: in steady state nothing more is stored (fewer stores for the
        // shard lock's next atomic to wait for: 4% of a cached alloc + free pair).
        if self.current > self.peak {
            self.peak = self.current;
        }
    }

    /// [`Stat::update`] by `-amount`, `amount >= 0`.
    #[inline]
    pub fn dec(&mut self, amount: i64) {
        debug_assert!(amount >= 0);
        self.current -= amount;
        self.freed += amount;
    }

    /// `reset_peak_memory_stats`.
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// `reset_accumulated_memory_stats`: both totals to zero.
    pub fn reset_totals(&mut self) {
        self.freed = 0;
        self.base = self.current;
    }

    fn merge(&mut self, other: &Stat) {
        self.current += other.current;
        self.peak += other.peak;
        self.freed += other.freed;
        self.base += other.base;
    }
}

/// PyTorch's four numbers, `allocated` included.
impl Serialize for Stat {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = ser.serialize_struct("Stat", 4)?;
        st.serialize_field("current", &self.current)?;
        st.serialize_field("peak", &self.peak)?;
        st.serialize_field("allocated", &self.allocated())?;
        st.serialize_field("freed", &self.freed)?;
        st.end()
    }
}

/// Which of PyTorch's pool breakdowns a statistic belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatType {
    Small,
    Large,
}

/// A statistic broken down as PyTorch does: all, small_pool, large_pool.
///
/// Only the two pools are counted; `all` is their sum ([`StatArray::all`]), except its peak,
/// which is kept: the peak of a sum is not the sum of the peaks. An update then stores one
/// pool's fields, not two statistics' (half the stores of an alloc + free pair's statistics).
///
/// The pools are an array indexed by `small as usize` (large, small): every update of a pair's
/// five statistics then addresses its pool with one shared index, where two named fields made
/// the compiler select a pointer per statistic.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    pools: [Stat; 2],
    /// Peak of the two pools' `current` summed.
    all_peak: i64,
}

impl StatArray {
    /// The small pool (blocks of at most 1 MiB).
    #[inline]
    pub fn small_pool(&self) -> &Stat {
        &self.pools[1]
    }

    /// The large pool.
    #[inline]
    pub fn large_pool(&self) -> &Stat {
        &self.pools[0]
    }

    /// Both pools together.
    #[inline]
    pub fn all(&self) -> Stat {
        let [l, s] = &self.pools;
        let current = s.current + l.current;
        Stat {
            current,
            peak: self.all_peak.max(current),
            freed: s.freed + l.freed,
            base: s.base + l.base,
        }
    }

    /// Set `all`'s peak, known better than from the pools (a device-wide counter); never below
    /// the current value.
    pub fn set_all_peak(&mut self, peak: i64) {
        self.all_peak = peak.max(self.pools[0].current + self.pools[1].current);
    }

    /// Update the breakdown named by `small` (and so `all`).
    #[inline]
    pub fn update(&mut self, small: bool, amount: i64) {
        if amount > 0 {
            self.inc(small, amount);
        } else if amount < 0 {
            self.dec(small, -amount);
        }
    }

    /// [`StatArray::update`] by `amount >= 0`.
    #[inline]
    pub fn inc(&mut self, small: bool, amount: i64) {
        self.pools[small as usize].inc(amount);
        let all = self.pools[0].current + self.pools[1].current;
        if all > self.all_peak {
            self.all_peak = all;
        }
    }

    /// [`StatArray::update`] by `-amount`, `amount >= 0`.
    #[inline]
    pub fn dec(&mut self, small: bool, amount: i64) {
        self.pools[small as usize].dec(amount);
    }

    fn merge(&mut self, other: &StatArray) {
        // Peaks add up, as the pools' do (an upper bound of the merged peak).
        let peak = self.all().peak + other.all().peak;
        for (p, o) in self.pools.iter_mut().zip(&other.pools) {
            p.merge(o);
        }
        self.all_peak = peak;
    }

    fn reset_peak(&mut self) {
        for p in &mut self.pools {
            p.reset_peak();
        }
        self.all_peak = self.pools[0].current + self.pools[1].current;
    }

    fn reset_totals(&mut self) {
        for p in &mut self.pools {
            p.reset_totals();
        }
    }
}

/// Serialised as PyTorch lays it out: all, small_pool, large_pool.
impl Serialize for StatArray {
    fn serialize<S: serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = ser.serialize_struct("StatArray", 3)?;
        st.serialize_field("all", &self.all())?;
        st.serialize_field("small_pool", self.small_pool())?;
        st.serialize_field("large_pool", self.large_pool())?;
        st.end()
    }
}

/// PyTorch's `DeviceStats`, for a device or for one pool.
///
/// Meanings follow PyTorch: `allocation` and `allocated_bytes` count blocks handed out and not yet
/// freed by the user (rounded sizes); `active` additionally counts blocks freed by the user but
/// waiting for cross-stream events; `requested_bytes` are the sizes asked for; `segment` and
/// `reserved_bytes` are backend memory (segments in classic mode, physical pages in vmm mode, each
/// counted once however many page slots map it);
/// `inactive_split` are free blocks that are part of a split classic segment.
///
/// `reserved_paused_bytes` (no PyTorch counterpart) are the bytes of paused pools
/// ([`crate::Allocator::pause_pool`]): pages given back to the driver at addresses the pool keeps,
/// mapped again by the resume. They are not in `reserved_bytes`, which counts what is held on the
/// device now; the two added are what the pools held before the pause.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryStats {
    pub allocation: StatArray,
    pub segment: StatArray,
    pub active: StatArray,
    pub inactive_split: StatArray,
    pub allocated_bytes: StatArray,
    pub reserved_bytes: StatArray,
    pub active_bytes: StatArray,
    pub inactive_split_bytes: StatArray,
    pub requested_bytes: StatArray,
    pub reserved_paused_bytes: StatArray,
    pub num_alloc_retries: i64,
    pub num_ooms: i64,
    pub num_sync_all_streams: i64,
    pub num_device_alloc: i64,
    pub num_device_free: i64,
    pub oversize_allocations: Stat,
    pub oversize_segments: Stat,
    pub max_split_size: i64,
}

impl MemoryStats {
    /// Add another set of statistics into this one. Peaks add up, so a sum over shards gives an
    /// upper bound of the device peak (exact when one shard was active).
    pub fn merge(&mut self, other: &MemoryStats) {
        for (a, b) in self.arrays_mut().into_iter().zip(other.arrays()) {
            a.merge(b);
        }
        self.num_alloc_retries += other.num_alloc_retries;
        self.num_ooms += other.num_ooms;
        self.num_sync_all_streams += other.num_sync_all_streams;
        self.num_device_alloc += other.num_device_alloc;
        self.num_device_free += other.num_device_free;
        self.oversize_allocations.merge(&other.oversize_allocations);
        self.oversize_segments.merge(&other.oversize_segments);
    }

    fn arrays(&self) -> [&StatArray; 10] {
        [
            &self.allocation,
            &self.segment,
            &self.active,
            &self.inactive_split,
            &self.allocated_bytes,
            &self.reserved_bytes,
            &self.active_bytes,
            &self.inactive_split_bytes,
            &self.requested_bytes,
            &self.reserved_paused_bytes,
        ]
    }

    fn arrays_mut(&mut self) -> [&mut StatArray; 10] {
        [
            &mut self.allocation,
            &mut self.segment,
            &mut self.active,
            &mut self.inactive_split,
            &mut self.allocated_bytes,
            &mut self.reserved_bytes,
            &mut self.active_bytes,
            &mut self.inactive_split_bytes,
            &mut self.requested_bytes,
            &mut self.reserved_paused_bytes,
        ]
    }

    /// `reset_peak_memory_stats`: every peak becomes the current value.
    pub fn reset_peak(&mut self) {
        for a in self.arrays_mut() {
            a.reset_peak();
        }
        self.oversize_allocations.reset_peak();
        self.oversize_segments.reset_peak();
    }

    /// `reset_accumulated_memory_stats`: totals and event counters go to zero.
    pub fn reset_accumulated(&mut self) {
        for a in self.arrays_mut() {
            a.reset_totals();
        }
        for s in [&mut self.oversize_allocations, &mut self.oversize_segments] {
            s.reset_totals();
        }
        self.num_alloc_retries = 0;
        self.num_ooms = 0;
        self.num_sync_all_streams = 0;
        self.num_device_alloc = 0;
        self.num_device_free = 0;
    }

    /// The flat dictionary of `torch.cuda.memory_stats()`: keys such as
    /// `allocated_bytes.all.current` or `num_alloc_retries`.
    pub fn to_flat_map(&self) -> BTreeMap<String, i64> {
        let names = [
            "allocation",
            "segment",
            "active",
            "inactive_split",
            "allocated_bytes",
            "reserved_bytes",
            "active_bytes",
            "inactive_split_bytes",
            "requested_bytes",
            "reserved_paused_bytes",
        ];
        let mut out = BTreeMap::new();
        for (name, arr) in names.iter().zip(self.arrays()) {
            for (pool, s) in [
                ("all", &arr.all()),
                ("small_pool", arr.small_pool()),
                ("large_pool", arr.large_pool()),
            ] {
                put_stat(&mut out, &format!("{name}.{pool}"), s);
            }
        }
        put_stat(&mut out, "oversize_allocations", &self.oversize_allocations);
        put_stat(&mut out, "oversize_segments", &self.oversize_segments);
        out.insert("num_alloc_retries".into(), self.num_alloc_retries);
        out.insert("num_ooms".into(), self.num_ooms);
        out.insert("num_sync_all_streams".into(), self.num_sync_all_streams);
        out.insert("num_device_alloc".into(), self.num_device_alloc);
        out.insert("num_device_free".into(), self.num_device_free);
        out.insert("max_split_size".into(), self.max_split_size);
        out
    }
}

fn put_stat(out: &mut BTreeMap<String, i64>, prefix: &str, s: &Stat) {
    out.insert(format!("{prefix}.current"), s.current);
    out.insert(format!("{prefix}.peak"), s.peak);
    out.insert(format!("{prefix}.allocated"), s.allocated());
    out.insert(format!("{prefix}.freed"), s.freed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.update(10);
        s.update(-4);
        s.update(3);
        assert_eq!(s, Stat::new(9, 10, 13, 4));
        assert_eq!((s.allocated(), s.freed), (13, 4));
        s.reset_totals();
        assert_eq!((s.current, s.allocated(), s.freed), (9, 0, 0));
        s.update(-2);
        s.update(5);
        assert_eq!((s.current, s.peak, s.allocated(), s.freed), (12, 12, 5, 2));
    }

    #[test]
    fn inc_and_dec_are_update_with_a_known_sign() {
        let (mut by_update, mut by_sign) = (StatArray::default(), StatArray::default());
        for (small, amount) in [(true, 7), (false, 5), (true, -3), (false, 0), (false, -5)] {
            by_update.update(small, amount);
            if amount >= 0 {
                by_sign.inc(small, amount);
            } else {
                by_sign.dec(small, -amount);
            }
        }
        assert_eq!(by_update, by_sign);
        assert_eq!(by_sign.all().peak, 12);
        assert_eq!(by_sign.small_pool().current, 4);
    }

    /// The plain definition the counters are checked against: three statistics, each with all
    /// four numbers counted.
    #[derive(Clone, Copy, Debug, Default)]
    struct Plain {
        current: i64,
        peak: i64,
        allocated: i64,
        freed: i64,
    }

    impl Plain {
        fn update(&mut self, amount: i64) {
            self.current += amount;
            self.peak = self.peak.max(self.current);
            if amount > 0 {
                self.allocated += amount;
            } else {
                self.freed -= amount;
            }
        }
        fn same(&self, s: &Stat) -> bool {
            (self.current, self.peak, self.allocated, self.freed)
                == (s.current, s.peak, s.allocated(), s.freed)
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Update(bool, i64),
        ResetPeak,
        ResetTotals,
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            8 => (any::<bool>(), -1000i64..1000).prop_map(|(s, a)| Op::Update(s, a)),
            1 => Just(Op::ResetPeak),
            1 => Just(Op::ResetTotals),
        ]
    }

    proptest::proptest! {
        /// `all` derived from the two pools (with its own peak) and totals derived from `freed`
        /// read exactly as three fully counted statistics would, through updates, resets and
        /// merges.
        #[test]
        fn derived_counters_match_the_plain_definition(
            ops in proptest::collection::vec(op(), 0..200),
            other in proptest::collection::vec(op(), 0..50),
        ) {
            let run = |ops: &[Op]| {
                let mut a = StatArray::default();
                let mut plain = [Plain::default(); 3]; // all, small, large
                for o in ops {
                    match *o {
                        Op::Update(small, amount) => {
                            a.update(small, amount);
                            plain[0].update(amount);
                            plain[if small { 1 } else { 2 }].update(amount);
                        }
                        Op::ResetPeak => {
                            let mut m = MemoryStats { allocation: a, ..Default::default() };
                            m.reset_peak();
                            a = m.allocation;
                            for p in &mut plain {
                                p.peak = p.current;
                            }
                        }
                        Op::ResetTotals => {
                            let mut m = MemoryStats { allocation: a, ..Default::default() };
                            m.reset_accumulated();
                            a = m.allocation;
                            for p in &mut plain {
                                p.allocated = 0;
                                p.freed = 0;
                            }
                        }
                    }
                    assert!(plain[0].same(&a.all()), "all: {:?} vs {:?}", plain[0], a.all());
                    assert!(plain[1].same(a.small_pool()));
                    assert!(plain[2].same(a.large_pool()));
                }
                (a, plain)
            };
            let (mut a, pa) = run(&ops);
            let (b, pb) = run(&other);
            let mut m = MemoryStats { allocation: a, ..Default::default() };
            m.merge(&MemoryStats { allocation: b, ..Default::default() });
            a = m.allocation;
            // Merged: every number adds up, peaks included.
            let all = a.all();
            proptest::prop_assert_eq!(
                (all.current, all.peak, all.allocated(), all.freed),
                (
                    pa[0].current + pb[0].current,
                    pa[0].peak + pb[0].peak,
                    pa[0].allocated + pb[0].allocated,
                    pa[0].freed + pb[0].freed
                )
            );
        }
    }

    #[test]
    fn flat_map_has_pytorch_keys_and_resets_work() {
        let mut m = MemoryStats::default();
        m.allocated_bytes.update(true, 512);
        m.allocated_bytes.update(true, -512);
        m.num_ooms = 2;
        let flat = m.to_flat_map();
        assert_eq!(flat["allocated_bytes.all.peak"], 512);
        assert_eq!(flat["allocated_bytes.small_pool.freed"], 512);
        assert_eq!(flat["allocated_bytes.large_pool.current"], 0);
        assert_eq!(flat["num_ooms"], 2);
        assert!(flat.contains_key("inactive_split_bytes.all.current"));
        assert!(flat.contains_key("requested_bytes.all.allocated"));
        assert!(flat.contains_key("reserved_paused_bytes.all.current"));
        m.reset_peak();
        assert_eq!(m.allocated_bytes.all().peak, 0);
        m.reset_accumulated();
        assert_eq!(m.allocated_bytes.all().freed, 0);
        assert_eq!(m.num_ooms, 0);
    }
}
