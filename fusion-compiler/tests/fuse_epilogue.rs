//! `FuseEpilogue`'s auxiliary-matrix forms: what folds into a GEMM and what must stay
//! unfolded, for the pre-activation saved (a GEMM result that is also an output, read by
//! one `gelu_tanh`) and the derivative applied (`(a @ b) * gelu_tanh_grad(h)`), on one
//! device. (Stream loops, plan candidates and the numbers: the facade's
//! `tests/epilogues.rs`.)

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, HostProgram, Node};
use fusion_compiler::ir::{Op, ParallelType, TensorId, UnaryOp};
use fusion_compiler::lower::{lower, LowerOptions};
use fusion_compiler::DType;

/// `a [m, k]`, `w [k, n]`, `h [m, n]` and a bias `[n]`, handed to `build`, whose results
/// are the outputs; the program on one device.
fn program(build: impl Fn(&mut FusionBuilder, [TensorId; 4]) -> Vec<TensorId>) -> HostProgram {
    let mut b = FusionBuilder::new();
    let input = |b: &mut FusionBuilder, name: &str, dims: &[&str]| {
        let axes: Vec<Axis> = (dims.iter())
            .map(|&s| Axis {
                extent: b.symbol(s),
                parallel: ParallelType::Serial,
            })
            .collect();
        b.input(name, DType::BF16, &axes).unwrap()
    };
    let a = input(&mut b, "a", &["m", "k"]);
    let w = input(&mut b, "w", &["k", "n"]);
    let h = input(&mut b, "h", &["m", "n"]);
    let bias = input(&mut b, "bias", &["n"]);
    for out in build(&mut b, [a, w, h, bias]) {
        b.output(out).unwrap();
    }
    let f = b.build().unwrap();
    lower(&f, 1, &LowerOptions::default()).unwrap().program
}

/// The fused GEMMs: their epilogue as printed and their inputs.
fn fused(p: &HostProgram) -> Vec<(String, Vec<TensorId>)> {
    let mut out = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            if let Op::Gemm { epilogue, .. } = &e.op {
                out.push((epilogue.describe(), e.inputs.clone()));
            }
        }
    });
    out
}

/// The elementwise ops left, as nodes or in fused segments.
fn elementwise(p: &HostProgram) -> usize {
    let mut n = 0;
    for_each_node(&p.body, &mut |x| {
        n += usize::from(matches!(x, Node::Compute(e) if e.op.is_elementwise()));
    });
    n + p.segments.iter().map(|s| s.exprs.len()).sum::<usize>()
}

#[test]
fn the_derivative_folds_in_either_operand_order() {
    for swap in [false, true] {
        let p = program(|b, [a, w, h, _]| {
            let d_act = b.matmul(a, w).unwrap();
            let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
            let (x, y) = if swap { (slope, d_act) } else { (d_act, slope) };
            vec![b.mul(x, y).unwrap()]
        });
        let (a, w, h) = (p.inputs[0], p.inputs[1], p.inputs[2]);
        let want = vec![("times gelu_tanh'(aux)".to_string(), vec![a, w, h])];
        assert_eq!(fused(&p), want, "{p}");
        assert_eq!(elementwise(&p), 0, "{p}");
    }
}

#[test]
fn what_the_derivative_must_not_take_stays_unfolded() {
    type Build = fn(&mut FusionBuilder, [TensorId; 4]) -> Vec<TensorId>;
    let cases: [(&str, Build); 6] = [
        ("a second reader of the product", |b, [a, w, h, _]| {
            let d_act = b.matmul(a, w).unwrap();
            let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
            let neg = b.unary(UnaryOp::Neg, d_act).unwrap();
            vec![b.mul(d_act, slope).unwrap(), neg]
        }),
        ("exact GELU's derivative", |b, [a, w, h, _]| {
            let d_act = b.matmul(a, w).unwrap();
            let slope = b.unary(UnaryOp::GeluGrad, h).unwrap();
            vec![b.mul(d_act, slope).unwrap()]
        }),
        ("another activation's derivative", |b, [a, w, h, _]| {
            let d_act = b.matmul(a, w).unwrap();
            let slope = b.unary(UnaryOp::SiluGrad, h).unwrap();
            vec![b.mul(d_act, slope).unwrap()]
        }),
        (
            "an op between the derivative and the mul",
            |b, [a, w, h, _]| {
                let d_act = b.matmul(a, w).unwrap();
                let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
                let slope = b.unary(UnaryOp::Neg, slope).unwrap();
                vec![b.mul(d_act, slope).unwrap()]
            },
        ),
        ("the derivative is also an output", |b, [a, w, h, _]| {
            let d_act = b.matmul(a, w).unwrap();
            let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
            vec![b.mul(d_act, slope).unwrap(), slope]
        }),
        (
            "a derivative broadcast over the rows",
            |b, [a, w, _, bias]| {
                let d_act = b.matmul(a, w).unwrap();
                let slope = b.unary(UnaryOp::GeluTanhGrad, bias).unwrap();
                vec![b.mul(d_act, slope).unwrap()]
            },
        ),
    ];
    for (what, build) in cases {
        let p = program(build);
        assert!(
            fused(&p).iter().all(|(e, _)| !e.contains("aux")),
            "{what}: {p}"
        );
    }
    // An op between the product and the mul: the product takes its bias, not the
    // derivative.
    let p = program(|b, [a, w, h, bias]| {
        let d_act = b.matmul(a, w).unwrap();
        let d_act = b.add(d_act, bias).unwrap();
        let slope = b.unary(UnaryOp::GeluTanhGrad, h).unwrap();
        vec![b.mul(d_act, slope).unwrap()]
    });
    let epilogues: Vec<String> = fused(&p).into_iter().map(|f| f.0).collect();
    assert_eq!(epilogues, ["bias"], "{p}");
}

#[test]
fn an_output_read_by_gelu_tanh_is_stored_as_its_pre_activation() {
    let p = program(|b, [a, w, _, _]| {
        let h = b.matmul(a, w).unwrap();
        vec![b.unary(UnaryOp::GeluTanh, h).unwrap(), h]
    });
    let (a, w, h) = (p.inputs[0], p.inputs[1], p.outputs[1]);
    let want = vec![("gelu_tanh, saves pre-activation".to_string(), vec![a, w, h])];
    assert_eq!(fused(&p), want, "{p}");
    assert_eq!(elementwise(&p), 0, "{p}");
    // With a bias before it: the bias folds into the GEMM writing h, then the activation.
    let p = program(|b, [a, w, _, bias]| {
        let h = b.matmul(a, w).unwrap();
        let h = b.add(h, bias).unwrap();
        vec![b.unary(UnaryOp::GeluTanh, h).unwrap(), h]
    });
    let epilogues: Vec<String> = fused(&p).into_iter().map(|f| f.0).collect();
    assert_eq!(epilogues, ["bias, gelu_tanh, saves pre-activation"], "{p}");
}

#[test]
fn what_the_pre_activation_must_not_take_stays_unfolded() {
    type Build = fn(&mut FusionBuilder, [TensorId; 4]) -> Vec<TensorId>;
    let cases: [(&str, Build); 3] = [
        ("a second reader besides the output", |b, [a, w, _, _]| {
            let h = b.matmul(a, w).unwrap();
            let neg = b.unary(UnaryOp::Neg, h).unwrap();
            vec![b.unary(UnaryOp::GeluTanh, h).unwrap(), h, neg]
        }),
        ("another activation", |b, [a, w, _, _]| {
            let h = b.matmul(a, w).unwrap();
            vec![b.unary(UnaryOp::Relu, h).unwrap(), h]
        }),
        ("exact GELU", |b, [a, w, _, _]| {
            let h = b.matmul(a, w).unwrap();
            vec![b.unary(UnaryOp::Gelu, h).unwrap(), h]
        }),
    ];
    for (what, build) in cases {
        let p = program(build);
        assert_eq!(fused(&p), [], "{what}: {p}");
    }
    // Not an output: the activation folds as before, with no auxiliary matrix.
    let p = program(|b, [a, w, _, _]| {
        let h = b.matmul(a, w).unwrap();
        vec![b.unary(UnaryOp::GeluTanh, h).unwrap()]
    });
    let epilogues: Vec<String> = fused(&p).into_iter().map(|f| f.0).collect();
    assert_eq!(epilogues, ["gelu_tanh"], "{p}");
}
