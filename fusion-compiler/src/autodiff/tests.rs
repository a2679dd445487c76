//! One test per adjoint rule: the ops the derived backward is made of, its inputs and
//! outputs, and the refusals; and what the saving form saves. (Numbers are checked
//! against finite differences on simulated devices in the facade's
//! `tests/backward_layers.rs`, the saving form against the recomputing one in
//! `tests/backward_saving.rs`.)

use super::{backward, saving, AutodiffError, Backward, BackwardInput, GradSpec};
use crate::builder::{Axis, FusionBuilder};
use crate::ir::{BinaryOp, Fusion, Op, ParallelType, TensorId, UnaryOp};
use crate::DType;

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

fn input(b: &mut FusionBuilder, name: &str, spec: &[(&str, ParallelType)]) -> TensorId {
    let axes: Vec<Axis> = (spec.iter())
        .map(|&(s, parallel)| Axis {
            extent: b.symbol(s),
            parallel,
        })
        .collect();
    b.input(name, DType::F32, &axes).unwrap()
}

/// The fusion `f(x, y)` for `x`, `y` of shape `[m, n]` (`y` `[n]` when `row`).
fn binary_fusion(f: impl Fn(&mut FusionBuilder, TensorId, TensorId) -> TensorId) -> Fusion {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("m", S), ("n", S)]);
    let y = input(&mut b, "y", &[("m", S), ("n", S)]);
    let out = f(&mut b, x, y);
    b.output(out).unwrap();
    b.build().unwrap()
}

fn unary_fusion(f: impl Fn(&mut FusionBuilder, TensorId) -> TensorId) -> Fusion {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("m", S), ("n", S)]);
    let out = f(&mut b, x);
    b.output(out).unwrap();
    b.build().unwrap()
}

fn derive(f: &Fusion) -> Backward {
    backward(f, &GradSpec::all(f)).unwrap_or_else(|e| panic!("{e}"))
}

/// The ops of the backward, in order.
fn ops(bw: &Backward) -> Vec<Op> {
    bw.fusion.exprs().iter().map(|e| e.op.clone()).collect()
}

fn parallel(f: &Fusion, t: TensorId) -> Vec<ParallelType> {
    (f.visible_axes(t).into_iter())
        .map(|p| f.axis(t, p).parallel)
        .collect()
}

#[test]
fn add_passes_the_gradient_to_both_operands() {
    let bw = derive(&binary_fusion(|b, x, y| b.add(x, y).unwrap()));
    // Nothing is recomputed: only the output gradient comes in.
    assert_eq!(bw.inputs, [BackwardInput::OutputGrad(0)]);
    assert_eq!(bw.outputs, [0, 1]);
    // Both outputs are the incoming gradient (copies, as outputs of an input).
    assert_eq!(ops(&bw), [Op::Set, Op::Set]);
}

#[test]
fn sub_negates_the_subtrahends_gradient() {
    let bw = derive(&binary_fusion(|b, x, y| {
        b.binary(BinaryOp::Sub, x, y).unwrap()
    }));
    assert_eq!(ops(&bw), [Op::Unary(UnaryOp::Neg), Op::Set]);
}

#[test]
fn mul_and_div_read_the_other_operand() {
    let bw = derive(&binary_fusion(|b, x, y| b.mul(x, y).unwrap()));
    assert_eq!(bw.inputs.len(), 3, "x and y are passed again");
    assert_eq!(
        ops(&bw),
        [Op::Binary(BinaryOp::Mul), Op::Binary(BinaryOp::Mul)]
    );
    let bw = derive(&binary_fusion(|b, x, y| {
        b.binary(BinaryOp::Div, x, y).unwrap()
    }));
    let div = Op::Binary(BinaryOp::Div);
    assert_eq!(ops(&bw).iter().filter(|o| **o == div).count(), 2);
    assert!(ops(&bw).contains(&Op::Unary(UnaryOp::Neg)));
}

#[test]
fn maximum_and_minimum_route_the_gradient_through_a_mask() {
    for op in [BinaryOp::Max, BinaryOp::Min] {
        let bw = derive(&binary_fusion(|b, x, y| b.binary(op, x, y).unwrap()));
        let o = ops(&bw);
        assert!(o.contains(&Op::Unary(UnaryOp::ReluGrad)), "{op:?}: {o:?}");
        assert_eq!(
            o.iter()
                .filter(|x| **x == Op::Binary(BinaryOp::Sub))
                .count(),
            2
        );
    }
}

#[test]
fn unary_ops_multiply_by_their_derivative_op() {
    for u in UnaryOp::ALL
        .into_iter()
        .filter(|u| u.derivative().is_some())
    {
        let bw = derive(&unary_fusion(|b, x| b.unary(u, x).unwrap()));
        let d = u.derivative().unwrap();
        assert_eq!(
            ops(&bw),
            [Op::Unary(d), Op::Binary(BinaryOp::Mul)],
            "{}",
            u.name()
        );
        assert_eq!(bw.inputs[0], BackwardInput::Primal(0), "x is passed again");
    }
    let bw = derive(&unary_fusion(|b, x| b.unary(UnaryOp::Neg, x).unwrap()));
    assert_eq!(ops(&bw), [Op::Unary(UnaryOp::Neg)]);
}

#[test]
fn a_derivative_op_is_refused_naming_it_and_its_tensor() {
    let f = unary_fusion(|b, x| {
        let g = b.unary(UnaryOp::GeluGrad, x).unwrap();
        b.name(g, "slope");
        g
    });
    let e = backward(&f, &GradSpec::all(&f)).unwrap_err();
    assert!(matches!(e, AutodiffError::NotDifferentiable { .. }), "{e}");
    assert_eq!(e.expr().map(|id| id.index()), Some(0));
    let msg = e.to_string();
    assert!(
        msg.contains("`gelu_grad`") && msg.contains("`slope`"),
        "{msg}"
    );
}

#[test]
fn views_and_max_reductions_are_refused() {
    let select = unary_fusion(|b, x| {
        let i = b.constant(0);
        b.select(x, 0, i).unwrap()
    });
    let max = unary_fusion(|b, x| b.reduce(crate::ir::ReduceOp::Max, x, &[1]).unwrap());
    for (f, op) in [(select, "select"), (max, "max")] {
        let e = backward(&f, &GradSpec::all(&f)).unwrap_err();
        assert!(e.to_string().contains(&format!("`{op}`")), "{e}");
    }
}

#[test]
fn sum_and_broadcast_are_each_others_adjoint() {
    // y = sum(x, 1) broadcast back and added to x: d_x = d_y + broadcast(sum(d_y, 1)).
    let bw = derive(&unary_fusion(|b, x| {
        let s = b.sum(x, &[1]).unwrap();
        let s = b.broadcast(s, &[false, true]).unwrap();
        b.add(x, s).unwrap()
    }));
    let o = ops(&bw);
    let sum = o.iter().position(|x| matches!(x, Op::Reduction { .. }));
    let bcast = o.iter().position(|x| matches!(x, Op::Broadcast { .. }));
    assert!(sum.unwrap() < bcast.unwrap(), "{o:?}");
    assert!(
        o.contains(&Op::Binary(BinaryOp::Add)),
        "the two paths accumulate: {o:?}"
    );
}

#[test]
fn permute_and_cast_are_undone() {
    let bw = derive(&unary_fusion(|b, x| {
        let t = b.transpose(x, 0, 1).unwrap();
        b.cast(t, DType::BF16).unwrap()
    }));
    assert_eq!(ops(&bw), [Op::Cast, Op::Permute { perm: vec![1, 0] }]);
    let out = bw.fusion.outputs()[0];
    assert_eq!(bw.fusion.tensor(out).dtype, DType::F32);
}

#[test]
fn a_gather_is_differentiated_as_a_copy_back_to_the_shards() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("d", Dx), ("m", S)]);
    let d = b.symbol("d");
    let m = b.symbol("m");
    let full = b
        .declare(x, DType::F32, &[Axis::serial(d), Axis::serial(m)])
        .unwrap();
    b.output(full).unwrap();
    let f = b.build().unwrap();
    let bw = derive(&f);
    let g = bw.fusion.outputs()[0];
    assert_eq!(parallel(&bw.fusion, g), [Dx, S], "d_x has x's sharding");
}

/// `x w` for `x` `[m, k]` and `w` `[d @ DIDx, k, n]` (column blocks).
fn column_blocks(b: &mut FusionBuilder) -> TensorId {
    let x = input(b, "x", &[("m", S), ("k", S)]);
    let w = input(b, "w", &[("d", Dx), ("k", S), ("n", S)]);
    b.matmul(x, w).unwrap()
}

#[test]
fn matmul_takes_transposed_operands() {
    let mut b = FusionBuilder::new();
    let y = column_blocks(&mut b);
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let bw = derive(&f);
    let o = ops(&bw);
    let permutes = o.iter().filter(|x| matches!(x, Op::Permute { .. })).count();
    let matmuls = o.iter().filter(|x| **x == Op::Matmul).count();
    assert_eq!((permutes, matmuls), (2, 2), "{o:?}");
    // d_x sums the column blocks (an all-reduce), d_w keeps w's sharding.
    assert!(o.iter().any(|x| matches!(x, Op::Reduction { .. })));
    let (dx, dw) = (bw.fusion.outputs()[0], bw.fusion.outputs()[1]);
    assert_eq!(parallel(&bw.fusion, dx), [S, S]);
    assert_eq!(parallel(&bw.fusion, dw), [Dx, S, S]);
}

#[test]
fn weight_gradients_stream_the_chunks_they_sum_and_share_one_transpose() {
    // Two column-parallel projections of the same gathered rows, streamed over the row
    // blocks: `rows w1 + rows w2` (a gated MLP's gate and up projections).
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("d", Dx), ("m", S), ("h", S)]);
    let w1 = input(&mut b, "w1", &[("d", Dx), ("h", S), ("f", S)]);
    let w2 = input(&mut b, "w2", &[("d", Dx), ("h", S), ("f", S)]);
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let streamed: Vec<Axis> = [("d", St), ("d", Dx), ("m", S), ("f", S)]
        .iter()
        .map(|&(s, parallel)| Axis {
            extent: b.symbol(s),
            parallel,
        })
        .collect();
    let y1 = b.matmul(rows, w1).unwrap();
    let y1 = b.declare(y1, DType::F32, &streamed).unwrap();
    let y2 = b.matmul(rows, w2).unwrap();
    let y2 = b.declare(y2, DType::F32, &streamed).unwrap();
    let y = b.add(y1, y2).unwrap();
    b.output(y).unwrap();
    let bw = derive(&b.build().unwrap());
    let g = &bw.fusion;
    // Each weight gradient sums a GEMM over the gathered row blocks, which keeps the
    // forward's Stream axis: lowering accumulates the chunks' GEMMs in the stream loop.
    for &dw in &g.outputs()[1..] {
        let e = g.expr(g.definition(dw).unwrap());
        assert!(matches!(e.op, Op::Reduction { .. }), "{g}");
        assert_eq!(parallel(g, e.inputs[0]), [St, Dx, S, S], "{g}");
    }
    // rows^T is made once for both weight gradients.
    let permutes_of_rows = (g.exprs().iter())
        .filter(|e| matches!(e.op, Op::Permute { .. }) && g.visible_axes(e.inputs[0]).len() == 4)
        .count();
    assert_eq!(permutes_of_rows, 1, "{g}");
}

#[test]
fn linear_gives_input_weight_and_bias_gradients() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("s", S), ("m", S), ("k", S)]);
    let w = input(&mut b, "w", &[("n", S), ("k", S)]);
    let bias = input(&mut b, "bias", &[("n", S)]);
    let y = b.linear(x, w, Some(bias)).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let bw = derive(&f);
    let shapes: Vec<usize> = (bw.fusion.outputs().iter())
        .map(|&t| bw.fusion.visible_axes(t).len())
        .collect();
    assert_eq!(shapes, [3, 2, 1]);
    assert_eq!(ops(&bw).iter().filter(|x| **x == Op::Matmul).count(), 2);
}

#[test]
fn requests_that_do_not_fit_are_errors() {
    let f = binary_fusion(|b, x, _| b.unary(UnaryOp::Exp, x).unwrap());
    let e = backward(&f, &GradSpec::all(&f)).unwrap_err();
    assert!(
        e.to_string()
            .contains("no differentiated output depends on `y`"),
        "{e}"
    );
    let spec = GradSpec {
        outputs: vec![1],
        inputs: vec![0],
    };
    let e = backward(&f, &spec).unwrap_err();
    assert!(e.to_string().contains("output 1 does not exist"), "{e}");
    let spec = GradSpec {
        outputs: vec![0],
        inputs: vec![0],
    };
    assert_eq!(derive_with(&f, &spec).outputs, [0]);
}

fn derive_with(f: &Fusion, spec: &GradSpec) -> Backward {
    backward(f, spec).unwrap_or_else(|e| panic!("{e}"))
}

/// How many expressions of `f` apply `op`.
fn count(f: &Fusion, op: &Op) -> usize {
    f.exprs().iter().filter(|e| e.op == *op).count()
}

#[test]
fn the_saving_form_takes_a_gemm_result_instead_of_recomputing_it() {
    // y = relu(x w): relu's adjoint reads x w.
    let mut b = FusionBuilder::new();
    let h = column_blocks(&mut b);
    let y = b.unary(UnaryOp::Relu, h).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    assert_eq!(s.saved, [1], "x w is returned after y");
    assert_eq!(s.forward.outputs(), [y, h]);
    // It keeps its layout: the DIDx axis the forward computed it with.
    let saved = s.backward.fusion.inputs()[2];
    assert_eq!(parallel(&s.backward.fusion, saved), [Dx, S, S]);
    use BackwardInput::*;
    assert_eq!(
        s.backward.inputs,
        [Primal(0), Primal(1), Saved(0), OutputGrad(0)]
    );
    // dX and dW; the recomputing form computes x w a third time.
    assert_eq!(count(&s.backward.fusion, &Op::Matmul), 2);
    assert_eq!(count(&derive(&f).fusion, &Op::Matmul), 3);
}

#[test]
fn a_saved_output_is_not_returned_twice() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("m", S), ("k", S)]);
    let w = input(&mut b, "w", &[("k", S), ("n", S)]);
    let h = b.matmul(x, w).unwrap();
    let y = b.unary(UnaryOp::Exp, h).unwrap();
    b.output(h).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    assert_eq!(
        (s.saved.as_slice(), s.forward.outputs().len()),
        (&[0][..], 2)
    );
}

#[test]
fn a_reduction_is_saved_and_the_values_after_it_recomputed() {
    // y = x * broadcast(sum(x, 1)): the mul's adjoint reads the broadcast sum, which is
    // recomputed from the saved sum (no second reduction of x).
    let f = unary_fusion(|b, x| {
        let s = b.sum(x, &[1]).unwrap();
        let s = b.broadcast(s, &[false, true]).unwrap();
        b.mul(x, s).unwrap()
    });
    let s = saving(&f, &GradSpec::all(&f)).unwrap();
    assert_eq!(s.saved, [1]);
    let bf = &s.backward.fusion;
    let sum_of_x = (bf.exprs().iter())
        .any(|e| matches!(e.op, Op::Reduction { .. }) && e.inputs == [bf.inputs()[0]]);
    assert!(!sum_of_x, "{bf}");
    // Nothing to save: the recomputing and saving forms of `x + y` are the same.
    let add = binary_fusion(|b, x, y| b.add(x, y).unwrap());
    let s = saving(&add, &GradSpec::all(&add)).unwrap();
    assert!(s.saved.is_empty());
    assert_eq!(ops(&s.backward), ops(&derive(&add)));
}
