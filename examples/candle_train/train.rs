//! The example's command line and its two training loops: the model over the world (every
//! rank from its own thread, the fusions' backwards under candle's autograd) and the same
//! model in candle alone on one device, each with plain SGD on the same data.

use candle_core::Device;
use clap::Parser;
use fusion::prelude::*;
use fusion_candle::BackwardForm;

use crate::model::{batch, loss, my_rows, sgd, weights, Dims, Form, Part, RefModel, TpModel};

/// The command line (also built by the tests).
#[derive(Parser, Debug, Clone)]
#[command(about = "Trains tensor-parallel MLP blocks through fusions under candle's autograd")]
pub struct Args {
    /// Devices [default: every GPU, else 4 simulated CPU devices]
    #[arg(long)]
    pub devices: Option<usize>,
    /// Train only the reference: the same model in candle alone on one device
    #[arg(long)]
    pub single: bool,
    /// How each block's tensor-parallel part is split into fusions
    #[arg(long, value_enum, default_value_t = Form::Layers)]
    pub form: Form,
    /// Backwards that recompute the forward's GEMM results instead of keeping them from
    /// the forward (less memory, one more GEMM per layer)
    #[arg(long)]
    pub recompute: bool,
    /// SGD steps
    #[arg(long, default_value_t = 300)]
    pub steps: usize,
    /// Learning rate
    #[arg(long, default_value_t = 0.1)]
    pub lr: f64,
    /// Rows (tokens) per batch, over every device
    #[arg(long, default_value_t = 32)]
    pub rows: usize,
    /// Hidden size
    #[arg(long, default_value_t = 16)]
    pub hidden: usize,
    /// FFN size (over every device)
    #[arg(long, default_value_t = 64)]
    pub ffn: usize,
    /// MLP blocks
    #[arg(long, default_value_t = 2)]
    pub blocks: usize,
    /// Seed of the weights and the data
    #[arg(long, default_value_t = 5)]
    pub seed: u64,
    /// Print every n-th step's losses
    #[arg(long, default_value_t = 25)]
    pub every: usize,
}

impl Args {
    /// The form of the fusions' backwards: saving unless `--recompute`.
    pub fn backward(&self) -> BackwardForm {
        match self.recompute {
            true => BackwardForm::Recomputing,
            false => BackwardForm::Saving,
        }
    }

    pub fn dims(&self) -> Dims {
        Dims {
            rows: self.rows,
            hidden: self.hidden,
            ffn: self.ffn,
            blocks: self.blocks,
        }
    }
}

/// The candle device of a rank: the CPU for simulated devices, `cuda:n` for the rank on
/// GPU `n` (its primary context, which the rank's calls run in).
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

/// One rank's training run: its share of every step's loss (taken before the step's
/// update).
fn train_rank(rank: &Rank, args: &Args) -> fusion_candle::Result<Vec<f32>> {
    let device = candle_device(rank)?;
    let dims = args.dims();
    let part = Part {
        index: rank.index(),
        count: rank.world_size(),
    };
    if dims.rows % part.count != 0 || dims.ffn % part.count != 0 {
        return Err(fusion_candle::Error::Unsupported(format!(
            "{} rows and an FFN of {} do not split over {} devices",
            dims.rows, dims.ffn, part.count
        )));
    }
    let whole = weights(&dims, args.seed, &device)?;
    let model = TpModel::new(args.form, &whole, part, args.backward())?;
    let numel = dims.rows * dims.hidden;
    let mut losses = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let (x, target) = batch(&dims, args.seed, step, &device)?;
        let (x, target) = (my_rows(&x, part)?, my_rows(&target, part)?);
        let l = loss(&model.forward(rank, &x)?, &target, numel)?;
        losses.push(l.to_scalar::<f32>()?);
        let grads = l.backward()?;
        sgd(&model.vars(), &grads, args.lr)?;
    }
    Ok(losses)
}

/// The loss of every step over the world (the sum of the ranks' shares), in a world of
/// this process's devices (a launched world of several processes would sum only this
/// process's shares: refused).
#[cfg_attr(test, allow(dead_code))] // the tests give their own worlds
pub fn train_tp(args: &Args) -> fusion::Result<Vec<f32>> {
    let world = World::auto(args.devices)?;
    if world.local_ranks().len() != world.size() {
        return Err(fusion::Error::World(
            "this example sums the ranks' losses in one process: run it without a launcher".into(),
        ));
    }
    train_on(&world, args)
}

/// [`train_tp`] on `world`, whose ranks are all in this process.
pub fn train_on(world: &World, args: &Args) -> fusion::Result<Vec<f32>> {
    let shares = world.run(|rank| Ok(train_rank(rank, args)?))?;
    Ok((0..args.steps)
        .map(|s| shares.iter().map(|l| l[s]).sum())
        .collect())
}

/// The loss of every step of the reference: the model in candle alone, on the CPU.
pub fn train_single(args: &Args) -> candle_core::Result<Vec<f32>> {
    let device = Device::Cpu;
    let dims = args.dims();
    let model = RefModel::new(&weights(&dims, args.seed, &device)?)?;
    let numel = dims.rows * dims.hidden;
    let mut losses = Vec::with_capacity(args.steps);
    for step in 0..args.steps {
        let (x, target) = batch(&dims, args.seed, step, &device)?;
        let l = loss(&model.forward(&x)?, &target, numel)?;
        losses.push(l.to_scalar::<f32>()?);
        let grads = l.backward()?;
        sgd(&model.vars(), &grads, args.lr)?;
    }
    Ok(losses)
}

/// The largest relative difference between two loss curves.
pub fn max_relative_difference(a: &[f32], b: &[f32]) -> f64 {
    (a.iter().zip(b))
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs() / f64::from(y).abs().max(1e-30))
        .fold(0.0, f64::max)
}
