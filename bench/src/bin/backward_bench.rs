//! Backward benchmark: the derived backward (`#[backward]`) of tensor-parallel layers on
//! every device of the world: the sequence-parallel MLP block and the overlap benchmark's
//! seed layers AG+GEMM and GEMM+RS (`fusion_bench::backward_cases`), in bf16.
//!
//! ```sh
//! cargo run --release -p fusion-bench --bin backward_bench -- --json backward.jsonl
//! ```
//!
//! Per layer and shape: `backward`, the derived backward in its saving form (what training
//! uses: `name::backward_saved(rank, &saved, ..)` with the `Saved` of
//! `name::forward_saving`), called as a user calls it (default options: its plan chosen at
//! the first call, tuned on GPUs; that first call is timed apart on the host clock with its
//! plan and tuning time), its gradients checked against a reference made of single-device
//! GEMMs and the collectives alone; `backward_recompute`, the recomputing form
//! (`name::backward(rank, ..)`, which computes the forward's first GEMM again), checked
//! the same way; `forward` (the layer's own call) and `forward_saving` (the saving form's,
//! which also returns the saved values); `step`, a training step without the optimizer
//! (`forward_saving`, then `backward_saved`) and `step_recompute` (`forward`, then
//! `backward`); and each step of the reference alone (`gemm_<name>_alone`, the backward's
//! GEMMs at their whole shapes, `recompute` for the one only the recomputing form runs;
//! `ag_*_alone`, `rs_*_alone`, `act*_alone`, and `gemm_dact_slope_alone`, the first GEMM
//! with the derivative in its epilogue). Times are device-event medians of `--iters`
//! calls after `--warmup`, all ranks released together, the slowest rank's median; inputs
//! are fresh uniform random values each run (the seed is printed). A gradient off by more
//! than a bf16 tolerance fails the run after the rows are written.

use clap::Parser;
use fusion::{ExecOptions, FusionExecutor, Rank, Result, Tensor, World};
use fusion_bench::backward_cases::{Kernels, Kind, Op, Parts, Steps, DTYPE};
use fusion_bench::cli::{list, seed_or_clock, write_file};
use fusion_bench::finish::finish;
use fusion_bench::first_call::{first_call, PlanInfo};
use fusion_bench::fusions as components;
use fusion_bench::measure::{device_ms, rel_error};
use serde_json::json;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// Devices (default: every GPU, else 4 simulated devices).
    #[arg(long)]
    devices: Option<usize>,
    /// Layers: `mlp`, `ag` (AG+GEMM), `rs` (GEMM+RS), comma-separated.
    #[arg(long, default_value = "mlp,ag,rs")]
    ops: String,
    /// Shapes of AG+GEMM and GEMM+RS as M,K,N separated by `;` (the overlap benchmark's).
    #[arg(long, default_value = "8192,8192,8192;16384,8192,2048;16384,8192,8192")]
    shapes: String,
    /// Shapes of the MLP block as M,H,F separated by `;` (the layer benchmark's).
    #[arg(
        long,
        default_value = "8192,4096,14336;8192,8192,28672;16384,8192,28672"
    )]
    mlp_shapes: String,
    #[arg(long, default_value_t = 20)]
    iters: usize,
    #[arg(long, default_value_t = 5)]
    warmup: usize,
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

/// A layer's three sizes (`M, H, F` or `M, K, N`).
type Shape = (usize, usize, usize);

/// The largest relative error a bf16 gradient may have against the reference.
const TOLERANCE: f64 = 5e-2;

/// One measured case on one rank.
#[derive(Clone, Debug)]
struct Sample {
    case: String,
    /// `call`, `gemm`, `comm` or `elementwise`.
    kind: &'static str,
    ms: f64,
    /// The backward's largest relative error over its gradients.
    relerr: Option<f64>,
    /// For a GEMM alone: whether it recomputes a forward value.
    recompute: Option<bool>,
    plan: Option<PlanInfo>,
}

impl Sample {
    fn call(case: &str, ms: f64, plan: Option<PlanInfo>) -> Sample {
        Sample {
            case: case.into(),
            kind: "call",
            ms,
            relerr: None,
            recompute: None,
            plan,
        }
    }
}

/// The reference's steps, each run once (its output) and, when `time`, timed alone.
struct Timed<'a> {
    rank: &'a Rank,
    a: &'a Args,
    options: ExecOptions,
    time: bool,
    out: Vec<Sample>,
}

impl Steps for Timed<'_> {
    fn step(
        &mut self,
        name: &str,
        kind: Kind,
        exec: &FusionExecutor,
        inputs: &[&Tensor],
    ) -> Result<Tensor> {
        let (rank, o) = (self.rank, &self.options);
        let first = exec.run_with(rank, inputs, None, o)?.outputs[0].clone();
        if !self.time {
            return Ok(first);
        }
        let ms = device_ms(rank, self.a.iters, self.a.warmup, || {
            exec.run_with(rank, inputs, None, o).map(|_| ())
        })?;
        let (kind, recompute) = match kind {
            Kind::Gemm { recompute } => ("gemm", Some(recompute)),
            Kind::Comm => ("comm", None),
            Kind::Elementwise => ("elementwise", None),
            Kind::Fused => ("fused", None),
        };
        self.out.push(Sample {
            case: format!("{name}_alone"),
            kind,
            ms,
            relerr: None,
            recompute,
            plan: None,
        });
        Ok(first)
    }
}

/// Options set by hand, so that nothing is tuned (the reference's single-device steps and
/// collectives alone, as the layer benchmark's components).
fn fixed() -> ExecOptions {
    let mut o = ExecOptions::default();
    o.lower = o.lower.without_pass("StreamParallelType");
    o
}

/// The largest relative error of the gradients `got` against `reference` (same shapes).
fn gradient_error(
    rank: &Rank,
    err: &FusionExecutor,
    got: &[Tensor],
    reference: &[Tensor],
) -> Result<f64> {
    if got.len() != reference.len() {
        return Err(fusion::Error::World(format!(
            "the backward returned {} gradients, the reference {}",
            got.len(),
            reference.len()
        )));
    }
    let mut worst = 0.0f64;
    for (i, (g, r)) in got.iter().zip(reference).enumerate() {
        if g.shape() != r.shape() {
            return Err(fusion::Error::World(format!(
                "gradient {i} has shape {:?}, the reference {:?}",
                g.shape(),
                r.shape()
            )));
        }
        worst = worst.max(rel_error(rank, err, g, r)?);
    }
    Ok(worst)
}

/// Which form's rows a pass over the layers measures: the saving form first (the default
/// training step, with the reference's steps timed alone), then the recomputing one, so
/// that a run cut short keeps the saving form's rows of every layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pass {
    Saving,
    Recomputing,
}

/// One pass's cases of one layer and shape, on one rank.
#[allow(clippy::too_many_arguments)]
fn run_case(
    rank: &Rank,
    a: &Args,
    k: &Kernels,
    err: &FusionExecutor,
    op: Op,
    shape: Shape,
    seed: u64,
    pass: Pass,
) -> Result<Vec<Sample>> {
    let p: Parts = op.inputs(rank, shape, seed)?;
    let mut steps = Timed {
        rank,
        a,
        options: fixed(),
        time: pass == Pass::Saving,
        out: Vec::new(),
    };
    let reference = op.reference(k, &p, rank.world_size(), &mut steps)?;
    let c = Case {
        rank,
        a,
        err,
        op,
        p: &p,
        reference: &reference,
        what: format!("{} {shape:?}", op.name()),
    };
    let mut out = match pass {
        Pass::Saving => saving_rows(&c)?,
        Pass::Recomputing => recomputing_rows(&c)?,
    };
    out.extend(steps.out);
    Ok(out)
}

/// One layer and shape on one rank: its inputs, the reference gradients, and how to
/// measure and check.
struct Case<'a> {
    rank: &'a Rank,
    a: &'a Args,
    err: &'a FusionExecutor,
    op: Op,
    p: &'a Parts,
    reference: &'a [Tensor],
    /// The layer and shape, for the first calls' plan reports.
    what: String,
}

/// The saving form's rows: `backward` (`backward_saved`), `forward_saving` and `step`.
/// The first calls (on the executors the entry points call) choose the plans.
fn saving_rows(c: &Case) -> Result<Vec<Sample>> {
    let (rank, op, p) = (c.rank, c.op, c.p);
    let (o, iters, warmup) = (ExecOptions::default(), c.a.iters, c.a.warmup);
    let primals: Vec<&Tensor> = p.primals.iter().collect();
    let (_, saved) = op.forward_saving(rank, p)?;
    let call = op.saving_call(p, &saved)?;
    let (forward_plan, _) = first_call(rank, &format!("{} forward_saving", c.what), || {
        call.forward.run_with(rank, &primals, None, &o)
    })?;
    let refs: Vec<&Tensor> = call.inputs.iter().collect();
    let (plan, report) = first_call(rank, &format!("{} backward_saved", c.what), || {
        call.backward.run_with(rank, &refs, None, &o)
    })?;
    let relerr = gradient_error(rank, c.err, &report.outputs, c.reference)?;
    drop(report);
    let ms = device_ms(rank, iters, warmup, || {
        op.backward_saved(rank, p, &saved).map(|_| ())
    })?;
    let mut backward = Sample::call("backward", ms, Some(plan));
    backward.relerr = Some(relerr);
    drop((call, saved));
    let ms = device_ms(rank, iters, warmup, || {
        op.forward_saving(rank, p).map(|_| ())
    })?;
    let forward = Sample::call("forward_saving", ms, Some(forward_plan));
    let ms = device_ms(rank, iters, warmup, || {
        let (_, saved) = op.forward_saving(rank, p)?;
        op.backward_saved(rank, p, &saved).map(|_| ())
    })?;
    Ok(vec![backward, forward, Sample::call("step", ms, None)])
}

/// The recomputing form's rows: `backward_recompute` (`backward`), `forward` (the layer's
/// own call) and `step_recompute`.
fn recomputing_rows(c: &Case) -> Result<Vec<Sample>> {
    let (rank, op, p) = (c.rank, c.op, c.p);
    let (o, iters, warmup) = (ExecOptions::default(), c.a.iters, c.a.warmup);
    let (exec, ins) = op.recomputing_call(p)?;
    let refs: Vec<&Tensor> = ins.iter().collect();
    let (plan, report) = first_call(rank, &format!("{} backward", c.what), || {
        exec.run_with(rank, &refs, None, &o)
    })?;
    let relerr = gradient_error(rank, c.err, &report.outputs, c.reference)?;
    drop(report);
    let ms = device_ms(rank, iters, warmup, || {
        op.backward_recomputing(rank, p).map(|_| ())
    })?;
    let mut backward = Sample::call("backward_recompute", ms, Some(plan));
    backward.relerr = Some(relerr);
    let primals: Vec<&Tensor> = p.primals.iter().collect();
    let forward_exec = op.forward_executor()?;
    let (plan, _) = first_call(rank, &format!("{} forward", c.what), || {
        forward_exec.run_with(rank, &primals, None, &o)
    })?;
    let ms = device_ms(rank, iters, warmup, || op.forward(rank, p).map(|_| ()))?;
    let forward = Sample::call("forward", ms, Some(plan));
    let ms = device_ms(rank, iters, warmup, || {
        op.forward(rank, p)?;
        op.backward_recomputing(rank, p).map(|_| ())
    })?;
    Ok(vec![
        backward,
        forward,
        Sample::call("step_recompute", ms, None),
    ])
}

/// One case over the ranks: rank 0's sample with the slowest rank's times and the
/// largest error.
struct Row {
    op: Op,
    shape: Shape,
    devices: usize,
    s: Sample,
    rank_ms: Vec<f64>,
}

impl Row {
    fn new(op: Op, shape: Shape, per_rank: &[Vec<Sample>], i: usize) -> Row {
        let worst =
            |f: &dyn Fn(&Sample) -> f64| per_rank.iter().map(|r| f(&r[i])).fold(0.0, f64::max);
        let mut s = per_rank[0][i].clone();
        s.ms = worst(&|s| s.ms);
        if s.relerr.is_some() {
            s.relerr = Some(worst(&|s| s.relerr.unwrap_or(0.0)));
        }
        if let Some(p) = &mut s.plan {
            p.tuning_ms = worst(&|s| s.plan.as_ref().map_or(0.0, |p| p.tuning_ms));
            p.first_call_ms = worst(&|s| s.plan.as_ref().map_or(0.0, |p| p.first_call_ms));
        }
        Row {
            op,
            shape,
            devices: per_rank.len(),
            rank_ms: per_rank.iter().map(|r| r[i].ms).collect(),
            s,
        }
    }

    fn json(&self) -> String {
        let (x, y, z) = self.shape;
        let [dx, dy, dz] = self.op.dims();
        let mut v = json!({
            "source": "ours", "op": self.op.name(), "shape": format!("{x},{y},{z}"),
            dx: x, dy: y, dz: z, "D": self.devices, "dtype": DTYPE.name(),
            "case": self.s.case, "kind": self.s.kind, "ms": r4(self.s.ms),
            "rank_ms": self.rank_ms.iter().copied().map(r4).collect::<Vec<_>>(),
        });
        if let Some(e) = self.s.relerr {
            v["relerr"] = json!(e);
        }
        if let Some(r) = self.s.recompute {
            v["recompute"] = json!(r);
        }
        if let Some(p) = &self.s.plan {
            v["plan"] = json!(p.plan);
            v["plan_source"] = json!(p.source);
            v["tuning_ms"] = json!(r4(p.tuning_ms));
            v["first_call_ms"] = json!(r4(p.first_call_ms));
        }
        v.to_string()
    }
}

/// `x` rounded to 4 decimals (times in ms).
fn r4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

fn main() -> std::process::ExitCode {
    finish(run())
}

/// The layers and shapes of the run, in order.
fn cases(a: &Args) -> Result<Vec<(Op, Shape)>> {
    let mut out = Vec::new();
    for name in a.ops.split(',').map(str::trim) {
        let op = Op::parse(name)
            .ok_or_else(|| fusion::Error::World(format!("unknown op `{name}`: mlp, ag, rs")))?;
        let shapes = if op == Op::Mlp {
            &a.mlp_shapes
        } else {
            &a.shapes
        };
        for s in shapes.split(';') {
            let &[x, y, z] = list(s).as_slice() else {
                return Err(fusion::Error::World(format!(
                    "bad shape `{s}`: three sizes"
                )));
            };
            out.push((op, (x, y, z)));
        }
    }
    Ok(out)
}

fn run() -> Result<()> {
    let mut a = Args::parse();
    if a.quick {
        a.shapes = "64,32,16;32,32,32".into();
        a.mlp_shapes = "64,32,48;128,64,96".into();
        a.iters = 3;
        a.warmup = 1;
    }
    let todo = cases(&a)?; // a wrong name fails before any device work
    let world = World::auto(a.devices)?;
    let d = world.size();
    println!(
        "backward_bench: backend {} devices {d} dtype {DTYPE}",
        world.backend().name()
    );
    let seed = seed_or_clock(a.seed);
    println!("backward_bench: input seed {seed}");
    let kernels = Kernels::new()?;
    let err = FusionExecutor::new(components::squared_error(DTYPE)?);
    let mut rows: Vec<Row> = Vec::new();
    // Rows go to the JSON file as they come, so a run cut short keeps what it measured.
    if let Some(path) = &a.json {
        write_file(path, "")?;
    }
    for pass in [Pass::Saving, Pass::Recomputing] {
        for &(op, shape) in &todo {
            if let Some(why) = op.unsplittable(shape, d) {
                if pass == Pass::Saving {
                    println!("skipping {} {shape:?}: {why}", op.name());
                }
                continue;
            }
            let per_rank =
                world.run(|rank| run_case(rank, &a, &kernels, &err, op, shape, seed, pass))?;
            let mut text = String::new();
            for i in 0..per_rank[0].len() {
                let row = Row::new(op, shape, &per_rank, i);
                print_row(&row);
                text += &(row.json() + "\n");
                rows.push(row);
            }
            if let Some(path) = &a.json {
                append(path, &text)?;
            }
        }
    }
    print_table(&rows);
    let off: Vec<String> = (rows.iter())
        .filter(|r| r.s.relerr.is_some_and(|e| e.is_nan() || e > TOLERANCE))
        .map(|r| format!("{} {:?}", r.op.name(), r.shape))
        .collect();
    if !off.is_empty() {
        return Err(fusion::Error::World(format!(
            "gradients off by more than {TOLERANCE}: {}",
            off.join(", ")
        )));
    }
    Ok(())
}

/// Appends `text` to the file at `path`.
fn append(path: &str, text: &str) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .map_err(|e| fusion::Error::World(format!("opening {path}: {e}")))?;
    f.write_all(text.as_bytes())
        .map_err(|e| fusion::Error::World(format!("writing {path}: {e}")))
}

/// One row on the console; a default call's plan after it.
fn print_row(row: &Row) {
    let (x, y, z) = row.shape;
    print!(
        "{:8} {x:>6} {y:>6} {z:>6} {:<18} {:8.3} ms",
        row.op.name(),
        row.s.case,
        row.s.ms
    );
    if let Some(e) = row.s.relerr {
        print!("  relerr {e:.2e}");
    }
    if let Some(p) = &row.s.plan {
        print!(
            "  plan {} ({}, tuning {:.0} ms, first call {:.1} ms)",
            p.plan, p.source, p.tuning_ms, p.first_call_ms
        );
    }
    println!();
}

/// Per layer and shape: each form's backward against the GEMMs it runs alone (the saving
/// form's: the gradient GEMMs; the recomputing form's: those and the recomputed one), the
/// collectives alone, the forwards and each form's training step.
fn print_table(rows: &[Row]) {
    println!(
        "\n| layer | shape | D | backward | gradient GEMMs | backward / GEMMs | backward_recompute | all GEMMs | recompute / GEMMs | collectives | forward | forward_saving | step | step_recompute | relerr (saving / recompute) | plan |"
    );
    println!("|{}", " --- |".repeat(16));
    let mut keys: Vec<(Op, Shape)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.op, r.shape)) {
            keys.push((r.op, r.shape));
        }
    }
    for (op, shape) in keys {
        let of_key = || (rows.iter()).filter(|r| r.op == op && r.shape == shape);
        let sum = |keep: &dyn Fn(&Sample) -> bool| -> f64 {
            of_key().filter(|r| keep(&r.s)).map(|r| r.s.ms).sum()
        };
        let get = |case: &str| of_key().find(|r| r.s.case == case);
        let ms = |case: &str| get(case).map_or(f64::NAN, |r| r.s.ms);
        let relerr = |case: &str| get(case).and_then(|r| r.s.relerr).unwrap_or(f64::NAN);
        let gemms = sum(&|s| s.kind == "gemm");
        let grads = sum(&|s| s.kind == "gemm" && s.recompute == Some(false));
        let comm = sum(&|s| s.kind == "comm");
        let plan = (get("backward").and_then(|r| r.s.plan.as_ref()))
            .map_or("-".into(), |p| format!("{} ({})", p.plan, p.source));
        let (x, y, z) = shape;
        let d = rows.first().map_or(0, |r| r.devices);
        let (saving, recompute) = (ms("backward"), ms("backward_recompute"));
        println!(
            "| {} | {x}, {y}, {z} | {d} | {saving:.3} | {grads:.3} | {:.2} | {recompute:.3} | {gemms:.3} | {:.2} | {comm:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1e} / {:.1e} | {plan} |",
            op.name(),
            saving / grads,
            recompute / gemms,
            ms("forward"),
            ms("forward_saving"),
            ms("step"),
            ms("step_recompute"),
            relerr("backward"),
            relerr("backward_recompute"),
        );
    }
}
