//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot()`) as traces.
//!
//! A snapshot is a pickled dict whose `device_traces` holds one list of trace entries per device;
//! each entry is a dict with `action`, `addr`, `size`, `stream` and, with the default context,
//! about 25 stack `frames`. The pickle is read as a stream by [`crate::pickle`], with the
//! `frames` lists pruned: what the replay needs is the entries' four scalars, and the memory this
//! takes grows with the number of entries, not with their stacks.

use std::io::{self, BufRead};

use crate::pickle::{Graph, PickleError, Unpickler, Val};
use crate::trace::{Action, Location, ReadOptions, Trace, TraceError, TraceEvent, TraceFormat};

/// Keys whose values the reader drops while reading: the stack frames of trace entries and of
/// segments' blocks.
const PRUNED_KEYS: &[&str] = &["frames"];

/// Reads a snapshot pickle from `reader` (already decompressed); `gzip` says whether read errors
/// are to be reported as a corrupt gzip stream.
pub(crate) fn read_snapshot<R: BufRead>(
    mut reader: R,
    source: &str,
    opts: ReadOptions,
    gzip: bool,
) -> Result<Trace, TraceError> {
    let file = || source.to_string();
    let bad = |message: String| TraceError::BadSnapshot {
        file: file(),
        message,
    };
    let io_err = |e: io::Error| crate::trace::io_error(source, gzip, None, e);
    let graph = match Unpickler::new(&mut reader).prune_keys(PRUNED_KEYS).load() {
        Ok(g) => g,
        Err(PickleError::Io(e)) => return Err(io_err(e)),
        Err(e) => return Err(bad(format!("cannot unpickle: {e}"))),
    };
    // Read to the end, so that a corrupt gzip trailer is reported too.
    io::copy(&mut reader, &mut io::sink()).map_err(io_err)?;
    let root = graph.root.unwrap_or(Val::None);
    if !is_dict(&graph, root) {
        return Err(bad(format!(
            "the pickle holds {} rather than the dict of torch.cuda.memory._snapshot()",
            graph.type_name(root)
        )));
    }
    let traces = graph.get(root, "device_traces").ok_or_else(|| {
        bad("no `device_traces` key (was it recorded with _record_memory_history?)".into())
    })?;
    let devices = graph.seq(traces).ok_or_else(|| {
        bad(format!(
            "`device_traces` is {}, not a list",
            graph.type_name(traces)
        ))
    })?;
    let device_list = |d: usize| -> Result<&[Val], TraceError> {
        graph.seq(devices[d]).ok_or_else(|| {
            bad(format!(
                "`device_traces[{d}]` is {}, not a list",
                graph.type_name(devices[d])
            ))
        })
    };
    let device = match opts.device {
        Some(d) if d < devices.len() => d,
        Some(d) => {
            return Err(TraceError::NoSuchDevice {
                file: file(),
                device: d,
                devices: devices.len(),
            });
        }
        None => {
            let mut chosen = 0;
            for d in 0..devices.len() {
                if !device_list(d)?.is_empty() {
                    chosen = d;
                    break;
                }
            }
            chosen
        }
    };
    let entries: &[Val] = if devices.is_empty() {
        &[]
    } else {
        device_list(device)?
    };
    let mut events = Vec::with_capacity(entries.len());
    for (index, &entry) in entries.iter().enumerate() {
        let at = Location::Entry { device, index };
        events.push(read_entry(&graph, entry, source, at, index)?);
    }
    Ok(Trace {
        events,
        source: source.to_string(),
        format: TraceFormat::Pickle,
        device,
    })
}

/// One trace entry (a dict) as an event.
fn read_entry(
    g: &Graph,
    entry: Val,
    source: &str,
    at: Location,
    index: usize,
) -> Result<TraceEvent, TraceError> {
    let file = || source.to_string();
    let bad_entry = |message: String| TraceError::BadEntry {
        file: file(),
        at,
        message,
    };
    if !is_dict(g, entry) {
        return Err(bad_entry(format!(
            "entry is {}, not a dict",
            g.type_name(entry)
        )));
    }
    let action = match g.get(entry, "action") {
        Some(v) => match g.str(v) {
            Some(s) => Action::from_name(s).ok_or_else(|| TraceError::UnknownAction {
                file: file(),
                at,
                action: s.to_string(),
            })?,
            None => {
                return Err(bad_entry(format!(
                    "`action` is {}, not a string",
                    g.type_name(v)
                )));
            }
        },
        None => return Err(bad_entry("no `action` key".into())),
    };
    let number = |field: &'static str, default: Option<u64>| -> Result<u64, TraceError> {
        match g.get(entry, field) {
            None | Some(Val::None) if default.is_some() => Ok(default.unwrap_or(0)),
            None => Err(bad_entry(format!("no `{field}` key"))),
            Some(v) => g.u64(v).ok_or_else(|| TraceError::BadNumber {
                file: file(),
                at,
                field,
                value: g.repr(v),
            }),
        }
    };
    // `oom` entries have no address (they carry `device_free` instead); `snapshot` ones have 0.
    let addr_default = matches!(action, Action::Oom | Action::Snapshot).then_some(0);
    let addr = number("addr", addr_default)?;
    let size = number("size", None)?;
    let stream = match g.get(entry, "stream") {
        None | Some(Val::None) => 0,
        // A `cudaStream_t` is a pointer: keep its bits even if pickled as a negative int.
        Some(Val::Int(i)) => i as u64,
        Some(v) => g.u64(v).ok_or_else(|| TraceError::BadNumber {
            file: file(),
            at,
            field: "stream",
            value: g.repr(v),
        })?,
    };
    Ok(TraceEvent {
        action,
        addr,
        size,
        stream,
        line: index,
    })
}

fn is_dict(g: &Graph, v: Val) -> bool {
    matches!(g.obj(v), Some(crate::pickle::Obj::Dict(_)))
}
