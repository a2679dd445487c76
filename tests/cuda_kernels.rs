//! The CUDA backend's kernels against the CPU backend's, on strided views and every dtype.
//!
//! These need a GPU, so they are `#[ignore]`d (shown as ignored, not passed, where there is
//! none); `scripts/gpu.sh check` runs them with `--ignored`.

use fusion::compiler::ir::{BinaryOp, ReduceOp, UnaryOp};
use fusion::runtime::backend::cpu::CpuDevice;
use fusion::runtime::backend::cuda::cuda_world;
use fusion::runtime::backend::cuda::{check_libraries, device_count, driver_present};
use fusion::runtime::backend::{
    Device, Kernel, PointwiseInstr, PointwiseProgram, RowInstr, RowProgram,
};
use fusion::{DType, Error, Rank, Result, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn tol(dt: DType) -> f64 {
    if dt == DType::F32 {
        1e-5
    } else {
        1e-2
    }
}

/// Moves a host tensor to the device under test.
type Upload<'a> = &'a dyn Fn(&Tensor) -> Result<Tensor>;
/// Builds and runs kernels on a device; returns the tensors to compare.
type Build<'a> = &'a dyn Fn(&dyn Device, Upload<'_>) -> Result<Vec<Tensor>>;

/// Runs `build` on the CPU device and on GPU 0 and compares the named outputs.
fn compare(rank: &Rank, what: &str, dt: DType, build: Build<'_>) -> Result<()> {
    compare_within(rank, what, dt, tol(dt), build)
}

/// [`compare`] with a given relative-error tolerance.
fn compare_within(rank: &Rank, what: &str, dt: DType, tol: f64, build: Build<'_>) -> Result<()> {
    let cpu = CpuDevice::new(0);
    let on_cpu = build(&cpu, &|t| Ok(t.clone()))?;
    let on_gpu = build(rank.device(), &|t| rank.to_device(t))?;
    for (c, g) in on_cpu.iter().zip(&on_gpu) {
        let g = rank.to_host(g)?;
        let e = g.rel_error(c)?;
        assert!(e < tol, "{what} ({dt}): relative error {e:.3e}");
    }
    Ok(())
}

fn gpu_rank_run(f: impl Fn(&Rank) -> Result<()> + Sync) {
    assert!(
        device_count() > 0,
        "no CUDA GPU is visible: these tests need one"
    );
    cuda_world(Some(1)).unwrap().run(f).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn copy_and_pointwise_match_the_cpu_backend() {
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let x = Tensor::randn(&[6, 5, 7], dt, 1);
            compare(rank, "transposed copy with dtype change", dt, &|dev, up| {
                let src = up(&x)?.permute(&[2, 0, 1])?;
                let dst = dev.allocate(0, DType::F32, src.shape())?;
                dev.execute(
                    0,
                    Kernel::Copy {
                        src: &src,
                        dst: &dst,
                    },
                )?;
                Ok(vec![dst])
            })?;
            let y = Tensor::randn(&[1, 5, 1], dt, 2);
            compare(rank, "fused pointwise with broadcast", dt, &|dev, up| {
                let a = up(&x)?;
                let b = up(&y)?.expand(&[6, 5, 7])?;
                let o1 = dev.allocate(0, dt, &[6, 5, 7])?;
                let o2 = dev.allocate(0, DType::F32, &[6, 5, 7])?;
                let prog = PointwiseProgram {
                    shape: vec![6, 5, 7],
                    inputs: vec![a, b],
                    instrs: vec![
                        PointwiseInstr::Binary(BinaryOp::Add, 0, 1),
                        PointwiseInstr::Unary(UnaryOp::Gelu, 2),
                        PointwiseInstr::Round(DType::BF16, 3),
                        PointwiseInstr::Binary(BinaryOp::Max, 4, 1),
                        PointwiseInstr::Unary(UnaryOp::Sigmoid, 5),
                    ],
                    outputs: vec![(o1.clone(), 5), (o2.clone(), 6)],
                };
                dev.execute(0, Kernel::Pointwise(&prog))?;
                Ok(vec![o1, o2])
            })?;
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn every_unary_op_and_derivative_matches_the_cpu_backend() {
    // Square roots and their derivatives read exp(x) (positive, away from 0); the others
    // read x itself, over a range where every op (and every derivative) varies.
    let positive_only = [
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::SqrtGrad,
        UnaryOp::RsqrtGrad,
    ];
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let x = Tensor::randn(&[4, 9, 33], dt, 11);
            for op in UnaryOp::ALL {
                let operand = if positive_only.contains(&op) { 1 } else { 0 };
                compare(rank, op.name(), dt, &|dev, up| {
                    let out = dev.allocate(0, dt, &[4, 9, 33])?;
                    let prog = PointwiseProgram {
                        shape: vec![4, 9, 33],
                        inputs: vec![up(&x)?],
                        instrs: vec![
                            PointwiseInstr::Unary(UnaryOp::Exp, 0),
                            PointwiseInstr::Unary(op, operand),
                        ],
                        outputs: vec![(out.clone(), 2)],
                    };
                    dev.execute(0, Kernel::Pointwise(&prog))?;
                    Ok(vec![out])
                })?;
            }
        }
        Ok(())
    });
}

/// `y = x + r` (written), `s = sum(y * y)` (written per row), `y * rsqrt(s) * w` rounded
/// to `dt`, on rows of `[a, b]` and elements of `n` (a warp walks rows of up to 256
/// elements, a block longer ones), `x` a transposed view.
fn add_norm_program(
    dt: DType,
    x: &Tensor,
    r: &Tensor,
    w: &Tensor,
    outs: [&Tensor; 3],
) -> RowProgram {
    let shape = x.shape().to_vec();
    let rows = shape[..2].to_vec();
    RowProgram {
        rows,
        row: shape[2..].to_vec(),
        inputs: vec![x.clone(), r.clone(), w.expand(&shape).unwrap()],
        instrs: vec![
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Add, 0, 1)), // 3
            RowInstr::Pointwise(PointwiseInstr::Round(dt, 3)),                // 4: y
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 4, 4)), // 5
            RowInstr::Reduce(ReduceOp::Sum, 5, DType::F32),                   // 6: s
            RowInstr::Pointwise(PointwiseInstr::Unary(UnaryOp::Rsqrt, 6)),    // 7
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 4, 7)), // 8
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Mul, 8, 2)), // 9
            RowInstr::Reduce(ReduceOp::Max, 9, dt),                           // 10
            RowInstr::Pointwise(PointwiseInstr::Binary(BinaryOp::Sub, 9, 10)), // 11
        ],
        outputs: vec![(outs[0].clone(), 4), (outs[1].clone(), 11)],
        row_outputs: vec![(outs[2].clone(), 6)],
    }
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn row_programs_match_the_cpu_backend() {
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            for n in [37, 256, 4096] {
                let (a, b) = (3, 5);
                let x = Tensor::randn(&[b, a, n], dt, 5);
                let r = Tensor::randn(&[a, b, n], dt, 6);
                let w = Tensor::randn(&[n], DType::F32, 7);
                compare(rank, "add + rms norm + max rows", dt, &|dev, up| {
                    let xt = up(&x)?.permute(&[1, 0, 2])?;
                    let outs = [
                        dev.allocate(0, dt, &[a, b, n])?,
                        dev.allocate(0, dt, &[a, b, n])?,
                        dev.allocate(0, DType::F32, &[a, b])?,
                    ];
                    let prog = add_norm_program(
                        dt,
                        &xt,
                        &up(&r)?,
                        &up(&w)?,
                        [&outs[0], &outs[1], &outs[2]],
                    );
                    dev.execute(0, Kernel::Rows(&prog))?;
                    Ok(outs.to_vec())
                })?;
            }
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn reductions_match_the_cpu_backend() {
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let x = Tensor::randn(&[5, 7, 9], dt, 3);
            for (op, axes) in [
                (ReduceOp::Sum, vec![0, 2]),
                (ReduceOp::Max, vec![1]),
                (ReduceOp::Sum, vec![0, 1, 2]),
            ] {
                compare(rank, "reduce", dt, &|dev, up| {
                    let src = up(&x)?.permute(&[1, 0, 2])?;
                    let shape: Vec<usize> = (0..3)
                        .filter(|d| !axes.contains(d))
                        .map(|d| src.shape()[d])
                        .collect();
                    let dst = dev.allocate(0, dt, &shape)?;
                    dev.execute(
                        0,
                        Kernel::Reduce {
                            op,
                            src: &src,
                            dst: &dst,
                            axes: &axes,
                        },
                    )?;
                    Ok(vec![dst])
                })?;
            }
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn gemms_match_the_cpu_backend() {
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let a = Tensor::randn(&[3, 33, 17], dt, 4);
            let bt = Tensor::randn(&[3, 29, 17], dt, 5);
            let b1 = Tensor::randn(&[17, 29], dt, 6);
            let bias = Tensor::randn(&[29], dt, 7);
            compare(
                rank,
                "batched gemm, transposed b, bias, strided dst",
                dt,
                &|dev, up| {
                    let a = up(&a)?;
                    let b = up(&bt)?.permute(&[0, 2, 1])?;
                    let big = dev.allocate(0, dt, &[2, 3, 33, 29])?;
                    let dst = big.select(0, 1)?;
                    let bias = up(&bias)?;
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
                    )?;
                    Ok(vec![dst])
                },
            )?;
            compare(
                rank,
                "gemm with a broadcast batch operand",
                dt,
                &|dev, up| {
                    let a = up(&a)?;
                    let b = up(&b1)?.expand(&[3, 17, 29])?;
                    let dst = dev.allocate(0, dt, &[3, 33, 29])?;
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
                    )?;
                    Ok(vec![dst])
                },
            )?;
            compare(
                rank,
                "gemm with a transposed, non-unit-stride a",
                dt,
                &|dev, up| {
                    let big = up(&Tensor::randn(&[17, 66], dt, 8))?;
                    let a = big.narrow(1, 0, 33)?.permute(&[1, 0])?;
                    let b = up(&b1)?;
                    let dst = dev.allocate(0, dt, &[33, 29])?;
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
                    )?;
                    Ok(vec![dst])
                },
            )?;
        }
        Ok(())
    });
}

/// A GEMM enqueued again at the same pointers replays a one-GEMM graph (captured at its
/// second launch): fresh values in the same buffers at every launch must give fresh
/// results, with a bias, accumulating, accumulating from another buffer, and for every
/// dtype.
#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn gemms_relaunched_at_the_same_pointers_read_fresh_values() {
    /// How a launch adds to the product.
    #[derive(Clone, Copy, Debug)]
    enum Adds {
        Bias,
        Held,
        Addend,
    }
    fn gemm<'t>(ts: [&'t Tensor; 5], adds: Adds) -> Kernel<'t> {
        Kernel::Gemm {
            a: ts[0],
            b: ts[1],
            bias: matches!(adds, Adds::Bias).then_some(ts[2]),
            accumulate: !matches!(adds, Adds::Bias),
            addend: matches!(adds, Adds::Addend).then_some(ts[4]),
            epilogue: &[],
            dst: ts[3],
        }
    }
    gpu_rank_run(|rank| {
        let dev = rank.device();
        let cpu = CpuDevice::new(0);
        for dt in DTYPES {
            let (m, k, n) = (64, 96, 48);
            let a = dev.allocate(0, dt, &[m, k])?;
            let b = dev.allocate(0, dt, &[k, n])?;
            let bias = dev.allocate(0, dt, &[n])?;
            let d = dev.allocate(0, dt, &[m, n])?;
            let c = dev.allocate(0, dt, &[m, n])?;
            for launch in 0..9u64 {
                let (ha, hb, hbias, hd, hc) = (
                    Tensor::randn(&[m, k], dt, 100 + launch),
                    Tensor::randn(&[k, n], dt, 200 + launch),
                    Tensor::randn(&[n], dt, 300 + launch),
                    Tensor::randn(&[m, n], dt, 400 + launch),
                    Tensor::randn(&[m, n], dt, 500 + launch),
                );
                for (dst, src) in [(&a, &ha), (&b, &hb), (&bias, &hbias), (&d, &hd), (&c, &hc)] {
                    dev.execute(
                        0,
                        Kernel::Copy {
                            src: &rank.to_device(src)?,
                            dst,
                        },
                    )?;
                }
                // Each kind of launch comes three times: direct, captured, replayed.
                let adds = [Adds::Bias, Adds::Held, Adds::Addend][launch as usize % 3];
                dev.execute(0, gemm([&a, &b, &bias, &d, &c], adds))?;
                let expected = hd.clone();
                cpu.execute(0, gemm([&ha, &hb, &hbias, &expected, &hc], adds))?;
                let e = rank.to_host(&d)?.rel_error(&expected)?;
                assert!(
                    e < tol(dt),
                    "launch {launch} ({dt}, {adds:?}): relative error {e:.3e}"
                );
                let e = rank.to_host(&c)?.rel_error(&hc)?;
                assert!(
                    e == 0.0,
                    "launch {launch} ({dt}, {adds:?}) changed the addend"
                );
            }
        }
        Ok(())
    });
}

/// `dst = (addend or dst) + a @ b`, twice (the second launch from the cached plan).
fn accumulate_twice(
    dev: &dyn Device,
    a: &Tensor,
    b: &Tensor,
    addend: Option<&Tensor>,
    dst: &Tensor,
) -> Result<()> {
    for _ in 0..2 {
        dev.execute(
            0,
            Kernel::Gemm {
                a,
                b,
                bias: None,
                accumulate: true,
                addend,
                epilogue: &[],
                dst,
            },
        )?;
    }
    Ok(())
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn gemm_epilogues_match_the_cpu_backend() {
    // cuBLASLt epilogues (bias, relu, tanh-GELU, with and without bias), the fallback
    // kernel (silu, exact GELU, chains, a dtype the GEMM cannot store), running sums
    // (accumulate), transposed operands, and every call twice (the cached plan).
    use UnaryOp::{Gelu, GeluTanh, Relu, Silu, Tanh};
    let chains: [(bool, &[UnaryOp]); 8] = [
        (false, &[]),
        (true, &[]),
        (false, &[GeluTanh]),
        (true, &[GeluTanh]),
        (true, &[Relu]),
        (false, &[Silu]),
        (true, &[Gelu]),
        (false, &[Silu, Tanh]),
    ];
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let a = Tensor::randn(&[1, 48, 40], dt, 11);
            let b = Tensor::randn(&[56, 40], dt, 12);
            let bias = Tensor::randn(&[56], dt, 13);
            let held = Tensor::randn(&[48, 56], dt, 14);
            for (with_bias, ops) in chains {
                for out in [dt, DType::F32] {
                    let what = format!("gemm, bias {with_bias}, epilogue {ops:?}, into {out}");
                    compare_within(rank, &what, dt, tol(dt).max(1e-4), &|dev, up| {
                        let a = up(&a)?;
                        let b = up(&b)?.permute(&[1, 0])?.unsqueeze(0)?;
                        let bias = up(&bias)?;
                        let dst = dev.allocate(0, out, &[1, 48, 56])?;
                        for _ in 0..2 {
                            dev.execute(
                                0,
                                Kernel::Gemm {
                                    a: &a,
                                    b: &b,
                                    bias: with_bias.then_some(&bias),
                                    accumulate: false,
                                    addend: None,
                                    epilogue: ops,
                                    dst: &dst,
                                },
                            )?;
                        }
                        Ok(vec![dst])
                    })?;
                }
            }
            compare(
                rank,
                "gemm accumulating onto a running sum",
                dt,
                &|dev, up| {
                    let a = up(&a)?.select(0, 0)?;
                    let b = up(&b)?.permute(&[1, 0])?;
                    // A fresh copy: on the CPU `up` shares the host tensor's storage.
                    let start = up(&held)?;
                    let dst = dev.allocate(0, dt, start.shape())?;
                    dev.execute(
                        0,
                        Kernel::Copy {
                            src: &start,
                            dst: &dst,
                        },
                    )?;
                    accumulate_twice(dev, &a, &b, None, &dst)?;
                    Ok(vec![dst])
                },
            )?;
            // A running sum finished into another buffer: cuBLASLt reads C from the addend
            // (same strides as dst), else (other strides) the addend is copied first.
            for transposed in [false, true] {
                let what =
                    format!("gemm finishing a running sum elsewhere (transposed {transposed})");
                compare(rank, &what, dt, &|dev, up| {
                    let a = up(&a)?.select(0, 0)?;
                    let b = up(&b)?.permute(&[1, 0])?;
                    let addend = if transposed {
                        up(&held.permute(&[1, 0])?.contiguous_copy()?)?.permute(&[1, 0])?
                    } else {
                        up(&held)?
                    };
                    let dst = dev.allocate(0, dt, &[48, 56])?;
                    accumulate_twice(dev, &a, &b, Some(&addend), &dst)?;
                    Ok(vec![dst, addend])
                })?;
            }
        }
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA GPU; run with --ignored on a GPU machine"]
fn batched_gemms_with_outer_batch_axes_match_the_cpu_backend() {
    // Rank-4 GEMMs: cuBLAS's strided batch over the inner batch axis and a loop over the
    // outer one, whose offsets are in each operand's own element size. With an epilogue
    // or an f32 output the product is stored in f32 from bf16/f16 operands (the MLP block
    // without stream lowering on 2 devices read its second batch from wrong addresses).
    use UnaryOp::GeluTanh;
    gpu_rank_run(|rank| {
        for dt in DTYPES {
            let a = Tensor::randn(&[3, 2, 24, 40], dt, 21);
            let b = Tensor::randn(&[1, 2, 40, 32], dt, 22);
            for (ops, out) in [
                (&[][..], dt),
                (&[][..], DType::F32),
                (&[GeluTanh][..], dt),
                (&[GeluTanh][..], DType::F32),
            ] {
                let what = format!("batched gemm [3, 2], epilogue {ops:?}, into {out}");
                compare_within(rank, &what, dt, tol(dt).max(1e-4), &|dev, up| {
                    let a = up(&a)?;
                    // B broadcast over the outer axis (stride 0), as a gathered matmul has.
                    let b = up(&b)?.expand(&[3, 2, 40, 32])?;
                    let dst = dev.allocate(0, out, &[3, 2, 24, 32])?;
                    dev.execute(
                        0,
                        Kernel::Gemm {
                            a: &a,
                            b: &b,
                            bias: None,
                            accumulate: false,
                            addend: None,
                            epilogue: ops,
                            dst: &dst,
                        },
                    )?;
                    Ok(vec![dst])
                })?;
            }
        }
        Ok(())
    });
}

#[test]
fn missing_cuda_libraries_are_reported_with_a_fix() {
    if driver_present() {
        eprintln!("skipping: a CUDA driver is present (this checks the no-driver message)");
        return;
    }
    let err = check_libraries(true).unwrap_err();
    assert!(
        matches!(&err, Error::MissingLibrary { library, .. } if library.contains("libcuda")),
        "{err}"
    );
    assert!(err.to_string().contains("FUSION_BACKEND=cpu"), "{err}");
    let err = cuda_world(Some(1))
        .err()
        .expect("no CUDA world without a driver");
    assert!(matches!(err, Error::MissingLibrary { .. }), "{err}");
}
