//! A fusion and its derived backward as one candle op, so that candle's autograd
//! (`Tensor::backward`, `GradStore`) trains through tensor-parallel layers: the forward
//! fusion runs when the op is applied, the backward fusion when candle's backward pass
//! reaches the op.

use std::ops::Deref;
use std::sync::{Arc, Mutex};

use candle_core::op::BackpropOp;
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage,
};
use fusion_compiler::autodiff::{backward, Backward, BackwardInput, GradSpec};
use fusion_compiler::ir::Fusion;
use fusion_runtime::{ExecOptions, FusionExecutor, Rank};

use crate::call::{run, Written};
use crate::error::{Error, Result};

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
}

/// What every application of one [`Differentiable`] shares.
struct Parts {
    forward: Executor,
    backward: Executor,
    /// The forward inputs' names, for errors.
    inputs: Vec<String>,
    /// What each backward input is.
    reads: Vec<BackwardInput>,
    /// For each backward output, the forward input whose gradient it is.
    gradients: Vec<usize>,
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
    /// `name::backward::derive()?` (what [`differentiable!`](crate::differentiable) writes).
    pub fn new(
        forward: &'static FusionExecutor,
        backward: &'static FusionExecutor,
        derived: Backward,
    ) -> Result<Differentiable> {
        Differentiable::assemble(
            Executor::Shared(forward),
            Executor::Shared(backward),
            derived,
        )
    }

    /// The op of a builder fusion: derives its backward for `spec` (e.g.
    /// `GradSpec::all(&forward)`) and makes an executor for each, named `name`.
    pub fn from_fusion(name: &str, forward: Fusion, spec: &GradSpec) -> Result<Differentiable> {
        let derived = backward(&forward, spec).map_err(fusion_compiler::Error::from)?;
        let bw =
            FusionExecutor::new(derived.fusion.clone()).with_name(&format!("{name}::backward"));
        let fw = FusionExecutor::new(forward).with_name(name);
        Differentiable::assemble(
            Executor::Owned(Box::new(fw)),
            Executor::Owned(Box::new(bw)),
            derived,
        )
    }

    /// [`Differentiable::new`] from the entry points' results (the expansion of
    /// [`differentiable!`](crate::differentiable)).
    #[doc(hidden)]
    pub fn from_entry_points(
        forward: fusion_runtime::Result<&'static FusionExecutor>,
        backward: fusion_runtime::Result<&'static FusionExecutor>,
        derived: std::result::Result<Backward, fusion_compiler::Error>,
    ) -> Result<Differentiable> {
        Differentiable::new(forward?, backward?, derived?)
    }

    fn assemble(forward: Executor, bw: Executor, derived: Backward) -> Result<Differentiable> {
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
        let foreign = |r: &BackwardInput| match *r {
            BackwardInput::Primal(i) => i >= inputs.len(),
            BackwardInput::OutputGrad(o) => o != 0,
        };
        if derived.inputs.iter().any(foreign) || derived.outputs.iter().any(|&i| i >= inputs.len())
        {
            return Err(Error::Unsupported(format!(
                "the backward given for fusion `{name}` reads {:?} and returns gradients of \
                 inputs {:?}, which are not all of its {} input(s) and one output",
                derived.inputs,
                derived.outputs,
                inputs.len()
            )));
        }
        let parts = Parts {
            forward,
            backward: bw,
            inputs,
            reads: derived.inputs,
            gradients: derived.outputs,
        };
        Ok(Differentiable {
            parts: Arc::new(parts),
            options: ExecOptions::default(),
        })
    }

    /// The op with these options for both fusions' calls (default: the runtime's).
    pub fn with_options(mut self, options: ExecOptions) -> Differentiable {
        self.options = options;
        self
    }

    /// The forward fusion's name.
    pub fn name(&self) -> &str {
        self.parts.forward.name()
    }

    /// The forward inputs that get a gradient, by name.
    pub fn gradients(&self) -> Vec<&str> {
        (self.parts.gradients.iter())
            .map(|&i| self.parts.inputs[i].as_str())
            .collect()
    }

    /// Runs the forward fusion on `rank` with `inputs` (this rank's tensors, in the
    /// fusion's order; contiguous from the start of their storage, as for [`crate::input`])
    /// and returns its output as a candle tensor whose gradient history is this op: a
    /// later `backward()` through it runs the backward fusion on the same rank. On a GPU
    /// both run on candle's stream.
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
        let mut written = run(rank, &self.parts.forward, &named, &self.options)?;
        let output = written
            .pop()
            .filter(|_| written.is_empty())
            .ok_or_else(|| {
                Error::Internal(format!(
                    "fusion `{}` did not return one output",
                    self.name()
                ))
            })?;
        let op = FusionOp {
            op: self.clone(),
            rank: rank.clone(),
            written: Mutex::new(Some(output)),
        };
        Ok(match inputs {
            [a] => a.apply_op1(op)?,
            [a, b] => a.apply_op2(b, op)?,
            [a, b, c] => a.apply_op3(b, c, op)?,
            _ => return Err(Error::Internal("arity checked above".into())),
        })
    }

    /// The gradients of the forward inputs `args` for output gradient `grad`, by the
    /// backward fusion on `rank` (`None` for inputs the backward does not differentiate).
    fn gradients_of(
        &self,
        rank: &Rank,
        args: &[&candle_core::Tensor],
        grad: &candle_core::Tensor,
    ) -> Result<Vec<Option<candle_core::Tensor>>> {
        // candle's gradients may be views (a broadcast, a narrow): the fusion reads whole
        // tensors, so such a gradient is copied once here.
        let layout = grad.layout();
        let grad = match layout.is_contiguous() && layout.start_offset() == 0 {
            true => grad.clone(),
            false => grad.force_contiguous()?,
        };
        let parts = &self.parts;
        let named: Vec<(&str, &candle_core::Tensor)> = (parts.reads.iter())
            .map(|r| match *r {
                BackwardInput::Primal(i) => (parts.inputs[i].as_str(), args[i]),
                BackwardInput::OutputGrad(_) => ("d_output", &grad),
            })
            .collect();
        let written = run(rank, &parts.backward, &named, &self.options)?;
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

/// One application of a [`Differentiable`]: its forward output, computed before candle
/// asks for it, and what its backward needs.
struct FusionOp {
    op: Differentiable,
    rank: Rank,
    /// The forward's output, until candle's forward takes it.
    written: Mutex<Option<Written>>,
}

impl FusionOp {
    /// The forward output, once.
    fn take(&self) -> candle_core::Result<(Storage, Shape)> {
        let taken = self
            .written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let (storage, shape) = taken.ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fusion op `{}`: the forward output was already taken",
                self.op.name()
            ))
        })?;
        Ok((storage, Shape::from(shape)))
    }

    fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        match self.take()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => Err(self.elsewhere("the CPU")),
        }
    }

    fn cuda(&self) -> candle_core::Result<(CudaStorage, Shape)> {
        match self.take()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => Err(self.elsewhere("a CUDA device")),
        }
    }

    fn elsewhere(&self, asked: &str) -> candle_core::Error {
        candle_core::Error::Msg(format!(
            "fusion op `{}`: candle asked for the output on {asked}, where the inputs are not",
            self.op.name()
        ))
    }

    fn grads(
        &self,
        args: &[&candle_core::Tensor],
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Vec<Option<candle_core::Tensor>>> {
        Ok(self.op.gradients_of(&self.rank, args, grad)?)
    }
}

/// The op's name in candle's messages.
const NAME: &str = "fusion";

impl CustomOp1 for FusionOp {
    fn name(&self) -> &'static str {
        NAME
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        self.cpu()
    }
    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        self.cuda()
    }
    fn bwd(
        &self,
        a: &candle_core::Tensor,
        _res: &candle_core::Tensor,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        let [ga]: [Option<candle_core::Tensor>; 1] = arity(self.grads(&[a], grad)?)?;
        Ok(ga)
    }
}

/// The impl of candle's custom-op trait of two or three tensors: storages `$s`, layouts
/// `$l`, arguments `$a`, gradients `$g`.
macro_rules! fusion_op {
    ($op:ident, [$($s:ident $l:ident $a:ident $g:ident),+]) => {
        impl $op for FusionOp {
            fn name(&self) -> &'static str {
                NAME
            }
            fn cpu_fwd(
                &self,
                $($s: &CpuStorage, $l: &Layout),+
            ) -> candle_core::Result<(CpuStorage, Shape)> {
                self.cpu()
            }
            fn cuda_fwd(
                &self,
                $($s: &CudaStorage, $l: &Layout),+
            ) -> candle_core::Result<(CudaStorage, Shape)> {
                self.cuda()
            }
            fn bwd(
                &self,
                $($a: &candle_core::Tensor,)+
                _res: &candle_core::Tensor,
                grad: &candle_core::Tensor,
            ) -> candle_core::Result<($(fusion_op!(@grad $g)),+)> {
                let [$($g),+] = arity(self.grads(&[$($a),+], grad)?)?;
                Ok(($($g),+))
            }
        }
    };
    (@grad $g:ident) => {
        Option<candle_core::Tensor>
    };
}

fusion_op!(CustomOp2, [_s1 _l1 a ga, _s2 _l2 b gb]);
fusion_op!(CustomOp3, [_s1 _l1 a ga, _s2 _l2 b gb, _s3 _l3 c gc]);

/// `N` gradients as an array.
fn arity<const N: usize>(
    grads: Vec<Option<candle_core::Tensor>>,
) -> candle_core::Result<[Option<candle_core::Tensor>; N]> {
    grads.try_into().map_err(|v: Vec<_>| {
        candle_core::Error::Msg(format!("fusion op: {} gradients for {N} inputs", v.len()))
    })
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
        )
    };
}
