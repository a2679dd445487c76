//! Batched matrix product kernel on the `gemm` crate, in f32.
//!
//! Each batch's operands are gathered into contiguous f32 matrices (converting bf16/f16,
//! resolving any strides), multiplied with f32 accumulation into one contiguous result,
//! and the result is written rounded into the destination view. Stride-0 broadcast batch
//! operands are gathered once, and since every read happens before the write, the
//! destination may alias an operand.

use std::collections::HashMap;

use ::gemm::Parallelism;
use fusion_compiler::ir::{EpilogueAux, UnaryOp};

use crate::error::Result;
use crate::tensor::Tensor;

use super::check::{cpu_err, require_host};
use super::gemm_aux;

/// The problem's sizes after validation: `batches` products of `[m, k] @ [k, n]`.
#[derive(Debug, Clone, Copy)]
struct Dims {
    batches: usize,
    m: usize,
    k: usize,
    n: usize,
}

/// Checks ranks, batch axes, M/K/N agreement and the bias shape.
fn validate(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, dst: &Tensor) -> Result<Dims> {
    require_host(a, "gemm: a")?;
    require_host(b, "gemm: b")?;
    require_host(dst, "gemm: dst")?;
    let (sa, sb, sd) = (a.shape(), b.shape(), dst.shape());
    let r = sa.len();
    if r < 2 || sb.len() != r || sd.len() != r {
        return Err(cpu_err(format!(
            "gemm: a {sa:?}, b {sb:?} and dst {sd:?} must all have one rank >= 2"
        )));
    }
    for i in 0..r - 2 {
        if sa[i] != sb[i] || sa[i] != sd[i] {
            return Err(cpu_err(format!(
                "gemm: batch axis {i} differs: a has {}, b has {}, dst has {} (a {sa:?}, b {sb:?}, dst {sd:?})",
                sa[i], sb[i], sd[i]
            )));
        }
    }
    let (m, k, n) = (sa[r - 2], sa[r - 1], sb[r - 1]);
    if sb[r - 2] != k {
        return Err(cpu_err(format!(
            "gemm: K differs: a {sa:?} has K = {k} (axis {}), b {sb:?} has K = {} (axis {})",
            r - 1,
            sb[r - 2],
            r - 2
        )));
    }
    if sd[r - 2] != m || sd[r - 1] != n {
        return Err(cpu_err(format!(
            "gemm: dst {sd:?} must end in [M, N] = [{m}, {n}] (a {sa:?}, b {sb:?})"
        )));
    }
    if let Some(bias) = bias {
        require_host(bias, "gemm: bias")?;
        if bias.shape() != [n] {
            return Err(cpu_err(format!(
                "gemm: bias has shape {:?}, but must be [N] = [{n}]",
                bias.shape()
            )));
        }
    }
    let batches = sa[..r - 2].iter().product();
    Ok(Dims { batches, m, k, n })
}

/// The matrix of batch `index` (row-major over the leading axes) of a rank >= 2 view.
fn batch_view(t: &Tensor, mut index: usize) -> Result<Tensor> {
    let batch_rank = t.rank() - 2;
    let mut idx = vec![0usize; batch_rank];
    for d in (0..batch_rank).rev() {
        let extent = t.shape()[d];
        idx[d] = index % extent;
        index /= extent;
    }
    idx.iter().try_fold(t.clone(), |v, &i| v.select(0, i))
}

/// Each batch's matrix as a contiguous f32 buffer; batches that view the same elements
/// (stride-0 broadcast) share one buffer.
struct Gathered {
    buffers: Vec<Vec<f32>>,
    /// Buffer index of each batch.
    of_batch: Vec<usize>,
}

impl Gathered {
    fn new(t: &Tensor, batches: usize) -> Result<Gathered> {
        let mut by_offset = HashMap::new();
        let mut buffers = Vec::new();
        let mut of_batch = Vec::with_capacity(batches);
        for bi in 0..batches {
            let view = batch_view(t, bi)?;
            // All batch views share shape and strides, so equal offsets mean equal matrices.
            let slot = match by_offset.get(&view.offset()) {
                Some(&slot) => slot,
                None => {
                    buffers.push(view.to_f32_vec()?);
                    by_offset.insert(view.offset(), buffers.len() - 1);
                    buffers.len() - 1
                }
            };
            of_batch.push(slot);
        }
        Ok(Gathered { buffers, of_batch })
    }

    fn batch(&self, bi: usize) -> &[f32] {
        &self.buffers[self.of_batch[bi]]
    }
}

/// `out[m, n] = a[m, k] @ b[k, n]`, all contiguous row-major, f32 accumulation.
fn multiply(d: Dims, a: &[f32], b: &[f32], out: &mut [f32]) -> Result<()> {
    if a.len() != d.m * d.k || b.len() != d.k * d.n || out.len() != d.m * d.n {
        return Err(cpu_err(format!(
            "gemm: internal buffer sizes disagree with {d:?}"
        )));
    }
    if d.m == 0 || d.n == 0 || d.k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    // SAFETY: the three buffers hold exactly m*k, k*n and m*n elements (checked above)
    // and the strides below describe row-major matrices of those shapes, so every access
    // stays in bounds; `out` is a unique borrow, distinct from the inputs.
    unsafe {
        ::gemm::gemm(
            d.m,
            d.n,
            d.k,
            out.as_mut_ptr(),
            1,
            d.n as isize,
            false,
            a.as_ptr(),
            1,
            d.k as isize,
            b.as_ptr(),
            1,
            d.n as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            // One simulated device is one host thread; ranks already run in parallel.
            Parallelism::None,
        );
    }
    Ok(())
}

/// Batched `dst = epilogue(a @ b (+ bias))`, or `dst = addend + a @ b`: a `[B.., M, K]`, b
/// `[B.., K, N]`, dst and addend `[B.., M, N]`; the epilogue runs in f32 and `dst` is
/// rounded once (see `Kernel::Gemm`). With `aux`, the auxiliary matrix of
/// `Kernel::GemmAux` (`[B.., M, N]`) is written or read as its mode says.
pub(super) fn gemm(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    addend: Option<&Tensor>,
    (epilogue, aux): (&[UnaryOp], Option<(&Tensor, EpilogueAux)>),
    dst: &Tensor,
) -> Result<()> {
    if addend.is_some() && (bias.is_some() || !epilogue.is_empty() || aux.is_some()) {
        return Err(cpu_err(
            "gemm: a bias or an epilogue cannot be combined with accumulate",
        ));
    }
    let d = validate(a, b, bias, dst)?;
    if let Some((x, _)) = aux {
        gemm_aux::validate(x, dst)?;
    }
    if d.batches == 0 || d.m == 0 || d.n == 0 {
        return Ok(()); // dst has no elements
    }
    let (ga, gb) = (Gathered::new(a, d.batches)?, Gathered::new(b, d.batches)?);
    let bias = bias.map(Tensor::to_f32_vec).transpose()?;
    let mut out = vec![0f32; d.batches * d.m * d.n];
    for (bi, chunk) in out.chunks_mut(d.m * d.n).enumerate() {
        multiply(d, ga.batch(bi), gb.batch(bi), chunk)?;
    }
    if let Some(addend) = addend {
        let held = addend.to_f32_vec()?;
        out.iter_mut().zip(held).for_each(|(o, h)| *o += h);
    }
    if let Some(bias) = &bias {
        for row in out.chunks_mut(d.n) {
            row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
        }
    }
    // A derivative's input is read before anything is written (it may alias `dst`).
    let slope = match aux {
        Some((x, EpilogueAux::Derivative(op))) => Some(gemm_aux::slope(x, op)?),
        _ => None,
    };
    if let Some((x, EpilogueAux::PreActivation)) = aux {
        x.write_f32(&out)?;
    }
    for &op in epilogue {
        out.iter_mut()
            .for_each(|o| *o = op.apply_f64(f64::from(*o)) as f32);
    }
    if let Some(slope) = slope {
        out.iter_mut().zip(slope).for_each(|(o, s)| *o *= s);
    }
    dst.write_f32(&out)
}

#[cfg(test)]
mod tests {
    use fusion_compiler::DType;

    use super::super::testutil::{assert_close, tolerance, values, DTYPES};
    use super::*;
    use crate::backend::cpu::CpuDevice;
    use crate::device::{Device, Kernel};

    /// Naive f64 reference over the row-major values of `[B.., M, K]` and `[B.., K, N]` views.
    fn reference(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Vec<f64> {
        let r = a.rank();
        let (m, k, n) = (a.shape()[r - 2], a.shape()[r - 1], b.shape()[r - 1]);
        let batches: usize = a.shape()[..r - 2].iter().product();
        let (av, bv) = (values(a), values(b));
        let biasv = bias.map(values).unwrap_or_else(|| vec![0.0; n]);
        let mut out = vec![0f64; batches * m * n];
        for p in 0..batches {
            for i in 0..m {
                for j in 0..n {
                    let mut s = biasv[j];
                    for l in 0..k {
                        s += av[(p * m + i) * k + l] * bv[(p * k + l) * n + j];
                    }
                    out[(p * m + i) * n + j] = s;
                }
            }
        }
        out
    }

    /// Runs the kernel into a fresh `dtype` destination and checks it against the reference.
    fn check(a: &Tensor, b: &Tensor, bias: Option<&Tensor>, dtype: DType, what: &str) -> Tensor {
        let dev = CpuDevice::new(0);
        let r = a.rank();
        let mut shape = a.shape().to_vec();
        shape[r - 1] = b.shape()[r - 1];
        let dst = dev.allocate(0, dtype, &shape).unwrap();
        dev.execute(
            0,
            Kernel::Gemm {
                a,
                b,
                bias,
                accumulate: false,
                addend: None,
                epilogue: &[],
                dst: &dst,
            },
        )
        .unwrap();
        let tol = tolerance(dtype)
            .max(tolerance(a.dtype()))
            .max(tolerance(b.dtype()));
        assert_close(&dst, &reference(a, b, bias), tol, what);
        dst
    }

    #[test]
    fn plain_in_every_dtype() {
        for dt in DTYPES {
            let (a, b) = (Tensor::randn(&[5, 7], dt, 1), Tensor::randn(&[7, 3], dt, 2));
            check(&a, &b, None, dt, &format!("plain {dt:?}"));
        }
        // big enough for the blocked paths of the gemm crate
        let (a, b) = (
            Tensor::randn(&[67, 130], DType::F32, 3),
            Tensor::randn(&[130, 45], DType::F32, 4),
        );
        check(&a, &b, None, DType::F32, "blocked");
        // mixed input dtypes, f32 output
        let (a, b) = (
            Tensor::randn(&[6, 9], DType::BF16, 5),
            Tensor::randn(&[9, 4], DType::F16, 6),
        );
        check(&a, &b, None, DType::F32, "mixed");
    }

    #[test]
    fn batched_with_broadcast_operands() {
        for dt in DTYPES {
            let a = Tensor::randn(&[2, 3, 4, 6], dt, 7);
            let b = Tensor::randn(&[6, 5], dt, 8).expand(&[2, 3, 6, 5]).unwrap();
            assert_eq!(&b.strides()[..2], &[0, 0]);
            check(&a, &b, None, dt, &format!("b broadcast {dt:?}"));
            // a broadcast along the middle batch axis only
            let a = Tensor::randn(&[2, 1, 4, 6], dt, 9)
                .expand(&[2, 3, 4, 6])
                .unwrap();
            let b = Tensor::randn(&[2, 3, 6, 5], dt, 10);
            check(&a, &b, None, dt, &format!("a broadcast {dt:?}"));
        }
    }

    #[test]
    fn transposed_operands_and_bias() {
        for dt in DTYPES {
            let b = Tensor::randn(&[5, 8], dt, 11).permute(&[1, 0]).unwrap(); // [K=8, N=5]
            assert!(!b.is_contiguous());
            let a = Tensor::randn(&[3, 8], dt, 12);
            check(&a, &b, None, dt, &format!("b^T {dt:?}"));
            let a_t = Tensor::randn(&[8, 3], dt, 13).permute(&[1, 0]).unwrap();
            let bias = Tensor::randn(&[5], dt, 14);
            check(&a_t, &b, Some(&bias), dt, &format!("a^T b^T + bias {dt:?}"));
            // batched transposes: b [2, N, K] -> [2, K, N]
            let a = Tensor::randn(&[2, 3, 8], dt, 15);
            let b = Tensor::randn(&[2, 5, 8], dt, 16)
                .permute(&[0, 2, 1])
                .unwrap();
            check(
                &a,
                &b,
                Some(&bias),
                dt,
                &format!("batched b^T + bias {dt:?}"),
            );
        }
    }

    #[test]
    fn strided_destination() {
        let dev = CpuDevice::new(0);
        for dt in DTYPES {
            let (a, b) = (
                Tensor::randn(&[4, 6], dt, 17),
                Tensor::randn(&[6, 5], dt, 18),
            );
            let bias = Tensor::randn(&[5], DType::F32, 19);
            let big = dev.allocate(0, dt, &[4, 3, 5]).unwrap();
            let dst = big.select(1, 1).unwrap();
            assert!(!dst.is_contiguous());
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: Some(&bias),
                    accumulate: false,
                    addend: None,
                    epilogue: &[],
                    dst: &dst,
                },
            )
            .unwrap();
            assert_close(
                &dst,
                &reference(&a, &b, Some(&bias)),
                tolerance(dt),
                &format!("select dst {dt:?}"),
            );
            for untouched in [0, 2] {
                let rest = big.select(1, untouched).unwrap().to_f32_vec().unwrap();
                assert!(
                    rest.iter().all(|v| v.is_nan()),
                    "gemm wrote outside its view"
                );
            }
            // a transposed destination
            let base = dev.allocate(0, dt, &[5, 4]).unwrap();
            let dst = base.permute(&[1, 0]).unwrap();
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: None,
                    accumulate: false,
                    addend: None,
                    epilogue: &[],
                    dst: &dst,
                },
            )
            .unwrap();
            assert_close(
                &dst,
                &reference(&a, &b, None),
                tolerance(dt),
                &format!("transposed dst {dt:?}"),
            );
        }
    }

    #[test]
    fn degenerate_sizes() {
        let dev = CpuDevice::new(0);
        for dt in DTYPES {
            for (m, k, n) in [(1, 7, 5), (4, 1, 3), (3, 6, 1), (1, 1, 1)] {
                let (a, b) = (
                    Tensor::randn(&[m, k], dt, 20),
                    Tensor::randn(&[k, n], dt, 21),
                );
                check(&a, &b, None, dt, &format!("m{m} k{k} n{n} {dt:?}"));
            }
            // K = 0: zeros plus bias
            let (a, b) = (Tensor::zeros(&[3, 0], dt), Tensor::zeros(&[0, 2], dt));
            let bias = Tensor::from_f32(&[2], &[1.5, -2.0], dt).unwrap();
            let dst = check(&a, &b, Some(&bias), dt, &format!("k0 {dt:?}"));
            assert_eq!(dst.to_f32_vec().unwrap(), [1.5, -2.0].repeat(3));
            // M = 0 or an empty batch: nothing to do
            let dst = Tensor::zeros(&[0, 2], dt);
            let (a, b) = (Tensor::zeros(&[0, 4], dt), Tensor::zeros(&[4, 2], dt));
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: None,
                    accumulate: false,
                    addend: None,
                    epilogue: &[],
                    dst: &dst,
                },
            )
            .unwrap();
            let (a, b) = (Tensor::zeros(&[0, 3, 4], dt), Tensor::zeros(&[0, 4, 2], dt));
            let dst = Tensor::zeros(&[0, 3, 2], dt);
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: None,
                    accumulate: false,
                    addend: None,
                    epilogue: &[],
                    dst: &dst,
                },
            )
            .unwrap();
        }
    }

    #[test]
    fn rejects_mismatched_shapes() {
        let dev = CpuDevice::new(0);
        let t = |s: &[usize]| Tensor::zeros(s, DType::F32);
        let run = |a: &[usize], b: &[usize], bias: Option<&[usize]>, d: &[usize]| {
            let bias = bias.map(t);
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &t(a),
                    b: &t(b),
                    bias: bias.as_ref(),
                    accumulate: false,
                    addend: None,
                    epilogue: &[],
                    dst: &t(d),
                },
            )
            .map_err(|e| e.to_string())
        };
        assert!(run(&[2, 3], &[3, 4], Some(&[4]), &[2, 4]).is_ok());
        let err = run(&[2, 3], &[5, 4], None, &[2, 4]).unwrap_err();
        assert!(err.contains("K = 3") && err.contains("K = 5"), "{err}");
        let err = run(&[2, 2, 3], &[3, 3, 4], None, &[2, 2, 4]).unwrap_err();
        assert!(
            err.contains("batch axis 0") && err.contains("b has 3"),
            "{err}"
        );
        assert!(run(&[3], &[3, 4], None, &[4]).unwrap_err().contains("rank"));
        assert!(run(&[1, 2, 3], &[3, 4], None, &[1, 2, 4])
            .unwrap_err()
            .contains("rank"));
        assert!(run(&[2, 3], &[3, 4], None, &[4, 2])
            .unwrap_err()
            .contains("[M, N] = [2, 4]"));
        assert!(run(&[2, 3], &[3, 4], Some(&[3]), &[2, 4])
            .unwrap_err()
            .contains("bias"));
        assert!(run(&[2, 3], &[3, 4], Some(&[1, 4]), &[2, 4])
            .unwrap_err()
            .contains("bias"));
    }

    #[test]
    fn epilogues_apply_in_f32_after_the_bias() {
        let dev = CpuDevice::new(0);
        let (a, b) = (
            Tensor::randn(&[4, 6], DType::BF16, 7),
            Tensor::randn(&[6, 5], DType::BF16, 8),
        );
        let bias = Tensor::randn(&[5], DType::BF16, 9);
        let ops = [UnaryOp::GeluTanh, UnaryOp::Silu];
        let dst = dev.allocate(0, DType::F32, &[4, 5]).unwrap();
        let run = |accumulate: bool, dst: &Tensor| {
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: Some(&bias),
                    accumulate,
                    addend: None,
                    epilogue: &ops,
                    dst,
                },
            )
        };
        run(false, &dst).unwrap();
        let want: Vec<f64> = reference(&a, &b, Some(&bias))
            .iter()
            .map(|&v| ops.iter().fold(v, |x, op| op.apply_f64(x)))
            .collect();
        let got = dst.to_f32_vec().unwrap();
        for (g, w) in got.iter().zip(&want) {
            assert!((f64::from(*g) - w).abs() < 1e-5, "{g} vs {w}");
        }
        assert!(run(true, &dst).is_err(), "no epilogue on a running sum");
    }

    #[test]
    fn a_running_sum_is_finished_into_another_buffer() {
        let dev = CpuDevice::new(0);
        let (a, b) = (
            Tensor::randn(&[3, 4], DType::F32, 1),
            Tensor::randn(&[4, 5], DType::F32, 2),
        );
        let held = Tensor::randn(&[3, 5], DType::F32, 3);
        let dst = dev.allocate(0, DType::F32, &[3, 5]).unwrap();
        let gemm = |accumulate, addend: &Tensor| {
            dev.execute(
                0,
                Kernel::Gemm {
                    a: &a,
                    b: &b,
                    bias: None,
                    accumulate,
                    addend: Some(addend),
                    epilogue: &[],
                    dst: &dst,
                },
            )
        };
        gemm(true, &held).unwrap();
        let want: Vec<f64> = reference(&a, &b, None)
            .iter()
            .zip(values(&held))
            .map(|(p, h)| p + h)
            .collect();
        assert_close(&dst, &want, 1e-5, "dst = addend + a @ b");
        assert_eq!(
            values(&held),
            values(&Tensor::randn(&[3, 5], DType::F32, 3)),
            "the addend is only read"
        );
        let err = gemm(false, &held).unwrap_err().to_string();
        assert!(err.contains("addend needs accumulate"), "{err}");
        let err = gemm(true, &Tensor::randn(&[5, 3], DType::F32, 4))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[5, 3]") && err.contains("[3, 5]"), "{err}");
    }
}
