//! `permute` and `transpose`: the builder's checks (each error on the argument at fault),
//! parallel types moving with their axes, and lowering keeping a transposed GEMM operand a
//! view while copying every other permute.

use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::hir::{for_each_node, HostProgram, Node};
use fusion_compiler::ir::{Op, ParallelType, TensorId};
use fusion_compiler::lower::{lower, LowerOptions};
use fusion_compiler::{Culprit, DType, Error};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

const F32: DType = DType::F32;

fn input(b: &mut FusionBuilder, name: &str, spec: &[(&str, ParallelType)]) -> TensorId {
    let axes: Vec<Axis> = spec
        .iter()
        .map(|&(s, parallel)| Axis {
            extent: b.symbol(s),
            parallel,
        })
        .collect();
    b.input(name, F32, &axes).unwrap()
}

fn parallel(b: &FusionBuilder, t: TensorId) -> Vec<ParallelType> {
    let f = b.fusion();
    f.visible_axes(t)
        .into_iter()
        .map(|p| f.axis(t, p).parallel)
        .collect()
}

/// The ops of a program's compute nodes, nested ones included.
fn ops(p: &HostProgram) -> Vec<Op> {
    let mut v = Vec::new();
    for_each_node(&p.body, &mut |n| {
        if let Node::Compute(e) = n {
            v.push(e.op.clone());
        }
    });
    v
}

#[test]
fn bad_permutations_name_the_argument() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("a", S), ("b", S), ("c", S)]);
    let e = b.permute(x, &[1, 0]).unwrap_err();
    assert_eq!(e.culprit(), Some(Culprit::Arg(1)));
    assert!(e.to_string().contains("lists 2 axes"), "{e}");
    let e = b.permute(x, &[0, 2, 0]).unwrap_err();
    assert_eq!(e.culprit(), Some(Culprit::Element { arg: 1, index: 2 }));
    assert!(
        e.to_string().contains("axis 0 of `x` is listed twice"),
        "{e}"
    );
    let e = b.permute(x, &[0, 3, 1]).unwrap_err();
    assert!(matches!(e, Error::AxisOutOfRange { axis: 3, .. }), "{e}");
    assert_eq!(e.culprit(), Some(Culprit::Element { arg: 1, index: 1 }));
    let e = b.transpose(x, 0, 5).unwrap_err();
    assert_eq!(e.culprit(), Some(Culprit::Arg(2)));
}

#[test]
fn axes_keep_their_extent_and_parallel_type() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("d", Dx), ("m", S), ("k", S)]);
    let y = b.permute(x, &[2, 0, 1]).unwrap();
    assert_eq!(parallel(&b, y), [S, Dx, S]);
    let (k, d) = (b.symbol("k"), b.symbol("d"));
    let f = b.fusion();
    let ext: Vec<_> = f
        .visible_axes(y)
        .iter()
        .map(|&p| f.axis(y, p).extent)
        .collect();
    assert_eq!((ext[0], ext[1]), (k, d));
    // A Stream axis moves too.
    let s = b.set(x).unwrap();
    let m = b.symbol("m");
    let s = b
        .declare(s, F32, &[Axis::didx(d), Axis::stream(m), Axis::serial(k)])
        .unwrap();
    let t = b.transpose(s, 1, 2).unwrap();
    assert_eq!(parallel(&b, t), [Dx, S, St]);
}

/// `matmul(transpose(a, 0, 1), b)` (`a [k, m]`, `b [k, n]`), optionally also returning
/// the transpose.
fn transposed_operand(return_it: bool) -> fusion_compiler::ir::Fusion {
    let mut b = FusionBuilder::new();
    let a = input(&mut b, "a", &[("k", S), ("m", S)]);
    let w = input(&mut b, "b", &[("k", S), ("n", S)]);
    let at = b.transpose(a, 0, 1).unwrap();
    let c = b.matmul(at, w).unwrap();
    b.output(c).unwrap();
    if return_it {
        b.output(at).unwrap();
    }
    b.build().unwrap()
}

#[test]
fn a_transposed_gemm_operand_is_a_view() {
    let p = lower(&transposed_operand(false), 1, &LowerOptions::default())
        .unwrap()
        .program;
    let ops = ops(&p);
    assert!(ops.contains(&Op::Permute { perm: vec![1, 0] }), "{ops:?}");
    assert!(!ops.contains(&Op::Set), "no copy: {ops:?}");
}

#[test]
fn other_permutes_are_copied() {
    let p = lower(&transposed_operand(true), 1, &LowerOptions::default())
        .unwrap()
        .program;
    let found = ops(&p);
    assert_eq!(
        found.iter().filter(|o| matches!(o, Op::Set)).count(),
        1,
        "one copy, for the returned transpose: {found:?}"
    );
    // An elementwise reader: copied too (the copy may fuse with the reader).
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("m", S), ("n", S)]);
    let t = b.transpose(x, 0, 1).unwrap();
    let y = b.add(t, t).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let options = LowerOptions::default().without_pass("FuseElementwise");
    let p = lower(&f, 1, &options).unwrap().program;
    assert!(ops(&p).contains(&Op::Set), "{:?}", ops(&p));
}

#[test]
fn a_stream_axis_moves_with_its_permute() {
    // y = transpose(x) with the result's n axis Stream-parallel: a loop of copies.
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", &[("m", S), ("n", S)]);
    let t = b.transpose(x, 0, 1).unwrap();
    let (m, n) = (b.symbol("m"), b.symbol("n"));
    let t = b
        .declare(t, F32, &[Axis::stream(n), Axis::serial(m)])
        .unwrap();
    let y = b.unary(fusion_compiler::ir::UnaryOp::Exp, t).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let p = lower(&f, 1, &LowerOptions::default()).unwrap().program;
    let mut loops = 0;
    for_each_node(&p.body, &mut |n| {
        loops += usize::from(matches!(n, Node::ForLoop(_)))
    });
    assert!(loops > 0, "the copy runs chunk by chunk");
}
