//! Layer benchmark: the tensor-parallel MLP block (and the gated MLP) as one fusion,
//! against its components alone in our runtime, on every device of the world.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin layer_bench -- --json layers.jsonl
//! ```
//!
//! Per shape (M, H, F): the NCCL AllGather of x and ReduceScatter of the partial result
//! alone, each GEMM alone (`[M, H] x [H, F/D]`, `[M, F/D] x [F/D, H]`), our sequential
//! program (the same fusion without stream lowering: AllGather, GEMMs, ReduceScatter), the
//! pipelined fusion with options set by hand (other row-range counts, and every distinct
//! candidate of the plan space as `plan_<name>`), and `default`: the block called with
//! `ExecOptions::default()`, as a user calls it, whose plan is chosen at the first call
//! (tuned on GPUs, or read from `--plan-file`); that first call is timed apart (host
//! clock, tuning included) and its plan, plan source and tuning time are reported. The
//! MLP block is also timed as written in other equivalent ways (`form_<name>`,
//! `fusion_bench::layer_forms`), with default options. Every variant's result is compared
//! with the sequential result of the same run before it is timed. Times are CUDA-event
//! medians of `--iters` calls, all ranks released together, the slowest rank's median;
//! the bound is max(AG + RS, sum of the GEMMs). Inputs are fresh uniform random values
//! each run (the seed is printed).

/// The MLP blocks of the `tp_mlp` lesson.
#[path = "../../../examples/tp_mlp/blocks.rs"]
mod blocks;

use std::path::PathBuf;

use clap::Parser;
use fusion::compiler::ir::Fusion;
use fusion::compiler::plan;
use fusion::{ExecOptions, FusionExecutor, PlanMode, Rank, Result, Tensor, World};
use fusion_bench::cli::{list, seed_or_clock, write_file};
use fusion_bench::finish::finish;
use fusion_bench::first_call::{first_call, PlanInfo};
use fusion_bench::fusions as components;
use fusion_bench::layer_forms::{self, Form};
use fusion_bench::measure::{device_ms, median, random_scaled, rel_error};
use fusion_bench::Dt;
use serde_json::json;

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
    /// Rounds of every alternating measurement (the default call against the best option,
    /// each form against its baseline): each round times both sides for half `--iters`
    /// calls; the medians over the rounds are compared.
    #[arg(long, default_value_t = 9)]
    ab_rounds: usize,
    /// Row ranges per chunk to try besides the default (2).
    #[arg(long, default_value = "1,4")]
    row_ranges: String,
    /// Worker streams.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// The plan file of the default calls (`ExecOptions::plan_file`): a second process
    /// given the same file runs the plans the first one tuned, without tuning.
    #[arg(long)]
    plan_file: Option<PathBuf>,
    /// Only the default calls and the forms (no variants set by hand, no components).
    #[arg(long)]
    only_default: bool,
    /// Forms of the MLP block to time (`all`, `none`, or names from
    /// `fusion_bench::layer_forms`, comma-separated).
    #[arg(long, default_value = "all")]
    forms: String,
    /// Skip the `plan_<name>` variants (every distinct plan candidate set by hand).
    #[arg(long)]
    no_candidates: bool,
    /// Only these plan candidates as `plan_<name>` rows (names, comma-separated).
    #[arg(long)]
    plans: Option<String>,
    /// After timing each `plan_<name>` row, one more call of it traced into
    /// `<dir>/plan_<name>` (`ExecOptions::trace_dir`: every node's host span and the
    /// device intervals of its kernels and transfers, per rank).
    #[arg(long)]
    trace_dir: Option<PathBuf>,
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

/// One measured variant on one rank.
#[derive(Clone, Debug)]
struct Sample {
    variant: String,
    ms: f64,
    relerr: f64,
    peak: usize,
    /// For the calls with default options.
    plan: Option<PlanInfo>,
    /// The row a form is compared with.
    baseline: Option<String>,
    /// For `ab_best`: the variant set by hand that was fastest.
    best_variant: Option<String>,
    /// For a form: its time and its baseline's on this rank, timed in alternation.
    ab_times: Option<(f64, f64)>,
    /// For a form over the ranks: the slowest rank's alternating time over the slowest
    /// rank's alternating time of its baseline.
    ab_ratio: Option<f64>,
}

impl Sample {
    fn new(variant: impl Into<String>, ms: f64, relerr: f64, peak: usize) -> Self {
        Sample {
            variant: variant.into(),
            ms,
            relerr,
            peak,
            plan: None,
            baseline: None,
            best_variant: None,
            ab_times: None,
            ab_ratio: None,
        }
    }
}

/// One measured variant over the ranks (ms: the slowest rank's median).
struct Row {
    block: &'static str,
    shape: (usize, usize, usize),
    devices: usize,
    dtype: &'static str,
    /// Rank 0's sample with the slowest rank's times and the largest error.
    s: Sample,
    rank_ms: Vec<f64>,
}

impl Row {
    /// The row of variant `i` from every rank's samples.
    fn new(
        block: &'static str,
        shape: (usize, usize, usize),
        dtype: &'static str,
        per_rank: &[Vec<Sample>],
        i: usize,
    ) -> Row {
        let worst =
            |f: &dyn Fn(&Sample) -> f64| per_rank.iter().map(|r| f(&r[i])).fold(0.0, f64::max);
        let mut s = per_rank[0][i].clone();
        s.ms = worst(&|s| s.ms);
        s.relerr = worst(&|s| s.relerr);
        if s.ab_times.is_some() {
            let x = worst(&|s| s.ab_times.map_or(0.0, |t| t.0));
            let y = worst(&|s| s.ab_times.map_or(0.0, |t| t.1));
            s.ab_ratio = Some(x / y);
        }
        if let Some(p) = &mut s.plan {
            p.tuning_ms = worst(&|s| s.plan.as_ref().map_or(0.0, |p| p.tuning_ms));
            p.first_call_ms = worst(&|s| s.plan.as_ref().map_or(0.0, |p| p.first_call_ms));
        }
        Row {
            block,
            shape,
            devices: per_rank.len(),
            dtype,
            rank_ms: per_rank.iter().map(|r| r[i].ms).collect(),
            s,
        }
    }

    fn json(&self) -> String {
        let (m, h, f) = self.shape;
        let mut v = json!({
            "source": "ours", "op": self.block, "M": m, "H": h, "F": f, "D": self.devices,
            "dtype": self.dtype, "case": self.s.variant, "ms": r4(self.s.ms),
            "rank_ms": self.rank_ms.iter().copied().map(r4).collect::<Vec<_>>(),
            "relerr": self.s.relerr, "peak_bytes": self.s.peak,
        });
        if let Some(p) = &self.s.plan {
            v["plan"] = json!(p.plan);
            v["plan_source"] = json!(p.source);
            v["tuning_ms"] = json!(r4(p.tuning_ms));
            v["first_call_ms"] = json!(r4(p.first_call_ms));
        }
        if let Some(b) = &self.s.baseline {
            v["baseline"] = json!(b);
        }
        if let Some(b) = &self.s.best_variant {
            v["best_variant"] = json!(b);
        }
        if let Some(x) = self.s.ab_ratio {
            v["ab_ratio"] = json!((x * 1e4).round() / 1e4);
        }
        v.to_string()
    }
}

/// `x` rounded to 4 decimals (times in ms).
fn r4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

struct Execs {
    block: FusionExecutor,
    /// The block's fusion again, to list its distinct plan candidates (a decision by the
    /// cost model) without deciding the plan of `block`.
    probe: FusionExecutor,
    allgather: FusionExecutor,
    reduce_scatter: FusionExecutor,
    gemm: FusionExecutor,
    err: FusionExecutor,
    /// The MLP block written in other ways (none for the gated block).
    forms: Vec<(Form, FusionExecutor)>,
}

impl Execs {
    /// Plan decisions that timed candidates, over all ranks.
    fn tunings(&self) -> usize {
        self.block.tunings() + self.forms.iter().map(|(_, e)| e.tunings()).sum::<usize>()
    }
}

fn sequential() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower = o.lower.without_pass("StreamParallelType");
    o
}

/// What a user passes: default options (the plan chosen at the first call), and the plan
/// file if given.
fn default_options(a: &Args) -> ExecOptions {
    ExecOptions {
        plan_file: a.plan_file.clone(),
        ..ExecOptions::default()
    }
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

/// `exec` called as a user calls it (default options): the first call, where the plan
/// is chosen, timed on the host until the device is done, then checked against
/// `reference` and timed like the other variants.
fn timed_default(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    exec: &FusionExecutor,
    ins: &[&Tensor],
    reference: &Tensor,
    variant: String,
) -> Result<Sample> {
    let o = default_options(a);
    // Rank 0 prints the candidates and their tuned times, to compare with the
    // `plan_<name>` rows.
    let what = format!("{variant} (x {:?} per rank)", ins[0].shape());
    let (info, report) = first_call(rank, &what, || exec.run_with(rank, ins, None, &o))?;
    let relerr = rel_error(rank, &e.err, &report.outputs[0], reference)?;
    let ms = device_ms(rank, a.iters, a.warmup, || {
        exec.run_with(rank, ins, None, &o).map(|_| ())
    })?;
    let mut s = Sample::new(variant, ms, relerr, report.stats.peak_live_bytes);
    s.plan = Some(info);
    Ok(s)
}

/// The distinct plan candidates of the block at these inputs, as the plan choice sees
/// them (the cost model's decision on a separate executor lists them; nothing is timed).
fn distinct_candidates(rank: &Rank, e: &Execs, ins: &[&Tensor]) -> Result<Vec<plan::Plan>> {
    let o = ExecOptions {
        plan: PlanMode::Model,
        ..ExecOptions::default()
    };
    let report = e.probe.run_with(rank, ins, None, &o)?;
    let d = rank.world_size();
    Ok(report.plan.map_or_else(Vec::new, |p| {
        (p.candidates.iter())
            .filter_map(|c| plan::find(d, &c.name))
            .collect()
    }))
}

/// The block with options set by hand: pipelined with row-range counts, and every
/// distinct plan candidate (`plan_<name>`) unless `--no-candidates`.
fn hand_set_variants(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    ins: &[&Tensor],
    reference: &Tensor,
    out: &mut Vec<Sample>,
    hand: &mut Vec<(String, ExecOptions)>,
) -> Result<()> {
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
    let mut one = |name: String, o: &ExecOptions| -> Result<()> {
        let (ms, err, peak, _) = timed(rank, a, e, &e.block, ins, o, Some(reference))?;
        out.push(Sample::new(name.clone(), ms, err, peak));
        hand.push((name, o.clone()));
        Ok(())
    };
    one("pipelined".into(), &o)?;
    for c in list(&a.row_ranges) {
        o.lower.pipelines.reduce_scatter_subchunks = Some(c);
        one(format!("pipelined_rows{c}"), &o)?;
    }
    if a.no_candidates {
        return Ok(());
    }
    let picked =
        |name: &str| (a.plans.as_deref()).is_none_or(|p| p.split(',').any(|n| n.trim() == name));
    for c in distinct_candidates(rank, e, ins)? {
        if !picked(&c.name) {
            continue;
        }
        let mut o = ExecOptions {
            lower: c.lower,
            number_of_streams: c.number_of_streams,
            plan: PlanMode::Default, // the "default" candidate too: nothing chosen
            ..ExecOptions::default()
        };
        let name = format!("plan_{}", c.name);
        one(name.clone(), &o)?;
        if let Some(dir) = &a.trace_dir {
            o.trace_dir = Some(dir.join(&name));
            e.block.run_with(rank, ins, None, &o)?;
        }
    }
    Ok(())
}

/// The default call and the fastest variant set by hand (by the slowest rank, agreed over
/// the ranks), timed again in alternation, so that drift between measurements taken
/// minutes apart does not decide a difference of a few percent: rows `ab_default` and
/// `ab_best` (the median of the rounds' medians).
fn interleaved(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    ins: &[&Tensor],
    out: &[Sample],
    hand: &[(String, ExecOptions)],
) -> Result<Vec<Sample>> {
    let ns = |name: &str| {
        (out.iter())
            .find(|s| s.variant == name)
            .map_or(i64::MAX, |s| (s.ms * 1e6) as i64)
    };
    let mine: Vec<i64> = hand.iter().map(|(name, _)| ns(name)).collect();
    let all = rank.communicator().exchange(&mine)?;
    let slowest = |j: usize| all.iter().filter_map(|v| v.get(j)).copied().max();
    let Some(best) = (0..hand.len()).min_by_key(|&j| (slowest(j), j)) else {
        return Ok(Vec::new());
    };
    let (name, best_o) = &hand[best];
    let default_o = default_options(a);
    let (d, b) = alternating(
        rank,
        a,
        (&e.block, ins, &default_o),
        (&e.block, ins, best_o),
    )?;
    let mut best_row = Sample::new("ab_best", b, 0.0, 0);
    best_row.best_variant = Some(name.clone());
    Ok(vec![Sample::new("ab_default", d, 0.0, 0), best_row])
}

/// A call to time: the executor, its inputs and options.
type Call<'a> = (&'a FusionExecutor, &'a [&'a Tensor], &'a ExecOptions);

/// `x` and `y` timed in turn for `--ab-rounds` rounds of half the iterations: the median of
/// each one's round medians, ms.
fn alternating(rank: &Rank, a: &Args, x: Call<'_>, y: Call<'_>) -> Result<(f64, f64)> {
    let iters = (a.iters / 2).max(3);
    let (mut xs, mut ys) = (Vec::new(), Vec::new());
    for _ in 0..a.ab_rounds.max(1) {
        for ((exec, ins, o), v) in [(x, &mut xs), (y, &mut ys)] {
            v.push(device_ms(rank, iters, 1, || {
                exec.run_with(rank, ins, None, o).map(|_| ())
            })?);
        }
    }
    Ok((median(xs), median(ys)))
}

/// The components alone: AllGather, the GEMMs, ReduceScatter.
fn component_variants(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    ins: &[Tensor],
    shape: (usize, usize, usize),
    out: &mut Vec<Sample>,
) -> Result<()> {
    let d = rank.world_size();
    let (mm, h, _) = shape;
    let seq_o = sequential();
    let (ms, _, _, gathered) = timed(rank, a, e, &e.allgather, &[&ins[0]], &seq_o, None)?;
    out.push(Sample::new("ag_alone", ms, 0.0, 0));
    let rows = gathered.reshape(&[1, mm, h])?;
    let w_up = ins[1].squeeze(0)?;
    let (ms, _, _, hidden) = timed(rank, a, e, &e.gemm, &[&rows, &w_up], &seq_o, None)?;
    out.push(Sample::new("gemm_up_alone", ms, 0.0, 0));
    let w_down = ins[ins.len() - 1].squeeze(0)?;
    let (ms, _, _, partial) = timed(rank, a, e, &e.gemm, &[&hidden, &w_down], &seq_o, None)?;
    out.push(Sample::new("gemm_down_alone", ms, 0.0, 0));
    let partial = partial.reshape(&[1, d, mm / d, h])?;
    let (ms, _, _, _) = timed(rank, a, e, &e.reduce_scatter, &[&partial], &seq_o, None)?;
    out.push(Sample::new("rs_alone", ms, 0.0, 0));
    Ok(())
}

/// The MLP block's other forms with default options: checked against the project's form
/// (`reference`, compared with the `default` row), the bias forms against the first bias
/// form's sequential result (and compared with that form's row); each then timed in
/// alternation with the call it is compared with (`ab_ratio`).
fn form_variants(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    ins: &[Tensor],
    reference: &Tensor,
    seed: u64,
    out: &mut Vec<Sample>,
) -> Result<()> {
    let bias = if e.forms.iter().any(|(f, _)| f.biased()) {
        let f = ins[1].shape()[2];
        let s = seed.wrapping_add(1000 * rank.index() as u64 + 7);
        Some(rank.to_device(&random_scaled(&[1, 1, f], a.dtype.dtype(), s, 0.5)?)?)
    } else {
        None
    };
    let o = default_options(a);
    let project = (
        "default".to_string(),
        reference.clone(),
        &e.block,
        ins.to_vec(),
    );
    // (row name, result, executor, inputs) of the first bias form.
    let mut bias_reference = None;
    for (form, exec) in &e.forms {
        let name = format!("form_{}", form.name);
        let form_ins = form.inputs(rank, &ins[0], &ins[1], &ins[2], bias.as_ref())?;
        let refs: Vec<&Tensor> = form_ins.iter().collect();
        if form.biased() && bias_reference.is_none() {
            let r = exec.run_with(rank, &refs, None, &sequential())?;
            let first = (name.clone(), r.outputs[0].clone(), exec, form_ins.clone());
            bias_reference = Some(first);
        }
        let base = match (&bias_reference, form.biased()) {
            (Some(b), true) => b,
            _ => &project,
        };
        let mut s = timed_default(rank, a, e, exec, &refs, &base.1, name.clone())?;
        if base.0 != name {
            let base_refs: Vec<&Tensor> = base.3.iter().collect();
            let (x, y) = alternating(rank, a, (exec, &refs, &o), (base.2, &base_refs, &o))?;
            s.ab_times = Some((x, y));
        }
        s.baseline = Some(base.0.clone());
        out.push(s);
    }
    Ok(())
}

/// Every variant of one block and shape, on one rank.
fn run_block(
    rank: &Rank,
    a: &Args,
    e: &Execs,
    gated: bool,
    shape: (usize, usize, usize),
    seed: u64,
) -> Result<Vec<Sample>> {
    let ins = inputs(rank, a, gated, shape, seed)?;
    let refs: Vec<&Tensor> = ins.iter().collect();
    let mut out: Vec<Sample> = Vec::new();
    let seq_o = sequential();
    let reference = if a.only_default {
        let r = e.block.run_with(rank, &refs, None, &seq_o)?;
        r.outputs[0].clone()
    } else {
        let (ms, _, peak, reference) = timed(rank, a, e, &e.block, &refs, &seq_o, None)?;
        out.push(Sample::new("sequential", ms, 0.0, peak));
        reference
    };
    out.push(timed_default(
        rank,
        a,
        e,
        &e.block,
        &refs,
        &reference,
        "default".into(),
    )?);
    if !a.only_default {
        let mut hand = vec![("sequential".to_string(), seq_o.clone())];
        hand_set_variants(rank, a, e, &refs, &reference, &mut out, &mut hand)?;
        let ab = interleaved(rank, a, e, &refs, &out, &hand)?;
        out.extend(ab);
        component_variants(rank, a, e, &ins, shape, &mut out)?;
    }
    form_variants(rank, a, e, &ins, &reference, seed, &mut out)?;
    Ok(out)
}

fn build(r: fusion::compiler::Result<Fusion>) -> Result<FusionExecutor> {
    Ok(FusionExecutor::new(r?))
}

/// The executors of one block (`gated` or the MLP block with its forms).
fn executors(a: &Args, gated: bool) -> Result<Execs> {
    let dt = a.dtype.dtype();
    let block = || {
        if gated {
            blocks::gated_mlp::build(dt)
        } else {
            blocks::mlp::build(dt)
        }
    };
    let forms = if gated {
        Vec::new()
    } else {
        (layer_forms::pick(&a.forms)?.into_iter())
            .map(|f| {
                let exec = build((f.build)(dt))?.with_name(&format!("form_{}", f.name));
                Ok((f, exec))
            })
            .collect::<Result<Vec<_>>>()?
    };
    Ok(Execs {
        block: build(block())?.with_name(if gated { "gated_mlp" } else { "mlp" }),
        probe: build(block())?,
        allgather: FusionExecutor::new(components::allgather(dt)?),
        reduce_scatter: FusionExecutor::new(components::reduce_scatter(dt)?),
        gemm: FusionExecutor::new(components::gemm(dt)?),
        err: FusionExecutor::new(components::squared_error(dt)?),
        forms,
    })
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
    layer_forms::pick(&a.forms)?; // a wrong name fails before any device work
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
    let mut tunings = 0;
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
            let e = executors(&a, gated)?;
            let per_rank = world.run(|rank| run_block(rank, &a, &e, gated, (m, h, f), seed))?;
            tunings += e.tunings();
            let name = if gated { "GatedMLP" } else { "MLP" };
            for i in 0..per_rank[0].len() {
                let row = Row::new(name, (m, h, f), dt.name(), &per_rank, i);
                print_row(&row);
                rows.push(row);
            }
        }
    }
    if let Some(path) = &a.json {
        let text: String = rows.iter().map(|r| r.json() + "\n").collect();
        write_file(path, text)?;
    }
    print_table(&rows);
    let from_file = (rows.iter())
        .filter(|r| r.s.plan.as_ref().is_some_and(|p| p.source == "file"))
        .count();
    // An executor counts one decision per rank.
    println!(
        "plan decisions: {} tuned, {from_file} from the plan file",
        tunings / d
    );
    Ok(())
}

/// One row on the console; a default call's plan after it.
fn print_row(row: &Row) {
    let (m, h, f) = row.shape;
    print!(
        "{:9} {m:>6} {h:>6} {f:>6} {:<26} {:8.3} ms  relerr {:.2e}",
        row.block, row.s.variant, row.s.ms, row.s.relerr
    );
    if let Some(p) = &row.s.plan {
        print!(
            "  plan {} ({}, tuning {:.0} ms, first call {:.1} ms)",
            p.plan, p.source, p.tuning_ms, p.first_call_ms
        );
    }
    println!();
}

/// True for the block itself run with some options (not a component, not a form).
fn is_option_variant(v: &str) -> bool {
    v == "sequential" || v == "default" || v.starts_with("pipelined") || v.starts_with("plan_")
}

/// Ours against the bound per block and shape: max(AG + RS, the GEMMs alone) (the gated
/// block has two up projections of the same shape); the default call against the best
/// variant any options give.
fn print_table(rows: &[Row]) {
    println!(
        "\n| block | M, H, F | D | AG + RS | GEMMs | bound | sequential | ours | ours / bound | default | best option | default / best |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut keys: Vec<(&str, (usize, usize, usize))> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.block, r.shape)) {
            keys.push((r.block, r.shape));
        }
    }
    for (block, shape) in keys {
        let of_key = || (rows.iter()).filter(|r| r.block == block && r.shape == shape);
        let get = |v: &str| {
            of_key()
                .find(|r| r.s.variant == v)
                .map_or(f64::NAN, |r| r.s.ms)
        };
        let fastest = |keep: &dyn Fn(&str) -> bool| {
            of_key()
                .filter(|r| keep(&r.s.variant))
                .min_by(|x, y| x.s.ms.total_cmp(&y.s.ms))
        };
        let ups = if block == "GatedMLP" { 2.0 } else { 1.0 };
        let comm = get("ag_alone") + get("rs_alone");
        let gemms = ups * get("gemm_up_alone") + get("gemm_down_alone");
        let bound = comm.max(gemms);
        let ours = fastest(&|v| v.starts_with("pipelined")).map_or(f64::NAN, |r| r.s.ms);
        let (best_name, best) =
            fastest(&is_option_variant).map_or(("-", f64::NAN), |r| (r.s.variant.as_str(), r.s.ms));
        let (m, h, f) = shape;
        let d = rows.first().map_or(0, |r| r.devices);
        let default = get("default");
        println!(
            "| {block} | {m}, {h}, {f} | {d} | {comm:.3} | {gemms:.3} | {bound:.3} | {:.3} | {ours:.3} | {:.2} | {default:.3} | {best:.3} ({best_name}) | {:.3} |",
            get("sequential"),
            ours / bound,
            default / best
        );
    }
    for r in rows {
        let Some(b) = &r.s.best_variant else { continue };
        let default = (rows.iter())
            .find(|x| x.block == r.block && x.shape == r.shape && x.s.variant == "ab_default")
            .map_or(f64::NAN, |x| x.s.ms);
        let (m, h, f) = r.shape;
        println!(
            "{} {m},{h},{f}: default / {b} timed in alternation = {:.3}",
            r.block,
            default / r.s.ms
        );
    }
    for r in rows {
        let Some(b) = &r.s.baseline else { continue };
        let base = (rows.iter())
            .find(|x| x.block == r.block && x.shape == r.shape && &x.s.variant == b)
            .map_or(f64::NAN, |x| x.s.ms);
        let (m, h, f) = r.shape;
        print!(
            "{} {m},{h},{f}: {} / {b} = {:.3}",
            r.block,
            r.s.variant,
            r.s.ms / base
        );
        match r.s.ab_ratio {
            Some(x) => println!(" ({x:.3} timed in alternation)"),
            None => println!(),
        }
    }
}
