//! Traces of calls: where communication and computation of different chunks overlapped,
//! and the Chrome trace format (open in ui.perfetto.dev or `chrome://tracing`), written
//! with `serde_json`.
//!
//! A traced call ([`crate::executor::ExecOptions::trace`]) records device intervals
//! ([`TraceEvent`]: communications and kernels, per stream, in ms from the call's start on
//! the device). With a trace directory (`FUSION_TRACE=<dir>` or
//! [`crate::executor::ExecOptions::trace_dir`]) it also records a host span for every node it
//! executes ([`HostSpan`]) and writes one file per call and rank,
//! `<dir>/<fusion>-<call>-rank<r>.json`:
//!
//! - process `rank r`, thread `host`: one complete event (`"ph": "X"`) per executed node,
//!   named by its kind, with `args` = `{node, text, stream, chunk}` (`node` is the node's
//!   pre-order index in the program, `text` its line of the program dump);
//! - threads `stream s`: the device intervals, named `op [chunk]`, category `comm` or
//!   `compute`, with `args` = `{node, stream, chunk}`;
//! - `otherData`: the fusion, call, rank, world size, backend, the program's text and the
//!   plan that ran (and why).
//!
//! Host and device times both count from the call's start but on different clocks (the
//! host's, and the device's from a marker the call records first), so they align only
//! roughly.

use std::path::{Path, PathBuf};

use fusion_compiler::hir::{for_each_node, HostProgram};
use fusion_compiler::node_string;
use serde_json::{json, Value};

use crate::error::{Error, Result};
pub use crate::eval::{HostSpan, TraceEvent};

/// A communication and a computation that ran at the same time on one device.
#[derive(Clone, Debug, PartialEq)]
pub struct Overlap {
    /// The transfer.
    pub communication: TraceEvent,
    /// The computation it overlapped.
    pub compute: TraceEvent,
    /// Length of the time both were running.
    pub ms: f64,
}

/// Pairs of a communication and a computation on different streams, for different
/// chunks, whose intervals intersect; longest first.
pub fn overlaps(events: &[TraceEvent]) -> Vec<Overlap> {
    let mut out = Vec::new();
    for c in events.iter().filter(|e| e.communication) {
        for k in events.iter().filter(|e| !e.communication) {
            if c.stream == k.stream || (c.chunk.is_some() && c.chunk == k.chunk) {
                continue;
            }
            let ms = c.end_ms.min(k.end_ms) - c.start_ms.max(k.start_ms);
            if ms > 0.0 {
                out.push(Overlap {
                    communication: c.clone(),
                    compute: k.clone(),
                    ms,
                });
            }
        }
    }
    out.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    out
}

/// Total time during which some communication ran (the union of their intervals).
pub fn busy_ms(events: &[TraceEvent], communication: bool) -> f64 {
    let mut iv: Vec<(f64, f64)> = events
        .iter()
        .filter(|e| e.communication == communication)
        .map(|e| (e.start_ms, e.end_ms))
        .collect();
    iv.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (mut total, mut cur): (f64, Option<(f64, f64)>) = (0.0, None);
    for (s, e) in iv {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}

/// The Chrome trace thread of the host (the rank's thread).
pub const HOST_THREAD: usize = 0;

/// The Chrome trace thread of device stream `stream` (0 is the caller's stream).
pub fn stream_thread(stream: usize) -> usize {
    stream + 1
}

fn metadata(name: &str, pid: usize, tid: Option<usize>, value: Value) -> Value {
    let mut e = json!({"name": name, "ph": "M", "pid": pid, "args": value});
    if let Some(t) = tid {
        e["tid"] = json!(t);
    }
    e
}

/// Names the process of `rank` and its threads (host and the streams in `streams`).
fn thread_names(rank: usize, streams: &[usize], host: bool) -> Vec<Value> {
    let mut out = vec![
        metadata(
            "process_name",
            rank,
            None,
            json!({"name": format!("rank {rank}")}),
        ),
        metadata(
            "process_sort_index",
            rank,
            None,
            json!({"sort_index": rank}),
        ),
    ];
    if host {
        out.push(metadata(
            "thread_name",
            rank,
            Some(HOST_THREAD),
            json!({"name": "host"}),
        ));
    }
    for &s in streams {
        let name = if s == 0 {
            "stream 0 (caller)".to_string()
        } else {
            format!("stream {s}")
        };
        let tid = stream_thread(s);
        out.push(metadata(
            "thread_name",
            rank,
            Some(tid),
            json!({"name": name}),
        ));
        out.push(metadata(
            "thread_sort_index",
            rank,
            Some(tid),
            json!({"sort_index": tid}),
        ));
    }
    out
}

/// One device interval as a complete event.
fn device_event(rank: usize, e: &TraceEvent) -> Value {
    let name = match e.chunk {
        Some(c) => format!("{} [{c}]", e.name),
        None => e.name.clone(),
    };
    json!({
        "name": name,
        "cat": if e.communication { "comm" } else { "compute" },
        "ph": "X",
        "pid": rank,
        "tid": stream_thread(e.stream),
        "ts": e.start_ms * 1e3,
        "dur": (e.end_ms - e.start_ms).max(0.0) * 1e3,
        "args": {"op": e.name, "node": e.node, "stream": e.stream, "chunk": e.chunk},
    })
}

fn streams_of(events: &[TraceEvent]) -> Vec<usize> {
    let mut s: Vec<usize> = events.iter().map(|e| e.stream).collect();
    s.sort_unstable();
    s.dedup();
    s
}

/// Chrome trace JSON of device intervals: one process per rank, one thread per stream.
pub fn chrome_trace_value(ranks: &[(usize, Vec<TraceEvent>)]) -> Value {
    let mut events = Vec::new();
    for (rank, evs) in ranks {
        events.extend(thread_names(*rank, &streams_of(evs), false));
        events.extend(evs.iter().map(|e| device_event(*rank, e)));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// [`chrome_trace_value`] as text.
pub fn chrome_trace(ranks: &[(usize, Vec<TraceEvent>)]) -> String {
    chrome_trace_value(ranks).to_string()
}

/// One traced call on one rank: what [`call_trace`] writes.
pub struct CallTrace<'a> {
    /// The fusion's name (the `fusion!` function, or the executor's name).
    pub fusion: &'a str,
    /// The call's number on this rank (0 for the first traced call of the executor).
    pub call: usize,
    /// The rank that ran it.
    pub rank: usize,
    /// The number of ranks.
    pub world_size: usize,
    /// `cpu` or `cuda`.
    pub backend: &'a str,
    /// The program the call ran.
    pub program: &'a HostProgram,
    /// Its device intervals.
    pub device: &'a [TraceEvent],
    /// Its nodes' host spans.
    pub host: &'a [HostSpan],
    /// Which plan ran and why, when the call's options left it open (empty otherwise).
    pub plan: &'a str,
}

/// The Chrome trace of one call on one rank: every executed node on the host thread,
/// the device intervals on their streams, and the program in `otherData`.
pub fn call_trace(t: &CallTrace<'_>) -> Value {
    let mut texts = Vec::with_capacity(t.program.node_count());
    for_each_node(&t.program.body, &mut |n| {
        texts.push(node_string(t.program, n))
    });
    let mut events = thread_names(t.rank, &streams_of(t.device), true);
    for h in t.host {
        events.push(json!({
            "name": format!("{:?}", h.kind),
            "cat": "host",
            "ph": "X",
            "pid": t.rank,
            "tid": HOST_THREAD,
            "ts": h.start_ms * 1e3,
            "dur": (h.end_ms - h.start_ms).max(0.0) * 1e3,
            "args": {
                "node": h.node,
                "text": texts.get(h.node),
                "stream": h.stream,
                "chunk": h.chunk,
            },
        }));
    }
    events.extend(t.device.iter().map(|e| device_event(t.rank, e)));
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "fusion": t.fusion,
            "call": t.call,
            "rank": t.rank,
            "world_size": t.world_size,
            "backend": t.backend,
            "nodes": texts.len(),
            "program": t.program.to_string(),
            "plan": t.plan,
        },
    })
}

/// The file [`write_call_trace`] writes for a call: `<dir>/<fusion>-<call>-rank<r>.json`.
pub fn call_trace_path(dir: &Path, fusion: &str, call: usize, rank: usize) -> PathBuf {
    let name: String = fusion
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("{name}-{call:04}-rank{rank}.json"))
}

/// Writes [`call_trace`] into `dir` (created if needed); returns the file's path.
pub fn write_call_trace(dir: &Path, t: &CallTrace<'_>) -> Result<PathBuf> {
    let path = call_trace_path(dir, t.fusion, t.call, t.rank);
    let io = |what: &str, e: std::io::Error| {
        Error::World(format!("FUSION_TRACE: {what} {}: {e}", path.display()))
    };
    std::fs::create_dir_all(dir).map_err(|e| io("creating the directory of", e))?;
    let text = serde_json::to_string(&call_trace(t))
        .map_err(|e| Error::World(format!("FUSION_TRACE: encoding a trace: {e}")))?;
    std::fs::write(&path, text).map_err(|e| io("writing", e))?;
    Ok(path)
}

/// The device intervals of a Chrome trace written by this module (by [`call_trace`] or
/// [`chrome_trace`]), per rank: for drawing a timeline from files.
pub fn device_events(trace: &Value) -> Vec<(usize, TraceEvent)> {
    let Some(events) = trace["traceEvents"].as_array() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in events {
        let communication = match e["cat"].as_str() {
            Some("comm") => true,
            Some("compute") => false,
            _ => continue,
        };
        let (Some(rank), Some(ts), Some(dur), Some(stream)) = (
            e["pid"].as_u64(),
            e["ts"].as_f64(),
            e["dur"].as_f64(),
            e["args"]["stream"].as_u64(),
        ) else {
            continue;
        };
        let args = &e["args"];
        out.push((
            rank as usize,
            TraceEvent {
                name: args["op"].as_str().unwrap_or_default().to_string(),
                communication,
                stream: stream as usize,
                chunk: args["chunk"].as_i64(),
                start_ms: ts / 1e3,
                end_ms: (ts + dur) / 1e3,
                node: args["node"].as_u64().map(|n| n as usize),
            },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(name: &str, comm: bool, stream: usize, chunk: i64, a: f64, b: f64) -> TraceEvent {
        TraceEvent {
            name: name.into(),
            communication: comm,
            stream,
            chunk: Some(chunk),
            start_ms: a,
            end_ms: b,
            node: Some(7),
        }
    }

    #[test]
    fn finds_cross_stream_overlap_only() {
        let events = vec![
            ev("P2P group", true, 1, 0, 0.0, 1.0),
            ev("matmul", false, 2, 1, 0.5, 2.0),
            ev("matmul", false, 1, 0, 1.0, 1.5),
            ev("P2P group", true, 2, 1, 2.0, 3.0),
        ];
        let o = overlaps(&events);
        assert_eq!(o.len(), 1);
        assert!((o[0].ms - 0.5).abs() < 1e-12);
        assert!((busy_ms(&events, true) - 2.0).abs() < 1e-12);
        assert!((busy_ms(&events, false) - 1.5).abs() < 1e-12);
        let json: Value = serde_json::from_str(&chrome_trace(&[(3, events.clone())])).unwrap();
        let named: Vec<&str> = json["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            named,
            ["P2P group [0]", "matmul [1]", "matmul [0]", "P2P group [1]"]
        );
        // What a file holds is read back as it was written.
        let back: Vec<TraceEvent> = device_events(&json)
            .into_iter()
            .map(|(r, e)| {
                assert_eq!(r, 3);
                e
            })
            .collect();
        assert_eq!(back.len(), events.len());
        for (b, e) in back.iter().zip(&events) {
            assert_eq!(
                (&b.name, b.communication, b.stream, b.chunk, b.node),
                (&e.name, e.communication, e.stream, e.chunk, e.node)
            );
            assert!((b.start_ms - e.start_ms).abs() < 1e-9 && (b.end_ms - e.end_ms).abs() < 1e-9);
        }
    }

    #[test]
    fn trace_paths_name_the_fusion_call_and_rank() {
        let p = call_trace_path(Path::new("/t"), "ag matmul/x", 3, 1);
        assert_eq!(p, Path::new("/t/ag_matmul_x-0003-rank1.json"));
    }
}
