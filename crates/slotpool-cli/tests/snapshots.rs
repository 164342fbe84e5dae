//! Real PyTorch snapshots (benches/traces/snapshots, written by `_dump_snapshot` on an H200 with
//! PyTorch 2.11 and the default stack context) read and replayed.
//!
//! The expected events are those the previous reader (serde-pickle's value tree) produced from
//! the same files: their count per action and a hash of every field of every event, in order.

use std::io::BufReader;
use std::path::PathBuf;

use slotpool_cli::pickle::{Obj, Unpickler};
use slotpool_cli::{
    Action, ReadOptions, ReplayOptions, SlotpoolTarget, Trace, TraceFormat, read_trace,
    read_trace_with, replay,
};
use slotpool_core::GrowthMode;

fn snapshot(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/traces/snapshots")
        .join(format!("{name}.pickle.gz"))
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// FNV-1a over (action, addr, size, stream, line) of every event.
fn digest(t: &Trace) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for e in &t.events {
        for x in [e.action as u64, e.addr, e.size, e.stream, e.line as u64] {
            h = (h ^ x).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

fn counts(t: &Trace) -> Vec<(Action, usize)> {
    Action::ALL
        .iter()
        .map(|&a| (a, t.count(a)))
        .filter(|c| c.1 > 0)
        .collect()
}

struct Expected {
    name: &'static str,
    events: usize,
    counts: &'static [(Action, usize)],
    digest: u64,
    torch_peak_reserved: u64,
}

use Action::*;

const REAL: [Expected; 4] = [
    Expected {
        name: "plain",
        events: 964,
        counts: &[
            (Alloc, 336),
            (FreeRequested, 284),
            (FreeCompleted, 284),
            (SegmentAlloc, 44),
            (SegmentFree, 16),
        ],
        digest: 4_287_328_456_200_994_745,
        torch_peak_reserved: 769_654_784,
    },
    Expected {
        name: "exp",
        events: 943,
        counts: &[
            (Alloc, 336),
            (FreeRequested, 284),
            (FreeCompleted, 284),
            (SegmentMap, 36),
            (SegmentUnmap, 3),
        ],
        digest: 4_111_094_205_421_954_100,
        torch_peak_reserved: 778_043_392,
    },
    Expected {
        name: "graph",
        events: 1065,
        counts: &[
            (Alloc, 376),
            (FreeRequested, 310),
            (FreeCompleted, 310),
            (SegmentAlloc, 52),
            (SegmentFree, 17),
        ],
        digest: 9_858_642_665_364_989_261,
        torch_peak_reserved: 826_277_888,
    },
    Expected {
        name: "big",
        events: 180_964,
        counts: &[
            (Alloc, 60_336),
            (FreeRequested, 60_284),
            (FreeCompleted, 60_284),
            (SegmentAlloc, 44),
            (SegmentFree, 16),
        ],
        digest: 8_904_939_010_518_570_901,
        torch_peak_reserved: 769_654_784,
    },
];

#[test]
fn real_snapshots_read_as_before() {
    for x in &REAL {
        let t = read_trace(snapshot(x.name)).unwrap();
        assert_eq!(t.format, TraceFormat::Pickle, "{}", x.name);
        assert_eq!(t.device, 0, "{}", x.name);
        assert_eq!(t.name(), x.name);
        assert_eq!(t.events.len(), x.events, "{}", x.name);
        assert_eq!(counts(&t), x.counts, "{}", x.name);
        assert_eq!(digest(&t), x.digest, "{}: events differ", x.name);
        assert_eq!(t.torch_peak_reserved(), x.torch_peak_reserved, "{}", x.name);
        // Entries are numbered from 0, in order.
        assert!(t.events.iter().enumerate().all(|(i, e)| e.line == i));
    }
}

#[test]
fn real_snapshots_replay() {
    for x in &REAL {
        let t = read_trace(snapshot(x.name)).unwrap();
        let mut target = SlotpoolTarget::new(GrowthMode::Vmm, 143_771_000_832).unwrap();
        let r = replay(&t, &mut target, &ReplayOptions::default()).unwrap();
        let allocs = x.counts[0].1 as u64;
        let frees = x.counts[2].1 as u64;
        assert_eq!((r.allocs, r.frees, r.skipped_frees), (allocs, frees, 0));
        assert_eq!(r.live_at_end, allocs - frees, "{}", x.name);
        assert_eq!(r.free_action, FreeCompleted);
        // What the replay derives from the trace alone, as the previous reader gave it.
        assert_eq!(r.peak_requested, 743_768_064, "{}", x.name);
        assert_eq!(r.torch_peak_allocated, 743_768_064, "{}", x.name);
        assert_eq!(r.torch_peak_reserved, x.torch_peak_reserved, "{}", x.name);
        assert!(r.peak_reserved >= r.peak_allocated && r.peak_allocated >= r.peak_requested);
        target.allocator().check_invariants().unwrap();
    }
}

#[test]
fn python_written_fixtures_read_as_before() {
    for (file, device, want_device, events, digest_want) in [
        (
            "snapshot_p4.pickle",
            None,
            0,
            12,
            11_345_786_665_516_208_767u64,
        ),
        (
            "snapshot_p5.pickle.gz",
            None,
            0,
            12,
            11_345_786_665_516_208_767,
        ),
        (
            "snapshot_p4.pickle",
            Some(1),
            1,
            2,
            9_597_520_174_052_768_020,
        ),
    ] {
        let t = read_trace_with(fixture(file), ReadOptions { device }).unwrap();
        assert_eq!(t.device, want_device, "{file}");
        assert_eq!(t.events.len(), events, "{file}");
        assert_eq!(digest(&t), digest_want, "{file} {device:?}");
    }
}

/// The reader keeps no stack frames: what the big snapshot's graph holds is about the entries'
/// own keys (8 pairs each), where the frames would double it.
#[test]
fn frames_are_pruned_while_reading() {
    let slots = |prune: &[&str]| {
        let file = std::fs::File::open(snapshot("big")).unwrap();
        let gz = BufReader::new(flate2::read::GzDecoder::new(file));
        let g = Unpickler::new(gz).prune_keys(prune).load().unwrap();
        g.objs
            .iter()
            .map(|o| match o {
                Obj::List(l) | Obj::Set(l) => l.len(),
                Obj::Tuple(t) => t.len(),
                Obj::Dict(d) => 2 * d.len(),
                _ => 0,
            })
            .sum::<usize>()
    };
    let entries = 180_964;
    let pruned = slots(&["frames"]);
    let whole = slots(&[]);
    assert!(pruned <= 18 * entries, "{pruned} slots");
    assert!(whole >= 2 * pruned, "{whole} vs {pruned} slots");
}

/// A real snapshot cut short or with a byte changed is read or refused with an error, never a
/// panic or a hang.
#[test]
fn damaged_snapshots_are_errors_not_panics() {
    use std::io::Read;
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(snapshot("plain")).unwrap())
        .read_to_end(&mut raw)
        .unwrap();
    let read = |bytes: &[u8]| slotpool_cli::parse_trace(bytes, "damaged", ReadOptions::default());
    assert_eq!(read(&raw).unwrap().events.len(), 964);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..150 {
        let cut = (next() % raw.len() as u64) as usize;
        let err = read(&raw[..cut]).expect_err("a cut pickle is an error");
        assert!(err.to_string().starts_with("damaged: "), "{err}");
    }
    let mut refused = 0;
    for _ in 0..300 {
        let mut bad = raw.clone();
        let at = (next() % raw.len() as u64) as usize;
        bad[at] = (next() & 0xff) as u8;
        refused += usize::from(read(&bad).is_err());
    }
    assert!(refused > 0);
}
