//! A fusion and its derived backward as one candle op, so that candle's autograd
//! (`Tensor::backward`, `GradStore`) trains through tensor-parallel layers: the forward
//! fusion runs when the op is applied, the backward fusion when candle's backward pass
//! reaches the op. The op trains with the backward's saving form (the forward's GEMM
//! results kept in the op until the backward) or its recomputing form ([`BackwardForm`]).

mod op;

use std::ops::Deref;
use std::sync::Arc;

use candle_core::op::BackpropOp;
use fusion_compiler::autodiff::{backward, saving, Backward, BackwardInput, GradSpec, Saving};
use fusion_compiler::ir::Fusion;
use fusion_runtime::{ExecOptions, FusionExecutor, Rank};

use crate::call::{run, Written};
use crate::error::{Error, Result};
use op::{Backprop, FusionOp, Gradients};

/// Which backward a [`Differentiable`] trains with: what it keeps from the forward to the
/// backward, memory against time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackwardForm {
    /// The forward also returns the GEMM (and reduction) results the backward reads, in
    /// the layout it computed them (no communication), and each applied op keeps them
    /// until candle drops its graph; the backward computes no GEMM twice. Memory: those
    /// results, per layer and rank, from the forward to the backward (the MLP block's
    /// hidden pre-activation: every row of this rank's `F/D` columns), as PyTorch's
    /// autograd keeps its activations. The forward stores the pre-activation too, so a
    /// GEMM's activation epilogue runs as its own elementwise pass. The default.
    #[default]
    Saving,
    /// Nothing is kept: the backward recomputes every forward value it reads (the MLP
    /// block's first GEMM again, one GEMM in five of its backward). For models short of
    /// memory.
    Recomputing,
}

/// A fusion with one output and one to three inputs, and its derived backward, applied to
/// candle tensors as a candle op with a gradient ([`Differentiable::apply`]): candle's
/// `backward()` calls the backward fusion with the forward inputs and the output's
/// gradient, and adds the input gradients it returns to candle's `GradStore`. Inputs
/// with a `DIDx` axis are this rank's blocks, as everywhere in the adapter, and so are
/// their gradients. Every rank applies the same ops in the same order, and runs
/// `backward()` on the same graph, so the collectives of the two fusions meet.
///
/// Make one per layer from a `#[backward]` fusion with [`differentiable!`](crate::differentiable)
/// (or [`Differentiable::new`]), or from a builder fusion with
/// [`Differentiable::from_fusion`]; clones share the executors.
///
/// It trains with the saving form of the backward by default: the forward also returns
/// the GEMM results its backward reads, which the op keeps until candle's backward reaches
/// it, so no GEMM runs twice. [`Differentiable::with_backward`] picks the recomputing form
/// instead, which keeps nothing and recomputes them ([`BackwardForm`] weighs the two).
///
/// ```
/// use candle_core::{Device, Tensor as CandleTensor, Var};
/// use fusion::prelude::*;
///
/// fusion! {
///     /// Plain tensor-parallel linear layer: the partial products all-reduced.
///     #[backward]
///     pub fn row_linear<d, m, k, n>(x: Tensor<f32, [d @ DIDx, m, k]>,
///                                   w: Tensor<f32, [d @ DIDx, k, n]>) -> Tensor<f32, [m, n]> {
///         sum(matmul(x, w), 0)
///     }
/// }
///
/// /// One training step's gradient of `w` on one rank.
/// fn grad_of_w(rank: &Rank, linear: &fusion_candle::Differentiable) -> fusion_candle::Result<Vec<f32>> {
///     let x = CandleTensor::ones((1, 2, 3), candle_core::DType::F32, &Device::Cpu)?;
///     let w = Var::ones((1, 3, 4), candle_core::DType::F32, &Device::Cpu)?;
///     let y = linear.apply(rank, &[&x, w.as_tensor()])?; // runs the forward fusion
///     let grads = y.sum_all()?.backward()?; // runs the backward fusion
///     let dw = grads.get(w.as_tensor()).expect("w has a gradient");
///     Ok(dw.flatten_all()?.to_vec1::<f32>()?)
/// }
///
/// let linear = fusion_candle::differentiable!(row_linear)?;
/// let dw = World::local(1)?.run(|rank| Ok(grad_of_w(rank, &linear)?))?;
/// assert_eq!(dw[0], [2f32; 12]); // each weight meets the two rows of ones
/// # Ok::<(), fusion_candle::Error>(())
/// ```
#[derive(Clone)]
pub struct Differentiable {
    parts: Arc<Parts>,
    options: ExecOptions,
    form: BackwardForm,
}

/// What every application of one [`Differentiable`] shares.
struct Parts {
    recomputing: Pair,
    saving: Pair,
    /// The forward inputs' names, for errors.
    inputs: Vec<String>,
    /// For each backward output, the forward input whose gradient it is.
    gradients: Vec<usize>,
}

/// One form of the backward: its forward and backward executors, what each backward
/// input is, and which forward outputs are the saved values (none when recomputing).
struct Pair {
    forward: Executor,
    backward: Executor,
    reads: Vec<BackwardInput>,
    saved: Vec<usize>,
}

impl Pair {
    /// The recomputing form: the fusion's own forward and `derived`.
    fn recomputing(forward: Executor, backward: Executor, derived: &Backward) -> Pair {
        Pair {
            forward,
            backward,
            reads: derived.inputs.clone(),
            saved: Vec::new(),
        }
    }

    /// The saving form `s` with its executors.
    fn saving(forward: Executor, backward: Executor, s: &Saving) -> Pair {
        Pair {
            forward,
            backward,
            reads: s.backward.inputs.clone(),
            saved: s.saved.clone(),
        }
    }

    /// The saving form `s` with executors of its own, named after `name`.
    fn owned_saving(name: &str, s: &Saving) -> Pair {
        let forward =
            FusionExecutor::new(s.forward.clone()).with_name(&format!("{name}::forward_saving"));
        let backward = FusionExecutor::new(s.backward.fusion.clone())
            .with_name(&format!("{name}::backward_saved"));
        Pair::saving(
            Executor::Owned(Box::new(forward)),
            Executor::Owned(Box::new(backward)),
            s,
        )
    }
}

/// An executor `fusion!` made (shared by every caller) or one of the op's own.
enum Executor {
    Shared(&'static FusionExecutor),
    Owned(Box<FusionExecutor>),
}

impl Deref for Executor {
    type Target = FusionExecutor;
    fn deref(&self) -> &FusionExecutor {
        match self {
            Executor::Shared(e) => e,
            Executor::Owned(e) => e,
        }
    }
}

impl Differentiable {
    /// The op of a `#[backward]` fusion from its entry points: `forward` is
    /// `name::executor()?`, `backward` is `name::backward::executor()?` and `derived`
    /// `name::backward::derive()?`. The saving form is derived here, with executors of its
    /// own ([`differentiable!`](crate::differentiable) shares `fusion!`'s instead).
    pub fn new(
        forward: &'static FusionExecutor,
        backward: &'static FusionExecutor,
        derived: Backward,
    ) -> Result<Differentiable> {
        let fusion = forward.fusion_for(&[])?;
        let saving_form = derive_saving(&fusion, &derived)?;
        let recomputing = Pair::recomputing(
            Executor::Shared(forward),
            Executor::Shared(backward),
            &derived,
        );
        let saving = Pair::owned_saving(forward.name(), &saving_form);
        Differentiable::assemble(recomputing, saving, derived.outputs)
    }

    /// The op of a builder fusion: derives its backward for `spec` (e.g.
    /// `GradSpec::all(&forward)`), in both forms, and makes an executor for each fusion,
    /// named after `name`.
    pub fn from_fusion(name: &str, forward: Fusion, spec: &GradSpec) -> Result<Differentiable> {
        let derived = backward(&forward, spec).map_err(fusion_compiler::Error::from)?;
        let saving_form = saving(&forward, spec).map_err(fusion_compiler::Error::from)?;
        let bw =
            FusionExecutor::new(derived.fusion.clone()).with_name(&format!("{name}::backward"));
        let fw = FusionExecutor::new(forward).with_name(name);
        let recomputing = Pair::recomputing(
            Executor::Owned(Box::new(fw)),
            Executor::Owned(Box::new(bw)),
            &derived,
        );
        let saving = Pair::owned_saving(name, &saving_form);
        Differentiable::assemble(recomputing, saving, derived.outputs)
    }

    /// The op from a `#[backward]` fusion's entry points' results, both forms with the
    /// executors `fusion!` made (the expansion of [`differentiable!`](crate::differentiable)).
    #[doc(hidden)]
    pub fn from_entry_points(
        forward: fusion_runtime::Result<&'static FusionExecutor>,
        backward: fusion_runtime::Result<&'static FusionExecutor>,
        derived: std::result::Result<Backward, fusion_compiler::Error>,
        saving_executors: fusion_runtime::Result<(
            &'static FusionExecutor,
            &'static FusionExecutor,
        )>,
        saving: std::result::Result<Saving, fusion_compiler::Error>,
    ) -> Result<Differentiable> {
        let derived = derived?;
        let (saving_fw, saving_bw) = saving_executors?;
        let recomputing = Pair::recomputing(
            Executor::Shared(forward?),
            Executor::Shared(backward?),
            &derived,
        );
        let saving = Pair::saving(
            Executor::Shared(saving_fw),
            Executor::Shared(saving_bw),
            &saving?,
        );
        Differentiable::assemble(recomputing, saving, derived.outputs)
    }

    fn assemble(recomputing: Pair, saving: Pair, gradients: Vec<usize>) -> Result<Differentiable> {
        let forward = &recomputing.forward;
        let name = forward.name().to_string();
        if !forward.dtype_params().is_empty() {
            return Err(Error::Unsupported(format!(
                "fusion `{name}` is generic over dtypes, which the backward does not \
                 differentiate yet: give it fixed dtypes"
            )));
        }
        let fusion = forward.fusion_for(&[])?;
        let inputs: Vec<String> = (fusion.inputs().iter())
            .map(|&t| fusion.tensor_name(t))
            .collect();
        if fusion.outputs().len() != 1 || !(1..=3).contains(&inputs.len()) {
            return Err(Error::Unsupported(format!(
                "fusion `{name}` has {} input(s) and {} output(s); a candle op with a \
                 gradient (candle's CustomOp1/2/3) takes one to three tensors and returns \
                 one: split the fusion",
                inputs.len(),
                fusion.outputs().len()
            )));
        }
        for pair in [&recomputing, &saving] {
            let foreign = |r: &BackwardInput| match *r {
                BackwardInput::Primal(i) => i >= inputs.len(),
                BackwardInput::Saved(k) => k >= pair.saved.len(),
                BackwardInput::OutputGrad(o) => o != 0,
            };
            if pair.reads.iter().any(foreign) || gradients.iter().any(|&i| i >= inputs.len()) {
                return Err(Error::Unsupported(format!(
                    "the backward given for fusion `{name}` reads {:?} and returns gradients \
                     of inputs {:?}, which are not all of its {} input(s), one output and \
                     the {} saved value(s)",
                    pair.reads,
                    gradients,
                    inputs.len(),
                    pair.saved.len()
                )));
            }
        }
        let parts = Parts {
            recomputing,
            saving,
            inputs,
            gradients,
        };
        Ok(Differentiable {
            parts: Arc::new(parts),
            options: ExecOptions::default(),
            form: BackwardForm::default(),
        })
    }

    /// The op with these options for both fusions' calls (default: the runtime's).
    pub fn with_options(mut self, options: ExecOptions) -> Differentiable {
        self.options = options;
        self
    }

    /// The op training with this form of the backward (default: [`BackwardForm::Saving`]).
    pub fn with_backward(mut self, form: BackwardForm) -> Differentiable {
        self.form = form;
        self
    }

    /// The form of the backward the op trains with.
    pub fn backward_form(&self) -> BackwardForm {
        self.form
    }

    /// The forward fusion's name.
    pub fn name(&self) -> &str {
        self.parts.recomputing.forward.name()
    }

    /// The forward inputs that get a gradient, by name.
    pub fn gradients(&self) -> Vec<&str> {
        (self.parts.gradients.iter())
            .map(|&i| self.parts.inputs[i].as_str())
            .collect()
    }

    /// The executors and reads of the form the op trains with.
    fn pair(&self) -> &Pair {
        match self.form {
            BackwardForm::Saving => &self.parts.saving,
            BackwardForm::Recomputing => &self.parts.recomputing,
        }
    }

    /// Runs the forward fusion on `rank` with `inputs` (this rank's tensors, in the
    /// fusion's order; contiguous from the start of their storage, as for [`crate::input`])
    /// and returns its output as a candle tensor whose gradient history is this op: a
    /// later `backward()` through it runs the backward fusion on the same rank. On a GPU
    /// both run on candle's stream. With the saving form the forward also returns the
    /// values the backward reads, which the op keeps (only when candle records the op: an
    /// input is a `Var` or computed from one; otherwise the plain forward runs).
    pub fn apply(
        &self,
        rank: &Rank,
        inputs: &[&candle_core::Tensor],
    ) -> Result<candle_core::Tensor> {
        let names = &self.parts.inputs;
        if inputs.len() != names.len() {
            return Err(Error::Unsupported(format!(
                "fusion `{}` takes {} input(s) ({}), given {}",
                self.name(),
                names.len(),
                names.join(", "),
                inputs.len()
            )));
        }
        let named: Vec<(&str, &candle_core::Tensor)> = names
            .iter()
            .map(String::as_str)
            .zip(inputs.iter().copied())
            .collect();
        let tracked = inputs.iter().any(|t| t.track_op());
        let pair = match tracked {
            true => self.pair(),
            false => &self.parts.recomputing,
        };
        let written = run(rank, &pair.forward, &named, &self.options)?;
        let (output, saved) = self.split_outputs(written, &pair.saved)?;
        let op = FusionOp::new(self.clone(), rank.clone(), output, saved);
        Ok(match inputs {
            [a] => a.apply_op1(op)?,
            [a, b] => a.apply_op2(b, op)?,
            [a, b, c] => a.apply_op3(b, c, op)?,
            _ => return Err(Error::Internal("arity checked above".into())),
        })
    }

    /// The forward's output, and the saved values among its outputs (`saved`: their
    /// indices) as candle tensors; `None` for one that is the output itself (the op's
    /// result, which candle hands to the backward).
    fn split_outputs(
        &self,
        written: Vec<Written>,
        saved: &[usize],
    ) -> Result<(Written, Vec<Option<candle_core::Tensor>>)> {
        let count = written.len();
        let mut outputs: Vec<Option<Written>> = written.into_iter().map(Some).collect();
        let mut take = |o: usize| {
            outputs.get_mut(o).and_then(Option::take).ok_or_else(|| {
                Error::Internal(format!(
                    "fusion `{}` returned {count} output(s), without output {o}",
                    self.name()
                ))
            })
        };
        let output = take(0)?;
        let saved = (saved.iter())
            .map(|&o| match o {
                0 => Ok(None),
                o => take(o).map(|(storage, shape)| {
                    let t = candle_core::Tensor::from_storage(
                        storage,
                        shape,
                        BackpropOp::none(),
                        false,
                    );
                    Some(t)
                }),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((output, saved))
    }
}

impl Gradients for Differentiable {
    fn name(&self) -> &str {
        Differentiable::name(self)
    }

    /// The gradients of the forward inputs, by the backward fusion of the op's form on the
    /// application's rank (`None` for inputs the backward does not differentiate).
    fn input_gradients(&self, b: Backprop<'_>) -> Result<Vec<Option<candle_core::Tensor>>> {
        let Backprop {
            rank,
            args,
            result,
            grad,
            saved,
        } = b;
        // candle's gradients may be views (a broadcast, a narrow): the fusion reads whole
        // tensors, so such a gradient is copied once here.
        let layout = grad.layout();
        let grad = match layout.is_contiguous() && layout.start_offset() == 0 {
            true => grad.clone(),
            false => grad.force_contiguous()?,
        };
        let (parts, pair) = (&self.parts, self.pair());
        let missing = |k: usize| {
            Error::Internal(format!(
                "fusion op `{}`: the forward kept {} saved value(s), the backward reads value {k}",
                self.name(),
                saved.len()
            ))
        };
        let named = (pair.reads.iter())
            .map(|r| match *r {
                BackwardInput::Primal(i) => Ok((parts.inputs[i].as_str(), args[i])),
                BackwardInput::Saved(k) => match saved.get(k) {
                    Some(t) => Ok(("saved value", t.as_ref().unwrap_or(result))),
                    None => Err(missing(k)),
                },
                BackwardInput::OutputGrad(_) => Ok(("d_output", &grad)),
            })
            .collect::<Result<Vec<(&str, &candle_core::Tensor)>>>()?;
        let written = run(rank, &pair.backward, &named, &self.options)?;
        let mut grads = vec![None; args.len()];
        for (k, (storage, shape)) in written.into_iter().enumerate() {
            let input = parts.gradients.get(k).copied().ok_or_else(|| {
                Error::Internal(format!("backward of `{}`: extra output {k}", self.name()))
            })?;
            grads[input] = Some(candle_core::Tensor::from_storage(
                storage,
                shape,
                BackpropOp::none(),
                false,
            ));
        }
        Ok(grads)
    }
}

/// The saving form of the fusion `fusion` for what `derived` differentiates.
fn derive_saving(fusion: &Fusion, derived: &Backward) -> Result<Saving> {
    let outputs = (derived.inputs.iter())
        .filter_map(|r| match *r {
            BackwardInput::OutputGrad(o) => Some(o),
            _ => None,
        })
        .collect();
    let spec = GradSpec {
        outputs,
        inputs: derived.outputs.clone(),
    };
    Ok(saving(fusion, &spec).map_err(fusion_compiler::Error::from)?)
}

/// The [`Differentiable`] of a `#[backward]` fusion, from the path of the fusion's
/// module: `differentiable!(mlp)` or `differentiable!(layers::mlp)`, a
/// `fusion_candle::Result<Differentiable>`.
#[macro_export]
macro_rules! differentiable {
    ($($fusion:ident)::+) => {
        $crate::Differentiable::from_entry_points(
            $($fusion)::+::executor(),
            $($fusion)::+::backward::executor(),
            $($fusion)::+::backward::derive(),
            $($fusion)::+::backward::saving_executors(),
            $($fusion)::+::backward::derive_saving(),
        )
    };
}
