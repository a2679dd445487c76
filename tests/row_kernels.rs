//! Normalizations as one kernel: a reduction over the trailing axes, the elementwise ops
//! before it and the ops reading its broadcast after it form one segment
//! (`FuseElementwise`), which the runtime runs as a row program. Checked on 1, 2, 3, 4 and
//! 8 simulated devices (and on GPUs with `FUSION_BACKEND=cuda`, `scripts/gpu.sh check`):
//! the fused program gives exactly the values of the unfused one (on GPUs within rounding) and
//! matches an f64 reference; the fused norm is one launch and keeps its sum in registers;
//! segments whose reductions do not fit (not over trailing axes, a broadcast of the sum
//! read elsewhere) still compute the same values; and what ends a row segment.

// The typed entry points are not called: the tests run each `build()`.
#![allow(dead_code)]

mod common;

use common::{device_counts, run, tolerance_for, Give, Take};
use fusion::compiler::hir::{for_each_node, HostProgram, Node};
use fusion::compiler::ir::{Fusion, Op};
use fusion::compiler::lower::{lower, LowerOptions};
use fusion::prelude::*;
use fusion::runtime::tensor::round_to;
use fusion::ExecOptions;

fusion! {
    /// The decode step's residual add and RMSNorm, then a projection and the residual:
    /// y = x + r, yn = y * rsqrt(sum(y^2 + eps)) * w in f32, out = y + yn p; each rank its
    /// block of rows. The norm's kernel writes y (read again after the GEMM) and yn.
    fn add_rms_norm<d, m, h>(
        x: Tensor<bf16, [d @ DIDx, m, h]>,
        r: Tensor<bf16, [d @ DIDx, m, h]>,
        w: Tensor<f32, [h]>,
        eps: Tensor<f32, [h]>,
        p: Tensor<bf16, [h, h]>,
    ) -> Tensor<bf16, [d @ DIDx, m, h]> {
        let y = x + r;
        let yf = cast(y, f32);
        let e: Tensor<f32, [1, 1, h]> = broadcast(broadcast(eps, [true, false]), [true, false, false]);
        let squares: Tensor<f32, [d @ DIDx, m]> = sum(yf * yf + e, 2);
        let s: Tensor<f32, [d @ DIDx, m, 1]> = broadcast(squares, [false, false, true]);
        let wb: Tensor<f32, [1, 1, h]> = broadcast(broadcast(w, [true, false]), [true, false, false]);
        let yn = cast(yf * rsqrt(s) * wb, bf16);
        y + matmul(yn, p)
    }

    /// Softmax over the last axis: max, exponentials, sum, division (three passes).
    fn softmax<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let top: Tensor<f32, [m, 1]> = broadcast(max(x, 1), [false, true]);
        let e = exp(x - top);
        let total: Tensor<f32, [m, 1]> = broadcast(sum(e, 1), [false, true]);
        e / total
    }

    /// Layer norm without affine: the mean, then the variance around it.
    fn layer_norm<m, n>(x: Tensor<f32, [m, n]>, inv_n: Tensor<f32, [n]>) -> Tensor<f32, [m, n]> {
        let scale: Tensor<f32, [1, n]> = broadcast(inv_n, [true, false]);
        let mean: Tensor<f32, [m, 1]> = broadcast(sum(x * scale, 1), [false, true]);
        let c = x - mean;
        let var: Tensor<f32, [m, 1]> = broadcast(sum(c * c * scale, 1), [false, true]);
        c * rsqrt(var)
    }

    /// The broadcast sum of squares read by a GEMM outside the norm's segment: the segment
    /// cannot be one row kernel (the broadcast is a view of the sum) and runs op by op.
    fn scaled_by_gemm<m, n>(x: Tensor<f32, [m, n]>, ones: Tensor<f32, [1, n]>) -> Tensor<f32, [m, n]> {
        let s: Tensor<f32, [m, 1]> = broadcast(sum(x * x, 1), [false, true]);
        matmul(s, ones) + x
    }

    /// `rsqrt` of the sum itself (not of its broadcast): a new run starts at it.
    fn rsqrt_of_the_sum<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let r: Tensor<f32, [m, 1]> = broadcast(rsqrt(sum(x * x, 1)), [false, true]);
        x * r
    }

    /// Five norms in a chain: four reductions a segment at most. (Divided, so the values
    /// stay finite: a row times its sum of squares five times over overflows f32.)
    fn five_norms<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let y1 = x / broadcast(sum(x * x, 1), [false, true]);
        let y2 = y1 / broadcast(sum(y1 * y1, 1), [false, true]);
        let y3 = y2 / broadcast(sum(y2 * y2, 1), [false, true]);
        let y4 = y3 / broadcast(sum(y3 * y3, 1), [false, true]);
        y4 / broadcast(sum(y4 * y4, 1), [false, true])
    }

    /// A row sum, then a sum over the last two axes of a value of the same run: other
    /// rows, so the second runs apart.
    fn two_row_shapes<b, m, n>(x: Tensor<f32, [b, m, n]>) -> Tensor<f32, [b]> {
        let y = x * broadcast(sum(x * x, 2), [false, false, true]);
        sum(y * y, [1, 2])
    }

    /// A row's sum of squares: the square and the sum in one kernel, the sum written out.
    fn row_squares<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m]> {
        sum(x * x, 1)
    }

    /// Column sums (a reduction over the leading axis): stays a reduction of its own.
    fn column_scale<m, n>(x: Tensor<f32, [m, n]>) -> Tensor<f32, [m, n]> {
        let c: Tensor<f32, [1, n]> = broadcast(sum(x * x, 0), [true, false]);
        x * c
    }
}

fn on_gpus() -> bool {
    std::env::var("FUSION_BACKEND").as_deref() == Ok("cuda")
}

fn unfused() -> ExecOptions {
    ExecOptions {
        lower: LowerOptions::default().without_pass("FuseElementwise"),
        ..ExecOptions::default()
    }
}

/// Segments of a program with a reduction among their ops, and reductions outside any.
fn row_segments(p: &HostProgram) -> (usize, usize) {
    let (mut fused, mut alone) = (0, 0);
    for_each_node(&p.body, &mut |n| match n {
        Node::Launch { segment, .. } => {
            let exprs = &p.segments[segment.index()].exprs;
            if exprs.iter().any(|e| matches!(e.op, Op::Reduction { .. })) {
                fused += 1;
            }
        }
        Node::Compute(e) if matches!(e.op, Op::Reduction { .. }) => alone += 1,
        _ => {}
    });
    (fused, alone)
}

/// Runs `f` fused and unfused on every device count; returns the fused runs' outputs
/// (assembled) after checking that both runs give the same bits, that the fused program
/// has `expect_segments` (segments with reductions, reductions alone), and that it kept
/// its intermediates out of memory (`row_kernel`: a row program ran) or allocated them all
/// (its segments ran op by op).
fn same_as_unfused(
    f: &Fusion,
    inputs: &dyn Fn(usize) -> Vec<(Tensor, Give)>,
    takes: &[Take],
    expect_segments: (usize, usize),
    row_kernel: bool,
) -> Vec<(usize, Vec<Tensor>)> {
    let mut out = Vec::new();
    for d in device_counts() {
        let ins = inputs(d);
        let fused = run(f, d, &ins, takes, &ExecOptions::default());
        let plain = run(f, d, &ins, takes, &unfused());
        assert_eq!(row_segments(&fused.program), expect_segments, "d = {d}");
        assert_eq!(row_segments(&plain.program).0, 0);
        let (a, b) = (
            fused.stats[0].allocated_bytes,
            plain.stats[0].allocated_bytes,
        );
        if row_kernel {
            assert!(a < b, "d = {d}: fused {a} bytes against unfused {b}");
        } else {
            assert_eq!(a, b, "d = {d}");
        }
        for (a, b) in fused.outputs.iter().zip(&plain.outputs) {
            if on_gpus() {
                // A warp sums a short row in another order than the reduction kernel.
                let e = a.rel_error(b).unwrap();
                assert!(e <= tolerance_for(a.dtype()), "d = {d}: {e:.3e}");
            } else {
                assert_eq!(a.to_f32_vec().unwrap(), b.to_f32_vec().unwrap(), "d = {d}");
            }
        }
        out.push((d, fused.outputs));
    }
    out
}

#[test]
fn an_add_rms_norm_is_one_kernel_with_the_unfused_values() {
    let f = add_rms_norm::build().unwrap();
    let (m, h) = (3, 300);
    let w = Tensor::randn(&[h], DType::F32, 7);
    let eps = Tensor::from_f32(&[h], &vec![1e-5 / h as f32; h], DType::F32).unwrap();
    let p = Tensor::randn(&[h, h], DType::BF16, 8);
    let inputs = |d: usize| {
        vec![
            (
                Tensor::randn(&[d, m, h], DType::BF16, 1 + d as u64),
                Give::Shard(0),
            ),
            (
                Tensor::randn(&[d, m, h], DType::BF16, 2 + d as u64),
                Give::Shard(0),
            ),
            (w.clone(), Give::Whole),
            (eps.clone(), Give::Whole),
            (p.clone(), Give::Whole),
        ]
    };
    let runs = same_as_unfused(&f, &inputs, &[Take::Sharded(0)], (1, 0), true);
    let (wv, pv) = (w.to_f32_vec().unwrap(), p.to_f32_vec().unwrap());
    for (d, outs) in runs {
        let ins = inputs(d);
        let (x, r) = (
            ins[0].0.to_f32_vec().unwrap(),
            ins[1].0.to_f32_vec().unwrap(),
        );
        let out = outs[0].to_f32_vec().unwrap();
        for row in 0..d * m {
            let ys: Vec<f64> = (0..h)
                .map(|c| round_to(DType::BF16, x[row * h + c] + r[row * h + c]) as f64)
                .collect();
            let s: f64 = ys.iter().map(|v| v * v + 1e-5 / h as f64).sum();
            let yn: Vec<f64> = (0..h).map(|c| ys[c] / s.sqrt() * wv[c] as f64).collect();
            for c in 0..h {
                let dot: f64 = (0..h).map(|k| yn[k] * pv[k * h + c] as f64).sum();
                let want = ys[c] + dot;
                let got = out[row * h + c] as f64;
                assert!(
                    (got - want).abs() <= 2e-2 * (want.abs() + 1.0),
                    "d = {d}, {row},{c}: {got} against {want}"
                );
            }
        }
    }
}

#[test]
fn a_softmax_is_one_kernel_of_three_passes() {
    let f = softmax::build().unwrap();
    let (m, n) = (5, 70);
    let x = Tensor::randn(&[m, n], DType::F32, 11);
    let inputs = |_| vec![(x.clone(), Give::Whole)];
    let runs = same_as_unfused(&f, &inputs, &[Take::Replicated], (1, 0), true);
    let xv = x.to_f32_vec().unwrap();
    for (_, outs) in runs {
        let p = outs[0].to_f32_vec().unwrap();
        for row in 0..m {
            let xs = &xv[row * n..(row + 1) * n];
            let top = xs.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let total: f64 = xs.iter().map(|&v| (v as f64 - top).exp()).sum();
            for c in 0..n {
                let want = (xs[c] as f64 - top).exp() / total;
                assert!((p[row * n + c] as f64 - want).abs() <= 1e-6, "{row},{c}");
            }
        }
    }
}

#[test]
fn a_layer_norm_writes_a_reduction_and_a_column_sum_stays_apart() {
    let (m, n) = (4, 33);
    let x = Tensor::randn(&[m, n], DType::F32, 21);
    let inv = Tensor::from_f32(&[n], &vec![1.0 / n as f32; n], DType::F32).unwrap();
    let f = layer_norm::build().unwrap();
    let inputs = |_| vec![(x.clone(), Give::Whole), (inv.clone(), Give::Whole)];
    let runs = same_as_unfused(&f, &inputs, &[Take::Replicated], (1, 0), true);
    let xv = x.to_f32_vec().unwrap();
    let rows: Vec<Vec<f64>> = (0..m)
        .map(|r| xv[r * n..(r + 1) * n].iter().map(|&v| v as f64).collect())
        .collect();
    for (_, outs) in runs {
        let y = outs[0].to_f32_vec().unwrap();
        for (row, xs) in rows.iter().enumerate() {
            let mean = xs.iter().sum::<f64>() / n as f64;
            let var = xs.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
            for c in 0..n {
                let want = (xs[c] - mean) / var.sqrt();
                assert!((y[row * n + c] as f64 - want).abs() <= 1e-4, "{row},{c}");
            }
        }
    }
    let f = row_squares::build().unwrap();
    let inputs = |_| vec![(x.clone(), Give::Whole)];
    for (_, outs) in same_as_unfused(&f, &inputs, &[Take::Replicated], (1, 0), true) {
        let sq = outs[0].to_f32_vec().unwrap();
        for (row, xs) in rows.iter().enumerate() {
            let want: f64 = xs.iter().map(|v| v * v).sum();
            assert!((sq[row] as f64 - want).abs() <= 1e-5 * want, "row {row}");
        }
    }
    // A reduction over the leading axis is no row's: the product reads it in a kernel of
    // its own, as before.
    let f = column_scale::build().unwrap();
    let inputs = |_| vec![(x.clone(), Give::Whole)];
    same_as_unfused(&f, &inputs, &[Take::Replicated], (0, 1), false);
}

#[test]
fn a_sum_whose_broadcast_a_gemm_reads_runs_op_by_op() {
    let f = scaled_by_gemm::build().unwrap();
    let (m, n) = (3, 20);
    let x = Tensor::randn(&[m, n], DType::F32, 31);
    let ones = Tensor::from_f32(&[1, n], &vec![1.0; n], DType::F32).unwrap();
    let inputs = |_| vec![(x.clone(), Give::Whole), (ones.clone(), Give::Whole)];
    let xv = x.to_f32_vec().unwrap();
    for (_, outs) in same_as_unfused(&f, &inputs, &[Take::Replicated], (1, 0), false) {
        let y = outs[0].to_f32_vec().unwrap();
        for row in 0..m {
            let s: f64 = (0..n).map(|c| (xv[row * n + c] as f64).powi(2)).sum();
            for c in 0..n {
                let want = xv[row * n + c] as f64 + s;
                assert!((y[row * n + c] as f64 - want).abs() <= 1e-5 * (want.abs() + 1.0));
            }
        }
    }
}

/// Reductions per segment with a reduction, in program order.
fn reductions_per_segment(f: &Fusion) -> Vec<usize> {
    let p = lower(f, 1, &LowerOptions::default()).unwrap().program;
    let mut per = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Launch { segment, .. } = n {
            let exprs = &p.segments[segment.index()].exprs;
            let k = (exprs.iter())
                .filter(|e| matches!(e.op, Op::Reduction { .. }))
                .count();
            if k > 0 {
                per.push(k);
            }
        }
    });
    per
}

#[test]
fn what_ends_a_row_segment() {
    // An op reading the sum itself: the square and the sum are one segment, the rest
    // another run.
    assert_eq!(
        reductions_per_segment(&rsqrt_of_the_sum::build().unwrap()),
        vec![1]
    );
    // At most four reductions a segment.
    assert_eq!(
        reductions_per_segment(&five_norms::build().unwrap()),
        vec![4, 1]
    );
    // A reduction over other rows does not join: it runs alone.
    assert_eq!(
        reductions_per_segment(&two_row_shapes::build().unwrap()),
        vec![1]
    );
    let x = Tensor::randn(&[2, 3, 10], DType::F32, 41);
    let f = two_row_shapes::build().unwrap();
    let inputs = |_| vec![(x.clone(), Give::Whole)];
    same_as_unfused(&f, &inputs, &[Take::Replicated], (1, 1), true);
    let y = Tensor::randn(&[3, 10], DType::F32, 42);
    let inputs = |_| vec![(y.clone(), Give::Whole)];
    for f in [
        five_norms::build().unwrap(),
        rsqrt_of_the_sum::build().unwrap(),
    ] {
        let n = reductions_per_segment(&f).len();
        for (d, outs) in same_as_unfused(&f, &inputs, &[Take::Replicated], (n, 0), true) {
            let v = outs[0].to_f32_vec().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "d = {d}: {v:?}");
        }
    }
}
