//! Compute nodes: views (a permute among them), pointwise programs, reductions and GEMMs.

use std::borrow::Cow;

use fusion_compiler::hir::SegmentId;
use fusion_compiler::ir::{Epilogue, EpilogueAux, Expr, Op, TensorId, UnaryOp};
use fusion_compiler::DType;

use super::evaluator::Evaluator;
use crate::device::{Kernel, PointwiseInstr, PointwiseProgram};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

impl Evaluator<'_> {
    pub(crate) fn compute(&mut self, e: &Expr) -> Result<()> {
        if !self.in_mesh[e.output.index()] {
            return Ok(());
        }
        match &e.op {
            Op::Select { axis, index } => {
                let i = self.eval(*index)?;
                let n = self.get(e.inputs[0])?.shape()[*axis];
                if i < 0 || i as usize >= n {
                    return Err(self.op_error(e, format!("select index {i} outside 0..{n}")));
                }
                let v = self.get(e.inputs[0])?.select(*axis, i as usize)?;
                self.bind_view(e, v)
            }
            Op::Slice { axis, start, stop } => {
                let (s, t) = (self.eval(*start)?, self.eval(*stop)?);
                let n = self.get(e.inputs[0])?.shape()[*axis] as i64;
                if s < 0 || t < s || t > n {
                    return Err(self.op_error(e, format!("slice {s}..{t} outside 0..{n}")));
                }
                let v = self
                    .get(e.inputs[0])?
                    .narrow(*axis, s as usize, (t - s) as usize)?;
                self.bind_view(e, v)
            }
            Op::Split { axis, outer } => {
                let o = self.eval(*outer)?;
                let x = self.get(e.inputs[0])?;
                let v = x
                    .split_axis(*axis, o.max(0) as usize)
                    .map_err(|err| self.op_error(e, err.to_string()))?;
                self.bind_view(e, v)
            }
            Op::Permute { perm } => {
                // Lowering keeps a permute only where a view does (a GEMM operand); a
                // copied one is a view and a `set`.
                let v = self
                    .get(e.inputs[0])?
                    .permute(perm)
                    .map_err(|err| self.op_error(e, err.to_string()))?;
                self.bind_view(e, v)
            }
            Op::Broadcast { flags } => {
                let mut v = self.get(e.inputs[0])?.clone();
                for (i, &is_new) in flags.iter().enumerate() {
                    if is_new {
                        v = v.unsqueeze(i)?;
                    }
                }
                self.bind_view(e, v)
            }
            Op::Set => {
                let src = self.get(e.inputs[0])?.clone();
                let dst = self.get_or_allocate(e.output)?;
                if src.shape() != dst.shape() {
                    return Err(self.op_error(
                        e,
                        format!("copy from {:?} into {:?}", src.shape(), dst.shape()),
                    ));
                }
                self.ctx.device.execute(
                    self.current,
                    Kernel::Copy {
                        src: &src,
                        dst: &dst,
                    },
                )
            }
            Op::Unary(_) | Op::Binary(_) | Op::Cast => {
                let prog = self.pointwise_program(std::slice::from_ref(e), &[e.output])?;
                self.ctx
                    .device
                    .execute(self.current, Kernel::Pointwise(&prog))
            }
            Op::Reduction { op, axes } => {
                let src = self.get(e.inputs[0])?.clone();
                let dst = self.get_or_allocate(e.output)?;
                self.ctx.device.execute(
                    self.current,
                    Kernel::Reduce {
                        op: *op,
                        src: &src,
                        dst: &dst,
                        axes,
                    },
                )
            }
            Op::Matmul => self.matmul(e, false, &[], None),
            Op::Linear => self.linear(e, &[], None),
            Op::Gemm {
                linear: false,
                epilogue,
            } if epilogue.sums_batch => self.summed_matmul(e, epilogue),
            Op::Gemm {
                linear: false,
                epilogue,
            } => {
                let aux = self.gemm_aux(e, epilogue)?;
                self.matmul(e, epilogue.bias, &epilogue.activations, aux)
            }
            Op::Gemm {
                linear: true,
                epilogue,
            } => {
                let aux = self.gemm_aux(e, epilogue)?;
                self.linear(e, &epilogue.activations, aux)
            }
        }
    }

    /// A fused GEMM's auxiliary matrix (its last input) and what it does with it; one it
    /// writes is bound to a buffer first.
    fn gemm_aux(&mut self, e: &Expr, epilogue: &Epilogue) -> Result<Option<(Tensor, EpilogueAux)>> {
        let (Some(mode), Some(&x)) = (epilogue.aux, e.inputs.last()) else {
            return Ok(None);
        };
        let t = match mode {
            EpilogueAux::PreActivation => self.get_or_allocate(x)?,
            EpilogueAux::Derivative(_) => self.get(x)?.clone(),
        };
        Ok(Some((t, mode)))
    }

    /// Binds view `v` of `e`'s input to `e`'s output.
    fn bind_view(&mut self, e: &Expr, v: Tensor) -> Result<()> {
        let t = e.output;
        let is_output = self.p.outputs.contains(&t);
        if let Some(bound) = self.tensors[t.index()].as_ref().filter(|_| is_output) {
            // A preallocated output that is a view of an input: copy into it. (Any other
            // bound view is from an earlier loop iteration and is simply rebound.)
            let dst = bound.clone();
            self.ctx
                .device
                .execute(self.current, Kernel::Copy { src: &v, dst: &dst })?;
            if let Some(rc) = self.race.as_mut() {
                rc.access(self.current, &[(e.inputs[0], &v)], &[(t, &dst)]);
            }
            return Ok(());
        }
        self.tensors[t.index()] = Some(v);
        Ok(())
    }

    fn op_error(&self, e: &Expr, reason: String) -> Error {
        Error::bad_tensor(
            self.p.ir.tensor_name(e.output),
            None,
            format!("{} on rank {}: {reason}", e.op.name(), self.ctx.rank),
        )
    }

    pub(crate) fn launch(&mut self, segment: SegmentId, outputs: &[TensorId]) -> Result<()> {
        let seg = &self.p.segments[segment.index()];
        let Some(&first) = outputs.first() else {
            return Ok(());
        };
        if !self.in_mesh[first.index()] {
            return Ok(());
        }
        if (seg.exprs.iter()).any(|e| matches!(e.op, Op::Reduction { .. })) {
            self.launch_rows(&seg.exprs, outputs)?;
        } else {
            let prog = self.pointwise_program(&seg.exprs, outputs)?;
            self.ctx
                .device
                .execute(self.current, Kernel::Pointwise(&prog))?;
        }
        if self.race.is_some() {
            let produced: Vec<TensorId> = seg.exprs.iter().map(|e| e.output).collect();
            let mut reads: Vec<TensorId> = Vec::new();
            for t in seg.exprs.iter().flat_map(|e| e.inputs.iter().copied()) {
                if !produced.contains(&t) && !reads.contains(&t) {
                    reads.push(t);
                }
            }
            self.record_access(&reads, outputs)?;
        }
        Ok(())
    }

    /// Builds the pointwise program of elementwise `exprs` writing `outputs`. Each value is
    /// rounded to its tensor's dtype, as if every op stored its result.
    fn pointwise_program(
        &mut self,
        exprs: &[Expr],
        outputs: &[TensorId],
    ) -> Result<PointwiseProgram> {
        let shape = self.local_shape(exprs.last().expect("non-empty").output)?;
        let mut regs: Vec<(TensorId, usize)> = Vec::new();
        let mut inputs: Vec<Tensor> = Vec::new();
        let mut instrs: Vec<PointwiseInstr> = Vec::new();
        let produced: Vec<TensorId> = exprs.iter().map(|e| e.output).collect();
        // Registers 0..n: the inputs, broadcast to the iteration shape.
        for e in exprs {
            for &t in &e.inputs {
                if produced.contains(&t) || regs.iter().any(|r| r.0 == t) {
                    continue;
                }
                let v = self
                    .get(t)?
                    .expand(&shape)
                    .map_err(|err| self.op_error(e, err.to_string()))?;
                regs.push((t, inputs.len()));
                inputs.push(v);
            }
        }
        let reg_of = |regs: &[(TensorId, usize)], t: TensorId| {
            regs.iter()
                .rev()
                .find(|r| r.0 == t)
                .map(|r| r.1)
                .expect("defined earlier")
        };
        let n_in = inputs.len();
        for e in exprs {
            let a = reg_of(&regs, e.inputs[0]);
            let out_dtype = self.p.ir.tensor(e.output).dtype;
            let ins = match e.op {
                Op::Set => None,
                Op::Cast => Some(PointwiseInstr::Round(out_dtype, a)),
                Op::Unary(u) => Some(PointwiseInstr::Unary(u, a)),
                Op::Binary(b) => Some(PointwiseInstr::Binary(b, a, reg_of(&regs, e.inputs[1]))),
                _ => return Err(self.op_error(e, "not an elementwise op".into())),
            };
            let mut reg = a;
            if let Some(i) = ins {
                instrs.push(i);
                reg = n_in + instrs.len() - 1;
            }
            if out_dtype != DType::F32 && !matches!(e.op, Op::Cast | Op::Set) {
                instrs.push(PointwiseInstr::Round(out_dtype, reg));
                reg = n_in + instrs.len() - 1;
            }
            regs.push((e.output, reg));
        }
        let mut outs = Vec::with_capacity(outputs.len());
        for &t in outputs {
            let v = self.get_or_allocate(t)?;
            if v.shape() != shape.as_slice() {
                return Err(Error::Internal(format!(
                    "fused output {} has shape {:?}, the segment iterates {:?}",
                    self.p.ir.tensor_name(t),
                    v.shape(),
                    shape
                )));
            }
            outs.push((v, reg_of(&regs, t)));
        }
        Ok(PointwiseProgram {
            shape,
            inputs,
            instrs,
            outputs: outs,
        })
    }

    /// torch.matmul semantics, normalized to one batched GEMM. A third input is, with
    /// `bias`, a vector `[N]` broadcast over the rows (a folded bias add); else an addend
    /// (from lowering): the output itself (`out += a @ b`) or a tensor of the output's
    /// shape (`out = addend + a @ b`, a running sum finished into another buffer).
    /// `epilogue` applies after it.
    fn matmul(
        &mut self,
        e: &Expr,
        bias: bool,
        epilogue: &[UnaryOp],
        aux: Option<(Tensor, EpilogueAux)>,
    ) -> Result<()> {
        let third = e.inputs.get(2).copied().filter(|_| aux.is_none() || bias);
        let accumulate = third.is_some() && !bias;
        let bias = match third {
            Some(t) if bias => Some(self.row_vector(e, t)?),
            _ => None,
        };
        // The operands are borrowed, and views are made only where a shape changes: this
        // runs at every GEMM of every pipeline iteration.
        let dst0 = self.get_or_allocate(e.output)?;
        let addend = match third {
            Some(c) if accumulate && c != e.output => {
                let v = self.get(c)?;
                if v.shape() != dst0.shape() {
                    return Err(self.op_error(
                        e,
                        format!(
                            "the addend {} {:?} does not have the product's shape {:?}",
                            self.p.ir.tensor_name(c),
                            v.shape(),
                            dst0.shape()
                        ),
                    ));
                }
                Some(Cow::Borrowed(v))
            }
            _ => None,
        };
        let a0 = self.get(e.inputs[0])?;
        let b0 = self.get(e.inputs[1])?;
        let extras = GemmExtras {
            bias: bias.as_ref(),
            accumulate,
            addend,
            epilogue,
            aux,
        };
        self.product(e, (a0, b0), dst0, extras)
    }

    /// `out = sum_i a[i] @ b[i]` over the operands' first axis (`Epilogue::sums_batch`): one
    /// GEMM whose K runs over every index where that axis steps over whole runs of K in
    /// both operands (a weight gradient over gathered blocks), else one GEMM per index
    /// adding onto the output.
    fn summed_matmul(&mut self, e: &Expr, epilogue: &Epilogue) -> Result<()> {
        let plain = !epilogue.bias && epilogue.activations.is_empty() && epilogue.aux.is_none();
        let a = self.get(e.inputs[0])?.clone();
        let b = self.get(e.inputs[1])?.clone();
        let dst = self.get_or_allocate(e.output)?;
        let (ra, rb) = (a.rank(), b.rank());
        let batch = a.shape().first().copied();
        let fits =
            ra == rb && ra == dst.rank() + 1 && ra >= 3 && batch == b.shape().first().copied();
        if !plain || e.inputs.len() != 2 || !fits {
            return Err(self.op_error(
                e,
                format!(
                    "a GEMM summed over its first batch axis takes two operands of one more \
                     axis than its output and nothing else in its epilogue (operands {:?} and \
                     {:?}, output {:?})",
                    a.shape(),
                    b.shape(),
                    dst.shape()
                ),
            ));
        }
        if let (Some(a1), Some(b1)) = (
            a.fold_first_axis_into(ra - 1),
            b.fold_first_axis_into(rb - 2),
        ) {
            return self.product(e, (&a1, &b1), dst, GemmExtras::default());
        }
        for i in 0..batch.unwrap_or(0) {
            let extras = GemmExtras {
                accumulate: i > 0,
                ..GemmExtras::default()
            };
            self.product(e, (&a.select(0, i)?, &b.select(0, i)?), dst.clone(), extras)?;
        }
        Ok(())
    }

    /// `dst0 = a0 @ b0` (with `extras`) by torch.matmul's rules on vectors and batch axes,
    /// as one batched GEMM on the current stream; `e` names it in errors.
    pub(super) fn product(
        &self,
        e: &Expr,
        (a0, b0): (&Tensor, &Tensor),
        dst0: Tensor,
        extras: GemmExtras<'_>,
    ) -> Result<()> {
        let GemmExtras {
            bias,
            accumulate,
            addend,
            epilogue,
            mut aux,
        } = extras;
        let (ra, rb) = (a0.rank(), b0.rank());
        let mut a = Cow::Borrowed(a0);
        let mut b = Cow::Borrowed(b0);
        let mut dst = dst0;
        let mut addend = addend;
        // A vector operand is a matrix of one row (a) or one column (b), and the product
        // gets that axis too.
        let mut unsqueezes = Vec::new();
        if ra == 1 {
            a = Cow::Owned(a0.unsqueeze(0)?);
            unsqueezes.push(dst.rank() - usize::from(rb >= 2));
        }
        if rb == 1 {
            b = Cow::Owned(b0.unsqueeze(1)?);
            unsqueezes.push(dst.rank() + usize::from(ra == 1));
        }
        for pos in unsqueezes {
            dst = dst.unsqueeze(pos)?;
            if let Some(c) = &addend {
                addend = Some(Cow::Owned(c.unsqueeze(pos)?));
            }
            if let Some((x, _)) = &mut aux {
                *x = x.unsqueeze(pos)?;
            }
        }
        let r = dst.rank();
        let (m, n, k) = (
            dst.shape()[r - 2],
            dst.shape()[r - 1],
            a.shape()[a.rank() - 1],
        );
        let batch = &dst.shape()[..r - 2];
        let a = fit(a, batch, m, k).map_err(|err| self.op_error(e, err.to_string()))?;
        let b = fit(b, batch, k, n).map_err(|err| self.op_error(e, err.to_string()))?;
        let kernel = match &aux {
            Some((x, mode)) => Kernel::GemmAux {
                a: &a,
                b: &b,
                bias,
                epilogue,
                aux: x,
                mode: *mode,
                dst: &dst,
            },
            None => Kernel::Gemm {
                a: &a,
                b: &b,
                bias,
                accumulate,
                addend: addend.as_deref(),
                epilogue,
                dst: &dst,
            },
        };
        self.ctx.device.execute(self.current, kernel)
    }

    /// A bias operand as the vector `[N]` a GEMM takes: its leading axes must be of extent 1
    /// or broadcast (stride 0).
    pub(super) fn row_vector(&self, e: &Expr, t: TensorId) -> Result<Tensor> {
        let mut v = self.get(t)?.clone();
        while v.rank() > 1 {
            if v.shape()[0] != 1 && v.strides()[0] != 0 {
                return Err(self.op_error(
                    e,
                    format!(
                        "the bias {:?} is not a row vector broadcast over the rows",
                        v.shape()
                    ),
                ));
            }
            v = v.select(0, 0)?;
        }
        Ok(v)
    }

    /// `epilogue(x @ w^T + bias)`, normalized to one batched GEMM.
    fn linear(
        &mut self,
        e: &Expr,
        epilogue: &[UnaryOp],
        mut aux: Option<(Tensor, EpilogueAux)>,
    ) -> Result<()> {
        let x = self.get(e.inputs[0])?.clone();
        let w = self.get(e.inputs[1])?.clone();
        let operands = e.inputs.len() - usize::from(aux.is_some());
        let bias = match e.inputs.get(2).filter(|_| operands == 3) {
            Some(&t) => Some(self.get(t)?.clone()),
            None => None,
        };
        let mut dst = self.get_or_allocate(e.output)?;
        let a = if x.rank() == 1 {
            dst = dst.unsqueeze(0)?;
            if let Some((t, _)) = &mut aux {
                *t = t.unsqueeze(0)?;
            }
            x.unsqueeze(0)?
        } else {
            x
        };
        let r = a.rank();
        let (k, n) = (a.shape()[r - 1], w.shape()[0]);
        let mut bs = a.shape()[..r - 2].to_vec();
        bs.extend([k, n]);
        let b = w
            .permute(&[1, 0])?
            .expand(&bs)
            .map_err(|err| self.op_error(e, err.to_string()))?;
        let extras = GemmExtras {
            bias: bias.as_ref(),
            epilogue,
            aux,
            ..GemmExtras::default()
        };
        self.product(e, (&a, &b), dst, extras)
    }
}

/// What a GEMM adds to the product (see [`Kernel::Gemm`]).
#[derive(Default)]
pub(super) struct GemmExtras<'t> {
    pub(super) bias: Option<&'t Tensor>,
    pub(super) accumulate: bool,
    pub(super) addend: Option<Cow<'t, Tensor>>,
    pub(super) epilogue: &'t [UnaryOp],
    /// The auxiliary matrix of [`Kernel::GemmAux`] (the product's shape) and its mode.
    pub(super) aux: Option<(Tensor, EpilogueAux)>,
}

/// `t` broadcast to `[batch.., rows, cols]`, as it is when it already has that shape.
fn fit<'t>(
    t: Cow<'t, Tensor>,
    batch: &[usize],
    rows: usize,
    cols: usize,
) -> Result<Cow<'t, Tensor>> {
    let s = t.shape();
    let r = batch.len() + 2;
    if s.len() == r && s[..r - 2] == *batch && s[r - 2] == rows && s[r - 1] == cols {
        return Ok(t);
    }
    let mut want = batch.to_vec();
    want.extend([rows, cols]);
    t.expand(&want).map(Cow::Owned)
}
