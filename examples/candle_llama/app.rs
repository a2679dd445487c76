//! The example's command line and run: the world, the weights file, every rank's timed
//! steps (`schedule.rs`), the report, and the verdict of the check against candle alone.

use std::path::PathBuf;

use candle_core::{DType as CDType, Device, Tensor as CTensor};
use clap::{Parser, ValueEnum};

use fusion::prelude::*;

use crate::config::{self, Config};
use crate::layer::Form;
use crate::report;
use crate::schedule::{self, RankRun};

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
    /// Tokens of the prefill step (from an empty cache)
    #[arg(long, default_value_t = 64)]
    pub prefill: usize,
    /// Timed prefill steps, each from an empty cache (the median is reported)
    #[arg(long, default_value_t = 20)]
    pub prefill_reps: usize,
    /// Decode steps after the prefill
    #[arg(long, default_value_t = 8)]
    pub decode_steps: usize,
    /// Tokens per decode step
    #[arg(long, default_value_t = 1)]
    pub decode_tokens: usize,
    /// Layers a step runs one after another, as a model's step does (the same weights,
    /// a KV cache each): in an eager step only the last layer's GPU work is left when the
    /// host is done issuing the step (the check's tolerance grows with the square root of
    /// the layers)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub layers: u16,
    /// Form of the decode steps: `tp` (replicated activations, GEMM + AllReduce fusions)
    /// or `sp` (sequence-parallel fusions) [default: tp; candle's modes: tp only]
    #[arg(long, value_enum)]
    pub decode_form: Option<Form>,
    /// Form of the prefill steps [default: tp up to 512 tokens, sp above, the faster as
    /// measured; candle's modes: tp only]
    #[arg(long, value_enum)]
    pub prefill_form: Option<Form>,
    /// Record the whole decode step as a CUDA graph on candle's stream once, after
    /// warm-up runs, and replay it for every step (on the CPU: the recorded body runs
    /// again on the same fixed buffers)
    #[arg(long)]
    pub graph: bool,
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
    /// Print where each step's time goes, part by part (norm and column-parallel GEMMs,
    /// attention, each row-parallel projection and its sum, ...), each rank's medians: on
    /// a GPU the time of candle's stream between marks (kernels, and waits for the host to
    /// launch them), and beside it the host's time to issue each part; with `--graph`, the
    /// replayed graph's time between event nodes recorded at the marks; and each fusion
    /// call's host time, copying into its slot apart from the call (with `--layers`, each
    /// part's median over every layer's)
    #[arg(long)]
    pub sections: bool,
}

/// What sums the row-parallel projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Fusions (either form).
    Fusions,
    /// candle's own tensor parallelism.
    CandleTp,
    /// The whole layer in candle on each rank.
    Candle,
}

impl Mode {
    /// The mode's name in the report's table.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Fusions => "fusions",
            Mode::CandleTp => "candle-tp",
            Mode::Candle => "candle-only",
        }
    }
}

/// Relative-error tolerance of a step's output after `layers` layers in `dtype`: one
/// layer's times the square root of the layers (each layer's rounding adds an independent
/// error, which grow together like a random walk's steps).
pub fn tolerance(dtype: Dt, layers: usize) -> f64 {
    dtype.tolerance() * (layers.max(1) as f64).sqrt()
}

/// What a run does, from the flags.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub mode: Mode,
    pub decode_form: Form,
    pub prefill_form: Form,
    pub graph: bool,
    pub prefill: usize,
    pub prefill_reps: usize,
    pub decode_steps: usize,
    pub decode_tokens: usize,
    pub layers: usize,
    pub sections: bool,
}

impl Plan {
    /// Positions the KV cache must hold: the prefill and every decode step.
    pub fn capacity(&self) -> usize {
        (self.prefill + self.decode_steps * self.decode_tokens).max(1)
    }

    /// Timed prefill steps (none without prefill tokens).
    pub fn prefill_reps(&self) -> usize {
        if self.prefill == 0 {
            0
        } else {
            self.prefill_reps.max(1)
        }
    }

    /// Decode steps (none without decode tokens).
    pub fn decode_steps(&self) -> usize {
        if self.decode_tokens == 0 {
            0
        } else {
            self.decode_steps
        }
    }
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

    /// The run the flags ask for; an error for a sequence-parallel form without fusions.
    pub fn plan(&self) -> fusion_candle::Result<Plan> {
        let mode = self.mode();
        let form = |asked: Option<Form>, fusions_default: Form, what: &str| match (mode, asked) {
            (Mode::Fusions, f) => Ok(f.unwrap_or(fusions_default)),
            (_, None | Some(Form::Tp)) => Ok(Form::Tp),
            (_, Some(Form::Sp)) => Err(fusion_candle::Error::Internal(format!(
                "--{what}-form sp needs the fusions: {} has the tensor-parallel form only",
                mode.name()
            ))),
        };
        Ok(Plan {
            mode,
            decode_form: form(self.decode_form, Form::Tp, "decode")?,
            prefill_form: form(
                self.prefill_form,
                Form::for_prefill(self.prefill),
                "prefill",
            )?,
            graph: self.graph,
            prefill: self.prefill,
            prefill_reps: self.prefill_reps,
            decode_steps: self.decode_steps,
            decode_tokens: self.decode_tokens,
            layers: usize::from(self.layers),
            sections: self.sections,
        })
    }
}

/// `--dtype` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dt {
    F32,
    Bf16,
}

impl Dt {
    /// The candle dtype.
    pub fn candle(self) -> CDType {
        match self {
            Dt::F32 => CDType::F32,
            Dt::Bf16 => CDType::BF16,
        }
    }

    /// Relative-error tolerance of one layer's output against the f32 reference.
    pub fn tolerance(self) -> f64 {
        match self {
            Dt::F32 => 1e-4,
            Dt::Bf16 => 1e-2,
        }
    }
}

/// Runs the layer as `args` say, prints what it measured, and fails when an output is
/// off the reference by more than the dtype's tolerance.
pub fn run(args: Args) -> fusion_candle::Result<()> {
    let plan = args.plan()?;
    let cfg = if args.llama3_8b {
        Config::llama3_8b()
    } else {
        Config::small()
    };
    let world = World::auto(args.devices)?;
    cfg.check_split(world.size())?;
    let path = args.weights.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "fusion-llama-layer-{}-{}-{}-{}-seed{}.safetensors",
            cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn, args.seed
        ))
    });
    if !path.exists() {
        config::write_weights(&cfg, &path, args.seed)?;
    }
    let total = plan.prefill + plan.decode_steps() * plan.decode_tokens;
    let inputs = random_rows(total, cfg.hidden, args.seed + 100)?;
    let setup = schedule::Setup {
        plan,
        cfg,
        dtype: args.dtype.candle(),
        weights: &path,
        inputs: &inputs,
    };
    let runs: Vec<RankRun> =
        world.run(|rank| schedule::run_rank(rank, &setup).map_err(Into::into))?;
    report::print(&world, &args, &plan, cfg, &runs);
    let tolerance = tolerance(args.dtype, plan.layers);
    let worst = runs
        .iter()
        .flat_map(|r| r.errors.iter().chain([&r.rep_spread]))
        .fold(0.0f64, |a, &e| a.max(e));
    if worst > tolerance || worst.is_nan() {
        return Err(fusion_candle::Error::Internal(format!(
            "relative error {worst:.2e} above the {:?} tolerance {tolerance:.1e}",
            args.dtype
        )));
    }
    Ok(())
}

/// `[rows, hidden]` of deterministic inputs (the same in every process).
fn random_rows(rows: usize, hidden: usize, seed: u64) -> candle_core::Result<CTensor> {
    let v = fusion::Tensor::randn(&[rows * hidden], DType::F32, seed)
        .to_f32_vec()
        .map_err(candle_core::Error::wrap)?;
    CTensor::from_vec(v, (rows, hidden), &Device::Cpu)
}
