//! A GEMM's epilogue where cuBLASLt cannot run it in the GEMM (an activation it lacks, an
//! output dtype cuBLAS cannot store, an auxiliary matrix whose leading dimension,
//! alignment or dtype it does not take): the product in f32, then one generated
//! elementwise kernel that adds the bias, applies the activations, stores the
//! pre-activation or multiplies by a derivative at the auxiliary matrix, and rounds once
//! at each store.

use fusion_compiler::ir::{BinaryOp, EpilogueAux};
use fusion_compiler::DType;

use super::{cublas_gemm, err, lt_gemm, GemmArgs, GemmDevice, LtEpilogue};
use crate::device::{Kernel, PointwiseInstr, PointwiseProgram, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

/// `g` (not accumulating) as the f32 product (cuBLASLt or cuBLAS) and one kernel for the
/// rest.
pub(super) fn product_then_kernel(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    g: &GemmArgs,
) -> Result<()> {
    let product = dev.allocate(stream, DType::F32, g.dst.shape())?;
    let plain = GemmArgs {
        bias: None,
        addend: None,
        epilogue: &[],
        aux: None,
        dst: &product,
        ..*g
    };
    if !lt_gemm(dev, stream, &plain, LtEpilogue::None)? {
        cublas_gemm(dev, stream, g.a, g.b, None, false, &product)?;
    }
    let program = program(g, product)?;
    dev.execute(stream, Kernel::Pointwise(&program))
}

/// The epilogue of `g` over its f32 `product`: bias, activations, then the derivative's
/// factor; outputs `dst` and, for [`EpilogueAux::PreActivation`], the auxiliary matrix
/// (the value before the activations).
fn program(g: &GemmArgs, product: Tensor) -> Result<PointwiseProgram> {
    let shape = g.dst.shape().to_vec();
    let mut inputs = vec![product];
    if let Some(bias) = g.bias {
        let full = bias
            .expand(&shape)
            .map_err(|e| err(format!("gemm bias: {e}")))?;
        inputs.push(full);
    }
    let slope = match g.aux {
        Some((x, EpilogueAux::Derivative(op))) => {
            inputs.push(x.clone());
            Some((inputs.len() - 1, op))
        }
        _ => None,
    };
    let n_in = inputs.len();
    let mut instrs = Vec::new();
    let mut push = |i: PointwiseInstr| {
        instrs.push(i);
        n_in + instrs.len() - 1
    };
    let mut reg = 0;
    if g.bias.is_some() {
        reg = push(PointwiseInstr::Binary(BinaryOp::Add, 0, 1));
    }
    let pre_activation = reg;
    for &op in g.epilogue {
        reg = push(PointwiseInstr::Unary(op, reg));
    }
    if let Some((x, op)) = slope {
        let factor = push(PointwiseInstr::Unary(op, x));
        reg = push(PointwiseInstr::Binary(BinaryOp::Mul, reg, factor));
    }
    let mut outputs = vec![(g.dst.clone(), reg)];
    if let Some((x, EpilogueAux::PreActivation)) = g.aux {
        outputs.push((x.clone(), pre_activation));
    }
    Ok(PointwiseProgram {
        shape,
        inputs,
        instrs,
        outputs,
    })
}
