//! Allocation traces: the events of a caching allocator, read from a file.
//!
//! Two formats are read, told apart by their content rather than their name:
//!
//! - **CSV** (`*.trace.csv`, optionally gzip-compressed): a header line naming at least the columns
//!   `action,addr,size,stream` (in any order; extra columns are allowed and ignored), then one line
//!   per event. An `oom` line may leave `addr` empty. This is the format of `benches/traces/`.
//! - **PyTorch snapshot pickles** written by `torch.cuda.memory._dump_snapshot()`: a pickled dict
//!   whose `device_traces` holds one list of trace entries per device (optionally gzip-compressed
//!   too). One device is read per trace (see [`ReadOptions::device`]); the reader is in
//!   [`crate::snapshot`].
//!
//! Detection: gzip magic `1f 8b` first (then the decompressed content is detected again), pickle
//! protocol opcode `0x80`, else a text line starting with `action`. Every failure is a
//! [`TraceError`] naming the file and the place (1-based line, or the pickle entry); nothing panics.

use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::str::FromStr;

use thiserror::Error;

/// What happened in one trace event (PyTorch's trace entry `action`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// A block was handed out; `size` is the requested (unrounded) size.
    Alloc,
    /// The user freed a block; it may still wait for stream events.
    FreeRequested,
    /// The block went back to the pool.
    FreeCompleted,
    /// A segment was obtained from the driver (`cudaMalloc`).
    SegmentAlloc,
    /// A segment was returned to the driver (`cudaFree`).
    SegmentFree,
    /// An expandable segment grew: physical memory mapped.
    SegmentMap,
    /// An expandable segment shrank: physical memory unmapped.
    SegmentUnmap,
    /// An allocation failed; `size` is the rounded request, `addr` is 0.
    Oom,
    /// A snapshot was taken; `size` is the total active bytes.
    Snapshot,
    /// slotpool's marker (written by benches/gpu/record_graph_variants.py): variant `size`
    /// begins.
    VariantBegin,
    /// slotpool's marker: a CUDA-graph capture begins (allocations go to the capture pool).
    CaptureBegin,
    /// slotpool's marker: the capture ends.
    CaptureEnd,
}

impl Action {
    /// Every action, in declaration order.
    pub const ALL: [Action; 12] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::SegmentMap,
        Action::SegmentUnmap,
        Action::Oom,
        Action::Snapshot,
        Action::VariantBegin,
        Action::CaptureBegin,
        Action::CaptureEnd,
    ];

    /// The name used in traces (`alloc`, `free_requested`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::SegmentMap => "segment_map",
            Action::SegmentUnmap => "segment_unmap",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
            Action::VariantBegin => "variant_begin",
            Action::CaptureBegin => "capture_begin",
            Action::CaptureEnd => "capture_end",
        }
    }

    /// Every action's name, comma-separated, for messages.
    pub fn names() -> String {
        Action::ALL.map(Action::name).join(", ")
    }

    /// Parses a trace action name; `None` when unknown.
    pub fn from_name(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.name() == name)
    }

    fn from_bytes(name: &[u8]) -> Option<Action> {
        Action::ALL
            .into_iter()
            .find(|a| a.name().as_bytes() == name)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Action {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Action::from_name(s)
            .ok_or_else(|| format!("unknown action `{s}` (known: {})", Action::names()))
    }
}

/// One event of a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    pub action: Action,
    /// Block or segment address (0 for `oom`).
    pub addr: u64,
    pub size: u64,
    /// The CUDA stream (an opaque `cudaStream_t` value).
    pub stream: u64,
    /// Where the event came from: the 1-based line of a CSV file, or the 0-based index of the entry
    /// in `device_traces[device]` of a pickle. Turn it into words with [`Trace::location`].
    pub line: usize,
}

/// The format a trace was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// `action,addr,size,stream` text.
    Csv,
    /// A PyTorch memory snapshot pickle.
    Pickle,
}

/// A place in a trace file, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// 1-based line of a CSV file.
    Line(usize),
    /// 0-based index in `device_traces[device]` of a snapshot pickle.
    Entry { device: usize, index: usize },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Entry { device, index } => {
                write!(f, "entry {index} of device_traces[{device}]")
            }
        }
    }
}

/// An allocation trace read from a file.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Events, oldest first.
    pub events: Vec<TraceEvent>,
    /// The file the trace was read from (as given), or a caller-chosen label.
    pub source: String,
    pub format: TraceFormat,
    /// The device whose events these are (always 0 for CSV).
    pub device: usize,
}

impl Trace {
    /// The place an event came from, e.g. `line 12` or `entry 11 of device_traces[0]`.
    pub fn location(&self, line: usize) -> Location {
        match self.format {
            TraceFormat::Csv => Location::Line(line),
            TraceFormat::Pickle => Location::Entry {
                device: self.device,
                index: line,
            },
        }
    }

    /// A short name for reports: the file name without directories and without the
    /// `.trace.csv.gz` / `.pickle` style suffixes.
    pub fn name(&self) -> String {
        let base = Path::new(&self.source)
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| self.source.clone());
        let mut name = base.as_str();
        for suffix in [".gz", ".csv", ".pickle", ".pkl", ".trace"] {
            if let Some(stripped) = name.strip_suffix(suffix)
                && !stripped.is_empty()
            {
                name = stripped;
            }
        }
        name.to_string()
    }

    /// Number of events with this action.
    pub fn count(&self, action: Action) -> usize {
        self.events.iter().filter(|e| e.action == action).count()
    }

    /// Peak of what PyTorch itself reserved according to the trace: the running sum of
    /// `segment_alloc` and `segment_map` sizes minus `segment_free` and `segment_unmap` sizes, its
    /// maximum over the trace (0 when the trace has no segment events).
    pub fn torch_peak_reserved(&self) -> u64 {
        let mut cur: i128 = 0;
        let mut peak: i128 = 0;
        for e in &self.events {
            match e.action {
                Action::SegmentAlloc | Action::SegmentMap => cur += i128::from(e.size),
                Action::SegmentFree | Action::SegmentUnmap => cur -= i128::from(e.size),
                _ => continue,
            }
            peak = peak.max(cur);
        }
        u64::try_from(peak).unwrap_or(u64::MAX)
    }
}

/// Why a trace could not be read. Every variant names the file; those about one event name its
/// place ([`Location`]).
#[derive(Debug, Error)]
pub enum TraceError {
    #[error("{file}: cannot read: {source}")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
    #[error("{file}: {}truncated or corrupt gzip stream ({source})", at_prefix(.at))]
    Gzip {
        file: String,
        /// Where the decompressed text had got to (CSV only).
        at: Option<Location>,
        #[source]
        source: io::Error,
    },
    #[error(
        "{file}: unknown trace format (expected an `action,addr,size,stream` CSV, a PyTorch \
         snapshot pickle, or either gzip-compressed)"
    )]
    UnknownFormat { file: String },
    #[error("{file}: {at}: bad header `{header}`: missing column `{missing}`")]
    BadHeader {
        file: String,
        at: Location,
        header: String,
        missing: &'static str,
    },
    #[error("{file}: {at}: expected {expected} columns, found {found}")]
    ColumnCount {
        file: String,
        at: Location,
        expected: usize,
        found: usize,
    },
    #[error("{file}: {at}: unknown action `{action}` (known: {})", Action::names())]
    UnknownAction {
        file: String,
        at: Location,
        action: String,
    },
    #[error("{file}: {at}: malformed {field} `{value}` (expected an unsigned integer)")]
    BadNumber {
        file: String,
        at: Location,
        field: &'static str,
        value: String,
    },
    #[error("{file}: {at}: {message}")]
    BadEntry {
        file: String,
        at: Location,
        message: String,
    },
    #[error("{file}: device {device} requested, but the trace has {}", device_range(*.devices))]
    NoSuchDevice {
        file: String,
        device: usize,
        /// How many devices the trace has (a CSV trace: 1).
        devices: usize,
    },
    #[error("{file}: not a PyTorch memory snapshot: {message}")]
    BadSnapshot { file: String, message: String },
}

/// Options for reading a trace.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReadOptions {
    /// Which device of a snapshot pickle to read. `None`: the first device with any events (device
    /// 0 when none has). A CSV trace holds one device, 0; asking for another is an error.
    pub device: Option<usize>,
}

/// Reads a trace file (CSV, snapshot pickle, or either gzip-compressed) with default options.
pub fn read_trace(path: impl AsRef<Path>) -> Result<Trace, TraceError> {
    read_trace_with(path, ReadOptions::default())
}

/// Reads a trace file with the given options.
pub fn read_trace_with(path: impl AsRef<Path>, opts: ReadOptions) -> Result<Trace, TraceError> {
    let path = path.as_ref();
    let file_name = path.display().to_string();
    let file = File::open(path).map_err(|source| TraceError::Io {
        file: file_name.clone(),
        source,
    })?;
    parse_trace(file, &file_name, opts)
}

/// Parses a trace from any reader; `source` names it in errors and in [`Trace::source`].
pub fn parse_trace(
    reader: impl Read,
    source: &str,
    opts: ReadOptions,
) -> Result<Trace, TraceError> {
    let (head, rest) = peek(reader, source, false)?;
    if head.starts_with(&[0x1f, 0x8b]) {
        let decoder =
            flate2::read::MultiGzDecoder::new(BufReader::new(io::Cursor::new(head).chain(rest)));
        let (inner_head, inner_rest) = peek(decoder, source, true)?;
        parse_plain(inner_head, inner_rest, source, opts, true)
    } else {
        parse_plain(head, rest, source, opts, false)
    }
}

/// Reads up to 16 bytes to detect the format; returns them and the rest of the stream.
fn peek<R: Read>(mut reader: R, source: &str, gzip: bool) -> Result<(Vec<u8>, R), TraceError> {
    let mut head = Vec::with_capacity(16);
    if let Err(e) = reader.by_ref().take(16).read_to_end(&mut head) {
        return Err(io_error(source, gzip, None, e));
    }
    Ok((head, reader))
}

fn device_range(devices: usize) -> String {
    match devices {
        0 => "no devices".to_string(),
        1 => "one device, 0".to_string(),
        n => format!("{n} devices, 0 to {}", n - 1),
    }
}

fn at_prefix(at: &Option<Location>) -> String {
    at.map(|at| format!("{at}: ")).unwrap_or_default()
}

pub(crate) fn io_error(
    file: &str,
    gzip: bool,
    at: Option<Location>,
    source: io::Error,
) -> TraceError {
    if gzip {
        TraceError::Gzip {
            file: file.to_string(),
            at,
            source,
        }
    } else {
        TraceError::Io {
            file: file.to_string(),
            source,
        }
    }
}

fn parse_plain<R: Read>(
    head: Vec<u8>,
    rest: R,
    source: &str,
    opts: ReadOptions,
    gzip: bool,
) -> Result<Trace, TraceError> {
    let is_pickle = head.first() == Some(&0x80);
    let text = head
        .strip_prefix(b"\xEF\xBB\xBF".as_slice())
        .unwrap_or(&head);
    let is_csv = {
        let first = text.trim_ascii_start();
        first.starts_with(b"action")
    };
    let reader = io::Cursor::new(head.clone()).chain(rest);
    let reader = BufReader::with_capacity(1 << 16, reader);
    if is_pickle {
        crate::snapshot::read_snapshot(reader, source, opts, gzip)
    } else if is_csv {
        if let Some(d) = opts.device.filter(|&d| d != 0) {
            return Err(TraceError::NoSuchDevice {
                file: source.to_string(),
                device: d,
                devices: 1,
            });
        }
        read_csv(reader, source, gzip)
    } else {
        Err(TraceError::UnknownFormat {
            file: source.to_string(),
        })
    }
}

// ---------------------------------------------------------------------------------------------
// CSV

const REQUIRED_COLUMNS: [&str; 4] = ["action", "addr", "size", "stream"];

fn read_csv<R: BufRead>(mut reader: R, source: &str, gzip: bool) -> Result<Trace, TraceError> {
    let file = || source.to_string();
    let mut buf = Vec::with_capacity(128);
    let mut line_no = 0usize;
    let mut events = Vec::new();

    // Header (the first non-empty line).
    let mut columns = [0usize; 4];
    let ncols = loop {
        buf.clear();
        line_no += 1;
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| io_error(source, gzip, Some(Location::Line(line_no)), e))?;
        if n == 0 {
            return Err(TraceError::UnknownFormat { file: file() });
        }
        let mut line = trim_eol(&buf);
        if line_no == 1 {
            line = line
                .strip_prefix(b"\xEF\xBB\xBF".as_slice())
                .unwrap_or(line);
        }
        if line.trim_ascii().is_empty() {
            continue;
        }
        let header: Vec<&[u8]> = line.split(|&b| b == b',').map(<[u8]>::trim_ascii).collect();
        for (slot, name) in columns.iter_mut().zip(REQUIRED_COLUMNS) {
            match header.iter().position(|h| *h == name.as_bytes()) {
                Some(i) => *slot = i,
                None => {
                    return Err(TraceError::BadHeader {
                        file: file(),
                        at: Location::Line(line_no),
                        header: String::from_utf8_lossy(line).into_owned(),
                        missing: name,
                    });
                }
            }
        }
        break header.len();
    };

    loop {
        buf.clear();
        line_no += 1;
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| io_error(source, gzip, Some(Location::Line(line_no)), e))?;
        if n == 0 {
            break;
        }
        let line = trim_eol(&buf);
        if line.trim_ascii().is_empty() {
            continue;
        }
        // The four wanted fields, by column index, and the number of fields.
        let mut fields: [&[u8]; 4] = [&[]; 4];
        let mut found = 0usize;
        for (i, field) in line.split(|&b| b == b',').enumerate() {
            for (slot, &col) in fields.iter_mut().zip(&columns) {
                if col == i {
                    *slot = field.trim_ascii();
                }
            }
            found += 1;
        }
        let at = Location::Line(line_no);
        if found != ncols {
            return Err(TraceError::ColumnCount {
                file: file(),
                at,
                expected: ncols,
                found,
            });
        }
        let action_field = fields[0];
        let action = Action::from_bytes(action_field).ok_or_else(|| TraceError::UnknownAction {
            file: file(),
            at,
            action: String::from_utf8_lossy(action_field).into_owned(),
        })?;
        let number = |field: &'static str, idx: usize| -> Result<u64, TraceError> {
            let raw = fields[idx];
            parse_u64(raw).ok_or_else(|| TraceError::BadNumber {
                file: file(),
                at,
                field,
                value: String::from_utf8_lossy(raw).into_owned(),
            })
        };
        let addr = if action == Action::Oom && fields[1].is_empty() {
            0
        } else {
            number("addr", 1)?
        };
        let size = number("size", 2)?;
        let stream = number("stream", 3)?;
        events.push(TraceEvent {
            action,
            addr,
            size,
            stream,
            line: line_no,
        });
    }
    Ok(Trace {
        events,
        source: source.to_string(),
        format: TraceFormat::Csv,
        device: 0,
    })
}

fn trim_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Decimal `u64` without sign, spaces or overflow.
fn parse_u64(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    let mut v: u64 = 0;
    for &b in s {
        let d = b.wrapping_sub(b'0');
        if d > 9 {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d))?;
    }
    Some(v)
}
