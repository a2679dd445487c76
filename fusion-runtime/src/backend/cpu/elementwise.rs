//! Copy and fused pointwise kernels.
//!
//! Every operand is gathered into a row-major f32 vector before any output is written, so
//! outputs may alias inputs (in-place updates, transposed aliases) and inputs may be
//! stride-0 broadcast views.

use crate::device::{PointwiseInstr, PointwiseProgram};
use crate::error::Result;
use crate::tensor::{round_to, Tensor};

use super::check::{cpu_err, require_host};

/// Elements evaluated per instruction sweep: keeps the register file small and cached.
const CHUNK: usize = 4096;

/// `dst = src` elementwise; the shapes must match exactly, the dtype converts.
pub(super) fn copy(src: &Tensor, dst: &Tensor) -> Result<()> {
    require_host(src, "copy: the source")?;
    require_host(dst, "copy: the destination")?;
    if src.shape() != dst.shape() {
        return Err(cpu_err(format!(
            "copy: source shape {:?} differs from destination shape {:?}",
            src.shape(),
            dst.shape()
        )));
    }
    dst.write_f32(&src.to_f32_vec()?)
}

/// Checks operand shapes and register indices, so evaluation cannot index out of range.
fn validate(prog: &PointwiseProgram) -> Result<()> {
    for (i, t) in prog.inputs.iter().enumerate() {
        require_host(t, &format!("pointwise: input {i}"))?;
        if t.shape() != prog.shape.as_slice() {
            return Err(cpu_err(format!(
                "pointwise: input {i} has shape {:?}, not the iteration shape {:?}",
                t.shape(),
                prog.shape
            )));
        }
    }
    let n_in = prog.inputs.len();
    for (i, ins) in prog.instrs.iter().enumerate() {
        let defined = n_in + i;
        let operands = match *ins {
            PointwiseInstr::Unary(_, a) | PointwiseInstr::Round(_, a) => [a, a],
            PointwiseInstr::Binary(_, a, b) => [a, b],
        };
        if let Some(r) = operands.iter().find(|&&r| r >= defined) {
            return Err(cpu_err(format!(
                "pointwise: instruction {i} ({ins:?}) reads register {r}, but only {defined} are defined"
            )));
        }
    }
    let n_regs = n_in + prog.instrs.len();
    for (i, (t, r)) in prog.outputs.iter().enumerate() {
        require_host(t, &format!("pointwise: output {i}"))?;
        if t.shape() != prog.shape.as_slice() {
            return Err(cpu_err(format!(
                "pointwise: output {i} has shape {:?}, not the iteration shape {:?}",
                t.shape(),
                prog.shape
            )));
        }
        if *r >= n_regs {
            return Err(cpu_err(format!(
                "pointwise: output {i} stores register {r}, but the program has {n_regs}"
            )));
        }
    }
    Ok(())
}

/// Runs `instrs` over one chunk: `regs[..n_in]` hold the inputs, the rest are overwritten.
/// Same arithmetic as [`PointwiseProgram::eval_element`], one instruction at a time.
fn eval_chunk(instrs: &[PointwiseInstr], n_in: usize, regs: &mut [Vec<f32>]) {
    for (i, ins) in instrs.iter().enumerate() {
        let (done, rest) = regs.split_at_mut(n_in + i);
        let out = &mut rest[0];
        out.clear();
        match *ins {
            PointwiseInstr::Unary(op, a) => {
                out.extend(done[a].iter().map(|&x| op.apply_f64(x as f64) as f32));
            }
            PointwiseInstr::Binary(op, a, b) => out.extend(
                done[a]
                    .iter()
                    .zip(&done[b])
                    .map(|(&x, &y)| op.apply_f64(x as f64, y as f64) as f32),
            ),
            PointwiseInstr::Round(dt, a) => out.extend(done[a].iter().map(|&x| round_to(dt, x))),
        }
    }
}

/// Runs a fused pointwise program over its iteration shape.
pub(super) fn pointwise(prog: &PointwiseProgram) -> Result<()> {
    validate(prog)?;
    let numel: usize = prog.shape.iter().product();
    let n_in = prog.inputs.len();
    let inputs = prog
        .inputs
        .iter()
        .map(Tensor::to_f32_vec)
        .collect::<Result<Vec<_>>>()?;
    let mut regs = vec![Vec::with_capacity(CHUNK.min(numel)); n_in + prog.instrs.len()];
    let mut outs = vec![Vec::with_capacity(numel); prog.outputs.len()];
    for start in (0..numel).step_by(CHUNK) {
        let end = (start + CHUNK).min(numel);
        for (reg, input) in regs.iter_mut().zip(&inputs) {
            reg.clear();
            reg.extend_from_slice(&input[start..end]);
        }
        eval_chunk(&prog.instrs, n_in, &mut regs);
        for (out, (_, r)) in outs.iter_mut().zip(&prog.outputs) {
            out.extend_from_slice(&regs[*r]);
        }
    }
    for ((t, _), data) in prog.outputs.iter().zip(&outs) {
        t.write_f32(data)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use fusion_compiler::ir::{BinaryOp, UnaryOp};
    use fusion_compiler::DType;

    use super::super::testutil::{assert_close, tolerance, values, DTYPES};
    use super::*;
    use crate::backend::cpu::CpuDevice;
    use crate::device::{Device, Kernel};

    fn run(prog: &PointwiseProgram) -> Result<()> {
        CpuDevice::new(0).execute(0, Kernel::Pointwise(prog))
    }

    /// f64 rounding to `dt` through f32 (how the reference models a cast).
    fn round64(dt: DType, v: f64) -> f64 {
        round_to(dt, v as f32) as f64
    }

    #[test]
    fn copy_converts_between_dtypes() {
        let dev = CpuDevice::new(0);
        for src_dt in DTYPES {
            for dst_dt in DTYPES {
                let src = Tensor::randn(&[3, 4], src_dt, 11);
                // a transposed source and a transposed destination view
                let src_t = src.permute(&[1, 0]).unwrap();
                let base = dev.allocate(0, dst_dt, &[3, 4]).unwrap();
                let dst = base.permute(&[1, 0]).unwrap();
                dev.execute(
                    0,
                    Kernel::Copy {
                        src: &src_t,
                        dst: &dst,
                    },
                )
                .unwrap();
                let reference: Vec<f64> =
                    values(&src_t).iter().map(|&v| round64(dst_dt, v)).collect();
                // exact: one rounding of each source value
                assert_eq!(values(&dst), reference, "copy {src_dt:?} -> {dst_dt:?}");
            }
        }
    }

    #[test]
    fn copy_rejects_shape_mismatch() {
        let dev = CpuDevice::new(0);
        let (a, b) = (
            Tensor::zeros(&[2, 3], DType::F32),
            Tensor::zeros(&[3, 2], DType::F32),
        );
        let err = dev
            .execute(0, Kernel::Copy { src: &a, dst: &b })
            .unwrap_err()
            .to_string();
        assert!(err.contains("[2, 3]") && err.contains("[3, 2]"), "{err}");
    }

    /// `x [4, 5]`, `y [5]` broadcast: out0 = tanh(round_bf16(x * y)) + y, out1 = the rounded product.
    #[test]
    fn broadcast_chain_with_round() {
        let dev = CpuDevice::new(0);
        for dt in DTYPES {
            let x = Tensor::randn(&[4, 5], dt, 1);
            let y = Tensor::randn(&[5], dt, 2);
            let yb = y.expand(&[4, 5]).unwrap();
            assert_eq!(yb.strides()[0], 0);
            let out0 = dev.allocate(0, dt, &[4, 5]).unwrap();
            let out1 = dev.allocate(0, DType::F32, &[4, 5]).unwrap();
            let prog = PointwiseProgram {
                shape: vec![4, 5],
                inputs: vec![x.clone(), yb.clone()],
                instrs: vec![
                    PointwiseInstr::Binary(BinaryOp::Mul, 0, 1),
                    PointwiseInstr::Round(DType::BF16, 2),
                    PointwiseInstr::Unary(UnaryOp::Tanh, 3),
                    PointwiseInstr::Binary(BinaryOp::Add, 4, 1),
                ],
                outputs: vec![(out0.clone(), 5), (out1.clone(), 3)],
            };
            run(&prog).unwrap();
            let (xv, yv) = (values(&x), values(&yb));
            let prod: Vec<f64> = xv
                .iter()
                .zip(&yv)
                .map(|(a, b)| round64(DType::BF16, a * b))
                .collect();
            let r0: Vec<f64> = prod.iter().zip(&yv).map(|(p, b)| p.tanh() + b).collect();
            assert_close(&out0, &r0, tolerance(dt), &format!("out0 {dt:?}"));
            assert_close(&out1, &prod, 1e-2, &format!("out1 {dt:?}"));
        }
    }

    /// The sweep-per-instruction evaluator agrees bit for bit with `eval_element`.
    #[test]
    fn matches_eval_element() {
        let n = CHUNK + 37; // more than one chunk
        let x = Tensor::randn(&[n], DType::F32, 5);
        let y = Tensor::randn(&[n], DType::F32, 6);
        let out = Tensor::zeros(&[n], DType::F32);
        let mut instrs = vec![PointwiseInstr::Round(DType::F16, 0)];
        instrs.extend(UnaryOp::ALL.iter().map(|&u| PointwiseInstr::Unary(u, 1)));
        instrs.extend(
            BinaryOp::ALL
                .iter()
                .map(|&b| PointwiseInstr::Binary(b, 0, 1)),
        );
        let last = 2 + instrs.len() - 1;
        instrs.push(PointwiseInstr::Binary(BinaryOp::Add, last, 4));
        let prog = PointwiseProgram {
            shape: vec![n],
            inputs: vec![x.clone(), y.clone()],
            instrs,
            outputs: vec![(out.clone(), last + 1)],
        };
        run(&prog).unwrap();
        let (xv, yv) = (x.to_f32_vec().unwrap(), y.to_f32_vec().unwrap());
        let got = out.to_f32_vec().unwrap();
        for i in 0..n {
            let mut regs = vec![xv[i], yv[i]];
            prog.eval_element(&mut regs);
            assert_eq!(got[i].to_bits(), regs[last + 1].to_bits(), "element {i}");
        }
    }

    #[test]
    fn in_place_and_transposed_alias() {
        for dt in DTYPES {
            // x = relu(x + 1), in place
            let x = Tensor::randn(&[3, 3], dt, 9);
            let before = values(&x);
            let one = Tensor::full(&[1, 1], DType::F32, 1.0)
                .expand(&[3, 3])
                .unwrap();
            let prog = PointwiseProgram {
                shape: vec![3, 3],
                inputs: vec![x.clone(), one],
                instrs: vec![
                    PointwiseInstr::Binary(BinaryOp::Add, 0, 1),
                    PointwiseInstr::Unary(UnaryOp::Relu, 2),
                ],
                outputs: vec![(x.clone(), 3)],
            };
            run(&prog).unwrap();
            let reference: Vec<f64> = before.iter().map(|v| (v + 1.0).max(0.0)).collect();
            assert_close(&x, &reference, tolerance(dt), &format!("in place {dt:?}"));

            // x = x + x^T: every output element needs inputs that other elements overwrite
            let before = values(&x);
            let xt = x.permute(&[1, 0]).unwrap();
            let prog = PointwiseProgram {
                shape: vec![3, 3],
                inputs: vec![x.clone(), xt],
                instrs: vec![PointwiseInstr::Binary(BinaryOp::Add, 0, 1)],
                outputs: vec![(x.clone(), 2)],
            };
            run(&prog).unwrap();
            let reference: Vec<f64> = (0..9)
                .map(|i| before[i] + before[(i % 3) * 3 + i / 3])
                .collect();
            assert_close(&x, &reference, tolerance(dt), &format!("x + x^T {dt:?}"));
        }
    }

    #[test]
    fn rejects_bad_programs() {
        let x = Tensor::zeros(&[2, 3], DType::F32);
        let wrong = Tensor::zeros(&[3, 2], DType::F32);
        let prog = |inputs: Vec<Tensor>, instrs, outputs| PointwiseProgram {
            shape: vec![2, 3],
            inputs,
            instrs,
            outputs,
        };
        let neg = vec![PointwiseInstr::Unary(UnaryOp::Neg, 0)];
        let err = run(&prog(
            vec![wrong.clone()],
            neg.clone(),
            vec![(x.clone(), 1)],
        ))
        .unwrap_err();
        assert!(
            err.to_string().contains("input 0 has shape [3, 2]"),
            "{err}"
        );
        assert!(run(&prog(vec![x.clone()], neg.clone(), vec![(wrong, 1)])).is_err());
        assert!(run(&prog(vec![x.clone()], neg.clone(), vec![(x.clone(), 2)])).is_err());
        let forward = vec![PointwiseInstr::Unary(UnaryOp::Neg, 1)];
        assert!(run(&prog(vec![x.clone()], forward, vec![(x.clone(), 1)])).is_err());
        // nothing was written by the failed runs
        assert!(values(&x).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn empty_and_scalar_shapes() {
        let e = Tensor::zeros(&[0, 4], DType::F32);
        let neg = vec![PointwiseInstr::Unary(UnaryOp::Neg, 0)];
        let prog = PointwiseProgram {
            shape: vec![0, 4],
            inputs: vec![e.clone()],
            instrs: neg.clone(),
            outputs: vec![(e, 1)],
        };
        run(&prog).unwrap();
        let s = Tensor::full(&[], DType::F16, 2.0);
        let prog = PointwiseProgram {
            shape: vec![],
            inputs: vec![s.clone()],
            instrs: neg,
            outputs: vec![(s.clone(), 1)],
        };
        run(&prog).unwrap();
        assert_eq!(values(&s), vec![-2.0]);
    }
}
