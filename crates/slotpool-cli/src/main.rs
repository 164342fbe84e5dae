//! `slotpool`: replay allocation traces, report fragmentation and latency, draw plots.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use slotpool_cli::plot::write_svg;
use slotpool_cli::variants::{VariantMode, replay_variants_with};
use slotpool_cli::{
    ReadOptions, ReplayOptions, ReplayReport, ReplayTarget, SlotpoolTarget, read_trace_with, replay,
};
use slotpool_core::{Config, GrowthMode};

#[derive(Debug, Parser)]
#[command(
    name = "slotpool",
    version,
    about = "slotpool: a CUDA caching memory allocator"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay an allocation trace (CSV, .csv.gz, or a PyTorch `_dump_snapshot` pickle) and report
    /// peak allocated/reserved memory and host time per call.
    Replay(ReplayArgs),
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// The trace file.
    trace: PathBuf,
    /// How the allocator grows: `vmm` (physical pages follow live bytes) or `classic` (one
    /// cudaMalloc per segment, PyTorch's sizes).
    #[arg(long, value_enum, default_value_t = Mode::Vmm)]
    mode: Mode,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Include the downsampled timeline in the JSON output.
    #[arg(long, requires = "json")]
    timeline: bool,
    /// Draw allocated and reserved memory over the replay into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Device of a snapshot pickle to replay (default: the first with events).
    #[arg(long)]
    device: Option<usize>,
    /// Replay a CUDA-graph variant trace (with variant and capture markers) with its captures
    /// pooled this way, and print the growth of physical memory as JSON.
    #[arg(long, value_enum, conflicts_with_all = ["plot", "timeline"])]
    variants: Option<Variants>,
    /// slotpool's configuration, as in `SLOTPOOL_CONF` (e.g. `vmm_slack_percent:8`); `--mode`
    /// sets the growth mode.
    #[arg(long, value_name = "KEY:VALUE,...")]
    conf: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Variants {
    Separate,
    Shared,
    Group,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Mode {
    Vmm,
    Classic,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Vmm => "vmm",
            Mode::Classic => "classic",
        }
    }
}

/// Memory of the simulated device: one H200 (141 GB), where the traces were recorded.
const H200_MEMORY: u64 = 143_771_000_832;

/// The allocator that a replay drives: slotpool on the simulated device.
fn make_target(mode: Mode, conf: Option<&str>) -> Result<Box<dyn ReplayTarget>, String> {
    let mut config = match conf {
        Some(c) => Config::parse(c).map_err(|e| format!("--conf: {e}"))?,
        None => Config::default(),
    };
    config.growth = match mode {
        Mode::Vmm => GrowthMode::Vmm,
        Mode::Classic => GrowthMode::Classic,
    };
    Ok(Box::new(SlotpoolTarget::with_config(config, H200_MEMORY)?))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => run_replay(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}

/// Traces with fewer operations than this replay without a progress bar.
const PROGRESS_MIN_OPS: u64 = 100_000;

fn run_replay(args: &ReplayArgs) -> Result<(), String> {
    let trace = read_trace_with(
        &args.trace,
        ReadOptions {
            device: args.device,
        },
    )
    .map_err(|e| e.to_string())?;
    if let Some(v) = args.variants {
        let mode = match v {
            Variants::Separate => VariantMode::Separate,
            Variants::Shared => VariantMode::Shared,
            Variants::Group => VariantMode::Group,
        };
        let mut config = match args.conf.as_deref() {
            Some(c) => Config::parse(c).map_err(|e| format!("--conf: {e}"))?,
            None => Config::default(),
        };
        config.growth = GrowthMode::Vmm;
        let report = replay_variants_with(&trace, mode, config)?;
        println!(
            "{}",
            serde_json::to_string(&report).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    let mut target = make_target(args.mode, args.conf.as_deref())?;

    let show_progress = !args.json && std::io::stderr().is_terminal();
    let bar = ProgressBar::hidden();
    if show_progress {
        bar.set_style(
            ProgressStyle::with_template("{spinner} replaying [{bar:40}] {pos}/{len} ops ({eta})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
    }
    let progress = |done: u64, total: u64| {
        if show_progress && total >= PROGRESS_MIN_OPS {
            if bar.is_hidden() {
                bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            }
            bar.set_length(total);
            bar.set_position(done);
        }
    };
    let opts = ReplayOptions {
        mode: args.mode.name().to_string(),
        progress: Some(&progress),
        ..ReplayOptions::default()
    };
    let report = replay(&trace, &mut target, &opts);
    bar.finish_and_clear();
    let report = report.map_err(|e| e.to_string())?;

    if let Some(path) = &args.plot {
        write_svg(&report, path)
            .map_err(|e| format!("{}: cannot write plot: {e}", path.display()))?;
    }
    if args.json {
        if args.timeline {
            println!("{}", report.to_json_with_timeline());
        } else {
            println!("{}", report.to_json());
        }
    } else {
        print_table(&report);
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
    }
    if report.skipped_frees > 0 {
        eprintln!(
            "warning: {} free(s) of addresses that were not live were skipped",
            report.skipped_frees
        );
    }
    if report.duplicate_allocs > 0 {
        eprintln!(
            "warning: {} alloc(s) of addresses still live; the old blocks were freed first",
            report.duplicate_allocs
        );
    }
    Ok(())
}

fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn print_table(r: &ReplayReport) {
    let ratio = |x: f64| {
        if x > 0.0 {
            format!("{x:.3}")
        } else {
            "-".to_string()
        }
    };
    let mut rows = vec![
        ("trace", r.trace.clone()),
        ("mode", r.mode.clone()),
        (
            "events",
            format!(
                "{} ({} allocs, {} frees as {})",
                count(r.events),
                count(r.allocs),
                count(r.frees),
                r.free_action
            ),
        ),
        ("peak allocated", gb(r.peak_allocated)),
        ("peak reserved", gb(r.peak_reserved)),
        ("ratio", ratio(r.ratio)),
        ("torch peak reserved", gb(r.torch_peak_reserved)),
        ("torch ratio", ratio(r.torch_ratio)),
        (
            "ns/alloc",
            format!("{} (p99 {})", r.ns_per_alloc, r.ns_per_alloc_p99),
        ),
        (
            "ns/free",
            format!("{} (p99 {})", r.ns_per_free, r.ns_per_free_p99),
        ),
    ];
    rows.extend(slotpool_cli::driver_time::table_rows(r));
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in rows {
        println!("{k:<width$}  {v}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_have_separators() {
        assert_eq!(count(0), "0");
        assert_eq!(count(999), "999");
        assert_eq!(count(1000), "1,000");
        assert_eq!(count(1_057_305), "1,057,305");
    }

    #[test]
    fn cli_parses() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
