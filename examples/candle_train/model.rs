//! The model: a stack of sequence-parallel MLP blocks `x + gelu(x W1) W2` whose
//! tensor-parallel parts are fusions with derived backwards, applied as candle ops
//! (`fusion_candle::Differentiable`), and the same model in candle alone on one device.
//! Both start from the same weights and see the same data.

use candle_core::{Device, Tensor as CTensor, Var};
use clap::ValueEnum;
use fusion::prelude::*;
use fusion_candle::{BackwardForm, Differentiable};

fusion! {
    /// Column-parallel linear of the gathered rows: x `[d @ DIDx, m, h]` (this rank's
    /// rows), w `[d @ DIDx, h, f]` (this rank's columns of W1) -> every row, this rank's
    /// columns, chunk by chunk as the rows arrive.
    #[backward]
    #[allow(dead_code)] // applied through `fusion_candle::differentiable!`
    pub fn column_linear<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, h, f]>,
    ) -> Tensor<f32, [d @ Stream, d @ DIDx, m, f]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    /// Row-parallel linear + reduce-scatter: a `[d, d @ DIDx, m, f]` (every row, this
    /// rank's columns), w `[d @ DIDx, f, h]` (the matching rows of W2) -> this rank's rows
    /// of the summed product.
    #[backward]
    #[allow(dead_code)] // applied through `fusion_candle::differentiable!`
    pub fn row_linear<d, m, f, h>(
        a: Tensor<f32, [d, d @ DIDx, m, f]>,
        w: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(a, w);
        sum(partial, 1)
    }

    /// The whole block but the residual, as one fusion:
    /// `ReduceScatter(gelu_tanh(AllGather(x) W1) W2)`.
    #[backward]
    #[allow(dead_code)] // applied through `fusion_candle::differentiable!`
    pub fn mlp<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w1: Tensor<f32, [d @ DIDx, h, f]>,
        w2: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ DIDx, m, h]> {
        let act: Tensor<f32, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }
}

/// How a block's tensor-parallel part is split into fusions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Form {
    /// Two ops, a column-parallel and a row-parallel linear, with candle's gelu between.
    Layers,
    /// One op for the whole block (`mlp`).
    Block,
}

/// The model's sizes (whole, over every rank).
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    /// Rows (tokens) of a batch.
    pub rows: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub blocks: usize,
}

/// A rank's part of the model: `count` ranks, this one `index`.
#[derive(Clone, Copy, Debug)]
pub struct Part {
    pub index: usize,
    pub count: usize,
}

/// Standard normal values, the same on every rank and run for a seed.
pub fn randn(
    shape: &[usize],
    seed: u64,
    scale: f64,
    device: &Device,
) -> candle_core::Result<CTensor> {
    let t = fusion::Tensor::randn(shape, DType::F32, seed);
    let v = t.to_f32_vec().map_err(candle_core::Error::wrap)?;
    CTensor::from_vec(v, shape, device)?.affine(scale, 0.0)
}

/// Every block's whole weights (W1 `[hidden, ffn]`, W2 `[ffn, hidden]`), from `seed`.
pub fn weights(
    dims: &Dims,
    seed: u64,
    device: &Device,
) -> candle_core::Result<Vec<(CTensor, CTensor)>> {
    let (h, f) = (dims.hidden, dims.ffn);
    (0..dims.blocks as u64)
        .map(|b| {
            let w1 = randn(&[h, f], seed + 2 * b, (h as f64).powf(-0.5), device)?;
            let w2 = randn(
                &[f, h],
                seed + 2 * b + 1,
                0.5 * (f as f64).powf(-0.5),
                device,
            )?;
            Ok((w1, w2))
        })
        .collect()
}

/// Step `step`'s batch: inputs `[rows, hidden]` and their targets `tanh(x A)` for a fixed
/// random `A`.
pub fn batch(
    dims: &Dims,
    seed: u64,
    step: usize,
    device: &Device,
) -> candle_core::Result<(CTensor, CTensor)> {
    let h = dims.hidden;
    let teacher = randn(&[h, h], seed + 1000, (h as f64).powf(-0.5), device)?;
    let x = randn(&[dims.rows, h], seed + 2000 + step as u64, 1.0, device)?;
    let y = x.matmul(&teacher)?.tanh()?;
    Ok((x, y))
}

/// This rank's rows of a `[rows, hidden]` tensor, as `[1, rows / count, hidden]` with
/// storage of its own (a fusion input starts at the beginning of its storage).
pub fn my_rows(t: &CTensor, part: Part) -> candle_core::Result<CTensor> {
    let (rows, h) = t.dims2()?;
    let m = rows / part.count;
    t.narrow(0, part.index * m, m)?
        .force_contiguous()?
        .reshape((1, m, h))
}

/// One rank's model: its blocks of every weight, as candle variables, and the ops.
pub struct TpModel {
    pub form: Form,
    /// Per block: this rank's columns of W1 `[1, hidden, ffn / count]` and rows of W2
    /// `[1, ffn / count, hidden]`.
    pub weights: Vec<(Var, Var)>,
    column: Differentiable,
    row: Differentiable,
    block: Differentiable,
}

impl TpModel {
    /// This rank's part of the model with whole weights `whole`, its ops training with
    /// the `backward` form.
    pub fn new(
        form: Form,
        whole: &[(CTensor, CTensor)],
        part: Part,
        backward: BackwardForm,
    ) -> fusion_candle::Result<Self> {
        let weights = (whole.iter())
            .map(|(w1, w2)| {
                let (h, f) = w1.dims2()?;
                let fp = f / part.count;
                let mine1 = w1
                    .narrow(1, part.index * fp, fp)?
                    .contiguous()?
                    .reshape((1, h, fp))?;
                let mine2 = w2.narrow(0, part.index * fp, fp)?.reshape((1, fp, h))?;
                Ok((Var::from_tensor(&mine1)?, Var::from_tensor(&mine2)?))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(TpModel {
            form,
            weights,
            column: fusion_candle::differentiable!(column_linear)?.with_backward(backward),
            row: fusion_candle::differentiable!(row_linear)?.with_backward(backward),
            block: fusion_candle::differentiable!(mlp)?.with_backward(backward),
        })
    }

    /// This rank's rows of the output for its rows `x` (`[1, m, hidden]`).
    pub fn forward(&self, rank: &Rank, x: &CTensor) -> fusion_candle::Result<CTensor> {
        let mut x = x.clone();
        for (w1, w2) in &self.weights {
            let (w1, w2) = (w1.as_tensor(), w2.as_tensor());
            let mlp = match self.form {
                Form::Block => self.block.apply(rank, &[&x, w1, w2])?,
                Form::Layers => {
                    let a = self.column.apply(rank, &[&x, w1])?.gelu()?;
                    self.row.apply(rank, &[&a, w2])?
                }
            };
            x = (x + mlp)?;
        }
        Ok(x)
    }

    /// The variables, in a fixed order.
    pub fn vars(&self) -> Vec<&Var> {
        self.weights.iter().flat_map(|(a, b)| [a, b]).collect()
    }
}

/// The model in candle alone, on one device, with whole weights.
pub struct RefModel {
    pub weights: Vec<(Var, Var)>,
}

impl RefModel {
    pub fn new(whole: &[(CTensor, CTensor)]) -> candle_core::Result<Self> {
        let weights = (whole.iter())
            .map(|(w1, w2)| Ok((Var::from_tensor(w1)?, Var::from_tensor(w2)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(RefModel { weights })
    }

    /// The output for every row `x` (`[rows, hidden]`).
    pub fn forward(&self, x: &CTensor) -> candle_core::Result<CTensor> {
        let mut x = x.clone();
        for (w1, w2) in &self.weights {
            let mlp = x.matmul(w1.as_tensor())?.gelu()?.matmul(w2.as_tensor())?;
            x = (x + mlp)?;
        }
        Ok(x)
    }

    pub fn vars(&self) -> Vec<&Var> {
        self.weights.iter().flat_map(|(a, b)| [a, b]).collect()
    }
}

/// This rank's share of the mean squared error over every element of the batch:
/// `sum((y - target)^2) / numel` over its rows, `numel` the whole batch's.
pub fn loss(y: &CTensor, target: &CTensor, numel: usize) -> candle_core::Result<CTensor> {
    (y - target)?
        .sqr()?
        .sum_all()?
        .affine(1.0 / numel as f64, 0.0)
}

/// One plain SGD step: `w -= lr * dL/dw` for every variable with a gradient.
pub fn sgd(
    vars: &[&Var],
    grads: &candle_core::backprop::GradStore,
    lr: f64,
) -> candle_core::Result<()> {
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            v.set(&(v.as_tensor() - g.affine(lr, 0.0)?)?)?;
        }
    }
    Ok(())
}
