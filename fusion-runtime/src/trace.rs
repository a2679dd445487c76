//! Reading traces ([`TraceEvent`]s recorded with `ExecOptions::trace`): where communication
//! and computation of different chunks overlapped, and export to the Chrome trace format
//! (open in `chrome://tracing` or ui.perfetto.dev).

use std::fmt::Write;

pub use crate::eval::TraceEvent;

/// A communication and a computation that ran at the same time on one device.
#[derive(Clone, Debug, PartialEq)]
pub struct Overlap {
    pub communication: TraceEvent,
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

/// Chrome trace JSON: one process per rank, one thread per stream.
pub fn chrome_trace(ranks: &[(usize, Vec<TraceEvent>)]) -> String {
    let mut s = String::from("{\"traceEvents\": [\n");
    let mut first = true;
    for (rank, events) in ranks {
        for e in events {
            if !first {
                s.push_str(",\n");
            }
            first = false;
            let name = match e.chunk {
                Some(c) => format!("{} [{c}]", e.name),
                None => e.name.clone(),
            };
            let _ = write!(
                s,
                "{{\"name\": \"{name}\", \"cat\": \"{}\", \"ph\": \"X\", \"pid\": {rank}, \"tid\": {}, \"ts\": {:.3}, \"dur\": {:.3}}}",
                if e.communication { "comm" } else { "compute" },
                e.stream,
                e.start_ms * 1e3,
                (e.end_ms - e.start_ms) * 1e3
            );
        }
    }
    s.push_str("\n]}\n");
    s
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
        let json = chrome_trace(&[(0, events)]);
        assert!(json.contains("\"name\": \"matmul [1]\"") && json.ends_with("]}\n"));
    }
}
