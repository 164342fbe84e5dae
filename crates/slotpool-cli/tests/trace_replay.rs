//! Trace readers, the replay driver and the plot, on the real traces of benches/traces and on
//! small fixtures.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_pickle::{HashableValue, SerOptions, Value};
use slotpool_cli::plot::{render_svg, write_svg};
use slotpool_cli::{
    Action, Location, ModelMode, ModelTarget, ReadOptions, ReplayError, ReplayOptions,
    ReplayTarget, Trace, TraceError, TraceFormat, read_trace, read_trace_with, replay,
};

fn traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/traces")
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A fresh directory under the system temp dir, unique to this process and test.
fn temp_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("slotpool-cli-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn err_of(path: &Path) -> (TraceError, String) {
    let err = read_trace(path).expect_err("expected an error");
    let msg = err.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "message does not name the file: {msg}"
    );
    (err, msg)
}

// ---------------------------------------------------------------------------------------------
// Real traces

fn check_real(name: &str, events: usize, allocs: usize) -> Trace {
    let path = traces_dir().join(format!("{name}.trace.csv.gz"));
    let t0 = Instant::now();
    let trace = read_trace(&path).unwrap();
    let read = t0.elapsed();
    assert_eq!(trace.format, TraceFormat::Csv);
    assert_eq!(trace.events.len(), events, "{name}: events");
    assert_eq!(trace.count(Action::Alloc), allocs, "{name}: allocs");
    assert_eq!(trace.name(), name);
    assert!(
        trace.events.iter().all(|e| e.stream == 0),
        "{name}: one stream"
    );
    // Lines are 1-based and the header is line 1.
    assert_eq!(trace.events[0].line, 2);
    let peak = trace.torch_peak_reserved();
    println!(
        "{name}: {} events read in {read:?}; torch peak reserved {peak} B = {:.3} GB",
        trace.events.len(),
        peak as f64 / 1e9
    );
    trace
}

#[test]
fn gpt2_train_trace() {
    let trace = check_real("gpt2_train", 22_081, 7_608);
    assert_eq!(trace.count(Action::FreeCompleted), 7_160);
    assert_eq!(trace.count(Action::FreeRequested), 7_160);
    assert_eq!(trace.count(Action::SegmentAlloc), 153);
    // traces/README.md: PyTorch's native peak reserved 15.29 GB (memory_stats, a little later
    // than the last segment_alloc line); the segment_alloc lines give 15.28 GB.
    let peak = trace.torch_peak_reserved() as f64 / 1e9;
    assert!((15.25..=15.30).contains(&peak), "{peak}");

    let mut target = ModelTarget::new(ModelMode::Vmm);
    let report = replay(&trace, &mut target, &ReplayOptions::default()).unwrap();
    println!("{}", report.to_json());
    assert_eq!(report.events, 22_081);
    assert_eq!(report.allocs, 7_608);
    assert_eq!(report.frees, 7_160);
    assert_eq!(report.free_action, Action::FreeCompleted);
    assert_eq!(report.skipped_frees, 0);
    assert_eq!(report.duplicate_allocs, 0);
    assert_eq!(report.live_at_end, 7_608 - 7_160);
    assert_eq!(target.live_blocks() as u64, report.live_at_end);
    // README: PyTorch 1.123 (15.29 / 13.61); the best-fit page model 1.005.
    assert!(
        (1.11..1.14).contains(&report.torch_ratio),
        "{}",
        report.torch_ratio
    );
    assert!((1.0..1.01).contains(&report.ratio), "{}", report.ratio);
    assert!(report.peak_allocated >= report.peak_requested);
    assert!(report.timeline.len() <= 2000 && report.timeline.len() > 100);
    let max_res = report.timeline.iter().map(|p| p.2).max().unwrap();
    let max_alloc = report.timeline.iter().map(|p| p.1).max().unwrap();
    assert_eq!(max_res, report.peak_reserved, "the timeline keeps the peak");
    assert_eq!(max_alloc, report.peak_allocated);
}

#[test]
fn llama_train_trace() {
    let trace = check_real("llama_train", 25_163, 8_594);
    let peak = trace.torch_peak_reserved() as f64 / 1e9;
    assert!((21.6..=21.7).contains(&peak), "{peak}"); // README: 21.66 GB
}

/// 1M events: about 1 s to read and 1 s to replay in a debug build.
#[test]
fn llama_generate_trace() {
    let trace = check_real("llama_generate", 1_057_305, 352_501);
    let peak = trace.torch_peak_reserved() as f64 / 1e9;
    assert!((7.28..=7.33).contains(&peak), "{peak}"); // README: 7.31 GB

    let t0 = Instant::now();
    let calls = std::cell::Cell::new(0u64);
    let last = std::cell::Cell::new((0u64, 0u64));
    let progress = |done: u64, total: u64| {
        calls.set(calls.get() + 1);
        last.set((done, total));
    };
    let opts = ReplayOptions {
        mode: "model-vmm".into(),
        progress: Some(&progress),
        ..ReplayOptions::default()
    };
    let report = replay(&trace, &mut ModelTarget::new(ModelMode::Vmm), &opts).unwrap();
    println!(
        "llama_generate replayed in {:?}: {}",
        t0.elapsed(),
        report.to_json()
    );
    assert!(calls.get() > 10);
    assert_eq!(last.get(), (352_501 + 352_351, 352_501 + 352_351));
    assert!(report.timeline.len() <= 2000);
    assert!((1.39..1.42).contains(&report.torch_ratio)); // README: 1.404
    assert!(report.ratio < 1.01);
}

// ---------------------------------------------------------------------------------------------
// CSV details and errors

#[test]
fn plain_csv_with_crlf_extra_columns_and_blank_lines() {
    let dir = temp_dir("plain");
    let text = "action,time_us,addr,size,stream\r\n\
                alloc,1,4096,100,7\r\n\
                \r\n\
                free_completed,2,4096,100,7\r\n\
                oom,3,,1048576,0\r\n";
    let path = write(&dir, "plain.csv", text.as_bytes());
    let trace = read_trace(&path).unwrap();
    assert_eq!(trace.events.len(), 3);
    assert_eq!(trace.events[0].action, Action::Alloc);
    assert_eq!(
        (
            trace.events[0].addr,
            trace.events[0].size,
            trace.events[0].stream
        ),
        (4096, 100, 7)
    );
    assert_eq!(trace.events[1].line, 4);
    assert_eq!(trace.events[2].action, Action::Oom);
    assert_eq!(trace.events[2].addr, 0);
    // The same bytes gzip-compressed, under a name that says nothing.
    let gz = write(&dir, "no_extension", &gzip(text.as_bytes()));
    assert_eq!(read_trace(&gz).unwrap().events, trace.events);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn csv_errors_name_file_and_line() {
    let dir = temp_dir("csv-errors");
    let header = "action,addr,size,stream\n";

    let p = write(
        &dir,
        "number.csv",
        format!("{header}alloc,1,2,0\nalloc,12x,2,0\n").as_bytes(),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::BadNumber {
                at: Location::Line(3),
                field: "addr",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("line 3") && msg.contains("12x"), "{msg}");

    let p = write(
        &dir,
        "negative.csv",
        format!("{header}alloc,1,-2,0\n").as_bytes(),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::BadNumber {
                at: Location::Line(2),
                field: "size",
                ..
            }
        ),
        "{msg}"
    );

    let p = write(
        &dir,
        "overflow.csv",
        format!("{header}alloc,1,2,99999999999999999999999\n").as_bytes(),
    );
    let (e, _) = err_of(&p);
    assert!(matches!(
        e,
        TraceError::BadNumber {
            field: "stream",
            ..
        }
    ));

    let p = write(
        &dir,
        "action.csv",
        format!("{header}alloc,1,2,0\nalloc,1,2,0\nmalloc,1,2,0\n").as_bytes(),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::UnknownAction {
                at: Location::Line(4),
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("line 4") && msg.contains("malloc"), "{msg}");

    let p = write(
        &dir,
        "columns.csv",
        format!("{header}alloc,1,2\n").as_bytes(),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::ColumnCount {
                at: Location::Line(2),
                expected: 4,
                found: 3,
                ..
            }
        ),
        "{msg}"
    );
    let p = write(
        &dir,
        "columns5.csv",
        format!("{header}alloc,1,2,0,9\n").as_bytes(),
    );
    let (e, _) = err_of(&p);
    assert!(matches!(e, TraceError::ColumnCount { found: 5, .. }));

    let p = write(&dir, "header.csv", b"action,addr,stream\nalloc,1,0\n");
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::BadHeader {
                missing: "size",
                ..
            }
        ),
        "{msg}"
    );
    assert!(msg.contains("line 1"), "{msg}");

    // A bad line deep inside a gzip file still names its line.
    let mut text = String::from(header);
    for i in 0..10_000 {
        text.push_str(&format!("alloc,{i},512,0\n"));
    }
    text.push_str("alloc,1,2,zero\n");
    let p = write(&dir, "deep.csv.gz", &gzip(text.as_bytes()));
    let (_, msg) = err_of(&p);
    assert!(msg.contains("line 10002"), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn truncated_gzip_is_an_error() {
    let dir = temp_dir("truncated");
    let real = std::fs::read(traces_dir().join("gpt2_train.trace.csv.gz")).unwrap();
    for cut in [
        5,
        11,
        100,
        real.len() / 2,
        real.len() - 9,
        real.len() - 4,
        real.len() - 1,
    ] {
        let p = write(&dir, &format!("cut{cut}.trace.csv.gz"), &real[..cut]);
        let (e, msg) = err_of(&p);
        assert!(matches!(e, TraceError::Gzip { .. }), "cut at {cut}: {msg}");
        assert!(msg.contains("gzip"), "{msg}");
        if cut == real.len() / 2 {
            assert!(msg.contains("line "), "{msg}");
        }
    }
    // A corrupted byte in the middle: an error too (bad deflate data or CRC).
    let mut bad = real.clone();
    let mid = bad.len() / 2;
    bad[mid] ^= 0xff;
    let p = write(&dir, "flipped.trace.csv.gz", &bad);
    assert!(read_trace(&p).is_err());
    // A truncated gzipped pickle.
    let pickle_gz = std::fs::read(fixtures_dir().join("snapshot_p5.pickle.gz")).unwrap();
    let p = write(&dir, "cut.pickle.gz", &pickle_gz[..pickle_gz.len() - 6]);
    let (e, msg) = err_of(&p);
    assert!(matches!(e, TraceError::Gzip { .. }), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unknown_formats() {
    let dir = temp_dir("unknown");
    for (name, bytes) in [
        ("empty.csv", &b""[..]),
        ("garbage.bin", &b"\x00\x01\x02\x03 not a trace"[..]),
        ("text.csv", &b"addr,size\n1,2\n"[..]),
        ("json.trace", &b"{\"device_traces\": []}"[..]),
    ] {
        let p = write(&dir, name, bytes);
        let (e, msg) = err_of(&p);
        assert!(
            matches!(e, TraceError::UnknownFormat { .. }),
            "{name}: {msg}"
        );
    }
    // Gzip of something that is neither CSV nor pickle.
    let p = write(&dir, "garbage.gz", &gzip(b"hello world"));
    let (e, _) = err_of(&p);
    assert!(matches!(e, TraceError::UnknownFormat { .. }));
    // A missing file.
    let (e, _) = err_of(&dir.join("missing.csv"));
    assert!(matches!(e, TraceError::Io { .. }));
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Snapshot pickles

#[test]
fn python_written_snapshot_pickles() {
    // Written by tests/fixtures/make_snapshot.py with protocols 4 and 5 (gzipped).
    let p4 = read_trace(fixtures_dir().join("snapshot_p4.pickle")).unwrap();
    let p5 = read_trace(fixtures_dir().join("snapshot_p5.pickle.gz")).unwrap();
    assert_eq!(p4.events, p5.events);
    assert_eq!(p4.format, TraceFormat::Pickle);
    assert_eq!(p4.device, 0);
    assert_eq!(p4.name(), "snapshot_p4");
    let actions: Vec<Action> = p4.events.iter().map(|e| e.action).collect();
    use Action::*;
    assert_eq!(
        actions,
        [
            SegmentAlloc,
            Alloc,
            Alloc,
            FreeRequested,
            FreeCompleted,
            SegmentMap,
            Alloc,
            Snapshot,
            SegmentUnmap,
            FreeRequested,
            FreeCompleted,
            Oom
        ]
    );
    let base = 0x7F3A_0000_0000u64;
    assert_eq!(p4.events[1].addr, base);
    assert_eq!(p4.events[1].size, 3 * (1 << 20) + 5);
    assert_eq!(p4.events[2].stream, 94_827_364_528);
    assert_eq!(p4.events[11].addr, 0); // oom: no addr
    assert_eq!(p4.events[11].line, 11);
    assert_eq!(p4.location(11).to_string(), "entry 11 of device_traces[0]");
    assert_eq!(p4.torch_peak_reserved(), 22 << 20);

    let report = replay(
        &p4,
        &mut ModelTarget::new(ModelMode::Vmm),
        &ReplayOptions::default(),
    )
    .unwrap();
    assert_eq!(report.allocs, 3);
    assert_eq!(report.frees, 1);
    assert_eq!(report.skipped_frees, 1); // 0x1234 was never allocated
    assert_eq!(report.live_at_end, 2);

    let d1 = read_trace_with(
        fixtures_dir().join("snapshot_p4.pickle"),
        ReadOptions { device: Some(1) },
    )
    .unwrap();
    assert_eq!(d1.device, 1);
    assert_eq!(d1.events.len(), 2);
    let err = read_trace_with(
        fixtures_dir().join("snapshot_p4.pickle"),
        ReadOptions { device: Some(2) },
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("device 2") && err.contains("snapshot_p4.pickle"),
        "{err}"
    );
}

fn s(v: &str) -> Value {
    Value::String(v.into())
}

fn entry(action: &str, addr: Option<i64>, size: Value) -> Value {
    let mut d = BTreeMap::new();
    d.insert(HashableValue::String("action".into()), s(action));
    if let Some(a) = addr {
        d.insert(HashableValue::String("addr".into()), Value::I64(a));
    }
    d.insert(HashableValue::String("size".into()), size);
    d.insert(HashableValue::String("stream".into()), Value::I64(0));
    d.insert(
        HashableValue::String("time_us".into()),
        Value::I64(1_700_000_000_000_000),
    );
    d.insert(
        HashableValue::String("frames".into()),
        Value::List(vec![Value::Dict(BTreeMap::from([
            (HashableValue::String("filename".into()), s("x.py")),
            (HashableValue::String("line".into()), Value::I64(3)),
            (HashableValue::String("name".into()), s("f")),
        ]))]),
    );
    Value::Dict(d)
}

fn snapshot(entries: Vec<Value>) -> Vec<u8> {
    let top = Value::Dict(BTreeMap::from([
        (
            HashableValue::String("segments".into()),
            Value::List(vec![]),
        ),
        (
            HashableValue::String("device_traces".into()),
            Value::List(vec![Value::List(entries)]),
        ),
    ]));
    serde_pickle::value_to_vec(&top, SerOptions::new()).unwrap()
}

#[test]
fn hand_built_pickle_without_free_completed_uses_free_requested() {
    let dir = temp_dir("pickle-skip");
    let bytes = snapshot(vec![
        entry("segment_alloc", Some(1 << 30), Value::I64(2 << 20)),
        entry("alloc", Some(1 << 30), Value::I64(1000)),
        entry("alloc", Some((1 << 30) + 1024), Value::I64(1000)),
        entry("free_requested", Some(1 << 30), Value::I64(1000)),
        entry("oom", None, Value::I64(1 << 40)),
        entry("segment_free", Some(1 << 30), Value::I64(2 << 20)),
    ]);
    assert_eq!(bytes[0], 0x80);
    let p = write(&dir, "snap.pickle", &bytes);
    let trace = read_trace(&p).unwrap();
    assert_eq!(trace.events.len(), 6);
    assert_eq!(trace.torch_peak_reserved(), 2 << 20);
    let report = replay(
        &trace,
        &mut ModelTarget::new(ModelMode::Vmm),
        &ReplayOptions::default(),
    )
    .unwrap();
    assert_eq!(report.free_action, Action::FreeRequested);
    assert_eq!((report.allocs, report.frees, report.live_at_end), (2, 1, 1));
    assert_eq!(report.peak_allocated, 2048);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pickle_errors_name_file_and_entry() {
    let dir = temp_dir("pickle-errors");
    let ok = entry("alloc", Some(4096), Value::I64(10));

    let p = write(
        &dir,
        "action.pickle",
        &snapshot(vec![ok.clone(), entry("allocate", Some(1), Value::I64(1))]),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(
            e,
            TraceError::UnknownAction {
                at: Location::Entry {
                    device: 0,
                    index: 1
                },
                ..
            }
        ),
        "{msg}"
    );
    assert!(
        msg.contains("entry 1 of device_traces[0]") && msg.contains("allocate"),
        "{msg}"
    );

    let p = write(
        &dir,
        "size.pickle",
        &snapshot(vec![
            ok.clone(),
            ok.clone(),
            entry("alloc", Some(1), s("12")),
        ]),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(e, TraceError::BadNumber { field: "size", .. }),
        "{msg}"
    );
    assert!(msg.contains("entry 2"), "{msg}");

    let p = write(
        &dir,
        "neg.pickle",
        &snapshot(vec![entry("alloc", Some(-5), Value::I64(1))]),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(e, TraceError::BadNumber { field: "addr", .. }),
        "{msg}"
    );

    let p = write(
        &dir,
        "noaddr.pickle",
        &snapshot(vec![entry("alloc", None, Value::I64(1))]),
    );
    let (e, msg) = err_of(&p);
    assert!(
        matches!(e, TraceError::BadEntry { .. }) && msg.contains("addr"),
        "{msg}"
    );

    let p = write(&dir, "notdict.pickle", &snapshot(vec![Value::I64(3)]));
    let (e, msg) = err_of(&p);
    assert!(
        matches!(e, TraceError::BadEntry { .. }) && msg.contains("entry 0"),
        "{msg}"
    );

    // A list of segments (memory_snapshot()) rather than the _snapshot() dict.
    let p = write(
        &dir,
        "list.pickle",
        &serde_pickle::value_to_vec(&Value::List(vec![]), SerOptions::new()).unwrap(),
    );
    let (e, msg) = err_of(&p);
    assert!(matches!(e, TraceError::BadSnapshot { .. }), "{msg}");

    let no_traces = Value::Dict(BTreeMap::from([(
        HashableValue::String("segments".into()),
        Value::List(vec![]),
    )]));
    let p = write(
        &dir,
        "notraces.pickle",
        &serde_pickle::value_to_vec(&no_traces, SerOptions::new()).unwrap(),
    );
    let (_, msg) = err_of(&p);
    assert!(msg.contains("device_traces"), "{msg}");

    // A truncated pickle.
    let full = snapshot(vec![ok.clone(), ok]);
    let p = write(&dir, "short.pickle", &full[..full.len() / 2]);
    let (e, msg) = err_of(&p);
    assert!(matches!(e, TraceError::BadSnapshot { .. }), "{msg}");
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// Replay semantics

fn csv_trace(lines: &[&str]) -> Trace {
    let mut text = String::from("action,addr,size,stream\n");
    for l in lines {
        text.push_str(l);
        text.push('\n');
    }
    slotpool_cli::parse_trace(text.as_bytes(), "inline.csv", ReadOptions::default()).unwrap()
}

#[test]
fn unknown_and_double_frees_are_counted_and_skipped() {
    let trace = csv_trace(&[
        "free_completed,999,8,0", // never allocated
        "alloc,100,1000,0",
        "free_requested,100,1000,0",
        "free_completed,100,1000,0",
        "free_completed,100,1000,0", // double free
        "alloc,100,2000,0",
        "alloc,100,3000,0", // still live: counted, the old one freed first
        "free_completed,100,3000,0",
    ]);
    let mut target = ModelTarget::new(ModelMode::Vmm);
    let report = replay(&trace, &mut target, &ReplayOptions::default()).unwrap();
    assert_eq!(report.free_action, Action::FreeCompleted);
    assert_eq!(report.skipped_frees, 2);
    assert_eq!(report.duplicate_allocs, 1);
    assert_eq!((report.allocs, report.frees, report.live_at_end), (3, 2, 0));
    assert_eq!(target.live_blocks(), 0);
    assert_eq!(report.peak_requested, 3000);
    assert_eq!(report.peak_allocated, 3072);
    assert_eq!(report.events, 8);
    assert_eq!(report.timeline.len(), 5);
}

#[test]
fn target_oom_names_the_line() {
    let trace = csv_trace(&[
        "alloc,1,1048576,0",
        "alloc,2,1048576,0",
        "alloc,3,4194304,0",
    ]);
    let mut target = ModelTarget::new(ModelMode::Vmm).with_limit(4 << 20);
    let err = replay(&trace, &mut target, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ReplayError::Alloc {
                at: Location::Line(4),
                size: 4194304,
                ..
            }
        ),
        "{err}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("inline.csv") && msg.contains("line 4") && msg.contains("out of memory"),
        "{msg}"
    );
}

/// A target whose free fails, to check the error path.
#[derive(Debug, Default)]
struct FailingFree(u64);

impl ReplayTarget for FailingFree {
    fn alloc(&mut self, size: u64, _stream: u64) -> Result<u64, String> {
        self.0 += size;
        Ok(self.0)
    }
    fn free(&mut self, _ptr: u64) -> Result<(), String> {
        Err("nope".into())
    }
    fn sample(&self) -> (u64, u64) {
        (self.0, self.0)
    }
}

#[test]
fn target_free_error_names_the_line_and_boxed_targets_work() {
    let trace = csv_trace(&["alloc,7,10,0", "free_completed,7,10,0"]);
    let mut target: Box<dyn ReplayTarget> = Box::new(FailingFree::default());
    let err = replay(&trace, &mut target, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ReplayError::Free {
                at: Location::Line(3),
                addr: 7,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn empty_trace_replays_to_zeros() {
    let trace = csv_trace(&[]);
    let report = replay(
        &trace,
        &mut ModelTarget::new(ModelMode::Classic),
        &ReplayOptions::default(),
    )
    .unwrap();
    assert_eq!(
        (report.events, report.allocs, report.peak_reserved),
        (0, 0, 0)
    );
    assert_eq!(report.ratio, 0.0);
    assert!(report.timeline.is_empty());
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["ratio"], 0.0);
    // An empty report still plots.
    let svg = render_svg(&report);
    assert!(svg.contains("</svg>"));
}

#[test]
fn json_has_the_keys_and_timeline_only_when_asked() {
    let trace = csv_trace(&[
        "segment_alloc,0,2097152,0",
        "alloc,1,1000,0",
        "free_completed,1,1000,0",
    ]);
    let opts = ReplayOptions {
        mode: "vmm".into(),
        ..ReplayOptions::default()
    };
    let report = replay(&trace, &mut ModelTarget::new(ModelMode::Vmm), &opts).unwrap();
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    for key in [
        "trace",
        "mode",
        "events",
        "skipped_frees",
        "peak_allocated",
        "peak_reserved",
        "ratio",
        "torch_peak_reserved",
        "ns_per_alloc",
        "ns_per_free",
    ] {
        assert!(json.get(key).is_some(), "missing {key}: {json}");
    }
    assert!(json.get("timeline").is_none());
    assert_eq!(json["trace"], "inline");
    assert_eq!(json["mode"], "vmm");
    assert_eq!(json["torch_peak_reserved"], 2097152);
    assert_eq!(json["free_action"], "free_completed");
    let with: serde_json::Value = serde_json::from_str(&report.to_json_with_timeline()).unwrap();
    assert_eq!(with["timeline"].as_array().unwrap().len(), 2);
}

// ---------------------------------------------------------------------------------------------
// Plot

#[test]
fn svg_has_both_series() {
    let dir = temp_dir("svg");
    let trace = read_trace(traces_dir().join("gpt2_train.trace.csv.gz")).unwrap();
    let opts = ReplayOptions {
        mode: "vmm".into(),
        ..ReplayOptions::default()
    };
    let report = replay(&trace, &mut ModelTarget::new(ModelMode::Vmm), &opts).unwrap();
    let path = dir.join("gpt2.svg");
    write_svg(&report, &path).unwrap();
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(
        svg.starts_with("<?xml") && svg.contains("<svg ") && svg.trim_end().ends_with("</svg>")
    );
    assert!(svg.contains(r#"id="allocated""#) && svg.contains(r#"id="reserved""#));
    assert!(svg.contains("gpt2_train (vmm)"));
    assert!(svg.contains(&format!("{:.3}", report.ratio)));
    // Each series has one point per timeline entry.
    for id in ["allocated", "reserved"] {
        let start = svg.find(&format!(r#"id="{id}""#)).unwrap();
        let points = &svg[start..];
        let points = &points[points.find("points=\"").unwrap() + 8..];
        let points = &points[..points.find('"').unwrap()];
        assert_eq!(points.split_whitespace().count(), report.timeline.len());
    }
    assert_eq!(svg.matches('<').count(), svg.matches('>').count());
    assert!(!dir.join("gpt2.svg.tmp").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
