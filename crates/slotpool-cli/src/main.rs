//! `slotpool`: replay allocation traces, report fragmentation and latency, draw plots.

use std::fs::File;
use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;
use slotpool_cli::help::replay_after_help;
use slotpool_cli::plot::write_svg;
use slotpool_cli::settings::{ENV_LOG, Layers, growth_name, replay_defaults, resolve};
use slotpool_cli::variants::{VariantMode, replay_variants_with};
use slotpool_cli::{
    Action, ReadOptions, ReplayOptions, ReplayReport, ReplayTarget, SlotpoolTarget, Trace,
    parse_trace, replay,
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
    #[command(after_long_help = replay_after_help())]
    Replay(ReplayArgs),
}

#[derive(Debug, Args)]
struct ReplayArgs {
    /// The trace file, or `-` for standard input.
    trace: PathBuf,
    /// How the allocator grows: `vmm` (physical pages follow live bytes) or `classic` (one
    /// cudaMalloc per segment, PyTorch's sizes). Default: the configuration's `growth` (vmm).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Print one JSON object instead of the table, with the configuration in effect (`config`)
    /// and any `warnings`.
    #[arg(long)]
    json: bool,
    /// Include the downsampled timeline in the JSON output.
    #[arg(long, requires = "json")]
    timeline: bool,
    /// Draw slotpool's allocated and reserved memory, PyTorch's reserved memory and the trace's
    /// capture and variant phases over the replay into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Device of a snapshot pickle to replay (default: the first with events; a CSV trace has
    /// device 0 only).
    #[arg(long)]
    device: Option<usize>,
    /// Replay a CUDA-graph variant trace (with variant and capture markers) with its captures
    /// pooled this way, and print the growth of physical memory as JSON (vmm growth only).
    #[arg(long, value_enum, conflicts_with_all = ["plot", "timeline"])]
    variants: Option<Variants>,
    /// slotpool's configuration, as in `SLOTPOOL_CONF` (e.g. `vmm_slack_percent:8`), applied
    /// over `SLOTPOOL_CONF`, which is applied over the defaults.
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
    fn growth(self) -> GrowthMode {
        match self {
            Mode::Vmm => GrowthMode::Vmm,
            Mode::Classic => GrowthMode::Classic,
        }
    }
}

/// Memory of the simulated device: one H200 (141 GB), where the traces were recorded.
const H200_MEMORY: u64 = 143_771_000_832;

/// The allocator that a replay drives: slotpool on the simulated device.
fn make_target(config: Config) -> Result<Box<dyn ReplayTarget>, String> {
    Ok(Box::new(SlotpoolTarget::with_config(config, H200_MEMORY)?))
}

fn main() -> ExitCode {
    install_logging();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.kind() == clap::error::ErrorKind::InvalidSubcommand => {
            let commands: Vec<String> = Cli::command()
                .get_subcommands()
                .map(|c| c.get_name().to_string())
                .collect();
            let given = std::env::args().nth(1).unwrap_or_default();
            eprintln!(
                "error: unknown command `{given}`; the commands are: {} (see `slotpool --help`)",
                commands.join(", ")
            );
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
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

/// Logs to stderr when `SLOTPOOL_LOG` is set, as the library does (colours only on a terminal).
fn install_logging() {
    let Ok(filter) = std::env::var(ENV_LOG) else {
        return;
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&filter).unwrap_or_else(|e| {
        eprintln!("warning: {ENV_LOG}={filter:?}: {e}; logging what it can");
        tracing_subscriber::EnvFilter::new(&filter)
    });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}

/// Traces with fewer operations than this replay without a progress bar.
const PROGRESS_MIN_OPS: u64 = 100_000;
/// Trace files smaller than this are read without a progress bar.
const PROGRESS_MIN_BYTES: u64 = 256 << 10;

fn run_replay(args: &ReplayArgs) -> Result<(), String> {
    let env_conf = slotpool_core::layers::env_conf();
    let config = resolve(
        replay_defaults(),
        &Layers {
            env: env_conf.as_deref(),
            conf: args.conf.as_deref(),
            mode: args.mode.map(Mode::growth),
            variants: args.variants.is_some(),
        },
    )?;
    tracing::info!(config = %config, "configuration");
    let show_progress = !args.json && std::io::stderr().is_terminal();
    let trace = read_input(args, show_progress)?;
    let mut warnings = Vec::new();
    if args.variants.is_none()
        && let Some(w) = marker_warning(&trace)
    {
        warnings.push(w);
    }

    if let Some(v) = args.variants {
        let mode = match v {
            Variants::Separate => VariantMode::Separate,
            Variants::Shared => VariantMode::Shared,
            Variants::Group => VariantMode::Group,
        };
        let report = replay_variants_with(&trace, mode, config.clone())?;
        let json = serde_json::to_value(&report).map_err(|e| e.to_string())?;
        println!("{}", with_config(json, &config, &warnings));
        print_warnings(&warnings);
        return Ok(());
    }
    let mut target = make_target(config.clone())?;
    let report = replay_with_progress(&trace, &mut target, &config, show_progress)?;
    warnings.extend(replay_warnings(&report));

    if let Some(path) = &args.plot {
        write_svg(&report, path)
            .map_err(|e| format!("{}: cannot write plot: {e}", path.display()))?;
    }
    if args.json {
        let text = if args.timeline {
            report.to_json_with_timeline()
        } else {
            report.to_json()
        };
        let json: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        println!("{}", with_config(json, &config, &warnings));
    } else {
        print_table(&report);
        if let Some(path) = &args.plot {
            println!("plot written to {}", path.display());
        }
    }
    print_warnings(&warnings);
    Ok(())
}

/// Reads the trace from the file or, for `-`, standard input; with a progress bar over the
/// bytes read when asked and the file is large enough.
fn read_input(args: &ReplayArgs, show_progress: bool) -> Result<Trace, String> {
    let opts = ReadOptions {
        device: args.device,
    };
    if args.trace.as_os_str() == "-" {
        let bar = if show_progress {
            let bar = ProgressBar::new_spinner();
            bar.set_style(
                ProgressStyle::with_template("{spinner} reading standard input: {bytes}")
                    .unwrap_or_else(|_| ProgressStyle::default_spinner()),
            );
            bar
        } else {
            ProgressBar::hidden()
        };
        let trace = parse_trace(bar.wrap_read(std::io::stdin().lock()), "<stdin>", opts);
        bar.finish_and_clear();
        return trace.map_err(|e| e.to_string());
    }
    let name = args.trace.display().to_string();
    let file = File::open(&args.trace).map_err(|e| format!("{name}: cannot read: {e}"))?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let bar = if show_progress && len >= PROGRESS_MIN_BYTES {
        let bar = ProgressBar::new(len);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} reading [{bar:40}] {bytes}/{total_bytes} ({eta})",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let reader: Box<dyn Read> = Box::new(bar.wrap_read(file));
    let trace = parse_trace(reader, &name, opts);
    bar.finish_and_clear();
    trace.map_err(|e| e.to_string())
}

fn replay_with_progress(
    trace: &Trace,
    target: &mut Box<dyn ReplayTarget>,
    config: &Config,
    show_progress: bool,
) -> Result<ReplayReport, String> {
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
        mode: growth_name(config.growth).to_string(),
        progress: Some(&progress),
        ..ReplayOptions::default()
    };
    let report = replay(trace, target, &opts);
    bar.finish_and_clear();
    report.map_err(|e| e.to_string())
}

/// The warning for a trace with variant or capture markers replayed without `--variants`.
fn marker_warning(trace: &Trace) -> Option<String> {
    let variants = trace.count(Action::VariantBegin);
    let captures = trace.count(Action::CaptureBegin);
    (variants + captures > 0).then(|| {
        format!(
            "{} has {variants} variant and {captures} capture markers, which a plain replay \
             ignores (every variant's captures stay in the default pool, as if all ran at \
             once); replay it with --variants separate|shared|group",
            trace.source
        )
    })
}

/// Warnings about what the replay skipped or repaired.
fn replay_warnings(report: &ReplayReport) -> Vec<String> {
    let mut w = Vec::new();
    if report.skipped_frees > 0 {
        w.push(format!(
            "{} free(s) of addresses that were not live were skipped",
            report.skipped_frees
        ));
    }
    if report.duplicate_allocs > 0 {
        w.push(format!(
            "{} alloc(s) of addresses still live; the old blocks were freed first",
            report.duplicate_allocs
        ));
    }
    w
}

fn print_warnings(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

/// `json` with `config` (every setting of the configuration in effect, null where unset) and
/// `warnings` added.
fn with_config(mut json: Value, config: &Config, warnings: &[String]) -> Value {
    if let Some(obj) = json.as_object_mut() {
        let settings: serde_json::Map<String, Value> = config
            .settings()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.map_or(Value::Null, Value::String)))
            .collect();
        obj.insert("config".into(), Value::Object(settings));
        obj.insert(
            "warnings".into(),
            Value::Array(warnings.iter().cloned().map(Value::String).collect()),
        );
    }
    json
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
