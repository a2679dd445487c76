//! The programs a backend runs as one generated kernel: elementwise programs, and row
//! programs (elementwise ops and reductions over a tensor's trailing axes: an RMSNorm's
//! residual add, sum of squares and scaling; a softmax's max, exponentials, sum and
//! division) instead of a pointwise kernel, a reduction kernel and another pointwise kernel
//! with their intermediates in memory.
//!
//! A row program's iteration shape is `rows ++ row`. A backend walks each row once per
//! *pass*: pass `p` computes what depends on reductions finished in earlier passes only,
//! accumulates the reductions whose operands it has, and writes the outputs it can. Values
//! are recomputed from the inputs in every pass that needs them (a row is read again, from
//! cache, rather than kept), so a program of any row length runs in fixed registers.

use fusion_compiler::ir::{BinaryOp, ReduceOp, UnaryOp};
use fusion_compiler::DType;

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One instruction of a [`PointwiseProgram`]. Registers `0..inputs.len()` hold the inputs;
/// instruction `i` writes register `inputs.len() + i`. Values are f32 in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PointwiseInstr {
    /// `op(register)`.
    Unary(UnaryOp, usize),
    /// `op(register, register)`.
    Binary(BinaryOp, usize, usize),
    /// Rounds a register to `DType` (a cast inside a fused chain).
    Round(DType, usize),
}

/// A fused elementwise computation over one iteration shape.
#[derive(Clone, Debug)]
pub struct PointwiseProgram {
    /// The iteration shape (every output's shape).
    pub shape: Vec<usize>,
    /// Input views, already broadcast to `shape` (stride 0 on broadcast axes).
    pub inputs: Vec<Tensor>,
    /// The instructions, in order.
    pub instrs: Vec<PointwiseInstr>,
    /// Output views of shape `shape`, each with the register it stores.
    pub outputs: Vec<(Tensor, usize)>,
}

impl PointwiseInstr {
    /// Its value for one element, given the registers it reads (reference semantics).
    pub fn apply(&self, regs: &[f32]) -> f32 {
        match *self {
            PointwiseInstr::Unary(op, a) => op.apply_f64(regs[a] as f64) as f32,
            PointwiseInstr::Binary(op, a, b) => op.apply_f64(regs[a] as f64, regs[b] as f64) as f32,
            PointwiseInstr::Round(dt, a) => crate::tensor::round_to(dt, regs[a]),
        }
    }
}

impl PointwiseProgram {
    /// Evaluates the program for one element given its inputs (reference semantics).
    pub fn eval_element(&self, regs: &mut Vec<f32>) {
        for ins in &self.instrs {
            let v = ins.apply(regs);
            regs.push(v);
        }
    }
}

/// One instruction of a [`RowProgram`]. Registers `0..inputs.len()` hold the inputs;
/// instruction `i` writes register `inputs.len() + i`. Values are f32 in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowInstr {
    /// An elementwise instruction, as in a pointwise program.
    Pointwise(PointwiseInstr),
    /// The `op`-reduction of a register over the row, rounded to `DType` (as if stored):
    /// the same value in every element of the row.
    Reduce(ReduceOp, usize, DType),
}

impl RowInstr {
    /// The registers it reads.
    pub fn operands(&self) -> Vec<usize> {
        match *self {
            RowInstr::Pointwise(PointwiseInstr::Unary(_, a))
            | RowInstr::Pointwise(PointwiseInstr::Round(_, a))
            | RowInstr::Reduce(_, a, _) => vec![a],
            RowInstr::Pointwise(PointwiseInstr::Binary(_, a, b)) => vec![a, b],
        }
    }
}

/// A fused computation over rows: elementwise instructions and reductions over each row.
#[derive(Clone, Debug)]
pub struct RowProgram {
    /// The leading axes of the iteration shape: one row per index.
    pub rows: Vec<usize>,
    /// The trailing axes: a row's elements, which the reductions combine.
    pub row: Vec<usize>,
    /// Input views of the iteration shape `rows ++ row` (stride 0 on broadcast axes).
    pub inputs: Vec<Tensor>,
    /// The instructions, in order.
    pub instrs: Vec<RowInstr>,
    /// Outputs of the iteration shape, each with the register it stores.
    pub outputs: Vec<(Tensor, usize)>,
    /// Outputs of shape `rows`, each with the register of a [`RowInstr::Reduce`] it stores.
    pub row_outputs: Vec<(Tensor, usize)>,
}

/// What one pass over a row does ([`RowProgram::passes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowPass {
    /// The inputs it loads, ascending.
    pub inputs: Vec<usize>,
    /// The instructions it evaluates per element, ascending; a [`RowInstr::Reduce`] among
    /// them was finished in an earlier pass and only supplies its value.
    pub instrs: Vec<usize>,
    /// The reductions it accumulates (instruction indices), finished at the pass's end.
    pub reduces: Vec<usize>,
    /// The outputs it writes (indices into [`RowProgram::outputs`]).
    pub outputs: Vec<usize>,
    /// The row outputs it writes at its end (indices into [`RowProgram::row_outputs`]).
    pub row_outputs: Vec<usize>,
}

impl RowProgram {
    /// The iteration shape, `rows ++ row`.
    pub fn shape(&self) -> Vec<usize> {
        self.rows.iter().chain(&self.row).copied().collect()
    }

    /// Checks operand shapes and registers, so that no backend indexes out of range.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Error::Internal(format!("row program: {reason}"));
        let shape = self.shape();
        for (i, t) in self.inputs.iter().enumerate() {
            if t.shape() != shape.as_slice() {
                return Err(bad(format!(
                    "input {i} has shape {:?}, not the iteration shape {shape:?}",
                    t.shape()
                )));
            }
        }
        let n_in = self.inputs.len();
        for (i, ins) in self.instrs.iter().enumerate() {
            if let Some(r) = ins.operands().into_iter().find(|&r| r >= n_in + i) {
                return Err(bad(format!(
                    "instruction {i} ({ins:?}) reads register {r}, defined later"
                )));
            }
        }
        if !self
            .instrs
            .iter()
            .any(|i| matches!(i, RowInstr::Reduce(..)))
        {
            return Err(bad("no reduction (a pointwise program does this)".into()));
        }
        let n_regs = n_in + self.instrs.len();
        for (i, (t, r)) in self.outputs.iter().enumerate() {
            if t.shape() != shape.as_slice() || *r >= n_regs {
                return Err(bad(format!(
                    "output {i} of shape {:?} stores register {r} (shape {shape:?}, {n_regs} registers)",
                    t.shape()
                )));
            }
        }
        for (i, (t, r)) in self.row_outputs.iter().enumerate() {
            let reduce = r
                .checked_sub(n_in)
                .and_then(|k| self.instrs.get(k))
                .is_some_and(|ins| matches!(ins, RowInstr::Reduce(..)));
            if t.shape() != self.rows.as_slice() || !reduce {
                return Err(bad(format!(
                    "row output {i} of shape {:?} stores register {r} (shape {:?}, a reduction's register)",
                    t.shape(),
                    self.rows
                )));
            }
        }
        Ok(())
    }

    /// Pass of every register: the pass from which its value is known in every element.
    /// Inputs 0; an elementwise instruction the latest of its operands; a reduction one
    /// more than its operand (it is accumulated in its operand's pass).
    fn levels(&self) -> Vec<usize> {
        let mut level = vec![0; self.inputs.len()];
        for ins in &self.instrs {
            let l = ins.operands().iter().map(|&r| level[r]).max().unwrap_or(0);
            level.push(match ins {
                RowInstr::Reduce(..) => l + 1,
                RowInstr::Pointwise(_) => l,
            });
        }
        level
    }

    /// The passes over each row, in order (see the module's documentation). Reductions
    /// whose operands need no earlier reduction share the first pass (a layer norm's sum
    /// and sum of squares), and a pass writes every output it can.
    pub fn passes(&self) -> Vec<RowPass> {
        let n_in = self.inputs.len();
        let level = self.levels();
        let reduce_pass = |k: usize| match self.instrs[k] {
            RowInstr::Reduce(_, a, _) => Some(level[a]),
            RowInstr::Pointwise(_) => None,
        };
        let last = (0..self.instrs.len())
            .filter_map(reduce_pass)
            .chain(self.outputs.iter().map(|&(_, r)| level[r]))
            .max()
            .unwrap_or(0);
        (0..=last)
            .map(|p| {
                let reduces: Vec<usize> = (0..self.instrs.len())
                    .filter(|&k| reduce_pass(k) == Some(p))
                    .collect();
                let outputs: Vec<usize> = (0..self.outputs.len())
                    .filter(|&o| level[self.outputs[o].1] == p)
                    .collect();
                let row_outputs: Vec<usize> = (0..self.row_outputs.len())
                    .filter(|&o| reduces.contains(&(self.row_outputs[o].1 - n_in)))
                    .collect();
                // Everything the pass's reductions and outputs read, back to the inputs
                // and to reductions finished before.
                let mut needed = vec![false; n_in + self.instrs.len()];
                let mut stack: Vec<usize> = reduces
                    .iter()
                    .flat_map(|&k| self.instrs[k].operands())
                    .chain(outputs.iter().map(|&o| self.outputs[o].1))
                    .collect();
                while let Some(r) = stack.pop() {
                    if std::mem::replace(&mut needed[r], true) || r < n_in {
                        continue;
                    }
                    if let RowInstr::Pointwise(_) = self.instrs[r - n_in] {
                        stack.extend(self.instrs[r - n_in].operands());
                    }
                }
                RowPass {
                    inputs: (0..n_in).filter(|&r| needed[r]).collect(),
                    instrs: (0..self.instrs.len())
                        .filter(|&k| needed[n_in + k])
                        .collect(),
                    reduces,
                    outputs,
                    row_outputs,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[usize]) -> Tensor {
        Tensor::full(shape, DType::F32, 0.0)
    }

    /// `y = x + r; s = sum(y * y); out = y * rsqrt(s)`, y and s also written.
    fn rms(rows: usize, n: usize) -> RowProgram {
        RowProgram {
            rows: vec![rows],
            row: vec![n],
            inputs: vec![t(&[rows, n]), t(&[rows, n])],
            instrs: vec![
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Add, 0, 1)), // 2: y
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 2, 2)), // 3
                RowInstr::Reduce(ReduceOp::Sum, 3, DType::F32),                   // 4: s
                RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Rsqrt, 4)),    // 5
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 2, 5)), // 6
            ],
            outputs: vec![(t(&[rows, n]), 6), (t(&[rows, n]), 2)],
            row_outputs: vec![(t(&[rows]), 4)],
        }
    }

    #[test]
    fn a_norm_is_two_passes_the_first_writing_what_needs_no_reduction() {
        let p = rms(3, 8);
        p.validate().unwrap();
        let passes = p.passes();
        assert_eq!(passes.len(), 2);
        assert_eq!(passes[0].instrs, vec![0, 1]);
        assert_eq!(passes[0].reduces, vec![2]);
        assert_eq!(passes[0].outputs, vec![1]);
        assert_eq!(passes[0].row_outputs, vec![0]);
        // The second pass recomputes y from both inputs and reads the finished sum.
        assert_eq!(passes[1].inputs, vec![0, 1]);
        assert_eq!(passes[1].instrs, vec![0, 2, 3, 4]);
        assert!(passes[1].reduces.is_empty());
        assert_eq!(passes[1].outputs, vec![0]);
    }

    #[test]
    fn independent_reductions_share_a_pass_and_dependent_ones_follow() {
        // softmax-like: m = max(x); e = exp(x - m); s = sum(e); out = e / s, plus sum(x).
        let n = 4;
        let p = RowProgram {
            rows: vec![2],
            row: vec![n],
            inputs: vec![t(&[2, n])],
            instrs: vec![
                RowInstr::Reduce(ReduceOp::Max, 0, DType::F32), // 1: m
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Sub, 0, 1)), // 2
                RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Exp, 2)), // 3
                RowInstr::Reduce(ReduceOp::Sum, 3, DType::F32), // 4: s
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Div, 3, 4)), // 5
                RowInstr::Reduce(ReduceOp::Sum, 0, DType::F32), // 6
            ],
            outputs: vec![(t(&[2, n]), 5)],
            row_outputs: vec![(t(&[2]), 6)],
        };
        p.validate().unwrap();
        let passes = p.passes();
        assert_eq!(passes.len(), 3);
        assert_eq!(passes[0].reduces, vec![0, 5]);
        assert_eq!(passes[0].row_outputs, vec![0]);
        assert_eq!(passes[1].reduces, vec![3]);
        assert_eq!(passes[1].instrs, vec![0, 1, 2]);
        assert_eq!(passes[2].outputs, vec![0]);
    }

    #[test]
    fn bad_programs_are_refused() {
        let mut p = rms(2, 4);
        p.row_outputs[0].1 = 2; // not a reduction
        assert!(p.validate().is_err());
        let mut p = rms(2, 4);
        p.outputs[0].0 = t(&[2, 5]);
        assert!(p.validate().is_err());
        let mut p = rms(2, 4);
        p.instrs.retain(|i| !matches!(i, RowInstr::Reduce(..)));
        p.outputs.clear();
        p.row_outputs.clear();
        assert!(p.validate().is_err());
    }
}
