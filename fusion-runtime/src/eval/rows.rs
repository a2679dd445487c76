//! Segments with reductions (`FuseElementwise` lets a reduction over the trailing axes, and
//! the broadcast of its result back over them, join a run of elementwise ops): built into
//! a [`RowProgram`] when this rank's shapes fit one, else run op by op.

use fusion_compiler::ir::{Expr, Op, TensorId};
use fusion_compiler::DType;

use super::evaluator::Evaluator;
use crate::device::{Kernel, PointwiseInstr};
use crate::error::Result;
use crate::fused_programs::{RowInstr, RowProgram};
use crate::tensor::Tensor;

/// Whether `shape` broadcasts to `to` (numpy's rule, aligned at the last axis).
fn broadcasts_to(shape: &[usize], to: &[usize]) -> bool {
    shape.len() <= to.len()
        && (shape.iter().rev().zip(to.iter().rev())).all(|(&a, &b)| a == b || a == 1)
}

/// The value bound to `t` last.
fn value_of(values: &[(TensorId, Value)], t: TensorId) -> Value {
    (values.iter().rev())
        .find(|v| v.0 == t)
        .map(|v| v.1)
        .expect("defined earlier")
}

/// What a segment value is in a row program.
#[derive(Clone, Copy)]
enum Value {
    /// A register of the iteration shape (broadcast to it).
    Element(usize),
    /// A reduction's register: one value per row, readable only through its broadcast.
    Row(usize),
}

impl Evaluator<'_> {
    /// Runs a segment that has reductions: one row program, or its ops one by one where
    /// this rank's shapes do not make one (a reduction not over the trailing axes of one
    /// iteration shape, an output of another shape).
    pub(super) fn launch_rows(&mut self, exprs: &[Expr], outputs: &[TensorId]) -> Result<()> {
        match self.row_program(exprs, outputs)? {
            Some(prog) => self.ctx.device.execute(self.current, Kernel::Rows(&prog)),
            None => {
                tracing::debug!(
                    rank = self.ctx.rank,
                    "a segment with reductions runs op by op: its shapes make no row program"
                );
                exprs.iter().try_for_each(|e| self.compute(e))
            }
        }
    }

    /// The row program of `exprs` writing `outputs`, or `None` where the shapes do not
    /// make one. Each value is rounded to its tensor's dtype, as if every op stored it.
    fn row_program(&mut self, exprs: &[Expr], outputs: &[TensorId]) -> Result<Option<RowProgram>> {
        let Some(first) = exprs.iter().find(|e| matches!(e.op, Op::Reduction { .. })) else {
            return Ok(None);
        };
        let Op::Reduction { axes, .. } = &first.op else {
            unreachable!("found as a reduction")
        };
        let shape = self.local_shape(first.inputs[0])?;
        let k = axes.len();
        let trailing = |axes: &[usize], shape: &[usize]| {
            let mut sorted = axes.to_vec();
            sorted.sort_unstable();
            sorted.len() <= shape.len()
                && sorted
                    .iter()
                    .enumerate()
                    .all(|(i, &a)| a == shape.len() - axes.len() + i)
        };
        if k == 0 || !trailing(axes, &shape) {
            return Ok(None);
        }
        let split = shape.len() - k;
        let produced: Vec<TensorId> = exprs.iter().map(|e| e.output).collect();
        let mut values: Vec<(TensorId, Value)> = Vec::new();
        let mut inputs = Vec::new();
        for e in exprs {
            for &t in &e.inputs {
                if produced.contains(&t) || values.iter().any(|v| v.0 == t) {
                    continue;
                }
                let Ok(v) = self.get(t)?.expand(&shape) else {
                    return Ok(None);
                };
                values.push((t, Value::Element(inputs.len())));
                inputs.push(v);
            }
        }
        let n_in = inputs.len();
        let mut instrs: Vec<RowInstr> = Vec::new();
        for e in exprs {
            let out_dtype = self.p.ir.tensor(e.output).dtype;
            let out_shape = self.local_shape(e.output)?;
            let v = match &e.op {
                Op::Reduction { op, axes } => {
                    let Value::Element(a) = value_of(&values, e.inputs[0]) else {
                        return Ok(None);
                    };
                    if self.local_shape(e.inputs[0])? != shape || !trailing(axes, &shape) {
                        return Ok(None);
                    }
                    if axes.len() != k {
                        return Ok(None);
                    }
                    instrs.push(RowInstr::Reduce(*op, a, out_dtype));
                    Value::Row(n_in + instrs.len() - 1)
                }
                Op::Broadcast { .. } => {
                    // Back over the reduced axes: `[rows.., 1..]`.
                    let Value::Row(r) = value_of(&values, e.inputs[0]) else {
                        return Ok(None);
                    };
                    let keepdim = out_shape.len() == shape.len()
                        && out_shape[..split] == shape[..split]
                        && out_shape[split..].iter().all(|&x| x == 1);
                    if !keepdim {
                        return Ok(None);
                    }
                    Value::Element(r)
                }
                Op::Set | Op::Cast | Op::Unary(_) | Op::Binary(_) => {
                    if !broadcasts_to(&out_shape, &shape) {
                        return Ok(None);
                    }
                    let mut regs = Vec::new();
                    for &t in &e.inputs {
                        match value_of(&values, t) {
                            Value::Element(r) => regs.push(r),
                            Value::Row(_) => return Ok(None),
                        }
                    }
                    let ins = match e.op {
                        Op::Set => None,
                        Op::Cast => Some(PointwiseInstr::Round(out_dtype, regs[0])),
                        Op::Unary(u) => Some(PointwiseInstr::Unary(u, regs[0])),
                        Op::Binary(b) => Some(PointwiseInstr::Binary(b, regs[0], regs[1])),
                        _ => unreachable!("matched above"),
                    };
                    let mut reg = regs[0];
                    if let Some(i) = ins {
                        instrs.push(RowInstr::Pointwise(i));
                        reg = n_in + instrs.len() - 1;
                    }
                    if out_dtype != DType::F32 && !matches!(e.op, Op::Cast | Op::Set) {
                        instrs.push(RowInstr::Pointwise(PointwiseInstr::Round(out_dtype, reg)));
                        reg = n_in + instrs.len() - 1;
                    }
                    Value::Element(reg)
                }
                _ => return Ok(None),
            };
            values.push((e.output, v));
        }
        let Some((outs, row_outs)) = self.row_outputs(exprs, outputs, &values, &shape, split)?
        else {
            return Ok(None);
        };
        Ok(Some(RowProgram {
            rows: shape[..split].to_vec(),
            row: shape[split..].to_vec(),
            inputs,
            instrs,
            outputs: outs,
            row_outputs: row_outs,
        }))
    }

    /// The program's outputs: of the iteration shape, or a reduction's of shape `rows`;
    /// `None` for any other (a broadcast of a sum read outside the segment).
    #[allow(clippy::type_complexity)]
    fn row_outputs(
        &mut self,
        exprs: &[Expr],
        outputs: &[TensorId],
        values: &[(TensorId, Value)],
        shape: &[usize],
        split: usize,
    ) -> Result<Option<(Vec<(Tensor, usize)>, Vec<(Tensor, usize)>)>> {
        let (mut outs, mut row_outs) = (Vec::new(), Vec::new());
        for &t in outputs {
            let produced_by = exprs.iter().find(|e| e.output == t);
            let is_view = produced_by.is_some_and(|e| e.op.is_view());
            match value_of(values, t) {
                Value::Row(r) => {
                    let buf = self.get_or_allocate(t)?;
                    if buf.shape() != &shape[..split] {
                        return Ok(None);
                    }
                    row_outs.push((buf, r));
                }
                // A broadcast read outside the segment is a view of its reduction, which
                // the op-by-op path binds.
                Value::Element(_) if is_view => return Ok(None),
                Value::Element(r) => {
                    let buf = self.get_or_allocate(t)?;
                    if buf.shape() != shape {
                        return Ok(None);
                    }
                    outs.push((buf, r));
                }
            }
        }
        Ok(Some((outs, row_outs)))
    }
}
