//! Time of one whole replay of each trace in `benches/traces/` on slotpool (vmm growth) over the
//! simulated device, as `slotpool replay` runs it (a fresh allocator per replay, its construction
//! outside the timing; the replay driver's own per-call timing and sampling are included).
//!
//! Run: `cargo bench --bench replay -- --noplot`.

use std::path::PathBuf;
use std::time::Duration;

use criterion::{BatchSize, Criterion, SamplingMode, Throughput, criterion_group, criterion_main};
use slotpool::core::GrowthMode;
use slotpool_cli::{Action, ReplayOptions, SlotpoolTarget, Trace, read_trace, replay};

/// Memory of the simulated device: one H200 (141 GB), as `slotpool replay` uses.
const H200_MEMORY: u64 = 143_771_000_832;

const TRACES: [&str; 3] = ["gpt2_train", "llama_train", "llama_generate"];

fn load(name: &str) -> Trace {
    let path: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "benches",
        "traces",
        &format!("{name}.trace.csv.gz"),
    ]
    .iter()
    .collect();
    read_trace(&path).unwrap_or_else(|e| panic!("{e}"))
}

fn bench_replay(c: &mut Criterion) {
    let mut g = c.benchmark_group("replay");
    g.sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1));
    for name in TRACES {
        let trace = load(name);
        let ops = trace.count(Action::Alloc) + trace.count(Action::FreeCompleted);
        // Operations (allocs + frees) per replay: the thrpt line is then ops/s.
        g.throughput(Throughput::Elements(ops as u64));
        // About 10 replays: ~0.2 s each for llama_generate, a few ms for the training traces.
        g.measurement_time(Duration::from_secs(if name == "llama_generate" {
            4
        } else {
            1
        }));
        let opts = ReplayOptions {
            mode: "vmm".into(),
            ..ReplayOptions::default()
        };
        g.bench_function(name, |b| {
            b.iter_batched(
                || SlotpoolTarget::new(GrowthMode::Vmm, H200_MEMORY).expect("target"),
                |mut target| {
                    let report = replay(&trace, &mut target, &opts).expect("replay");
                    (report, target)
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, bench_replay);
criterion_main!(benches);
