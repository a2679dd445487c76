//! Row programs ([`RowProgram`]): row by row, pass by pass, reductions accumulated in f64
//! in the row's order like the reduction kernel, so a fused norm gives the values of its
//! unfused kernels.

use crate::error::Result;
use crate::fused_programs::{RowInstr, RowProgram};
use crate::tensor::round_to;

use super::check::require_host;

/// Runs `prog` (every operand gathered before any output is written).
pub(super) fn rows(prog: &RowProgram) -> Result<()> {
    prog.validate()?;
    for (i, t) in prog.inputs.iter().enumerate() {
        require_host(t, &format!("rows: input {i}"))?;
    }
    for (i, (t, _)) in prog.outputs.iter().chain(&prog.row_outputs).enumerate() {
        require_host(t, &format!("rows: output {i}"))?;
    }
    let passes = prog.passes();
    let n_in = prog.inputs.len();
    let n_rows: usize = prog.rows.iter().product();
    let n: usize = prog.row.iter().product();
    let inputs = prog
        .inputs
        .iter()
        .map(|t| t.to_f32_vec())
        .collect::<Result<Vec<_>>>()?;
    let mut outs = vec![vec![0f32; n_rows * n]; prog.outputs.len()];
    let mut row_outs = vec![Vec::with_capacity(n_rows); prog.row_outputs.len()];
    let mut regs = vec![0f32; n_in + prog.instrs.len()];
    // The reductions' finished values for the current row, by instruction.
    let mut reduced = vec![0f32; prog.instrs.len()];
    for r in 0..n_rows {
        for pass in &passes {
            let mut acc: Vec<f64> = pass
                .reduces
                .iter()
                .map(|&k| match prog.instrs[k] {
                    RowInstr::Reduce(op, ..) => op.init(),
                    RowInstr::Pointwise(_) => unreachable!("passes list reductions"),
                })
                .collect();
            for c in 0..n {
                let e = r * n + c;
                for &i in &pass.inputs {
                    regs[i] = inputs[i][e];
                }
                for &k in &pass.instrs {
                    regs[n_in + k] = match prog.instrs[k] {
                        RowInstr::Pointwise(ins) => ins.apply(&regs),
                        RowInstr::Reduce(..) => reduced[k],
                    };
                }
                for (a, &k) in acc.iter_mut().zip(&pass.reduces) {
                    if let RowInstr::Reduce(op, x, _) = prog.instrs[k] {
                        *a = op.combine(*a, regs[x] as f64);
                    }
                }
                for &o in &pass.outputs {
                    outs[o][e] = regs[prog.outputs[o].1];
                }
            }
            for (a, &k) in acc.iter().zip(&pass.reduces) {
                if let RowInstr::Reduce(_, _, dt) = prog.instrs[k] {
                    reduced[k] = round_to(dt, *a as f32);
                }
            }
            // Each row output is its reduction's, finished once per row, rows in order.
            for &o in &pass.row_outputs {
                row_outs[o].push(reduced[prog.row_outputs[o].1 - n_in]);
            }
        }
    }
    for ((t, _), data) in prog.outputs.iter().zip(&outs) {
        t.write_f32(data)?;
    }
    for ((t, _), data) in prog.row_outputs.iter().zip(&row_outs) {
        t.write_f32(data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fusion_compiler::ir::{BinaryOp, ReduceOp, UnaryOp};
    use fusion_compiler::DType;

    use super::*;
    use crate::backend::cpu::CpuDevice;
    use crate::device::{Device, Kernel, PointwiseInstr};
    use crate::tensor::Tensor;

    fn filled(shape: &[usize], f: impl Fn(usize) -> f32, dt: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(f).collect();
        let t = Tensor::full(shape, dt, 0.0);
        t.write_f32(&v).unwrap();
        t
    }

    #[test]
    fn an_rms_norm_matches_its_definition_and_writes_its_sum() {
        let (m, n) = (3, 37);
        let x = filled(&[m, n], |i| ((i * 7) % 11) as f32 * 0.25 - 1.0, DType::F32);
        let w = filled(&[n], |i| 0.5 + i as f32 * 0.01, DType::F32)
            .expand(&[m, n])
            .unwrap();
        let out = Tensor::full(&[m, n], DType::BF16, 0.0);
        let sums = Tensor::full(&[m], DType::F32, 0.0);
        let prog = RowProgram {
            rows: vec![m],
            row: vec![n],
            inputs: vec![x.clone(), w.clone()],
            instrs: vec![
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 0, 0)), // 2
                RowInstr::Reduce(ReduceOp::Sum, 2, DType::F32),                   // 3
                RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Rsqrt, 3)),    // 4
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 0, 4)), // 5
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 5, 1)), // 6
                RowInstr::Pointwise(PointwiseInstr::Round(DType::BF16, 6)),       // 7
            ],
            outputs: vec![(out.clone(), 7)],
            row_outputs: vec![(sums.clone(), 3)],
        };
        CpuDevice::new(0).execute(0, Kernel::Rows(&prog)).unwrap();
        let (xv, wv) = (x.to_f32_vec().unwrap(), w.to_f32_vec().unwrap());
        let (ov, sv) = (out.to_f32_vec().unwrap(), sums.to_f32_vec().unwrap());
        for r in 0..m {
            let s: f64 = (0..n).map(|c| (xv[r * n + c] * xv[r * n + c]) as f64).sum();
            assert_eq!(sv[r], s as f32);
            for c in 0..n {
                let want = xv[r * n + c] as f64 / s.sqrt() * wv[r * n + c] as f64;
                let got = ov[r * n + c] as f64;
                assert!(
                    (got - want).abs() <= 1e-2 * want.abs() + 1e-6,
                    "{r},{c}: {got} {want}"
                );
            }
        }
    }

    #[test]
    fn a_softmax_of_three_passes_sums_to_one() {
        let (m, n) = (4, 9);
        let x = filled(&[m, n], |i| (i % 5) as f32 * 3.0 - 4.0, DType::F32);
        let out = Tensor::full(&[m, n], DType::F32, 0.0);
        let prog = RowProgram {
            rows: vec![m],
            row: vec![n],
            inputs: vec![x],
            instrs: vec![
                RowInstr::Reduce(ReduceOp::Max, 0, DType::F32), // 1
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Sub, 0, 1)), // 2
                RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Exp, 2)), // 3
                RowInstr::Reduce(ReduceOp::Sum, 3, DType::F32), // 4
                RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Div, 3, 4)), // 5
            ],
            outputs: vec![(out.clone(), 5)],
            row_outputs: vec![],
        };
        CpuDevice::new(0).execute(0, Kernel::Rows(&prog)).unwrap();
        let v = out.to_f32_vec().unwrap();
        for r in 0..m {
            let s: f32 = v[r * n..(r + 1) * n].iter().sum();
            assert!((s - 1.0).abs() < 1e-5, "row {r}: {s}");
            assert!(v[r * n..(r + 1) * n].iter().all(|&p| p > 0.0 && p <= 1.0));
        }
    }
}
