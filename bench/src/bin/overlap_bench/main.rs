//! Overlap benchmark: AllGather+GEMM and GEMM+ReduceScatter on every device of the world,
//! timing communication alone, GEMM alone, the sequential program and each of our
//! lowerings (collective pipeline, NCCL P2P pipeline, copy-engine P2P pipeline), in one
//! process and run.
//! Every variant's result is checked against the sequential result of the same run.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin overlap_bench -- --json out.json
//! ```
//!
//! Times are medians over `--iters` calls (device events around each call, all ranks
//! released together), the maximum over ranks; "bound" is max(NCCL collective alone, GEMM
//! alone) measured in the same run.

mod ag;
mod host;
mod report;
mod rs;
mod sample;

use std::sync::Arc;

use clap::Parser;
use fusion::{DType, Result, Tensor, World};
use fusion_bench::cli::{list, seed_or_clock, write_file};
use fusion_bench::finish::finish;
use fusion_bench::measure::random;

use report::Row;
use sample::{gather_times, Execs, Sample, Samples};

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices).
    #[arg(long)]
    devices: Option<usize>,
    /// Shapes as M,K,N separated by `;`.
    #[arg(long, default_value = "16384,8192,2048;8192,8192,8192;16384,8192,8192")]
    shapes: String,
    /// `ag`, `rs` or both.
    #[arg(long, default_value = "ag,rs")]
    ops: String,
    #[arg(long, default_value = "bf16")]
    dtype: String,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Chunk counts of the collective pipelines.
    #[arg(long, default_value = "2,4,8")]
    chunks: String,
    /// Stream counts.
    #[arg(long, default_value = "2,4")]
    streams: String,
    /// Copy-engine transports to try, as mode/stream: `push/peer` (the sender copies, on a
    /// copy stream per peer) is the only one since the others were measured and deleted
    /// (`docs/ARCHITECTURE.md`, "Decisions"); empty for none.
    #[arg(long, default_value = "push/peer")]
    transports: String,
    /// Row sub-chunks per device block of the copy-engine GEMM+RS pipeline to try besides
    /// the default (`LowerOptions::pipelines.reduce_scatter_subchunks`), with the transports of
    /// `--rs-subchunk-transports`.
    #[arg(long, default_value = "1,2,4")]
    rs_subchunks: String,
    /// Transports (of `--transports`) with which the `--rs-subchunks` variants run.
    #[arg(long, default_value = "push/peer")]
    rs_subchunk_transports: String,
    /// Variants (names as printed) to run once more with a trace; rank 0's timeline is
    /// printed.
    #[arg(long, default_value = "")]
    trace: String,
    /// Write every measurement as JSON lines here.
    #[arg(long)]
    json: Option<String>,
    /// The plan file of the `default_call` variants (default: `FUSION_PLAN_CACHE` or the
    /// user's cache directory). A second run with the same file tunes nothing.
    #[arg(long)]
    plan_file: Option<String>,
    /// Only the sequential program and the default call (e.g. a second process that
    /// should read every plan from `--plan-file`).
    #[arg(long)]
    only_default: bool,
    /// Seed of the random inputs (default: drawn from the clock, so every run gets fresh
    /// inputs; printed for a rerun).
    #[arg(long)]
    seed: Option<u64>,
    /// Small shapes for a quick run on simulated devices.
    #[arg(long)]
    quick: bool,
    /// Stream iterations (chunks) of the tiny collective AG+GEMM pipeline whose host time
    /// per call is measured eagerly and replayed as a CUDA graph (empty: skip).
    #[arg(long, default_value = "2,4,8,16")]
    host_iterations: String,
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn run() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        a.shapes = "64,32,16;32,32,32".into();
        a.iters = 3;
        a.warmup = 1;
    }
    let dt = DType::from_name(&a.dtype)
        .ok_or_else(|| fusion::Error::World(format!("unknown dtype {}", a.dtype)))?;
    let world = World::auto(a.devices)?;
    let d = world.size();
    println!(
        "overlap_bench: backend {} devices {d} dtype {dt}{}",
        world.backend().name(),
        match world.launch_spec() {
            Some(s) => format!(
                " (launched by {}: {} processes, this one holds ranks {:?})",
                s.launcher.name(),
                s.processes,
                world.local_ranks()
            ),
            None => " (one process)".into(),
        }
    );
    // In a launched world only rank 0's process writes the results.
    let reports = world.local_ranks().contains(&0);
    let execs = Execs::new(dt)?;
    let seed = seed_or_clock(a.seed);
    // Every process of a launched world uses rank 0's seed.
    let seed = world.run(|rank| Ok(rank.communicator().exchange(&[seed as i64])?[0][0] as u64))?[0];
    println!("overlap_bench: input seed {seed}");
    let transports: Vec<String> = a
        .transports
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(t) = transports.iter().find(|t| t.as_str() != "push/peer") {
        return Err(fusion::Error::World(format!(
            "--transports {t}: the copy-engine transport is push/peer (pull mode and the \
             serial and iteration copy streams were deleted, see docs/ARCHITECTURE.md, \
             \"Decisions\")"
        )));
    }
    let rows = measure(&world, &a, &execs, dt, seed, &transports, reports)?;
    let host_lines = host::host_lines(&world, dt, &list(&a.host_iterations), reports)?;
    if !reports {
        return Ok(());
    }
    if let Some(path) = &a.json {
        let mut text = String::new();
        for r in &rows {
            text.push_str(&r.json());
            text.push('\n');
        }
        text.push_str(&host_lines);
        write_file(path, text)?;
    }
    report::print_table(&rows);
    let tuned = execs.ag_p2p.tunings() + execs.rs_p2p.tunings();
    let from_file = rows
        .iter()
        .filter(|r| r.plan.as_ref().is_some_and(|p| p.1 == "File"))
        .count();
    println!(
        "plan decisions: {tuned} tuned (per rank), {from_file} default calls read the plan file"
    );
    Ok(())
}

/// Every shape and op of `a`, in the NCCL group then one group per copy-engine transport,
/// on every rank: a row per variant (the slowest rank's time), printed as it is measured
/// where this process reports.
fn measure(
    world: &World,
    a: &Args,
    execs: &Execs,
    dt: DType,
    seed: u64,
    transports: &[String],
    reports: bool,
) -> Result<Vec<Row>> {
    let d = world.size();
    let mut rows: Vec<Row> = Vec::new();
    for shape_s in a.shapes.split(';') {
        let v = list(shape_s);
        let (m, k, n) = (v[0], v[1], v[2]);
        for op in a.ops.split(',') {
            let host: Arc<[Tensor; 2]> = Arc::new(match op {
                "ag" => [
                    random(&[d, m / d, k], dt, seed.wrapping_add(1))?,
                    random(&[k, n], dt, seed.wrapping_add(2))?,
                ],
                "rs" => [
                    random(&[d, m, k / d], dt, seed.wrapping_add(3))?,
                    random(&[d, k / d, n], dt, seed.wrapping_add(4))?,
                ],
                other => return Err(fusion::Error::World(format!("unknown op {other}"))),
            });
            let groups: Vec<Option<String>> = std::iter::once(None)
                .chain(transports.iter().cloned().map(Some))
                .take(if a.only_default { 1 } else { usize::MAX })
                .collect();
            for g in groups {
                let per_rank = world.run(|rank| {
                    let samples = match op {
                        "ag" => ag::run_ag(rank, a, execs, &host, (m, k, n), g.as_deref()),
                        _ => rs::run_rs(rank, a, execs, &host, (m, k, n), g.as_deref()),
                    }?;
                    let all = gather_times(rank, &samples)?;
                    Ok((samples, all))
                })?;
                let (per_rank, mut everyone): (Vec<Samples>, Vec<_>) = per_rank.into_iter().unzip();
                let all_ranks = everyone.swap_remove(0);
                for (i, (name, _)) in per_rank[0].iter().enumerate() {
                    let samples: Vec<&Sample> = per_rank.iter().map(|r| &r[i].1).collect();
                    let every: Vec<(f64, f64)> = all_ranks.iter().map(|r| r[i]).collect();
                    rows.push(Row {
                        op: if op == "ag" { "AG+GEMM" } else { "GEMM+RS" }.into(),
                        m,
                        k,
                        n,
                        devices: d,
                        dtype: dt.name().into(),
                        variant: name.clone(),
                        ms: every.iter().map(|s| s.0).fold(0.0, f64::max),
                        rank_ms: every.iter().map(|s| s.0).collect(),
                        relerr: every.iter().map(|s| s.1).fold(0.0, f64::max),
                        peak_bytes: samples[0].peak_bytes,
                        nodes: samples[0].nodes,
                        plan: samples[0].plan.clone(),
                    });
                    let r = rows.last().expect("pushed");
                    if !reports {
                        continue;
                    }
                    println!(
                        "{:8} {m:>6} {k:>6} {n:>6} {:<28} {:8.3} ms  relerr {:.2e}{}",
                        r.op,
                        r.variant,
                        r.ms,
                        r.relerr,
                        match &r.plan {
                            Some((plan, why, first)) => {
                                format!("  plan {plan} ({why}; first call {first:.1} ms)")
                            }
                            None => String::new(),
                        }
                    );
                    if a.trace.split(',').any(|t| t == name) {
                        report::print_trace(&per_rank[0][i].1);
                    }
                }
            }
        }
    }
    Ok(rows)
}
