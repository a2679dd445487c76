//! Benchmark rows, their JSON form, the summary table (each time over the bound), and a
//! traced variant's timeline.

use std::collections::BTreeMap;

use crate::sample::Sample;

/// One measured variant (times in ms, maximum over ranks of each rank's median).
#[derive(Clone, Debug)]
pub struct Row {
    pub op: String,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub devices: usize,
    pub dtype: String,
    pub variant: String,
    pub ms: f64,
    pub rank_ms: Vec<f64>,
    pub relerr: f64,
    pub peak_bytes: usize,
    pub nodes: usize,
    /// Rank 0's plan, why it was chosen, and its first call's host ms (the default call).
    pub plan: Option<(String, String, f64)>,
}

impl Row {
    pub fn json(&self) -> String {
        let ranks: Vec<String> = self.rank_ms.iter().map(|x| format!("{x:.4}")).collect();
        let plan = match &self.plan {
            Some((plan, why, first)) => format!(
                ", \"plan\": \"{plan}\", \"plan_source\": \"{why}\", \"first_call_ms\": {first:.3}"
            ),
            None => String::new(),
        };
        format!(
            "{{\"op\": \"{}\", \"M\": {}, \"K\": {}, \"N\": {}, \"D\": {}, \"dtype\": \"{}\", \"case\": \"{}\", \"ms\": {:.4}, \"rank_ms\": [{}], \"relerr\": {:.3e}, \"peak_bytes\": {}, \"nodes\": {}{plan}}}",
            self.op,
            self.m,
            self.k,
            self.n,
            self.devices,
            self.dtype,
            self.variant,
            self.ms,
            ranks.join(", "),
            self.relerr,
            self.peak_bytes,
            self.nodes
        )
    }
}

/// Per op and shape: comm alone, GEMM alone, bound, sequential, and our best lowering.
pub fn print_table(rows: &[Row]) {
    let mut by: BTreeMap<(String, usize, usize, usize), Vec<&Row>> = BTreeMap::new();
    for r in rows {
        by.entry((r.op.clone(), r.m, r.k, r.n)).or_default().push(r);
    }
    println!();
    println!("| op | M, K, N | D | comm | GEMM | bound | sequential | ours best | variant | best / bound | default call | plan | default / best option (alternating) | max relerr |");
    println!(
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    );
    for ((op, m, k, n), rs) in by {
        let get = |name: &str| rs.iter().find(|r| r.variant == name).map(|r| r.ms);
        let (Some(comm), Some(gemm)) = (get("comm_alone"), get("gemm_alone")) else {
            continue;
        };
        let bound = comm.max(gemm);
        let ours = rs
            .iter()
            .filter(|r| {
                !matches!(r.variant.as_str(), "comm_alone" | "gemm_alone")
                    && !r.variant.starts_with("gemm_alone_")
                    && !r.variant.ends_with("_fullbuf")
                    && !r.variant.starts_with("ab_")
            })
            .min_by(|a, b| a.ms.total_cmp(&b.ms));
        let relerr = rs.iter().map(|r| r.relerr).fold(0.0, f64::max);
        // Options of the same fusion (not the collective pipelines, which take their
        // input in another layout).
        let best_option = rs
            .iter()
            .filter(|r| is_option_of_the_fusion(&r.variant))
            .map(|r| r.ms)
            .fold(f64::INFINITY, f64::min);
        let default = rs.iter().find(|r| r.variant == "default_call");
        let (dms, dplan) = match default {
            Some(r) => (r.ms, r.plan.as_ref().map_or("-".into(), |p| p.0.clone())),
            None => (f64::NAN, "-".into()),
        };
        if let Some(best) = ours {
            println!(
                "| {op} | {m}, {k}, {n} | {} | {comm:.3} | {gemm:.3} | {bound:.3} | {:.3} | {:.3} | {} | {:.2} | {dms:.3} | {dplan} | {:.3} | {relerr:.1e} |",
                best.devices,
                get("sequential").unwrap_or(f64::NAN),
                best.ms,
                best.variant,
                best.ms / bound,
                match (get("ab_default"), get("ab_best")) {
                    (Some(x), Some(y)) => x / y,
                    _ => dms / best_option,
                },
            );
        }
    }
}

/// Whether `variant` runs the benchmark's P2P fusion with options (or by default), as
/// opposed to a component alone or the collective pipelines' other input layout.
pub fn is_option_of_the_fusion(variant: &str) -> bool {
    variant == "sequential"
        || variant == "default_call"
        || variant.starts_with("p2p_")
        || variant.starts_with("gathered_gemm_persistent")
        || variant == "scattered_gemm_persistent"
}

/// Rank 0's timeline of a traced call: each communication and kernel with its stream,
/// chunk and interval.
pub fn print_trace(s: &Sample) {
    let Some(events) = &s.trace else {
        return;
    };
    use fusion::runtime::trace::{busy_ms, overlaps};
    println!(
        "    trace (rank 0): comm busy {:.3} ms, compute busy {:.3} ms, {} comm/compute overlaps",
        busy_ms(events, true),
        busy_ms(events, false),
        overlaps(events).len()
    );
    let total: f64 = s.host.iter().map(|h| h.2).sum();
    let per_kind: Vec<String> = s
        .host
        .iter()
        .map(|(k, n, us)| format!("{k} {n}x {:.1}", us / f64::from(*n)))
        .collect();
    println!(
        "    host (rank 0, untraced call): {total:.1} us in leaf nodes; us per node: {}",
        per_kind.join(", ")
    );
    for e in events {
        println!(
            "    {:>8.3} {:>8.3}  stream {:<2} chunk {:<4} {}",
            e.start_ms,
            e.end_ms,
            e.stream,
            e.chunk.map_or("-".into(), |c| c.to_string()),
            e.name
        );
    }
}
