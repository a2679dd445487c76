//! One application of a [`Differentiable`] as candle's custom op of one to three tensors:
//! the forward output computed before candle asks for it, the saved values the backward
//! reads (saving form), and the backward run when candle's backward pass reaches it.

use std::sync::Mutex;

use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Shape, Storage,
};
use fusion_runtime::Rank;

use crate::call::Written;
use crate::error::Result;

/// What candle's backward pass hands one application on `rank`: the forward inputs
/// `args`, the forward's `result` and the output's gradient `grad`; and `saved`, the
/// values the forward kept (`None`: the result).
pub(super) struct Backprop<'a> {
    pub rank: &'a Rank,
    pub args: &'a [&'a candle_core::Tensor],
    pub result: &'a candle_core::Tensor,
    pub grad: &'a candle_core::Tensor,
    pub saved: &'a [Option<candle_core::Tensor>],
}

/// What an application's backward asks of the op that made it (a `Differentiable`).
pub(super) trait Gradients: Clone + Send + Sync + 'static {
    /// The fusion's name, for candle's messages.
    fn name(&self) -> &str;

    /// The gradients of the forward inputs (`None` for those not differentiated).
    fn input_gradients(&self, b: Backprop<'_>) -> Result<Vec<Option<candle_core::Tensor>>>;
}

/// One application of a `Differentiable` (`op`): its forward output, computed before
/// candle asks for it, and what its backward needs.
pub(super) struct FusionOp<G> {
    op: G,
    rank: Rank,
    /// The forward's output, until candle's forward takes it.
    written: Mutex<Option<Written>>,
    /// The values the saving forward returned for the backward (`None`: the output
    /// itself), kept as long as candle keeps the op (its graph); empty when recomputing.
    saved: Vec<Option<candle_core::Tensor>>,
}

impl<G: Gradients> FusionOp<G> {
    /// The application of `op` on `rank` whose forward wrote `output` and `saved`.
    pub(super) fn new(
        op: G,
        rank: Rank,
        output: Written,
        saved: Vec<Option<candle_core::Tensor>>,
    ) -> FusionOp<G> {
        FusionOp {
            op,
            rank,
            written: Mutex::new(Some(output)),
            saved,
        }
    }

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
        result: &candle_core::Tensor,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Vec<Option<candle_core::Tensor>>> {
        let b = Backprop {
            rank: &self.rank,
            args,
            result,
            grad,
            saved: &self.saved,
        };
        Ok(self.op.input_gradients(b)?)
    }
}

/// The op's name in candle's messages.
const NAME: &str = "fusion";

impl<G: Gradients> CustomOp1 for FusionOp<G> {
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
        res: &candle_core::Tensor,
        grad: &candle_core::Tensor,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        let [ga]: [Option<candle_core::Tensor>; 1] = arity(self.grads(&[a], res, grad)?)?;
        Ok(ga)
    }
}

/// The impl of candle's custom-op trait of two or three tensors: storages `$s`, layouts
/// `$l`, arguments `$a`, gradients `$g`.
macro_rules! fusion_op {
    ($op:ident, [$($s:ident $l:ident $a:ident $g:ident),+]) => {
        impl<G: Gradients> $op for FusionOp<G> {
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
                res: &candle_core::Tensor,
                grad: &candle_core::Tensor,
            ) -> candle_core::Result<($(fusion_op!(@grad $g)),+)> {
                let [$($g),+] = arity(self.grads(&[$($a),+], res, grad)?)?;
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
