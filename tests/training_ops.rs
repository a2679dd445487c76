//! The gradients of the tensor-parallel layers, written in the DSL with `transpose`:
//! the column-parallel weight gradient dW = AG(X)^T dY, the column-parallel input gradient
//! dX = RS(dY W^T) and the row-parallel input gradient dA = AG(dY) W^T (plain and as the
//! AllGather + GEMM pipeline). Each is checked against an f64 reference written from the
//! whole matrices, on 1 to 4 simulated devices and under every candidate plan; the
//! transposed operands reach the GEMMs as views (no copy in the program).

// The typed entry points are not called: the test runs each `build()` under every plan.
#![allow(dead_code)]

mod common;

use common::reference::RefArray;
use common::{device_counts, run, tolerance_for, Give, Take};
use fusion::compiler::hir::{for_each_node, HostProgram, Node};
use fusion::compiler::ir::{Expr, Fusion, Op};
use fusion::compiler::lower::Pipelining;
use fusion::compiler::plan;
use fusion::prelude::*;
use fusion::PlanMode;

fusion! {
    /// dW = AG(X)^T dY: X's rows sharded (sequence parallel), dY's columns sharded (the
    /// column block of this rank, every row block); each rank its column block of dW.
    fn column_weight_grad<d, m, k, n>(
        x: Tensor<f32, [d @ DIDx, m, k]>,
        dy: Tensor<f32, [d @ DIDx, d, m, n]>,
    ) -> Tensor<f32, [d @ DIDx, k, n]> {
        let xg: Tensor<f32, [d, m, k]> = x;
        sum(matmul(transpose(xg, 1, 2), dy), 1)
    }

    /// dX = RS(dY W^T): this rank's column block of dY (every row block) times its
    /// column block of W transposed, reduce-scattered over the row blocks.
    fn column_input_grad<d, m, n, k>(
        dy: Tensor<f32, [d, d @ DIDx, m, n]>,
        w: Tensor<f32, [d @ DIDx, k, n]>,
    ) -> Tensor<f32, [d @ DIDx, m, k]> {
        let partial: Tensor<f32, [d @ Stream, d @ DIDx, m, k]> = matmul(dy, transpose(w, 1, 2));
        sum(partial, 1)
    }

    /// dA = AG(dY) W^T for a row-parallel layer: dY's rows gathered, each rank its row
    /// block of W (`[f, h]`) transposed; each rank its column block of dA.
    fn row_input_grad<d, m, h, f>(
        dy: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d, d @ DIDx, m, f]> {
        let dyg: Tensor<f32, [d, m, h]> = dy;
        matmul(broadcast(dyg, [false, true, false, false]), transpose(w, 1, 2))
    }

    /// The same gradient with dY's rows arriving chunk by chunk (AllGather + GEMM).
    fn row_input_grad_streamed<d, m, h, f>(
        dy: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, f, h]>,
    ) -> Tensor<f32, [d @ Stream, d @ DIDx, m, f]> {
        matmul(broadcast(dy, [false, true, false, false]), transpose(w, 1, 2))
    }
}

const M: usize = 3;
const K: usize = 5;
const N: usize = 4;

/// A case: the fusion, its full inputs with how ranks get them, how its output is put
/// back together, and the reference output.
struct Case {
    name: &'static str,
    fusion: Fusion,
    inputs: Vec<(Tensor, Give)>,
    take: Take,
    want: RefArray,
}

/// Row-major index of `idx` in an array of `shape`.
fn at(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// Builds a reference of `shape` element by element.
fn reference(shape: &[usize], value: impl Fn(&[usize]) -> f64) -> RefArray {
    let n: usize = shape.iter().product();
    let mut idx = vec![0; shape.len()];
    let data = (0..n)
        .map(|mut i| {
            for a in (0..shape.len()).rev() {
                idx[a] = i % shape[a];
                i /= shape[a];
            }
            value(&idx)
        })
        .collect();
    RefArray::new(shape, data)
}

fn cases(d: usize) -> Vec<Case> {
    let t = |shape: &[usize], seed: u64| Tensor::randn(shape, DType::F32, seed + 10 * d as u64);
    let full = |t: &Tensor| RefArray::from_tensor(t);
    let mut out = Vec::new();

    // X as a whole [d m, k] (row block s = rows s m..), dY as a whole [d m, d n] (column
    // block r of row block s = dy[r, s]); dW = X^T dY, column block r on rank r.
    let (x, dy) = (t(&[d, M, K], 1), t(&[d, d, M, N], 2));
    let (xa, dya) = (full(&x), full(&dy));
    let want = reference(&[d, K, N], |i| {
        let (r, a, j) = (i[0], i[1], i[2]);
        let mut acc = 0.0;
        for row in 0..d * M {
            let (s, ir) = (row / M, row % M);
            acc +=
                xa.data[at(&[d, M, K], &[s, ir, a])] * dya.data[at(&[d, d, M, N], &[r, s, ir, j])];
        }
        acc
    });
    out.push(Case {
        name: "column_weight_grad",
        fusion: column_weight_grad::build().unwrap(),
        inputs: vec![(x, Give::Shard(0)), (dy, Give::Shard(0))],
        take: Take::Sharded(0),
        want,
    });

    // dY as a whole [d m, d n] (block (s, r) = dy[s, r]), W as a whole [k, d n] (column
    // block r = w[r]): dX = dY W^T = sum_r dY[:, r] W_r^T, row block s on rank s.
    let (dy, w) = (t(&[d, d, M, N], 3), t(&[d, K, N], 4));
    let (dya, wa) = (full(&dy), full(&w));
    let want = reference(&[d, M, K], |i| {
        let (s, ir, a) = (i[0], i[1], i[2]);
        let mut acc = 0.0;
        for col in 0..d * N {
            let (r, j) = (col / N, col % N);
            acc +=
                dya.data[at(&[d, d, M, N], &[s, r, ir, j])] * wa.data[at(&[d, K, N], &[r, a, j])];
        }
        acc
    });
    out.push(Case {
        name: "column_input_grad",
        fusion: column_input_grad::build().unwrap(),
        inputs: vec![(dy, Give::Shard(1)), (w, Give::Shard(0))],
        take: Take::Sharded(0),
        want,
    });

    // dY as a whole [d m, h] (row block s = dy[s]), W as a whole [d f, h] (row block r =
    // w[r]): dA = dY W^T, block (s, r) = dY_s W_r^T, column block r on rank r.
    let (dy, w) = (t(&[d, M, K], 5), t(&[d, N, K], 6));
    let (dya, wa) = (full(&dy), full(&w));
    let want = reference(&[d, d, M, N], |i| {
        let (s, r, ir, j) = (i[0], i[1], i[2], i[3]);
        (0..K)
            .map(|a| dya.data[at(&[d, M, K], &[s, ir, a])] * wa.data[at(&[d, N, K], &[r, j, a])])
            .sum()
    });
    for (name, fusion) in [
        ("row_input_grad", row_input_grad::build().unwrap()),
        (
            "row_input_grad_streamed",
            row_input_grad_streamed::build().unwrap(),
        ),
    ] {
        out.push(Case {
            name,
            fusion,
            inputs: vec![(dy.clone(), Give::Shard(0)), (w.clone(), Give::Shard(0))],
            take: Take::Sharded(1),
            want: want.clone(),
        });
    }
    out
}

/// The expressions of a program's compute nodes and fused segments.
fn exprs(p: &HostProgram) -> Vec<Expr> {
    let mut v = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            v.push(e.clone());
        }
    });
    v.extend(p.segments.iter().flat_map(|s| s.exprs.iter().cloned()));
    v
}

/// Asserts that the program has a permute and that only GEMMs read it (no copy).
fn assert_transpose_is_a_view(p: &HostProgram, what: &str) {
    let found = exprs(p);
    let views: Vec<_> = found
        .iter()
        .filter(|e| matches!(e.op, Op::Permute { .. }))
        .map(|e| e.output)
        .collect();
    assert!(
        !views.is_empty(),
        "{what}: the transpose is a view: {found:?}"
    );
    for e in found
        .iter()
        .filter(|e| e.inputs.iter().any(|t| views.contains(t)))
    {
        assert!(
            matches!(e.op, Op::Matmul | Op::Gemm { .. } | Op::Linear),
            "{what}: a GEMM reads the transpose, not {:?}",
            e.op
        );
    }
}

#[test]
fn gradients_match_the_reference_under_every_plan() {
    let tol = tolerance_for(DType::F32);
    for d in device_counts().into_iter().filter(|&d| d <= 4) {
        for case in cases(d) {
            for p in plan::candidates(d) {
                for pipelining in [Pipelining::Never, Pipelining::Always] {
                    let mut lower = p.lower.clone();
                    lower.pipelines.pipelining = pipelining;
                    let options = ExecOptions {
                        lower,
                        number_of_streams: p.number_of_streams,
                        plan: PlanMode::Default,
                        ..ExecOptions::default()
                    };
                    let what = format!(
                        "{} on {d} devices, plan {} ({pipelining:?})",
                        case.name, p.name
                    );
                    let got = run(
                        &case.fusion,
                        d,
                        &case.inputs,
                        std::slice::from_ref(&case.take),
                        &options,
                    );
                    common::assert_close(&case.want, &got.outputs[0], tol, &what);
                    assert_transpose_is_a_view(&got.program, &what);
                }
            }
        }
    }
}
