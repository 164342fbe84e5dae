//! The device-wide allocated peak against a model that sums allocated bytes after every step:
//! shards spend bytes they freed through credits and leases (`slotpool_core::peak`), and the
//! peak must stay between the true one and the true one plus the other streams' credits.

use proptest::prelude::*;
use slotpool::core::GrowthMode;

use crate::common::{MIB, setup};

/// `slotpool_core::peak::CREDIT_MAX`: what one stream may keep counted outside its lease.
const CREDIT_MAX: u64 = 2 * MIB;
const STREAMS: u64 = 3;

#[derive(Clone, Debug)]
enum Op {
    Alloc { size: u64, stream: u64 },
    Free(usize),
    ResetPeak,
    EmptyCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop_oneof![1u64..(1 << 20), (1u64 << 20)..(96 << 20)], 0..STREAMS)
            .prop_map(|(size, stream)| Op::Alloc { size, stream }),
        5 => any::<usize>().prop_map(Op::Free),
        1 => Just(Op::ResetPeak),
        1 => Just(Op::EmptyCache),
    ]
}

fn run(growth: GrowthMode, ops: &[Op]) {
    let (_dev, a) = setup(growth, 2 << 30);
    let mut live = Vec::new();
    let mut true_peak = 0u64;
    for op in ops {
        match *op {
            Op::Alloc { size, stream } => {
                if let Ok(p) = a.alloc(size, stream) {
                    live.push(p);
                }
            }
            Op::Free(i) if !live.is_empty() => {
                let p = live.swap_remove(i % live.len());
                a.free(p).unwrap();
            }
            Op::Free(_) => {}
            Op::ResetPeak => {
                a.reset_peak_stats();
                true_peak = 0;
            }
            Op::EmptyCache => a.empty_cache(),
        }
        let st = a.stats();
        let now = st.allocated_bytes.all().current as u64;
        true_peak = true_peak.max(now);
        let peak = st.allocated_bytes.all().peak as u64;
        assert!(
            peak >= true_peak,
            "{op:?}: peak {peak} below the true peak {true_peak}"
        );
        assert!(
            peak <= true_peak + (STREAMS - 1) * CREDIT_MAX,
            "{op:?}: peak {peak} overstates the true peak {true_peak} by more than the other streams' credits"
        );
        a.check_invariants().unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: crate::common::cases(64), ..ProptestConfig::default() })]

    #[test]
    fn device_peak_brackets_the_true_peak_vmm(ops in prop::collection::vec(op(), 1..100)) {
        run(GrowthMode::Vmm, &ops);
    }

    #[test]
    fn device_peak_brackets_the_true_peak_classic(ops in prop::collection::vec(op(), 1..100)) {
        run(GrowthMode::Classic, &ops);
    }
}

/// Large pairs that alternate between streams: each stream's freed bytes sit in its lease, and
/// the next stream's allocation takes them back instead of counting them twice.
#[test]
fn leased_bytes_do_not_count_twice() {
    for growth in [GrowthMode::Vmm, GrowthMode::Classic] {
        let (_dev, a) = setup(growth, 1 << 30);
        for round in 0..3 {
            for stream in 0..STREAMS {
                let p = a.alloc(64 * MIB, stream).unwrap();
                a.free(p).unwrap();
                assert_eq!(
                    a.stats().allocated_bytes.all().peak as u64,
                    64 * MIB,
                    "{growth:?}: round {round}, stream {stream}"
                );
                a.check_invariants().unwrap();
            }
        }
    }
}
