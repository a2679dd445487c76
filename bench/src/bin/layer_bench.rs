//! Layer benchmark: the tensor-parallel MLP block (and the gated MLP) as one fusion,
//! against its components alone in our runtime, on every device of the world.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin layer_bench -- --json layers.jsonl
//! ```
//!
//! Per shape (M, H, F): the NCCL AllGather of x and ReduceScatter of the partial result
//! alone, each GEMM alone (`[M, H] x [H, F/D]`, `[M, F/D] x [F/D, H]`), our sequential
//! program (the same fusion without stream lowering: AllGather, GEMMs, ReduceScatter), and
//! the pipelined fusion with its default options and with other row-range counts. Every
//! variant's result is compared with the sequential result of the same run before it is
//! timed. Times are CUDA-event medians of `--iters` calls, all ranks released together,
//! the slowest rank's median; the bound is max(AG + RS, sum of the GEMMs). Inputs are fresh
//! uniform random values each run (the seed is printed).

/// The MLP blocks of the `tp_mlp` lesson.
#[path = "../../../examples/tp_mlp/blocks.rs"]
mod blocks;

use clap::Parser;
use fusion::compiler::ir::Fusion;
use fusion::{ExecOptions, FusionExecutor, Rank, Result, Tensor, World};
use fusion_bench::cli::{list, seed_or_clock, write_file};
use fusion_bench::finish::finish;
use fusion_bench::fusions as components;
use fusion_bench::measure::{device_ms, random_scaled, rel_error};
use fusion_bench::Dt;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices).
    #[arg(long)]
    devices: Option<usize>,
    /// Shapes as M,H,F separated by `;` (M rows of x, hidden H, FFN width F).
    #[arg(
        long,
        default_value = "8192,4096,14336;8192,8192,28672;16384,8192,28672"
    )]
    shapes: String,
    /// `mlp`, `gated` or both.
    #[arg(long, default_value = "mlp,gated")]
    blocks: String,
    #[arg(long, value_enum, default_value_t = Dt::Bf16)]
    dtype: Dt,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
    /// Row ranges per chunk to try besides the default (2).
    #[arg(long, default_value = "1,4")]
    row_ranges: String,
    /// Worker streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// Write every measurement as JSON lines here.
    #[arg(long)]
    json: Option<String>,
    /// Seed of the random inputs (default: from the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Small shapes and few calls, for a run on simulated devices.
    #[arg(long)]
    quick: bool,
}

/// One measured variant (ms: the slowest rank's median).
struct Row {
    block: &'static str,
    shape: (usize, usize, usize),
    devices: usize,
    dtype: &'static str,
    variant: String,
    ms: f64,
    rank_ms: Vec<f64>,
    relerr: f64,
    peak_bytes: usize,
}

impl Row {
    fn json(&self) -> String {
        let ranks: Vec<String> = self.rank_ms.iter().map(|x| format!("{x:.4}")).collect();
        let (m, h, f) = self.shape;
        format!(
            "{{\"source\": \"ours\", \"op\": \"{}\", \"M\": {m}, \"H\": {h}, \"F\": {f}, \"D\": {}, \"dtype\": \"{}\", \"case\": \"{}\", \"ms\": {:.4}, \"rank_ms\": [{}], \"relerr\": {:.3e}, \"peak_bytes\": {}}}",
            self.block,
            self.devices,
            self.dtype,
            self.variant,
            self.ms,
            ranks.join(", "),
            self.relerr,
            self.peak_bytes
        )
    }
}

/// What one rank measured: (variant, ms, relerr, peak bytes).
type Samples = Vec<(String, f64, f64, usize)>;

struct Execs {
    block: FusionExecutor,
    allgather: FusionExecutor,
    reduce_scatter: FusionExecutor,
    gemm: FusionExecutor,
    err: FusionExecutor,
}

fn sequential() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower = o.lower.without_pass("StreamParallelType");
    o
}

/// The block's inputs on this rank: x `[1, m, h]`, then the weights (`[1, h, f]` per up
/// projection, `[1, f, h]` down), scaled like a layer's initialization.
fn inputs(
    rank: &Rank,
    a: &Args,
    gated: bool,
    shape: (usize, usize, usize),
    seed: u64,
) -> Result<Vec<Tensor>> {
    let (mm, h, ff) = shape;
    let d = rank.world_size();
    let (m, f) = (mm / d, ff / d);
    let dt = a.dtype.dtype();
    let s = seed.wrapping_add(1000 * rank.index() as u64);
    let mut host = vec![random_scaled(&[1, m, h], dt, s, 1.0)?];
    let up = 1.0 / (h as f32).sqrt();
    for i in 0..(1 + usize::from(gated)) {
        host.push(random_scaled(&[1, h, f], dt, s + 1 + i as u64, up)?);
    }
    host.push(random_scaled(
        &[1, f, h],
        dt,
        s + 5,
        1.0 / (ff as f32).sqrt(),
    )?);
    host.iter().map(|t| rank.to_device(t)).collect()
}

/// Times `exec` on `ins`; the output and its relative error against `reference`.
fn timed(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    exec: &FusionExecutor,
    ins: &[&Tensor],
    o: &ExecOptions,
    reference: Option<&Tensor>,
) -> Result<(f64, f64, usize, Tensor)> {
    // Checked first, then timed.
    let report = exec.run_with(rank, ins, None, o)?;
    let out = report.outputs[0].clone();
    let relerr = match reference {
        Some(r) => rel_error(rank, &e.err, &out, r)?,
        None => 0.0,
    };
    let ms = device_ms(rank, a.iters, a.warmup, || {
        exec.run_with(rank, ins, None, o).map(|_| ())
    })?;
    Ok((ms, relerr, report.stats.peak_live_bytes, out))
}

/// Every variant of one block and shape, on one rank.
fn run_block(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    gated: bool,
    shape: (usize, usize, usize),
    seed: u64,
) -> Result<Samples> {
    let d = rank.world_size();
    let (mm, h, _) = shape;
    let ins = inputs(rank, a, gated, shape, seed)?;
    let refs: Vec<&Tensor> = ins.iter().collect();
    let mut out: Samples = Vec::new();
    let seq_o = sequential();
    let (ms, _, peak, reference) = timed(rank, a, e, &e.block, &refs, &seq_o, None)?;
    out.push(("sequential".into(), ms, 0.0, peak));
    let mut o = ExecOptions {
        number_of_streams: a.streams,
        lower: fusion::LowerOptions {
            pipelines: fusion::PipelineOptions {
                pipelining: fusion::Pipelining::Always, // compared with the sequential plan
                ..Default::default()
            },
            ..fusion::LowerOptions::default()
        },
        ..ExecOptions::default()
    };
    let (ms, err, peak, _) = timed(rank, a, e, &e.block, &refs, &o, Some(&reference))?;
    out.push(("pipelined".into(), ms, err, peak));
    for c in list(&a.row_ranges) {
        o.lower.pipelines.reduce_scatter_subchunks = Some(c);
        let (ms, err, peak, _) = timed(rank, a, e, &e.block, &refs, &o, Some(&reference))?;
        out.push((format!("pipelined_rows{c}"), ms, err, peak));
    }
    // Components alone.
    let (ms, _, _, gathered) = timed(rank, a, e, &e.allgather, &[&ins[0]], &seq_o, None)?;
    out.push(("ag_alone".into(), ms, 0.0, 0));
    let rows = gathered.reshape(&[1, mm, h])?;
    let w_up = ins[1].squeeze(0)?;
    let (ms, _, _, hidden) = timed(rank, a, e, &e.gemm, &[&rows, &w_up], &seq_o, None)?;
    out.push(("gemm_up_alone".into(), ms, 0.0, 0));
    let w_down = ins[ins.len() - 1].squeeze(0)?;
    let (ms, _, _, partial) = timed(rank, a, e, &e.gemm, &[&hidden, &w_down], &seq_o, None)?;
    out.push(("gemm_down_alone".into(), ms, 0.0, 0));
    let partial = partial.reshape(&[1, d, mm / d, h])?;
    let (ms, _, _, _) = timed(rank, a, e, &e.reduce_scatter, &[&partial], &seq_o, None)?;
    out.push(("rs_alone".into(), ms, 0.0, 0));
    Ok(out)
}

fn build(r: std::result::Result<Fusion, fusion::compiler::Error>) -> Result<FusionExecutor> {
    Ok(FusionExecutor::new(r?))
}

fn main() -> std::process::ExitCode {
    finish(run())
}

fn run() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        a.shapes = "64,32,48;128,64,96".into();
        a.iters = 3;
        a.warmup = 1;
    }
    let world = World::auto(a.devices)?;
    let d = world.size();
    let dt = a.dtype.dtype();
    println!(
        "layer_bench: backend {} devices {d} dtype {dt}",
        world.backend().name()
    );
    let seed = seed_or_clock(a.seed);
    println!("layer_bench: input seed {seed}");
    let mut rows: Vec<Row> = Vec::new();
    for shape_s in a.shapes.split(';') {
        let v = list(shape_s);
        let &[m, h, f] = v.as_slice() else {
            return Err(fusion::Error::World(format!(
                "bad shape `{shape_s}`: M,H,F"
            )));
        };
        if m % d != 0 || f % d != 0 {
            println!("skipping {m},{h},{f}: M and F must divide by {d}");
            continue;
        }
        for block in a.blocks.split(',').map(str::trim) {
            let gated = match block {
                "mlp" => false,
                "gated" => true,
                other => return Err(fusion::Error::World(format!("unknown block {other}"))),
            };
            let e = Execs {
                block: if gated {
                    build(blocks::gated_mlp::build(dt))?
                } else {
                    build(blocks::mlp::build(dt))?
                },
                allgather: FusionExecutor::new(components::allgather(dt)?),
                reduce_scatter: FusionExecutor::new(components::reduce_scatter(dt)?),
                gemm: FusionExecutor::new(components::gemm(dt)?),
                err: FusionExecutor::new(components::squared_error(dt)?),
            };
            let per_rank = world.run(|rank| run_block(rank, &a, &e, gated, (m, h, f), seed))?;
            let name = if gated { "GatedMLP" } else { "MLP" };
            for (i, (variant, _, _, peak)) in per_rank[0].iter().enumerate() {
                let rank_ms: Vec<f64> = per_rank.iter().map(|r| r[i].1).collect();
                let row = Row {
                    block: name,
                    shape: (m, h, f),
                    devices: d,
                    dtype: dt.name(),
                    variant: variant.clone(),
                    ms: rank_ms.iter().copied().fold(0.0, f64::max),
                    relerr: per_rank.iter().map(|r| r[i].2).fold(0.0, f64::max),
                    rank_ms,
                    peak_bytes: *peak,
                };
                println!(
                    "{name:9} {m:>6} {h:>6} {f:>6} {:<22} {:8.3} ms  relerr {:.2e}",
                    row.variant, row.ms, row.relerr
                );
                rows.push(row);
            }
        }
    }
    if let Some(path) = &a.json {
        let text: String = rows.iter().map(|r| r.json() + "\n").collect();
        write_file(path, text)?;
    }
    print_table(&rows);
    Ok(())
}

/// Ours against the bound per block and shape: max(AG + RS, the GEMMs alone) (the gated
/// block has two up projections of the same shape).
fn print_table(rows: &[Row]) {
    println!(
        "\n| block | M, H, F | D | AG + RS | GEMMs | bound | sequential | ours | ours / bound |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut keys: Vec<(&str, (usize, usize, usize))> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.block, r.shape)) {
            keys.push((r.block, r.shape));
        }
    }
    for (block, shape) in keys {
        let get = |v: &str| {
            rows.iter()
                .find(|r| r.block == block && r.shape == shape && r.variant == v)
                .map_or(f64::NAN, |r| r.ms)
        };
        let ups = if block == "GatedMLP" { 2.0 } else { 1.0 };
        let comm = get("ag_alone") + get("rs_alone");
        let gemms = ups * get("gemm_up_alone") + get("gemm_down_alone");
        let bound = comm.max(gemms);
        let ours = rows
            .iter()
            .filter(|r| r.block == block && r.shape == shape && r.variant.starts_with("pipelined"))
            .map(|r| r.ms)
            .fold(f64::INFINITY, f64::min);
        let (m, h, f) = shape;
        let d = rows.first().map_or(0, |r| r.devices);
        println!(
            "| {block} | {m}, {h}, {f} | {d} | {comm:.3} | {gemms:.3} | {bound:.3} | {:.3} | {ours:.3} | {:.2} |",
            get("sequential"),
            ours / bound
        );
    }
}
