//! The operands of one GEMM ([`Kernel::Gemm`] or [`Kernel::GemmAux`]) as the CUDA
//! backend takes them, and the checks of their ranks, shapes and dtypes.

use super::{err, gemm, GemmDevice};
use crate::device::{GemmOperands, Kernel, StreamHandle};
use crate::error::Result;

/// The operands of one [`Kernel::Gemm`] or [`Kernel::GemmAux`].
pub(crate) type GemmArgs<'a> = GemmOperands<'a>;

/// Runs a [`Kernel::Gemm`] or [`Kernel::GemmAux`] (any other kernel is an error).
pub(crate) fn gemm_kernel(dev: &dyn GemmDevice, stream: StreamHandle, k: Kernel) -> Result<()> {
    match k.gemm_operands() {
        Some(g) => gemm(dev, stream, g),
        None => Err(err("gemm: not a GEMM kernel".into())),
    }
}

/// Checks ranks, shapes and dtypes of a GEMM.
pub(super) fn validate(g: &GemmArgs) -> Result<()> {
    let (a, b, dst) = (g.a, g.b, g.dst);
    if g.accumulate && (g.bias.is_some() || !g.epilogue.is_empty() || g.aux.is_some()) {
        return Err(err(
            "gemm: a bias or an epilogue cannot be combined with accumulate".into(),
        ));
    }
    if let Some((x, _)) = g.aux.filter(|(x, _)| x.shape() != g.dst.shape()) {
        return Err(err(format!(
            "gemm: the auxiliary matrix {:?} must have dst's shape {:?}",
            x.shape(),
            g.dst.shape()
        )));
    }
    let r = dst.rank();
    if r < 2 || a.rank() != r || b.rank() != r {
        return Err(err(format!(
            "gemm: a {:?}, b {:?} and dst {:?} must share one rank >= 2",
            a.shape(),
            b.shape(),
            dst.shape()
        )));
    }
    let (m, n, k) = (dst.shape()[r - 2], dst.shape()[r - 1], a.shape()[r - 1]);
    if a.shape()[r - 2] != m
        || b.shape()[r - 2] != k
        || b.shape()[r - 1] != n
        || a.shape()[..r - 2] != dst.shape()[..r - 2]
        || b.shape()[..r - 2] != dst.shape()[..r - 2]
    {
        return Err(err(format!(
            "gemm: a {:?} @ b {:?} does not give dst {:?}",
            a.shape(),
            b.shape(),
            dst.shape()
        )));
    }
    if a.dtype() != b.dtype() {
        return Err(err(format!(
            "gemm: operand dtypes {} and {} must agree",
            a.dtype(),
            b.dtype()
        )));
    }
    if let Some(bias) = g.bias {
        if bias.shape() != [n] {
            return Err(err(format!(
                "gemm: bias {:?} must be [N] = [{n}]",
                bias.shape()
            )));
        }
    }
    crate::device::gemm_addend(g.accumulate, g.addend, dst)?;
    if g.accumulate && dst.dtype() != a.dtype() {
        return Err(err(format!(
            "gemm: accumulating into {} from {} operands",
            dst.dtype(),
            a.dtype()
        )));
    }
    Ok(())
}
