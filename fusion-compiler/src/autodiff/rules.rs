//! The adjoint of each op: given the gradient `g` of an expression's output, the
//! contributions to the gradients of its inputs (in shapes that broadcast to theirs; the
//! accumulation sums them down). GEMM adjoints use transposed operands, which lowering
//! keeps as views of the GEMM.

use super::context::Ctx;
use super::error::Result;
use crate::ir::{BinaryOp, Expr, ExprId, Op, ParallelType, ReduceOp, TensorId, UnaryOp};

impl Ctx<'_> {
    /// Adds the contributions of expression `id` (output gradient `g`) to the gradients
    /// of its inputs that `active` marks.
    pub fn adjoint(&mut self, id: ExprId, g: TensorId, active: &[bool]) -> Result<()> {
        let e = self.f.expr(id).clone();
        let wants = |i: usize| active[e.inputs[i].index()];
        let x = e.inputs[0];
        match &e.op {
            Op::Set => self.add_grad(x, g),
            Op::Cast => {
                let c = self.b.cast(g, self.f.tensor(x).dtype)?;
                self.add_grad(x, c)
            }
            Op::Unary(u) => self.unary_adjoint(id, *u, x, g),
            Op::Binary(op) => self.binary_adjoint(*op, &e, g, [wants(0), wants(1)]),
            Op::Reduction {
                op: ReduceOp::Sum,
                axes,
            } => {
                let rank = self.f.visible_axes(x).len();
                let flags: Vec<bool> = (0..rank).map(|a| axes.contains(&a)).collect();
                let c = self.b.broadcast(g, &flags)?;
                self.add_grad(x, c)
            }
            Op::Broadcast { flags } => self.broadcast_adjoint(x, flags, g),
            Op::Permute { perm } => {
                let mut inverse = vec![0; perm.len()];
                for (j, &p) in perm.iter().enumerate() {
                    inverse[p] = j;
                }
                let c = self.b.permute(g, &inverse)?;
                self.add_grad(x, c)
            }
            Op::Matmul => self.matmul_adjoint(id, &e, g, [wants(0), wants(1)]),
            Op::Linear => self.linear_adjoint(id, &e, g, active),
            Op::Reduction { .. } => Err(self.not_differentiable(
                id,
                "the gradient of a max goes to the elements equal to it, and the IR has no \
                 comparison to find them; differentiate a fusion that keeps the max out of \
                 the differentiated path",
            )),
            Op::Select { .. } | Op::Slice { .. } | Op::Split { .. } => Err(self
                .not_differentiable(
                    id,
                    "its adjoint writes the gradient into part of a zero tensor of the input's \
                 shape (or merges axes), and the IR has no pad, concatenation or reshape; keep \
                 views out of the differentiated path",
                )),
            Op::Gemm { .. } => Err(self.not_differentiable(id, "a fused GEMM is host IR")),
        }
    }

    /// `neg` negates the gradient; the others multiply it by their derivative op at the
    /// (recomputed) input.
    fn unary_adjoint(&mut self, id: ExprId, u: UnaryOp, x: TensorId, g: TensorId) -> Result<()> {
        let c = match (u, u.derivative()) {
            (UnaryOp::Neg, _) => self.b.unary(UnaryOp::Neg, g)?,
            (_, Some(d)) => {
                let xp = self.primal(x)?;
                let slope = self.b.unary(d, xp)?;
                self.b.mul(g, slope)?
            }
            (_, None) => {
                return Err(self.not_differentiable(
                    id,
                    "a derivative op has no derivative op of its own (no second derivatives)",
                ))
            }
        };
        self.add_grad(x, c)
    }

    /// add/sub pass the gradient on (negated for the subtrahend), mul and div by the
    /// product and quotient rules, maximum/minimum through a mask (the gradient goes to
    /// the operand that was picked; on a tie, to the second).
    fn binary_adjoint(
        &mut self,
        op: BinaryOp,
        e: &Expr,
        g: TensorId,
        wants: [bool; 2],
    ) -> Result<()> {
        let (a, c) = (e.inputs[0], e.inputs[1]);
        let (da, dc) = match op {
            BinaryOp::Add => (Some(g), Some(g)),
            BinaryOp::Sub => (
                Some(g),
                wants[1]
                    .then(|| self.b.unary(UnaryOp::Neg, g))
                    .transpose()?,
            ),
            BinaryOp::Mul => {
                let da = if wants[0] {
                    Some(self.times_primal(g, c)?)
                } else {
                    None
                };
                let dc = if wants[1] {
                    Some(self.times_primal(g, a)?)
                } else {
                    None
                };
                (da, dc)
            }
            BinaryOp::Div => {
                let cp = self.primal(c)?;
                let da = if wants[0] {
                    Some(self.b.binary(BinaryOp::Div, g, cp)?)
                } else {
                    None
                };
                let dc = if wants[1] {
                    let ap = self.primal(a)?;
                    let num = self.b.mul(g, ap)?;
                    let den = self.b.mul(cp, cp)?;
                    let q = self.b.binary(BinaryOp::Div, num, den)?;
                    Some(self.b.unary(UnaryOp::Neg, q)?)
                } else {
                    None
                };
                (da, dc)
            }
            BinaryOp::Max | BinaryOp::Min => {
                let (ap, cp) = (self.primal(a)?, self.primal(c)?);
                let diff = match op {
                    BinaryOp::Max => self.b.binary(BinaryOp::Sub, ap, cp)?,
                    _ => self.b.binary(BinaryOp::Sub, cp, ap)?,
                };
                let picked = self.b.unary(UnaryOp::ReluGrad, diff)?;
                let da = self.b.mul(g, picked)?;
                let dc = self.b.binary(BinaryOp::Sub, g, da)?;
                (Some(da), Some(dc))
            }
        };
        for (t, (want, d)) in [(a, (wants[0], da)), (c, (wants[1], dc))] {
            if let (true, Some(d)) = (want, d) {
                self.add_grad(t, d)?;
            }
        }
        Ok(())
    }

    /// `g * primal(t)`.
    fn times_primal(&mut self, g: TensorId, t: TensorId) -> Result<TensorId> {
        let p = self.primal(t)?;
        Ok(self.b.mul(g, p)?)
    }

    /// Sums the gradient as it accumulated (not settled: it may have extra leading axes)
    /// over those and the inserted axes, in one reduction; the sum of a broadcast of
    /// exactly these axes (as the adjoint of a sum makes) is its input.
    fn broadcast_adjoint(&mut self, x: TensorId, flags: &[bool], g: TensorId) -> Result<()> {
        let bf = self.b.fusion();
        let lead = bf.visible_axes(g).len().saturating_sub(flags.len());
        if let Some(d) = bf.definition(g).filter(|_| lead == 0) {
            let e = bf.expr(d);
            if e.op
                == (Op::Broadcast {
                    flags: flags.to_vec(),
                })
            {
                let input = e.inputs[0];
                return self.add_grad(x, input);
            }
        }
        let axes: Vec<usize> = (0..lead)
            .chain(
                (flags.iter().enumerate())
                    .filter(|(_, &f)| f)
                    .map(|(i, _)| i + lead),
            )
            .collect();
        let c = if axes.is_empty() {
            g
        } else {
            self.b.sum(g, &axes)?
        };
        self.add_grad(x, c)
    }
}

/// Where a GEMM adjoint's result takes each axis' parallel type from.
pub(super) enum AxisSource {
    /// The forward GEMM output's axis (its DIDx or Stream). A Stream axis stays one where
    /// the gradient is summed over it afterwards (a weight gradient's batch axis): the
    /// lowering then accumulates each chunk's GEMM into the sum inside the stream loop.
    Output(usize),
    /// A contracted or weight axis: serial.
    Serial,
}

impl Ctx<'_> {
    /// Declares a GEMM adjoint's result `r` with parallel types taken from the forward
    /// GEMM output `out` (so the backward's GEMMs stream and shard as the forward's did).
    pub fn gemm_layout(
        &mut self,
        r: TensorId,
        out: TensorId,
        sources: &[AxisSource],
    ) -> Result<TensorId> {
        let vis = self.f.visible_axes(out);
        let pars: Vec<ParallelType> = (sources.iter())
            .map(|s| match *s {
                AxisSource::Output(axis) => self.f.axis(out, vis[axis]).parallel,
                AxisSource::Serial => ParallelType::Serial,
            })
            .collect();
        let mesh = self.f.tensor(out).mesh.clone();
        self.declare_pars(r, &pars, mesh)
    }
}
