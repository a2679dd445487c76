//! The example's command line and run: the world, the weights file, the timed steps on
//! every rank, the check against candle alone, the report.

use std::path::PathBuf;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use clap::{Parser, ValueEnum};

use fusion::prelude::*;

use crate::layer::{self, CandleLayer, Config, RankLayer, Replays};
use crate::tp;

/// The command line (also built by the tests).
#[derive(Parser, Debug, Clone)]
#[command(about = "A Llama decoder layer in candle with its tensor-parallel parts as fusions")]
pub struct Args {
    /// Devices [default: every GPU, else 4 simulated CPU devices; a launcher's world]
    #[arg(long)]
    pub devices: Option<usize>,
    /// Element type of the layer (the reference is always f32)
    #[arg(long, value_enum, default_value_t = Dt::F32)]
    pub dtype: Dt,
    /// Tokens of the prefill step
    #[arg(long, default_value_t = 64)]
    pub prefill: usize,
    /// Decode steps after the prefill
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// Tokens per decode step
    #[arg(long, default_value_t = 1)]
    pub decode_tokens: usize,
    /// Llama-3-8B's layer sizes (hidden 4096, 32 heads, 8 KV heads, FFN 14336) instead of
    /// a small layer
    #[arg(long)]
    pub llama3_8b: bool,
    /// The safetensors file of the layer's weights (written with random weights first if
    /// missing) [default: a file in the temporary directory named after the sizes]
    #[arg(long)]
    pub weights: Option<PathBuf>,
    /// Seed of the random weights and inputs
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Run the layer the way candle's own tensor parallelism does (`llama_multiprocess`:
    /// column- and row-parallel linears, a blocking NCCL all-reduce after each block), as
    /// the point of comparison
    #[arg(long, conflicts_with = "candle_only")]
    pub candle_tp: bool,
    /// Run the whole layer in candle alone on every rank (no communication)
    #[arg(long)]
    pub candle_only: bool,
}

/// How the layer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Sequence- and tensor-parallel, the three blocks as fusions.
    Fusions,
    /// candle's own tensor parallelism.
    CandleTp,
    /// The whole layer in candle on each rank.
    Candle,
}

impl Args {
    /// The mode the flags ask for.
    pub fn mode(&self) -> Mode {
        match (self.candle_tp, self.candle_only) {
            (true, _) => Mode::CandleTp,
            (false, true) => Mode::Candle,
            (false, false) => Mode::Fusions,
        }
    }
}

/// `--dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dt {
    F32,
    Bf16,
}

impl Dt {
    fn candle(self) -> CDType {
        match self {
            Dt::F32 => CDType::F32,
            Dt::Bf16 => CDType::BF16,
        }
    }

    /// Relative-error tolerance of the check against the f32 reference.
    fn tolerance(self) -> f64 {
        match self {
            Dt::F32 => 1e-4,
            Dt::Bf16 => 1e-2,
        }
    }
}

/// One step of the layer on one rank: its input and token count to its output.
type Step<'a> = dyn FnMut(&CTensor, usize) -> fusion_candle::Result<(CTensor, Replays)> + 'a;

/// What one rank measured: per step, its wall time and replays.
struct RankRun {
    steps: Vec<(usize, f64, Replays)>,
    /// Relative error of every step (computed on rank 0 of the world, empty elsewhere).
    errors: Vec<f64>,
    /// Tensors the runtime copied from a device to the host during the timed steps.
    host_copies: u64,
}

/// Runs the layer as `args` say, prints what it measured, and fails when a step's output
/// is off the reference by more than the dtype's tolerance.
pub fn run(args: Args) -> fusion_candle::Result<()> {
    let cfg = if args.llama3_8b {
        Config::llama3_8b()
    } else {
        Config::small()
    };
    let world = World::auto(args.devices)?;
    let d = world.size();
    cfg.check_split(d)?;
    let path = args.weights.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "fusion-llama-layer-{}-{}-{}-{}-seed{}.safetensors",
            cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, args.seed
        ))
    });
    if !path.exists() {
        layer::write_weights(&cfg, &path, args.seed)?;
    }
    let steps = step_tokens(&args);
    let total: usize = steps.iter().sum();
    let inputs = random_rows(total, cfg.hidden, args.seed + 100)?;
    let runs =
        world.run(|rank| run_rank(rank, &args, cfg, &path, &steps, &inputs).map_err(Into::into))?;
    report(&world, &args, cfg, &steps, &runs);
    let worst = runs
        .iter()
        .flat_map(|r| &r.errors)
        .fold(0.0f64, |a, &e| a.max(e));
    if worst > args.dtype.tolerance() || worst.is_nan() {
        return Err(fusion_candle::Error::Internal(format!(
            "relative error {worst:.2e} above the {:?} tolerance {:.0e}",
            args.dtype,
            args.dtype.tolerance()
        )));
    }
    Ok(())
}

/// Tokens of every step: the prefill, then the decode steps.
fn step_tokens(args: &Args) -> Vec<usize> {
    std::iter::once(args.prefill)
        .chain(std::iter::repeat_n(args.decode_tokens, args.decode_steps))
        .filter(|&t| t > 0)
        .collect()
}

/// `[rows, hidden]` of deterministic inputs (the same in every process).
fn random_rows(rows: usize, hidden: usize, seed: u64) -> candle_core::Result<CTensor> {
    let v = fusion::Tensor::randn(&[rows * hidden], DType::F32, seed)
        .to_f32_vec()
        .map_err(candle_core::Error::wrap)?;
    CTensor::from_vec(v, (rows, hidden), &Device::Cpu)
}

/// The candle device of a rank: the CPU for simulated devices, `cuda:n` for the rank on
/// GPU `n` (candle's device, on its per-thread default stream).
fn candle_device(rank: &Rank) -> fusion_candle::Result<Device> {
    match rank.backend() {
        BackendKind::Cpu => Ok(Device::Cpu),
        #[cfg(feature = "candle-cuda")]
        BackendKind::Cuda => Ok(Device::new_cuda(rank.device().ordinal())?),
        #[allow(unreachable_patterns)]
        other => Err(candle_core::Error::msg(format!(
            "the {} backend needs a build with the `candle-cuda` feature",
            other.name()
        ))
        .into()),
    }
}

/// One step of the fusions' layer, called on the candle device's stream on a GPU.
fn fusion_step(
    layer: &mut RankLayer,
    rank: &Rank,
    device: &Device,
    x: &CTensor,
    tokens: usize,
) -> fusion_candle::Result<(CTensor, Replays)> {
    #[cfg(feature = "candle-cuda")]
    if let Some(stream) = fusion_candle::stream_of(device) {
        return layer.forward(&rank.on(&stream), x, tokens);
    }
    let _ = device;
    layer.forward(rank, x, tokens)
}

/// This rank's part of every step, timed; then the check against the reference.
fn run_rank(
    rank: &Rank,
    args: &Args,
    cfg: Config,
    path: &std::path::Path,
    steps: &[usize],
    inputs: &CTensor,
) -> fusion_candle::Result<RankRun> {
    let (d, r) = (rank.world_size(), rank.index());
    let device = candle_device(rank)?;
    let dtype = args.dtype.candle();
    let weights = layer::load_weights(path, &Device::Cpu)?;
    let mode = args.mode();
    // Every step's input for this rank, on its device before the timing: its rows of the
    // tokens (padded to a multiple of the rank count) for the fusions, every token for
    // candle's own tensor parallelism and for candle alone.
    let mut xs = Vec::new();
    let mut start = 0;
    for &t in steps {
        let all = inputs.narrow(0, start, t)?;
        let x = if mode == Mode::Fusions {
            let m = t.div_ceil(d);
            all.pad_with_zeros(0, 0, d * m - t)?.narrow(0, r * m, m)?
        } else {
            all
        };
        xs.push(x.to_dtype(dtype)?.to_device(&device)?);
        start += t;
    }
    // Every mode runs all its steps twice on a fresh layer each time: the first pass warms
    // up (kernels compiled and loaded, GEMM plans, lowering, graphs), the second is timed.
    let make_step = || -> fusion_candle::Result<Box<Step>> {
        Ok(match mode {
            Mode::Fusions => {
                let mut layer = RankLayer::new(rank, cfg, &weights, dtype, &device)?;
                let device = device.clone();
                Box::new(move |x, t| fusion_step(&mut layer, rank, &device, x, t))
            }
            Mode::Candle => {
                let mut layer = CandleLayer::part(cfg, &weights, 0, 1, dtype, &device)?;
                Box::new(move |x, _| Ok((layer.forward(x)?, Replays::default())))
            }
            Mode::CandleTp => {
                let mut layer = CandleLayer::part(cfg, &weights, r, d, dtype, &device)?;
                let mut all_reduce = tp::all_reduce(rank, &device)?;
                Box::new(move |x, _| {
                    Ok((layer.forward_with(x, &mut all_reduce)?, Replays::default()))
                })
            }
        })
    };
    let mut warm = make_step()?;
    for (x, &t) in xs.iter().zip(steps) {
        warm(x, t)?;
    }
    drop(warm);
    device.synchronize()?;
    rank.synchronize()?;
    let mut step = make_step()?;
    let mut timed = Vec::new();
    let mut outputs = Vec::new();
    let copies = || fusion::runtime::counters::counters().device_to_host_copies;
    let before = copies();
    for (x, &t) in xs.iter().zip(steps) {
        let clock = Instant::now();
        let (y, replays) = step(x, t)?;
        device.synchronize()?;
        rank.synchronize()?;
        timed.push((t, clock.elapsed().as_secs_f64() * 1e3, replays));
        outputs.push(y);
    }
    let host_copies = copies() - before;
    drop(step);
    // The check, outside the timing: every step against candle alone in f32, on rank 0
    // (the fusions' rows gathered from every rank; the other modes hold every token).
    // The reference runs in f32 on the rank's device (a GPU computes it in moments).
    let mut reference = (r == 0)
        .then(|| CandleLayer::part(cfg, &weights, 0, 1, CDType::F32, &device))
        .transpose()?;
    let mut errors = Vec::new();
    let mut start = 0;
    for (y, &t) in outputs.iter().zip(steps) {
        let got = if mode == Mode::Fusions {
            let mine = fusion_candle::input(rank, "y", y)?;
            let parts = rank.gather_to_host(&mine)?;
            let rows = parts
                .iter()
                .map(|p| {
                    let v = p.to_f32_vec()?;
                    Ok(CTensor::from_vec(
                        v,
                        (p.shape()[0], cfg.hidden),
                        &Device::Cpu,
                    )?)
                })
                .collect::<fusion_candle::Result<Vec<_>>>()?;
            CTensor::cat(&rows, 0)?.narrow(0, 0, t)?
        } else {
            y.to_device(&Device::Cpu)?
        };
        if let Some(reference) = reference.as_mut() {
            let want = reference
                .forward(&inputs.narrow(0, start, t)?.to_device(&device)?)?
                .to_device(&Device::Cpu)?;
            errors.push(relative_error(&got, &want)?);
        }
        start += t;
    }
    Ok(RankRun {
        steps: timed,
        errors,
        host_copies,
    })
}

/// `‖got − want‖ / ‖want‖` in f64.
fn relative_error(got: &CTensor, want: &CTensor) -> candle_core::Result<f64> {
    let got = got.to_dtype(CDType::F64)?;
    let want = want.to_dtype(CDType::F64)?;
    let diff = (&got - &want)?.sqr()?.sum_all()?.to_scalar::<f64>()?;
    let norm = want.sqr()?.sum_all()?.to_scalar::<f64>()?;
    Ok((diff / norm.max(f64::MIN_POSITIVE)).sqrt())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

fn report(world: &World, args: &Args, cfg: Config, steps: &[usize], runs: &[RankRun]) {
    let Some(first) = runs.first() else {
        return;
    };
    println!(
        "candle_llama: a Llama decoder layer in candle, {}",
        match args.mode() {
            Mode::Fusions => "its tensor-parallel parts as fusions",
            Mode::CandleTp => "candle's own tensor parallelism (all-reduce per block)",
            Mode::Candle => "candle alone on every rank",
        }
    );
    println!(
        "  backend {}, {} ranks ({} in this process), dtype {:?}",
        world.backend().name(),
        world.size(),
        runs.len(),
        args.dtype
    );
    println!(
        "  hidden {}, {} heads ({} KV) of {}, FFN {}; prefill {} tokens, {} decode steps of {}",
        cfg.hidden,
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim(),
        cfg.ffn,
        args.prefill,
        args.decode_steps,
        args.decode_tokens
    );
    // Steps are timed on every rank; the slowest rank's time is the step's.
    let per_step: Vec<(f64, Replays)> = (0..first.steps.len())
        .map(|i| {
            let ms = runs.iter().map(|r| r.steps[i].1).fold(0.0, f64::max);
            let mut rep = Replays::default();
            for r in runs {
                rep.add(&r.steps[i].2);
            }
            (ms, rep)
        })
        .collect();
    let errors: Vec<f64> = runs.iter().flat_map(|r| r.errors.iter().copied()).collect();
    let calls = |r: &Replays| {
        format!(
            "{}/{} fusion calls replayed ({} captured, {} eager at new addresses)",
            r.replayed, r.calls, r.captured, r.moved
        )
    };
    if let Some((ms, rep)) = per_step.first() {
        println!(
            "  prefill (after a warm-up pass): {ms:.3} ms, {}",
            calls(rep)
        );
    }
    if per_step.len() > 1 {
        let decode = &per_step[1..];
        let mut rep = Replays::default();
        for s in decode {
            rep.add(&s.1);
        }
        println!(
            "  decode: median {:.3} ms per step of {} tokens over {} steps, {}",
            median(decode.iter().map(|s| s.0).collect()),
            steps.get(1).copied().unwrap_or(0),
            decode.len(),
            calls(&rep)
        );
    }
    println!(
        "  device-to-host copies by the runtime during the steps: {} (the check comes after)",
        runs.iter().map(|r| r.host_copies).sum::<u64>()
    );
    if !errors.is_empty() {
        let worst = errors.iter().copied().fold(0.0f64, f64::max);
        println!(
            "  check: max relative error {worst:.2e} over {} steps against candle alone in f32 \
             (tolerance {:.0e}): {}",
            errors.len(),
            args.dtype.tolerance(),
            if worst <= args.dtype.tolerance() {
                "ok"
            } else {
                "FAILED"
            }
        );
    }
}
