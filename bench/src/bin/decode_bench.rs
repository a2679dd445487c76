//! Decode-size communication: Allreduce latency from 4 KB to 64 MB, and a decode-size
//! GEMM followed by its Allreduce against the GEMM alone, on every device of the world.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin decode_bench -- --json decode.jsonl
//! ```
//!
//! Every variant is a fusion call as users make it: `sum(x, 0)` of `x: [d @ DIDx, n]` (the
//! Allreduce), `sum(matmul(x, w), 0)` of `x: [d @ DIDx, m, k]`, `w: [d @ DIDx, k, n]` (a
//! row-parallel linear layer: GEMM + Allreduce), and one rank's `[1, m, k] @ [k, n]` (the
//! GEMM alone). `ours` runs with the default options (the lowering puts small collectives
//! on peer memory), `nccl` with `LowerOptions::transports.peer_memory = Never`. Each
//! collective's result is checked against a host reference before it is timed; each GEMM +
//! Allreduce against the `nccl` variant's (cuBLAS, then NCCL), its `apart` variant the
//! default options without the fused GEMM + Allreduce kernel.
//!
//! Times per call, slowest rank's median of `--iters`, all ranks released together:
//! - `graph`: `--calls` calls recorded into one CUDA graph on a stream of the caller's
//!   (the way an application captures its decode step) and launched whole: device time;
//! - `replay`: `--calls` calls back to back, each replaying the fusion's own graph: what a
//!   loop of calls costs where the host is slower than the device.

use clap::Parser;
use fusion::compiler::builder::{Axis, FusionBuilder};
use fusion::compiler::ir::{Fusion, ParallelType};
use fusion::{
    DType, ExecOptions, FusionExecutor, PeerMemoryCollectives, Rank, Result, Tensor, World,
};
use fusion_bench::cli::{list, seed_or_clock, write_file};
use fusion_bench::finish::finish;
use fusion_bench::fusions::axes;
use fusion_bench::measure::random;
use fusion_bench::stream_timing::Timing;
use fusion_bench::Dt;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU).
    #[arg(long)]
    devices: Option<usize>,
    /// Allreduce message sizes in bytes.
    #[arg(
        long,
        default_value = "4096,8192,16384,32768,65536,131072,262144,1048576,4194304,16777216,67108864"
    )]
    sizes: String,
    /// GEMM + Allreduce shapes as name:K:N (K summed over the devices) separated by `;`.
    #[arg(long, default_value = "o_proj:8192:8192;down_proj:28672:8192")]
    gemms: String,
    /// Rows of the GEMM + Allreduce (decode tokens).
    #[arg(long, default_value = "1,8,32,128")]
    rows: String,
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Calls per timed sample.
    #[arg(long, default_value_t = 50)]
    calls: usize,
    /// Skip the GEMM + Allreduce rows.
    #[arg(long)]
    no_gemm: bool,
    /// Also time Allgather and ReduceScatter at these message sizes (bytes).
    #[arg(long, default_value = "4096,32768,262144,1048576,4194304")]
    gather_sizes: String,
    /// Also time the calls recorded into a CUDA graph of the caller's.
    #[arg(long)]
    graph: bool,
    /// Write every measurement as JSON lines here.
    #[arg(long)]
    json: Option<String>,
    /// Seed of the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
}

/// One rank's measurement: what, variant, mode, microseconds per call, relative error.
type Sample = (String, &'static str, &'static str, f64, f64);

/// One measurement: what, variant, mode, microseconds per call on each rank.
#[derive(Clone, Debug)]
struct Row {
    what: String,
    variant: &'static str,
    mode: &'static str,
    rank_us: Vec<f64>,
    relerr: f64,
}

impl Row {
    fn us(&self) -> f64 {
        self.rank_us.iter().copied().fold(0.0, f64::max)
    }
}

/// `sum(x, 0)` of `x: [d @ DIDx, n]`.
fn allreduce(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(
        &mut b,
        &[("d", ParallelType::DIDx), ("n", ParallelType::Serial)],
    );
    let x = b.input("x", dt, &a)?;
    let y = b.sum(x, &[0])?;
    b.output(y)?;
    Ok(b.build()?)
}

/// `sum(matmul(x, w), 0)` of `x: [d @ DIDx, m, k]`, `w: [d @ DIDx, k, n]`.
fn matmul_allreduce(dt: DType) -> Result<Fusion> {
    use ParallelType::{DIDx, Serial};
    let mut b = FusionBuilder::new();
    let xa = axes(&mut b, &[("d", DIDx), ("m", Serial), ("k", Serial)]);
    let x = b.input("x", dt, &xa)?;
    let (d, k) = (xa[0].extent, xa[2].extent);
    let n = b.symbol("n");
    let w = b.input("w", dt, &[Axis::didx(d), Axis::serial(k), Axis::serial(n)])?;
    let p = b.matmul(x, w)?;
    let y = b.sum(p, &[0])?;
    b.output(y)?;
    Ok(b.build()?)
}

/// `[g, m, k] @ [k, n]` on one rank.
fn gemm(dt: DType) -> Result<Fusion> {
    fusion_bench::fusions::gemm(dt)
}

/// `ours`: the default options; `peer`: every eligible collective on peer memory;
/// `apart`: the default options with the GEMM and its Allreduce kept apart (no fused
/// GEMM + Allreduce kernel); `nccl`: no collective on peer memory.
fn options(variant: &str) -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower.transports.gemm_allreduce = variant != "apart";
    o.lower.transports.peer_memory = match variant {
        "nccl" => PeerMemoryCollectives::Never,
        "peer" => PeerMemoryCollectives::UpTo(usize::MAX),
        _ => PeerMemoryCollectives::Auto,
    };
    o
}

/// The variants every collective row is timed in.
const VARIANTS: [&str; 3] = ["ours", "peer", "nccl"];

/// Median microseconds per call of `call` in both modes (`fusion_bench::stream_timing`).
fn time_modes(
    rank: &Rank,
    a: &Args,
    call: &dyn Fn(&fusion::runtime::OnStream<'_>) -> Result<()>,
) -> Result<(f64, std::result::Result<f64, String>)> {
    let t = Timing {
        calls: a.calls,
        iters: a.iters,
    };
    t.both_modes(rank, a.graph, call)
}

/// Largest |got - want| / max|want| over the output.
fn relerr(rank: &Rank, got: &Tensor, want: &[f64]) -> Result<f64> {
    let got = rank.to_host(got)?.to_f32_vec()?;
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    Ok(got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs() / scale)))
}

/// The Allreduce rows of one size on one rank: ours and NCCL in both modes.
fn allreduce_rows(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    bytes: usize,
    seed: u64,
) -> Result<Vec<Sample>> {
    let dt = a.dtype.dtype();
    let n = bytes / dt.size_bytes();
    let d = rank.world_size();
    let mut want = vec![0f64; n];
    let mut mine = None;
    for r in 0..d {
        let t = random(&[1, n], dt, seed + r as u64)?;
        for (w, v) in want.iter_mut().zip(t.to_f32_vec()?) {
            *w += f64::from(v);
        }
        if r == rank.index() {
            mine = Some(rank.to_device(&t)?);
        }
    }
    let x = mine.expect("this rank's input");
    collective_rows(rank, a, exec, &x, &want, format!("allreduce {bytes}"))
}

/// Ours, peer memory throughout and NCCL for one collective of `exec` on input `x`,
/// checked against `want`, in both modes.
fn collective_rows(
    rank: &Rank,
    a: &Args,
    exec: &FusionExecutor,
    x: &Tensor,
    want: &[f64],
    what: String,
) -> Result<Vec<Sample>> {
    let mut out = Vec::new();
    for variant in VARIANTS {
        let o = options(variant);
        let y = exec.run_with(rank, &[x], None, &o)?.outputs[0].clone();
        let err = relerr(rank, &y, want)?;
        let (replay, graph) =
            time_modes(rank, a, &|on| exec.run_with(on, &[x], None, &o).map(|_| ()))?;
        out.push((what.clone(), variant, "replay", replay, err));
        match graph {
            Ok(us) => out.push((what.clone(), variant, "graph", us, err)),
            Err(e) if a.graph => println!("rank {}: {variant} {what}: no graph: {e}", rank.index()),
            Err(_) => {}
        }
    }
    Ok(out)
}

/// The Allgather and ReduceScatter rows of one message size (the gathered output, the
/// scattered input) on one rank.
fn gather_scatter_rows(
    rank: &Rank,
    a: &Args,
    (ag, rs): (&FusionExecutor, &FusionExecutor),
    bytes: usize,
    seed: u64,
) -> Result<Vec<Sample>> {
    let dt = a.dtype.dtype();
    let (d, r) = (rank.world_size(), rank.index());
    let cols = 64;
    let m = (bytes / dt.size_bytes() / d / cols).max(1);
    let blocks: Vec<Tensor> = (0..d)
        .map(|q| random(&[1, m, cols], dt, seed + 7 * q as u64))
        .collect::<Result<_>>()?;
    let mut gathered = Vec::new();
    for b in &blocks {
        gathered.extend(b.to_f32_vec()?.into_iter().map(f64::from));
    }
    let x = rank.to_device(&blocks[r])?;
    let mut out = collective_rows(rank, a, ag, &x, &gathered, format!("allgather {bytes}"))?;
    let partials: Vec<Vec<f32>> = (0..d)
        .map(|q| random(&[1, d, m, cols], dt, seed + 11 * q as u64)?.to_f32_vec())
        .collect::<Result<_>>()?;
    let want: Vec<f64> = (0..m * cols)
        .map(|i| {
            partials
                .iter()
                .map(|p| f64::from(p[r * m * cols + i]))
                .sum()
        })
        .collect();
    let p = rank.to_device(&random(&[1, d, m, cols], dt, seed + 11 * r as u64)?)?;
    out.extend(collective_rows(
        rank,
        a,
        rs,
        &p,
        &want,
        format!("reduce_scatter {bytes}"),
    )?);
    Ok(out)
}

/// The GEMM + Allreduce rows of one shape on one rank.
fn gemm_rows(
    rank: &Rank,
    a: &Args,
    execs: (&FusionExecutor, &FusionExecutor),
    (name, k_total, n, m): (&str, usize, usize, usize),
    seed: u64,
) -> Result<Vec<Sample>> {
    let dt = a.dtype.dtype();
    let d = rank.world_size();
    let k = k_total / d;
    let r = rank.index() as u64;
    let x = rank.to_device(&random(&[1, m, k], dt, seed + 2 * r)?)?;
    let w = rank.to_device(&random(&[1, k, n], dt, seed + 2 * r + 1)?)?;
    let what = format!("{name} m={m} k={k_total} n={n}");
    // The reference: cuBLAS's GEMM then NCCL's Allreduce, the variant that shares the least
    // with the others (a host product of these shapes would take longer than the timing).
    let reference = execs
        .0
        .run_with(rank, &[&x, &w], None, &options("nccl"))?
        .outputs[0]
        .clone();
    let want: Vec<f64> = rank
        .to_host(&reference)?
        .to_f32_vec()?
        .into_iter()
        .map(f64::from)
        .collect();
    let mut out = Vec::new();
    for variant in ["ours", "apart", "nccl"] {
        let o = options(variant);
        let y = execs.0.run_with(rank, &[&x, &w], None, &o)?.outputs[0].clone();
        let err = relerr(rank, &y, &want)?;
        let (replay, graph) = time_modes(rank, a, &|on| {
            execs.0.run_with(on, &[&x, &w], None, &o).map(|_| ())
        })?;
        out.push((what.clone(), variant, "replay", replay, err));
        if let Ok(us) = graph {
            out.push((what.clone(), variant, "graph", us, err));
        }
    }
    let (x1, w1) = (x.clone(), w.squeeze(0)?);
    let o = ExecOptions::default();
    let (replay, graph) = time_modes(rank, a, &|on| {
        execs.1.run_with(on, &[&x1, &w1], None, &o).map(|_| ())
    })?;
    out.push((what.clone(), "gemm", "replay", replay, 0.0));
    if let Ok(us) = graph {
        out.push((what, "gemm", "graph", us, 0.0));
    }
    Ok(out)
}

fn collect(rows: &mut Vec<Row>, per_rank: Vec<Vec<Sample>>) {
    for (i, (what, variant, mode, _, _)) in per_rank[0].iter().enumerate() {
        let row = Row {
            what: what.clone(),
            variant,
            mode,
            rank_us: per_rank
                .iter()
                .map(|r| r.get(i).map_or(f64::NAN, |x| x.3))
                .collect(),
            relerr: per_rank
                .iter()
                .map(|r| r.get(i).map_or(f64::NAN, |x| x.4))
                .fold(0.0, f64::max),
        };
        println!(
            "{:34} {:5} {:6} {:9.2} us  relerr {:.1e}",
            row.what,
            row.variant,
            row.mode,
            row.us(),
            row.relerr
        );
        rows.push(row);
    }
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn run() -> Result<()> {
    let a = Args::parse();
    let world = World::auto(a.devices)?;
    let d = world.size();
    let dt = a.dtype.dtype();
    let seed = seed_or_clock(a.seed);
    println!(
        "decode_bench: backend {} devices {d} dtype {dt} input seed {seed}",
        world.backend().name()
    );
    let mut rows = Vec::new();
    let ar = FusionExecutor::new(allreduce(dt)?);
    for bytes in list(&a.sizes) {
        collect(
            &mut rows,
            world.run(|rank| allreduce_rows(rank, &a, &ar, bytes, seed))?,
        );
    }
    let (ag, rs) = (
        FusionExecutor::new(fusion_bench::fusions::allgather(dt)?),
        FusionExecutor::new(fusion_bench::fusions::reduce_scatter(dt)?),
    );
    for bytes in list(&a.gather_sizes) {
        collect(
            &mut rows,
            world.run(|rank| gather_scatter_rows(rank, &a, (&ag, &rs), bytes, seed))?,
        );
    }
    if !a.no_gemm {
        let (mar, g) = (
            FusionExecutor::new(matmul_allreduce(dt)?),
            FusionExecutor::new(gemm(dt)?),
        );
        for spec in a.gemms.split(';') {
            let parts: Vec<&str> = spec.split(':').collect();
            let [name, k, n] = parts.as_slice() else {
                return Err(fusion::Error::World(format!(
                    "bad GEMM shape `{spec}`: name:K:N"
                )));
            };
            let (k, n): (usize, usize) = (k.parse().unwrap_or(0), n.parse().unwrap_or(0));
            for m in list(&a.rows) {
                collect(
                    &mut rows,
                    world.run(|rank| gemm_rows(rank, &a, (&mar, &g), (name, k, n, m), seed))?,
                );
            }
        }
    }
    if let Some(path) = &a.json {
        let text: String = rows
            .iter()
            .map(|r| {
                serde_json::json!({"what": r.what, "variant": r.variant, "mode": r.mode, "devices": d,
                    "us": r.us(), "rank_us": r.rank_us, "relerr": r.relerr})
                .to_string()
                    + "\n"
            })
            .collect();
        write_file(path, text)?;
    }
    print_tables(&rows, d);
    Ok(())
}

fn print_tables(rows: &[Row], d: usize) {
    let get = |what: &str, variant: &str, mode: &str| {
        rows.iter()
            .find(|r| r.what == what && r.variant == variant && r.mode == mode)
            .map_or(f64::NAN, Row::us)
    };
    let mut whats: Vec<&str> = Vec::new();
    for r in rows {
        if !whats.contains(&r.what.as_str()) {
            whats.push(&r.what);
        }
    }
    println!(
        "\n| D = {d} | ours graph | peer (GEMM rows: apart) graph | NCCL graph | ours replay | NCCL replay | GEMM graph | ours - GEMM |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for w in whats {
        let g = get(w, "gemm", "graph");
        let ours = get(w, "ours", "graph");
        println!(
            "| {w} | {ours:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {g:.2} | {:.2} |",
            match get(w, "peer", "graph") {
                us if us.is_nan() => get(w, "apart", "graph"),
                us => us,
            },
            get(w, "nccl", "graph"),
            get(w, "ours", "replay"),
            get(w, "nccl", "replay"),
            ours - g
        );
    }
}
