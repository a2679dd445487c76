//! Reduction kernel: sum or max over a set of axes, accumulated in f64.

use fusion_compiler::ir::ReduceOp;

use crate::error::Result;
use crate::tensor::{contiguous_strides, for_each_offset, Tensor};

use super::check::{cpu_err, require_host};

/// `dst = op` over `axes` of `src`; dst's shape is src's with those axes removed.
///
/// An empty reduced extent yields `op.init()` (0 for sum, -inf for max).
pub(super) fn reduce(op: ReduceOp, src: &Tensor, dst: &Tensor, axes: &[usize]) -> Result<()> {
    require_host(src, "reduce: the source")?;
    require_host(dst, "reduce: the destination")?;
    let rank = src.rank();
    let mut reduced = vec![false; rank];
    for &a in axes {
        if a >= rank {
            return Err(cpu_err(format!(
                "reduce: axis {a} is out of range for source shape {:?}",
                src.shape()
            )));
        }
        if std::mem::replace(&mut reduced[a], true) {
            return Err(cpu_err(format!(
                "reduce: axis {a} is listed twice in {axes:?}"
            )));
        }
    }
    let kept: Vec<usize> = (0..rank)
        .filter(|&i| !reduced[i])
        .map(|i| src.shape()[i])
        .collect();
    if dst.shape() != kept.as_slice() {
        return Err(cpu_err(format!(
            "reduce: reducing axes {axes:?} of shape {:?} gives shape {kept:?}, but the destination has shape {:?}",
            src.shape(),
            dst.shape()
        )));
    }

    // Destination strides laid over the source's axes (0 on reduced axes): walking the
    // source in row-major order with them yields each element's accumulator index.
    let dst_strides = contiguous_strides(&kept);
    let mut kept_strides = dst_strides.iter();
    let acc_strides: Vec<isize> = reduced
        .iter()
        .map(|&r| {
            if r {
                0
            } else {
                *kept_strides.next().unwrap_or(&0)
            }
        })
        .collect();

    let values = src.to_f32_vec()?;
    let mut acc = vec![op.init(); dst.numel()];
    let mut it = values.iter();
    for_each_offset(src.shape(), &acc_strides, 0, |o| {
        if let Some(&v) = it.next() {
            acc[o] = op.combine(acc[o], v as f64);
        }
    });
    let out: Vec<f32> = acc.iter().map(|&v| v as f32).collect();
    dst.write_f32(&out)
}

#[cfg(test)]
mod tests {
    use fusion_compiler::DType;

    use super::super::testutil::{assert_close, tolerance, values, DTYPES};
    use super::*;
    use crate::backend::cpu::CpuDevice;
    use crate::device::{Device, Kernel};

    /// Naive reference over a `[3, 4, 5]` source, in f64.
    fn reference(op: ReduceOp, x: &[f64], shape: [usize; 3], axes: &[usize]) -> Vec<f64> {
        let keep: Vec<usize> = (0..3).filter(|a| !axes.contains(a)).collect();
        let out_shape: Vec<usize> = keep.iter().map(|&a| shape[a]).collect();
        let mut out = vec![op.init(); out_shape.iter().product()];
        for i in 0..shape[0] {
            for j in 0..shape[1] {
                for k in 0..shape[2] {
                    let idx = [i, j, k];
                    let o = keep.iter().fold(0, |acc, &a| acc * shape[a] + idx[a]);
                    let v = x[(i * shape[1] + j) * shape[2] + k];
                    out[o] = match op {
                        ReduceOp::Sum => out[o] + v,
                        ReduceOp::Max => out[o].max(v),
                    };
                }
            }
        }
        out
    }

    #[test]
    fn sum_and_max_over_one_and_two_axes() {
        let dev = CpuDevice::new(0);
        let shape = [3, 4, 5];
        for dt in DTYPES {
            let x = Tensor::randn(&shape, dt, 21);
            let xv = values(&x);
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                for axes in [&[1][..], &[2, 0][..], &[0][..]] {
                    let out_shape: Vec<usize> = (0..3)
                        .filter(|a| !axes.contains(a))
                        .map(|a| shape[a])
                        .collect();
                    let dst = dev.allocate(0, dt, &out_shape).unwrap();
                    dev.execute(
                        0,
                        Kernel::Reduce {
                            op,
                            src: &x,
                            dst: &dst,
                            axes,
                        },
                    )
                    .unwrap();
                    let r = reference(op, &xv, shape, axes);
                    assert_close(
                        &dst,
                        &r,
                        tolerance(dt),
                        &format!("{op:?} over {axes:?} in {dt:?}"),
                    );
                }
            }
        }
    }

    #[test]
    fn strided_source_and_destination() {
        let dev = CpuDevice::new(0);
        // source: [5, 4, 3] permuted to [3, 4, 5]; destination: a column of a [3, 2] tensor
        let base = Tensor::randn(&[5, 4, 3], DType::F32, 4);
        let x = base.permute(&[2, 1, 0]).unwrap();
        let big = dev.allocate(0, DType::F32, &[3, 2]).unwrap();
        let dst = big.select(1, 1).unwrap();
        dev.execute(
            0,
            Kernel::Reduce {
                op: ReduceOp::Sum,
                src: &x,
                dst: &dst,
                axes: &[1, 2],
            },
        )
        .unwrap();
        let r = reference(ReduceOp::Sum, &values(&x), [3, 4, 5], &[1, 2]);
        assert_close(&dst, &r, 1e-5, "strided");
        assert!(big
            .select(1, 0)
            .unwrap()
            .to_f32_vec()
            .unwrap()
            .iter()
            .all(|v| v.is_nan()));
    }

    #[test]
    fn empty_extent_gives_identity() {
        let dev = CpuDevice::new(0);
        let x = Tensor::zeros(&[3, 0], DType::F32);
        for (op, want) in [(ReduceOp::Sum, 0.0), (ReduceOp::Max, f32::NEG_INFINITY)] {
            let dst = dev.allocate(0, DType::BF16, &[3]).unwrap();
            dev.execute(
                0,
                Kernel::Reduce {
                    op,
                    src: &x,
                    dst: &dst,
                    axes: &[1],
                },
            )
            .unwrap();
            assert_eq!(dst.to_f32_vec().unwrap(), vec![want; 3]);
        }
        // reducing no axes is a copy; reducing every axis gives a scalar
        let x = Tensor::randn(&[2, 3], DType::F32, 3);
        let dst = Tensor::zeros(&[2, 3], DType::F32);
        dev.execute(
            0,
            Kernel::Reduce {
                op: ReduceOp::Sum,
                src: &x,
                dst: &dst,
                axes: &[],
            },
        )
        .unwrap();
        assert_eq!(values(&dst), values(&x));
        let s = Tensor::zeros(&[], DType::F32);
        dev.execute(
            0,
            Kernel::Reduce {
                op: ReduceOp::Max,
                src: &x,
                dst: &s,
                axes: &[0, 1],
            },
        )
        .unwrap();
        assert_eq!(
            values(&s)[0],
            values(&x).into_iter().fold(f64::NEG_INFINITY, f64::max)
        );
    }

    #[test]
    fn rejects_bad_axes_and_shapes() {
        let dev = CpuDevice::new(0);
        let x = Tensor::zeros(&[3, 4, 5], DType::F32);
        let dst = Tensor::zeros(&[3, 5], DType::F32);
        let run = |axes: &[usize], dst: &Tensor| {
            dev.execute(
                0,
                Kernel::Reduce {
                    op: ReduceOp::Sum,
                    src: &x,
                    dst,
                    axes,
                },
            )
            .map_err(|e| e.to_string())
        };
        assert!(run(&[1], &dst).is_ok());
        assert!(run(&[3], &dst).unwrap_err().contains("out of range"));
        assert!(run(&[1, 1], &dst).unwrap_err().contains("twice"));
        let err = run(&[0], &dst).unwrap_err();
        assert!(err.contains("[4, 5]") && err.contains("[3, 5]"), "{err}");
    }
}
