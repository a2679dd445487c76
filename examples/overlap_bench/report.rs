//! Benchmark rows, their JSON form, and the summary table (each time over the bound).

use std::collections::BTreeMap;

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
}

impl Row {
    pub fn json(&self) -> String {
        let ranks: Vec<String> = self.rank_ms.iter().map(|x| format!("{x:.4}")).collect();
        format!(
            "{{\"op\": \"{}\", \"M\": {}, \"K\": {}, \"N\": {}, \"D\": {}, \"dtype\": \"{}\", \"case\": \"{}\", \"ms\": {:.4}, \"rank_ms\": [{}], \"relerr\": {:.3e}, \"peak_bytes\": {}, \"nodes\": {}}}",
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
    println!("| op | M, K, N | D | comm | GEMM | bound | sequential | ours best | variant | best / bound | max relerr |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
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
                    && !r.variant.starts_with("gemm_alone_rows")
                    && !r.variant.ends_with("_fullbuf")
            })
            .min_by(|a, b| a.ms.total_cmp(&b.ms));
        let relerr = rs.iter().map(|r| r.relerr).fold(0.0, f64::max);
        if let Some(best) = ours {
            println!(
                "| {op} | {m}, {k}, {n} | {} | {comm:.3} | {gemm:.3} | {bound:.3} | {:.3} | {:.3} | {} | {:.2} | {relerr:.1e} |",
                best.devices,
                get("sequential").unwrap_or(f64::NAN),
                best.ms,
                best.variant,
                best.ms / bound
            );
        }
    }
}
