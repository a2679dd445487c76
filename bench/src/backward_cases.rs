//! The layers whose derived backward the backward benchmark times (`backward_bench`): the
//! sequence-parallel MLP block and the overlap benchmark's two seed layers, AG+GEMM
//! (column-parallel) and GEMM+RS (row-parallel), each a bf16 `fusion!` with `#[backward]`
//! (the backward of a fusion generic over dtypes is not derived yet). Beside them: each
//! layer's per-rank inputs, its forward and backward called as a user calls them, and a
//! reference for its gradients built from single-device GEMMs and the collectives alone,
//! whose steps the benchmark times as the backward's GEMMs alone.
//!
//! Backward of each layer, per rank (D devices):
//! - AG+GEMM `Y = AG(X) W` (X rows sharded, W column blocks): `dX = RS(dY W^T)`,
//!   `dW = AG(X)^T dY`;
//! - GEMM+RS `Y = RS(A W)` (A column blocks, W row blocks): `dA = AG(dY) W^T`,
//!   `dW = A^T AG(dY)`;
//! - MLP `Y = RS(gelu(AG(X) W1) W2)`: `dW2 = act^T AG(dY)`, `dH = (AG(dY) W2^T) gelu'(H)`,
//!   `dW1 = AG(X)^T dH`, `dX = RS(dH W1^T)`, with `H = AG(X) W1` saved by the forward
//!   (the saving form, what training uses) or recomputed (the recomputing form).
//!
//! Each layer's backward runs in both forms: `name::forward_saving` + `name::backward_saved`
//! and `name::backward`.

use fusion::compiler::autodiff::BackwardInput;
use fusion::compiler::ir::Fusion;
use fusion::prelude::*;
use fusion::{FusionExecutor, Rank, Result, Tensor};

use crate::fusions as components;
use crate::measure::random_scaled;

fusion! {
    /// The sequence-parallel MLP block (`examples/tp_mlp/blocks.rs`, in bf16).
    #[backward]
    pub fn mlp<d, m, h, f>(
        x: Tensor<bf16, [d @ DIDx, m, h]>,
        w1: Tensor<bf16, [d @ DIDx, h, f]>,
        w2: Tensor<bf16, [d @ DIDx, f, h]>,
    ) -> Tensor<bf16, [d @ DIDx, m, h]> {
        let act: Tensor<bf16, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<bf16, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    /// Column-parallel AG+GEMM: the gathered rows times this rank's column block of W.
    #[backward]
    pub fn ag_gemm<d, m, k, n>(
        x: Tensor<bf16, [d @ DIDx, m, k]>,
        w: Tensor<bf16, [d @ DIDx, k, n]>,
    ) -> Tensor<bf16, [d @ Stream, d @ DIDx, m, n]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    /// Row-parallel GEMM+RS: every row of A's column block times W's row block, the partial
    /// sums reduce-scattered by rows.
    #[backward]
    pub fn gemm_rs<d, m, k, n>(
        a: Tensor<bf16, [d, d @ DIDx, m, k]>,
        w: Tensor<bf16, [d @ DIDx, k, n]>,
    ) -> Tensor<bf16, [d @ DIDx, m, n]> {
        let partial: Tensor<bf16, [d @ Stream, d @ DIDx, m, n]> = matmul(a, w);
        sum(partial, 1)
    }

    /// One device's GEMM `A B`.
    pub fn gemm_nn<T: Float, m, k, n>(a: Tensor<T, [m, k]>, b: Tensor<T, [k, n]>)
        -> Tensor<T, [m, n]> {
        matmul(a, b)
    }

    /// One device's GEMM `A B^T` (an input gradient: `dY W^T`).
    pub fn gemm_nt<T: Float, m, k, n>(a: Tensor<T, [m, n]>, b: Tensor<T, [k, n]>)
        -> Tensor<T, [m, k]> {
        matmul(a, transpose(b, 0, 1))
    }

    /// One device's GEMM `A^T B` (a weight gradient: `X^T dY`).
    pub fn gemm_tn<T: Float, m, k, n>(a: Tensor<T, [m, k]>, b: Tensor<T, [m, n]>)
        -> Tensor<T, [k, n]> {
        matmul(transpose(a, 0, 1), b)
    }

    /// `dY W^T` times the activation's derivative at `h`: the backward's first GEMM with
    /// the derivative in its epilogue, as the derived backward runs it.
    pub fn gemm_nt_slope<T: Float, m, k, n>(
        a: Tensor<T, [m, n]>,
        b: Tensor<T, [k, n]>,
        h: Tensor<T, [m, k]>,
    ) -> Tensor<T, [m, k]> {
        matmul(a, transpose(b, 0, 1)) * gelu_tanh_grad(h)
    }

    /// The MLP's activation alone.
    pub fn act<T: Float, m, f>(h: Tensor<T, [m, f]>) -> Tensor<T, [m, f]> {
        gelu_tanh(h)
    }

    /// The activation's adjoint: `g gelu'(h)`.
    pub fn act_grad<T: Float, m, f>(h: Tensor<T, [m, f]>, g: Tensor<T, [m, f]>)
        -> Tensor<T, [m, f]> {
        g * gelu_tanh_grad(h)
    }
}

/// The element type of every layer here.
pub const DTYPE: DType = DType::BF16;

/// A layer whose backward is timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The MLP block; shape `(M, H, F)`.
    Mlp,
    /// AG+GEMM; shape `(M, K, N)`, N the columns of each rank.
    AgGemm,
    /// GEMM+RS; shape `(M, K, N)`, K the whole contraction (K/D per rank).
    GemmRs,
}

/// What a step of a reference computation is, for its row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A GEMM; `recompute` for one that recomputes a forward value (only the recomputing
    /// form's backward runs it: the saving form takes the forward's).
    Gemm { recompute: bool },
    /// An AllGather or ReduceScatter.
    Comm,
    /// An elementwise op (the activation or its adjoint).
    Elementwise,
    /// A GEMM with an elementwise op in its epilogue (timed beside the two apart; not
    /// counted among the GEMMs).
    Fused,
}

/// Runs one step of a reference computation (the benchmark also times it).
pub trait Steps {
    /// `exec` on `inputs`: its first output.
    fn step(
        &mut self,
        name: &str,
        kind: Kind,
        exec: &FusionExecutor,
        inputs: &[&Tensor],
    ) -> Result<Tensor>;
}

/// The single-device fusions and collectives the references are made of.
pub struct Kernels {
    allgather: FusionExecutor,
    reduce_scatter: FusionExecutor,
    nn: FusionExecutor,
    nt: FusionExecutor,
    tn: FusionExecutor,
    act: FusionExecutor,
    act_grad: FusionExecutor,
    nt_slope: FusionExecutor,
}

impl Kernels {
    /// The executors, in [`DTYPE`].
    pub fn new() -> Result<Kernels> {
        Ok(Kernels {
            allgather: exec(components::allgather(DTYPE))?,
            reduce_scatter: exec(components::reduce_scatter(DTYPE))?,
            nn: exec(gemm_nn::build(DTYPE))?,
            nt: exec(gemm_nt::build(DTYPE))?,
            tn: exec(gemm_tn::build(DTYPE))?,
            act: exec(act::build(DTYPE))?,
            act_grad: exec(act_grad::build(DTYPE))?,
            nt_slope: exec(gemm_nt_slope::build(DTYPE))?,
        })
    }
}

/// An executor of a built fusion (by the builder or `fusion!`).
fn exec<E>(f: std::result::Result<Fusion, E>) -> Result<FusionExecutor>
where
    fusion::Error: From<E>,
{
    Ok(FusionExecutor::new(f?))
}

/// One layer's tensors on one rank: the forward inputs and the output gradient.
pub struct Parts {
    /// The forward inputs, in the fusion's order.
    pub primals: Vec<Tensor>,
    /// The gradient of the output (a `Stream` axis of the output is a serial axis here).
    pub dy: Tensor,
}

fn r3(t: &Tensor) -> Result<Tensor3> {
    t.clone().try_into()
}

fn r4(t: &Tensor) -> Result<Tensor4> {
    t.clone().try_into()
}

impl Op {
    /// The op's name in the rows.
    pub fn name(self) -> &'static str {
        match self {
            Op::Mlp => "MLP",
            Op::AgGemm => "AG+GEMM",
            Op::GemmRs => "GEMM+RS",
        }
    }

    /// The names of the shape's three dimensions.
    pub fn dims(self) -> [&'static str; 3] {
        match self {
            Op::Mlp => ["M", "H", "F"],
            _ => ["M", "K", "N"],
        }
    }

    /// The op of a `--ops` name (`mlp`, `ag`, `rs`).
    pub fn parse(s: &str) -> Option<Op> {
        match s {
            "mlp" => Some(Op::Mlp),
            "ag" => Some(Op::AgGemm),
            "rs" => Some(Op::GemmRs),
            _ => None,
        }
    }

    /// Why the shape does not split over `d` devices, if it does not.
    pub fn unsplittable(self, (m, k, n): (usize, usize, usize), d: usize) -> Option<String> {
        let split = match self {
            Op::Mlp => ("M and F", m % d == 0 && n % d == 0),
            Op::AgGemm => ("M", m % d == 0),
            Op::GemmRs => ("M and K", m % d == 0 && k % d == 0),
        };
        (!split.1).then(|| format!("{} must divide by {d}", split.0))
    }

    /// This rank's inputs and output gradient: uniform random values, the weights scaled
    /// like a layer's initialization, different on every rank.
    pub fn inputs(self, rank: &Rank, (m, k, n): (usize, usize, usize), seed: u64) -> Result<Parts> {
        let d = rank.world_size();
        let s = seed.wrapping_add(1000 * rank.index() as u64);
        let t = |shape: &[usize], i: u64, scale: f32| -> Result<Tensor> {
            rank.to_device(&random_scaled(shape, DTYPE, s + i, scale)?)
        };
        let inv = |x: usize| 1.0 / (x as f32).sqrt();
        Ok(match self {
            // (M, H, F): x [1, M/d, H], w1 [1, H, F/d], w2 [1, F/d, H].
            Op::Mlp => Parts {
                primals: vec![
                    t(&[1, m / d, k], 0, 1.0)?,
                    t(&[1, k, n / d], 1, inv(k))?,
                    t(&[1, n / d, k], 2, inv(n))?,
                ],
                dy: t(&[1, m / d, k], 3, 1.0)?,
            },
            Op::AgGemm => Parts {
                primals: vec![t(&[1, m / d, k], 0, 1.0)?, t(&[1, k, n], 1, inv(k))?],
                dy: t(&[d, 1, m / d, n], 3, 1.0)?,
            },
            Op::GemmRs => Parts {
                primals: vec![
                    t(&[d, 1, m / d, k / d], 0, 1.0)?,
                    t(&[1, k / d, n], 1, inv(k))?,
                ],
                dy: t(&[1, m / d, n], 3, 1.0)?,
            },
        })
    }

    /// The forward as a user calls it (default options).
    pub fn forward(self, rank: &Rank, p: &Parts) -> Result<Tensor> {
        let t = &p.primals;
        Ok(match self {
            Op::Mlp => mlp(rank, &r3(&t[0])?, &r3(&t[1])?, &r3(&t[2])?)?.into_inner(),
            Op::AgGemm => ag_gemm(rank, &r3(&t[0])?, &r3(&t[1])?)?.into_inner(),
            Op::GemmRs => gemm_rs(rank, &r4(&t[0])?, &r3(&t[1])?)?.into_inner(),
        })
    }

    /// The recomputing backward as a user calls it (`name::backward`, default options):
    /// the input gradients in input order.
    pub fn backward_recomputing(self, rank: &Rank, p: &Parts) -> Result<Vec<Tensor>> {
        let t = &p.primals;
        Ok(match self {
            Op::Mlp => {
                let (dx, dw1, dw2) =
                    mlp::backward(rank, &r3(&t[0])?, &r3(&t[1])?, &r3(&t[2])?, &r3(&p.dy)?)?;
                vec![dx.into(), dw1.into(), dw2.into()]
            }
            Op::AgGemm => {
                let (dx, dw) = ag_gemm::backward(rank, &r3(&t[0])?, &r3(&t[1])?, &r4(&p.dy)?)?;
                vec![dx.into(), dw.into()]
            }
            Op::GemmRs => {
                let (da, dw) = gemm_rs::backward(rank, &r4(&t[0])?, &r3(&t[1])?, &r3(&p.dy)?)?;
                vec![da.into(), dw.into()]
            }
        })
    }

    /// The saving forward as a user calls it (`name::forward_saving`, default options): the
    /// output, and what the saving backward takes.
    pub fn forward_saving(self, rank: &Rank, p: &Parts) -> Result<(Tensor, Saved)> {
        let t = &p.primals;
        Ok(match self {
            Op::Mlp => {
                let (y, s) = mlp::forward_saving(rank, &r3(&t[0])?, &r3(&t[1])?, &r3(&t[2])?)?;
                (y.into_inner(), Saved::Mlp(s))
            }
            Op::AgGemm => {
                let (y, s) = ag_gemm::forward_saving(rank, &r3(&t[0])?, &r3(&t[1])?)?;
                (y.into_inner(), Saved::AgGemm(s))
            }
            Op::GemmRs => {
                let (y, s) = gemm_rs::forward_saving(rank, &r4(&t[0])?, &r3(&t[1])?)?;
                (y.into_inner(), Saved::GemmRs(s))
            }
        })
    }

    /// The saving backward as a user calls it (`name::backward_saved`, default options)
    /// with what [`Op::forward_saving`] kept: the input gradients in input order.
    pub fn backward_saved(self, rank: &Rank, p: &Parts, saved: &Saved) -> Result<Vec<Tensor>> {
        let t = &p.primals;
        Ok(match (self, saved) {
            (Op::Mlp, Saved::Mlp(s)) => {
                let (x, w1, w2, dy) = (r3(&t[0])?, r3(&t[1])?, r3(&t[2])?, r3(&p.dy)?);
                let (dx, dw1, dw2) = mlp::backward_saved(rank, s, &x, &w1, &w2, &dy)?;
                vec![dx.into(), dw1.into(), dw2.into()]
            }
            (Op::AgGemm, Saved::AgGemm(s)) => {
                let (x, w, dy) = (r3(&t[0])?, r3(&t[1])?, r4(&p.dy)?);
                let (dx, dw) = ag_gemm::backward_saved(rank, s, &x, &w, &dy)?;
                vec![dx.into(), dw.into()]
            }
            (Op::GemmRs, Saved::GemmRs(s)) => {
                let (a, w, dy) = (r4(&t[0])?, r3(&t[1])?, r3(&p.dy)?);
                let (da, dw) = gemm_rs::backward_saved(rank, s, &a, &w, &dy)?;
                vec![da.into(), dw.into()]
            }
            _ => {
                return Err(fusion::Error::World(format!(
                    "{}: a Saved of another layer",
                    self.name()
                )))
            }
        })
    }

    /// The forward's shared executor (the one [`Op::forward`] calls).
    pub fn forward_executor(self) -> Result<&'static FusionExecutor> {
        match self {
            Op::Mlp => mlp::executor(),
            Op::AgGemm => ag_gemm::executor(),
            Op::GemmRs => gemm_rs::executor(),
        }
    }

    /// The recomputing backward's shared executor (the one [`Op::backward_recomputing`]
    /// calls) and its inputs picked from `p`, to make the first call with its plan report.
    pub fn recomputing_call(self, p: &Parts) -> Result<(&'static FusionExecutor, Vec<Tensor>)> {
        let (exec, derived) = match self {
            Op::Mlp => (mlp::backward::executor()?, mlp::backward::derive()),
            Op::AgGemm => (ag_gemm::backward::executor()?, ag_gemm::backward::derive()),
            Op::GemmRs => (gemm_rs::backward::executor()?, gemm_rs::backward::derive()),
        };
        Ok((exec, pick(&derived?.inputs, p, &[])?))
    }

    /// The saving form's shared executors (those [`Op::forward_saving`] and
    /// [`Op::backward_saved`] call) and the saving backward's inputs picked from `p` and
    /// `saved`, to make the first calls with their plan reports.
    pub fn saving_call(self, p: &Parts, saved: &Saved) -> Result<SavingCall> {
        let ((forward, backward), derived) = match self {
            Op::Mlp => (
                mlp::backward::saving_executors()?,
                mlp::backward::derive_saving(),
            ),
            Op::AgGemm => (
                ag_gemm::backward::saving_executors()?,
                ag_gemm::backward::derive_saving(),
            ),
            Op::GemmRs => (
                gemm_rs::backward::saving_executors()?,
                gemm_rs::backward::derive_saving(),
            ),
        };
        let inputs = pick(&derived?.backward.inputs, p, saved.tensors())?;
        Ok(SavingCall {
            forward,
            backward,
            inputs,
        })
    }

    /// The input gradients computed from single-device GEMMs and the collectives alone
    /// (each a step of `s`), shaped like [`Op::backward_saved`]'s.
    pub fn reference(
        self,
        k: &Kernels,
        p: &Parts,
        d: usize,
        s: &mut dyn Steps,
    ) -> Result<Vec<Tensor>> {
        let t = &p.primals;
        let two = |x: &Tensor| -> Result<Tensor> {
            let sh = x.shape();
            x.reshape(&[sh[..sh.len() - 1].iter().product(), sh[sh.len() - 1]])
        };
        let grad = Kind::Gemm { recompute: false };
        match self {
            Op::AgGemm => {
                let (dy, w) = (two(&p.dy)?, two(&t[1])?); // [M, N], [K, N]
                let partial = s.step("gemm_dx", grad, &k.nt, &[&dy, &w])?;
                let dx = scatter(k, s, "rs_dx", &partial, d)?;
                let xg = two(&s.step("ag_x", Kind::Comm, &k.allgather, &[&t[0]])?)?;
                let dw = s.step("gemm_dw", grad, &k.tn, &[&xg, &dy])?;
                Ok(vec![dx, dw.unsqueeze(0)?])
            }
            Op::GemmRs => {
                let dyg = two(&s.step("ag_dy", Kind::Comm, &k.allgather, &[&p.dy])?)?;
                let w = two(&t[1])?; // [K/d, N]
                let da = s.step("gemm_da", grad, &k.nt, &[&dyg, &w])?; // [M, K/d]
                let dw = s.step("gemm_dw", grad, &k.tn, &[&two(&t[0])?, &dyg])?;
                Ok(vec![da.reshape(t[0].shape())?, dw.unsqueeze(0)?])
            }
            Op::Mlp => {
                let (w1, w2) = (two(&t[1])?, two(&t[2])?); // [H, F/d], [F/d, H]
                let xg = two(&s.step("ag_x", Kind::Comm, &k.allgather, &[&t[0]])?)?;
                let recompute = Kind::Gemm { recompute: true };
                let h = s.step("gemm_up", recompute, &k.nn, &[&xg, &w1])?;
                let act = s.step("act", Kind::Elementwise, &k.act, &[&h])?;
                let dyg = two(&s.step("ag_dy", Kind::Comm, &k.allgather, &[&p.dy])?)?;
                let dact = s.step("gemm_dact", grad, &k.nt, &[&dyg, &w2])?;
                let dw2 = s.step("gemm_dw2", grad, &k.tn, &[&act, &dyg])?;
                let dh = s.step("act_grad", Kind::Elementwise, &k.act_grad, &[&h, &dact])?;
                // Timed only: the same dH as one GEMM with the derivative in its epilogue.
                s.step(
                    "gemm_dact_slope",
                    Kind::Fused,
                    &k.nt_slope,
                    &[&dyg, &w2, &h],
                )?;
                let dw1 = s.step("gemm_dw1", grad, &k.tn, &[&xg, &dh])?;
                let dxg = s.step("gemm_dx", grad, &k.nt, &[&dh, &w1])?;
                let dx = scatter(k, s, "rs_dx", &dxg, d)?;
                Ok(vec![dx, dw1.unsqueeze(0)?, dw2.unsqueeze(0)?])
            }
        }
    }
}

/// What a layer's saving forward kept for its backward (its `name::Saved`).
pub enum Saved {
    Mlp(mlp::Saved),
    AgGemm(ag_gemm::Saved),
    GemmRs(gemm_rs::Saved),
}

impl Saved {
    /// This rank's saved tensors, in the order the saving backward takes them.
    pub fn tensors(&self) -> &[Tensor] {
        match self {
            Saved::Mlp(s) => s.tensors(),
            Saved::AgGemm(s) => s.tensors(),
            Saved::GemmRs(s) => s.tensors(),
        }
    }
}

/// The saving form's executors, and its backward's inputs.
pub struct SavingCall {
    pub forward: &'static FusionExecutor,
    pub backward: &'static FusionExecutor,
    pub inputs: Vec<Tensor>,
}

/// A backward's inputs, as `reads` lists them, from `p` and the saved tensors `saved`.
fn pick(reads: &[BackwardInput], p: &Parts, saved: &[Tensor]) -> Result<Vec<Tensor>> {
    (reads.iter())
        .map(|w| match *w {
            BackwardInput::Primal(i) => Ok(p.primals[i].clone()),
            BackwardInput::OutputGrad(_) => Ok(p.dy.clone()),
            BackwardInput::Saved(k) => saved
                .get(k)
                .cloned()
                .ok_or_else(|| fusion::Error::World(format!("no saved value {k}"))),
        })
        .collect()
}

/// The ReduceScatter by rows of a whole `[M, C]` partial sum: this rank's `[1, M/d, C]`.
fn scatter(
    k: &Kernels,
    s: &mut dyn Steps,
    name: &str,
    partial: &Tensor,
    d: usize,
) -> Result<Tensor> {
    let (m, c) = (partial.shape()[0], partial.shape()[1]);
    let blocks = partial.reshape(&[1, d, m / d, c])?;
    s.step(name, Kind::Comm, &k.reduce_scatter, &[&blocks])
}
