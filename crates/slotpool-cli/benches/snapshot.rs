//! Time to read each real PyTorch snapshot of benches/traces/snapshots into a trace (gzip
//! decompression, unpickling with the stack frames pruned, and the conversion to events).
//!
//! Run: `cargo bench -p slotpool-cli --bench snapshot -- --noplot`. Peak memory and Python's
//! `pickle.load` of the same file, side by side: `crates/slotpool-cli/scripts/measure_snapshot.sh`.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use slotpool_cli::read_trace;

fn bench_read(c: &mut Criterion) {
    let mut g = c.benchmark_group("read_snapshot");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1));
    for name in ["plain", "big"] {
        let path: PathBuf = [
            env!("CARGO_MANIFEST_DIR"),
            "../../benches/traces/snapshots",
            &format!("{name}.pickle.gz"),
        ]
        .iter()
        .collect();
        let events = read_trace(&path)
            .unwrap_or_else(|e| panic!("{e}"))
            .events
            .len();
        // Entries per read: the thrpt line is then entries/s.
        g.throughput(Throughput::Elements(events as u64));
        g.bench_function(name, |b| {
            b.iter(|| read_trace(&path).unwrap_or_else(|e| panic!("{e}")))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_read);
criterion_main!(benches);
