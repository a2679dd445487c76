//! The adjoints of `matmul` and `linear`: the gradient times the other operand
//! transposed (a view the GEMM reads as it is), summed over the batch axes the operand
//! was broadcast along. Each result takes the forward output's parallel types on the
//! axes it shares with it, so a column-parallel layer's input gradient is a GEMM whose
//! row blocks are reduce-scattered (streamed as the forward's gather was) and its weight
//! gradient a GEMM over the gathered rows, streamed along them too: lowering adds each
//! chunk's GEMM onto the weight gradient as the chunk arrives. A transposed operand is
//! made once per forward value.

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
            let at = self.transposed_primal(a)?;
            let r = self.b.matmul(at, g)?;
            let mut src = batch_sources(nb);
            src.extend([AxisSource::Serial, AxisSource::Output(nb + 1)]);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, bm);
            self.add_grad(bm, r)?;
        }
        if wants[0] {
            let bt = self.transposed_primal(bm)?;
            let r = self.b.matmul(g, bt)?;
            let mut src = batch_sources(nb);
            src.extend([AxisSource::Output(nb), AxisSource::Serial]);
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
            let xp = self.operand_primal(x)?;
            let gt = self.b.transpose(g, rx - 2, rx - 1)?;
            let r = self.b.matmul(gt, xp)?;
            let mut src = batch_sources(rx - 2);
            src.extend([AxisSource::Output(rx - 1), AxisSource::Serial]);
            let r = self.gemm_layout(r, out, &src)?;
            self.name_grad(r, w);
            self.add_grad(w, r)?;
        }
        if wants(x) {
            let wp = self.primal(w)?;
            let r = self.b.matmul(g, wp)?;
            let mut src = batch_sources(rx - 1);
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

    /// The forward value `t` with its last two axes swapped (a view), made once: the
    /// weight gradients of two GEMMs reading one operand (a gated MLP's projections of the
    /// same rows) share it.
    fn transposed_primal(&mut self, t: TensorId) -> Result<TensorId> {
        if let Some(&v) = self.transposed.get(&t) {
            return Ok(v);
        }
        let r = self.rank(t);
        let p = self.operand_primal(t)?;
        let v = self.b.transpose(p, r - 2, r - 1)?;
        self.transposed.insert(t, v);
        Ok(v)
    }

    /// Visible rank of forward tensor `t`.
    fn rank(&self, t: TensorId) -> usize {
        self.f.visible_axes(t).len()
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

/// The sources of a GEMM adjoint's `nb` leading (batch) axes: the forward output's, in
/// order. An axis the operand lacks or broadcasts is summed afterwards and keeps its
/// parallel type all the same (see [`AxisSource::Output`]).
fn batch_sources(nb: usize) -> Vec<AxisSource> {
    (0..nb).map(AxisSource::Output).collect()
}
