//! `FuseEpilogue`: elementwise ops that consume a GEMM's result are folded into the GEMM
//! (bias, activations, a final cast), at the top level and inside stream loops; what it
//! must leave alone stays unfused; and the numbers match the unfused program and an f64
//! reference, in f32 and bf16.

mod common;

use common::cases::{self, axes};
use common::*;
use fusion::compiler::builder::FusionBuilder;
use fusion::compiler::hir::{for_each_node, HostProgram, Node};
use fusion::compiler::ir::{BinaryOp, Fusion, Op, ParallelType, UnaryOp};
use fusion::compiler::lower::{lower, LowerOptions};
use fusion::{DType, ExecOptions, Tensor};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

/// The fused GEMMs of a program: (linear, epilogue as printed).
fn fused(p: &HostProgram) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            if let Op::Gemm { linear, epilogue } = &e.op {
                out.push((*linear, epilogue.describe()));
            }
        }
    });
    out
}

fn unary_nodes(p: &HostProgram) -> usize {
    let mut n = 0;
    for_each_node(&p.body, &mut |x| {
        n += usize::from(matches!(x, Node::Compute(e) if matches!(e.op, Op::Unary(_))))
    });
    n + p
        .segments
        .iter()
        .flat_map(|s| &s.exprs)
        .filter(|e| matches!(e.op, Op::Unary(_)))
        .count()
}

/// Runs `f` with and without the pass; both must match `expected`.
/// Runs `f` with and without the epilogue pass on every device count the machine runs
/// (replicated inputs and output) and compares with `expected`.
fn check(f: &Fusion, inputs: &[(Tensor, Give)], expected: &RefArray, tol: f64, what: &str) {
    for d in device_counts().into_iter().filter(|&d| d <= 2) {
        for lower_opts in [
            LowerOptions::default(),
            LowerOptions::default().without_pass("FuseEpilogue"),
        ] {
            let o = ExecOptions {
                lower: lower_opts,
                ..ExecOptions::default()
            };
            let r = run(f, d, inputs, &[Take::Replicated], &o);
            assert_close(expected, &r.outputs[0], tol, what);
        }
    }
}

/// `act(matmul(a, b) + bias)` with a `[s, m, k]`, b `[k, n]`, bias `[n]`.
fn matmul_bias_act(dt: DType, act: UnaryOp, stream: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("s", S), ("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let tb = axes(&mut b, &[("n", S)]);
    let a = b.input("a", dt, &ta).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let p = b.matmul(a, w).unwrap();
    let p = b.add(p, bias).unwrap();
    let y = b.unary(act, p).unwrap();
    let y = if stream {
        let ty = axes(&mut b, &[("s", St), ("m", S), ("n", S)]);
        b.declare(y, dt, &ty).unwrap()
    } else {
        y
    };
    b.output(y).unwrap();
    b.build().unwrap()
}

/// A column-parallel layer with its bias blocks: `gelu_tanh(x @ w + bias)` with x `[m, k]`
/// replicated, w `[d@DIDx, k, n]` and bias `[d@DIDx, 1, n]` (each rank its block).
#[test]
fn a_sharded_bias_block_folds_into_the_matmul() {
    let dt = DType::F32;
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let one = b.constant(1);
    let mut tb = axes(&mut b, &[("d", Dx), ("n", S)]);
    tb.insert(
        1,
        fusion::Axis {
            extent: one,
            parallel: S,
        },
    );
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let p = b.matmul(x, w).unwrap();
    let p = b.add(p, bias).unwrap();
    let y = b.unary(UnaryOp::GeluTanh, p).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    for d in device_counts() {
        let p = lower(&f, d, &LowerOptions::default()).unwrap().program;
        assert_eq!(fused(&p), [(false, "bias, gelu_tanh".to_string())], "{p}");
        let xs = Tensor::randn(&[4, 8], dt, 11);
        let ws = Tensor::randn(&[d, 8, 5], dt, 12);
        let bs = Tensor::randn(&[d, 1, 5], dt, 13);
        let expected = RefArray::from_tensor(&xs)
            .matmul(&RefArray::from_tensor(&ws))
            .zip(&RefArray::from_tensor(&bs), |x, y| x + y)
            .map(|v| UnaryOp::GeluTanh.apply_f64(v));
        let r = run(
            &f,
            d,
            &[
                (xs, Give::Whole),
                (ws, Give::Shard(0)),
                (bs, Give::Shard(0)),
            ],
            &[Take::Sharded(0)],
            &ExecOptions::default(),
        );
        assert_close(
            &expected,
            &r.outputs[0],
            tolerance_for(dt),
            "sharded bias block",
        );
    }
}

#[test]
fn bias_and_activation_fold_into_the_matmul() {
    for dt in [DType::F32, DType::BF16] {
        for stream in [false, true] {
            for act in [
                UnaryOp::GeluTanh,
                UnaryOp::Relu,
                UnaryOp::Silu,
                UnaryOp::Gelu,
            ] {
                let f = matmul_bias_act(dt, act, stream);
                let p = lower(&f, 2, &LowerOptions::default()).unwrap().program;
                assert_eq!(
                    fused(&p),
                    [(false, format!("bias, {}", act.name()))],
                    "{dt} {act:?} stream {stream}:\n{p}"
                );
                assert_eq!(unary_nodes(&p), 0, "{p}");
                let text = p.to_string();
                assert!(!text.contains(" + T"), "no separate add:\n{text}");
                let a = Tensor::randn(&[3, 4, 8], dt, 1);
                let w = Tensor::randn(&[8, 5], dt, 2);
                let bias = Tensor::randn(&[5], dt, 3);
                let expected = RefArray::from_tensor(&a)
                    .matmul(&RefArray::from_tensor(&w))
                    .zip(&RefArray::from_tensor(&bias), |x, y| x + y)
                    .map(|v| act.apply_f64(v));
                check(
                    &f,
                    &[(a, Give::Whole), (w, Give::Whole), (bias, Give::Whole)],
                    &expected,
                    tolerance_for(dt),
                    &format!("{} epilogue {dt}", act.name()),
                );
            }
        }
    }
    // Inside a stream loop the product never gets a slot buffer.
    let f = matmul_bias_act(DType::F32, UnaryOp::GeluTanh, true);
    let with = lower(&f, 2, &LowerOptions::default()).unwrap().program;
    let without = lower(&f, 2, &LowerOptions::default().without_pass("FuseEpilogue"))
        .unwrap()
        .program;
    let allocations = |p: &HostProgram| {
        p.body
            .iter()
            .filter(|n| matches!(n, Node::Allocate { .. }))
            .count()
    };
    assert!(
        allocations(&with) < allocations(&without),
        "fused:\n{with}\nunfused:\n{without}"
    );
}

#[test]
fn linear_with_bias_activation_and_cast_is_one_gemm() {
    // relu(linear(x, w, bias)) stored as f32 from bf16 operands.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("n", S), ("k", S)]);
    let tb = axes(&mut b, &[("n", S)]);
    let dt = DType::BF16;
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let bias = b.input("bias", dt, &tb).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let y = b.unary(UnaryOp::Relu, y).unwrap();
    let y = b.cast(y, DType::F32).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert_eq!(fused(&p), [(true, "bias, relu".to_string())], "{p}");
    assert!(
        p.to_string().contains("epilogue( bias, relu ) -> float"),
        "{p}"
    );
    let xs = Tensor::randn(&[6, 7], dt, 4);
    let ws = Tensor::randn(&[5, 7], dt, 5);
    let bs = Tensor::randn(&[5], dt, 6);
    let expected = RefArray::from_tensor(&xs)
        .matmul(&RefArray::from_tensor(&ws).transpose_last())
        .zip(&RefArray::from_tensor(&bs), |x, y| x + y)
        .map(|v| v.max(0.0));
    let r = run(
        &f,
        1,
        &[(xs, Give::Whole), (ws, Give::Whole), (bs, Give::Whole)],
        &[Take::Replicated],
        &ExecOptions::default(),
    );
    assert_eq!(r.outputs[0].dtype(), DType::F32);
    // f32 output: the product is rounded once, not to bf16 first.
    assert_close(
        &expected,
        &r.outputs[0],
        1e-5,
        "linear + bias + relu -> f32",
    );
}

#[test]
fn what_cannot_fold_stays_unfused() {
    let dt = DType::F32;
    // silu(x @ wg) * (x @ wu): silu stays with the multiply (one generated kernel), and a
    // product read twice keeps its buffer.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let wg = b.input("wg", dt, &tw).unwrap();
    let wu = b.input("wu", dt, &tw).unwrap();
    let g = b.matmul(x, wg).unwrap();
    let g = b.unary(UnaryOp::Silu, g).unwrap();
    let u = b.matmul(x, wu).unwrap();
    let twice = b.binary(BinaryOp::Add, u, u).unwrap();
    let y = b.mul(g, twice).unwrap();
    let relu_u = b.unary(UnaryOp::Relu, u).unwrap();
    b.output(y).unwrap();
    b.output(relu_u).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert!(fused(&p).is_empty(), "{p}");
    assert_eq!(unary_nodes(&p), 2, "{p}");
    // A matmul that is an output keeps its value.
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let h = b.matmul(x, w).unwrap();
    let h = b.output(h).unwrap();
    let r = b.unary(UnaryOp::Relu, h).unwrap();
    b.output(r).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    assert!(fused(&p).is_empty(), "{p}");
}

#[test]
fn the_mlp_block_folds_its_activation_into_the_first_gemm() {
    for (act, folded) in [
        (UnaryOp::GeluTanh, "gelu_tanh"),
        (UnaryOp::Gelu, "gelu"),
        (UnaryOp::Relu, "relu"),
    ] {
        let f = cases::tp_mlp(DType::BF16, act);
        for d in [2, 3, 4] {
            let p = lower(&f, d, &LowerOptions::default()).unwrap().program;
            assert_eq!(fused(&p), [(false, folded.to_string())], "{d}:\n{p}");
            assert_eq!(unary_nodes(&p), 0, "{p}");
        }
    }
}
