//! The auxiliary matrix of a GEMM epilogue (`Kernel::GemmAux`) on the CPU: checked
//! against the product's shape, and read as a derivative's input (the pre-activation is
//! stored by `matmul::gemm` itself, rounded once at the store).

use fusion_compiler::ir::UnaryOp;

use crate::error::Result;
use crate::tensor::Tensor;

use super::check::{cpu_err, require_host};

/// Checks that `aux` is a host matrix of `dst`'s shape.
pub(super) fn validate(aux: &Tensor, dst: &Tensor) -> Result<()> {
    require_host(aux, "gemm: aux")?;
    if aux.shape() != dst.shape() {
        return Err(cpu_err(format!(
            "gemm: the auxiliary matrix {:?} must have dst's shape {:?}",
            aux.shape(),
            dst.shape()
        )));
    }
    Ok(())
}

/// `op` at each of `aux`'s values (row-major), in f32: what the product is multiplied by.
pub(super) fn slope(aux: &Tensor, op: UnaryOp) -> Result<Vec<f32>> {
    Ok((aux.to_f32_vec()?.into_iter())
        .map(|x| op.apply_f64(f64::from(x)) as f32)
        .collect())
}

#[cfg(test)]
mod tests {
    use fusion_compiler::ir::EpilogueAux;
    use fusion_compiler::DType;

    use super::super::testutil::{assert_close, tolerance, values};
    use crate::backend::cpu::CpuDevice;
    use crate::device::{Device, Kernel};
    use crate::tensor::Tensor;

    use super::*;

    /// `a @ b` in f64 over row-major `[m, k]` and `[k, n]` values.
    fn product(a: &Tensor, b: &Tensor) -> Vec<f64> {
        let (m, k, n) = (a.shape()[0], a.shape()[1], b.shape()[1]);
        let (av, bv) = (values(a), values(b));
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|l| av[i * k + l] * bv[l * n + j]).sum();
            }
        }
        out
    }

    fn gemm_aux(
        a: &Tensor,
        b: &Tensor,
        aux: &Tensor,
        mode: EpilogueAux,
        act: &[UnaryOp],
    ) -> Tensor {
        let dev = CpuDevice::new(0);
        let dst = dev.allocate(0, a.dtype(), aux.shape()).unwrap();
        let kernel = Kernel::GemmAux {
            a,
            b,
            bias: None,
            epilogue: act,
            aux,
            mode,
            dst: &dst,
        };
        dev.execute(0, kernel).unwrap();
        dst
    }

    #[test]
    fn stores_the_pre_activation_beside_the_activation() {
        for dt in [DType::F32, DType::BF16] {
            let (a, b) = (Tensor::randn(&[5, 7], dt, 1), Tensor::randn(&[7, 3], dt, 2));
            let h = Tensor::zeros(&[5, 3], dt);
            let y = gemm_aux(&a, &b, &h, EpilogueAux::PreActivation, &[UnaryOp::GeluTanh]);
            let want = product(&a, &b);
            assert_close(&h, &want, tolerance(dt), "pre-activation");
            let act: Vec<f64> = want
                .iter()
                .map(|&v| UnaryOp::GeluTanh.apply_f64(v))
                .collect();
            assert_close(&y, &act, tolerance(dt), "activation");
        }
    }

    #[test]
    fn multiplies_by_the_derivative_at_aux() {
        for dt in [DType::F32, DType::BF16] {
            let (a, b) = (Tensor::randn(&[4, 6], dt, 3), Tensor::randn(&[6, 5], dt, 4));
            let h = Tensor::randn(&[4, 5], dt, 5);
            let d = EpilogueAux::Derivative(UnaryOp::GeluTanhGrad);
            let y = gemm_aux(&a, &b, &h, d, &[]);
            let want: Vec<f64> = (product(&a, &b).iter().zip(values(&h)))
                .map(|(p, x)| p * UnaryOp::GeluTanhGrad.apply_f64(x))
                .collect();
            assert_close(&y, &want, tolerance(dt), "derivative");
        }
    }

    #[test]
    fn an_aux_of_another_shape_is_an_error() {
        let dev = CpuDevice::new(0);
        let (a, b) = (
            Tensor::randn(&[4, 6], DType::F32, 3),
            Tensor::randn(&[6, 5], DType::F32, 4),
        );
        let h = Tensor::zeros(&[4, 4], DType::F32);
        let dst = Tensor::zeros(&[4, 5], DType::F32);
        let r = dev.execute(
            0,
            Kernel::GemmAux {
                a: &a,
                b: &b,
                bias: None,
                epilogue: &[],
                aux: &h,
                mode: EpilogueAux::PreActivation,
                dst: &dst,
            },
        );
        assert!(r.unwrap_err().to_string().contains("auxiliary"));
    }
}
