//! The adjoints of `matmul` and `linear`: the gradient times the other operand
//! transposed (a view the GEMM reads as it is), summed over the batch axes the operand
//! was broadcast along. Each result takes the forward output's parallel types on the
//! axes it shares with it, so a column-parallel layer's input gradient is a GEMM whose
//! row blocks are reduce-scattered (streamed as the forward's gather was) and its weight
//! gradient a GEMM over the gathered rows.

use super::context::Ctx;
use super::error::{AutodiffError, Result};
use super::rules::AxisSource;
use crate::ir::{Expr, ExprId, TensorId};

impl Ctx<'_> {
    /// `C = A B` (batched): dA = dC B^T, dB = A^T dC. dB comes first, so that dA (the
    /// activation's gradient, usually reduce-scattered next) is next to what sums it: a
    /// stream loop pipelines a GEMM with the reduction that follows it directly.
    pub fn matmul_adjoint(
        &mut self,
        id: ExprId,
        e: &Expr,
        g: TensorId,
        wants: [bool; 2],
    ) -> Result<()> {
        let (a, bm, out) = (e.inputs[0], e.inputs[1], e.output);
        let (ra, rb) = (self.rank(a), self.rank(bm));
        if ra < 2 || rb < 2 {
            return Err(self.not_differentiable(
                id,
                "a 1-D matmul operand; write the vector as a matrix with one row or column",
            ));
        }
        self.matrix_axes_exact(id, g, out, 2)?;
        let nb = self.rank(out) - 2;
        if wants[1] {
            let ap = self.primal(a)?;
            let at = self.b.transpose(ap, ra - 2, ra - 1)?;
            let r = self.b.matmul(at, g)?;
            let mut src = self.batch_sources(bm, nb, rb - 2);
            let n = AxisSource::Output {
                axis: nb + 1,
                summed: false,
            };
            src.extend([AxisSource::Serial, n]);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, bm);
            self.add_grad(bm, r)?;
        }
        if wants[0] {
            let bp = self.primal(bm)?;
            let bt = self.b.transpose(bp, rb - 2, rb - 1)?;
            let r = self.b.matmul(g, bt)?;
            let mut src = self.batch_sources(a, nb, ra - 2);
            src.extend([
                AxisSource::Output {
                    axis: nb,
                    summed: false,
                },
                AxisSource::Serial,
            ]);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, a);
            self.add_grad(a, r)?;
        }
        Ok(())
    }

    /// `y = x W^T + bias` (x `[.., k]`, W `[n, k]`): dx = dy W, dW = dy^T x (summed over
    /// x's batch axes), dbias = dy summed over them.
    pub fn linear_adjoint(
        &mut self,
        id: ExprId,
        e: &Expr,
        g: TensorId,
        active: &[bool],
    ) -> Result<()> {
        let (x, w, out) = (e.inputs[0], e.inputs[1], e.output);
        let rx = self.rank(x);
        let wants = |t: TensorId| active[t.index()];
        if wants(w) && rx < 2 {
            return Err(self.not_differentiable(
                id,
                "the weight gradient of a 1-D input; write the input as a matrix with one row",
            ));
        }
        self.matrix_axes_exact(id, g, out, rx.min(2))?;
        if wants(w) {
            let xp = self.primal(x)?;
            let gt = self.b.transpose(g, rx - 2, rx - 1)?;
            let r = self.b.matmul(gt, xp)?;
            let mut src: Vec<AxisSource> = (0..rx - 2)
                .map(|axis| AxisSource::Output { axis, summed: true })
                .collect();
            src.extend([
                AxisSource::Output {
                    axis: rx - 1,
                    summed: false,
                },
                AxisSource::Serial,
            ]);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, w);
            self.add_grad(w, r)?;
        }
        if wants(x) {
            let wp = self.primal(w)?;
            let r = self.b.matmul(g, wp)?;
            let mut src: Vec<AxisSource> = (0..rx - 1)
                .map(|axis| AxisSource::Output {
                    axis,
                    summed: false,
                })
                .collect();
            src.push(AxisSource::Serial);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, x);
            self.add_grad(x, r)?;
        }
        if let Some(&bias) = e.inputs.get(2).filter(|&&t| wants(t)) {
            self.add_grad(bias, g)?;
        }
        Ok(())
    }

    /// Visible rank of forward tensor `t`.
    fn rank(&self, t: TensorId) -> usize {
        self.f.visible_axes(t).len()
    }

    /// Sources of the `nb` batch axes of a GEMM adjoint's result for an operand with
    /// `own` batch axes (right-aligned): an axis the operand lacks or broadcasts is summed
    /// afterwards.
    fn batch_sources(&self, operand: TensorId, nb: usize, own: usize) -> Vec<AxisSource> {
        let skip = nb - own;
        (0..nb)
            .map(|j| {
                let summed = j < skip || self.forward_broadcast_like(operand, j - skip);
                AxisSource::Output { axis: j, summed }
            })
            .collect()
    }

    /// Refuses a GEMM whose gradient is constant along one of the output's last `n` axes
    /// (a sum over a matrix axis of its result): the IR cannot expand it back.
    fn matrix_axes_exact(&self, id: ExprId, g: TensorId, out: TensorId, n: usize) -> Result<()> {
        let r = self.rank(out);
        for k in r - n..r {
            if self.broadcast_like(g, k) && !self.forward_broadcast_like(out, k) {
                return Err(self.not_differentiable(
                    id,
                    "its result is summed over a matrix axis (not a batch axis), and the IR \
                     has no op to expand that gradient back; sum over batch axes only",
                ));
            }
        }
        Ok(())
    }

    /// Names a gradient contribution `d_<primal>` when the primal has a name.
    fn name_grad(&mut self, r: TensorId, primal: TensorId) {
        if self.f.tensor(primal).name.is_some() {
            let name = self.grad_name(primal);
            self.b.name(r, &name);
        }
    }

    /// `AutodiffError::NotDifferentiable` for expression `id`.
    pub fn not_differentiable(&self, id: ExprId, reason: &str) -> AutodiffError {
        let e = self.f.expr(id);
        AutodiffError::NotDifferentiable {
            op: e.op.name(),
            tensor: self.f.tensor_name(e.output),
            reason: reason.into(),
            expr: id,
        }
    }
}
