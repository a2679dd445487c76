//! The builder's checking features: dtype parameters, poisoned stand-ins, culprits, and
//! whole-fusion problems with their sites.

use super::*;
use crate::ir::{ReduceOp, UnaryOp};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

fn axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    spec.iter()
        .map(|&(s, p)| Axis {
            extent: match s.parse() {
                Ok(v) => b.constant(v),
                Err(_) => b.symbol(s),
            },
            parallel: p,
        })
        .collect()
}

fn input(
    b: &mut FusionBuilder,
    name: &str,
    dt: impl Into<DTypeSpec>,
    spec: &[(&str, ParallelType)],
) -> TensorId {
    let a = axes(b, spec);
    b.input(name, dt, &a).unwrap()
}

const T: DTypeSpec = DTypeSpec::Param(0);
const U: DTypeSpec = DTypeSpec::Param(1);

#[test]
fn a_dtype_parameter_equals_only_itself() {
    let mut b = FusionBuilder::with_dtype_params(&["T", "U"]);
    let x = input(&mut b, "x", T, &[("n", S)]);
    let y = input(&mut b, "y", U, &[("n", S)]);
    let z = input(&mut b, "z", DType::BF16, &[("n", S)]);
    let w = input(&mut b, "w", T, &[("n", S)]);
    let e = b.add(x, y).unwrap_err().to_string();
    assert_eq!(
        e,
        "add: `x` is `T` but `y` is `U`; convert one with `cast(x, T)`"
    );
    let e = b.mul(x, z).unwrap_err();
    assert_eq!(e.culprit(), Some(Culprit::Call));
    assert!(e.to_string().contains("`z` is `bf16`"), "{e}");
    let s = b.add(x, w).unwrap();
    assert_eq!(b.dtype(s), T);
    let c = b.cast(y, T).unwrap();
    let sc = b.add(s, c).unwrap();
    assert_eq!(b.dtype(sc), T);
    let f = b.cast(s, DType::F32).unwrap();
    assert_eq!(b.dtype(f), DTypeSpec::Fixed(DType::F32));
    let n = b.symbol("n");
    let e = b.declare(f, T, &[Axis::serial(n)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "declared element type `T`, but `T7` is `f32`; declare `f32` or convert with \
         `cast(x, T)`"
    );
    assert_eq!(e.culprit(), Some(Culprit::Arg(1)));
    assert!(
        b.cast(x, DTypeSpec::Param(2)).is_err(),
        "no third parameter"
    );
    b.output(s).unwrap();
    let e = b.build().unwrap_err().to_string();
    assert!(e.contains("generic over [\"T\", \"U\"]"), "{e}");
}

#[test]
fn a_poisoned_stand_in_is_checked_against_and_never_builds() {
    let mut b = FusionBuilder::new();
    let a = input(&mut b, "a", DType::F32, &[("m", S), ("n", S)]);
    let c = input(&mut b, "c", DType::F32, &[("m", S), ("k", S)]);
    let h_axes = axes(&mut b, &[("m", S), ("n", S)]);
    let h = b.poisoned(DType::F32, &h_axes, DeviceMesh::World).unwrap();
    b.name(h, "h");
    // What reads the stand-in is checked with its declared type...
    let e = b.add(h, c).unwrap_err().to_string();
    assert!(
        e.contains("axis 1 of `h` has extent `n` but axis 1 of `c` has extent `k`"),
        "{e}"
    );
    // ... and what is computed from it is poisoned too.
    let r = b.add(h, a).unwrap();
    assert!(b.is_poisoned(r) && !b.is_poisoned(a));
    b.output(r).unwrap();
    assert!(b
        .build()
        .unwrap_err()
        .to_string()
        .contains("a definition failed"));
}

#[test]
fn errors_name_the_argument_at_fault() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", DType::F32, &[("4", S), ("8", S)]);
    let d = input(&mut b, "d", DType::F32, &[("d", Dx), ("8", S)]);
    let at = |r: Result<TensorId>| r.unwrap_err().culprit();
    let el = |arg, index| Some(Culprit::Element { arg, index });
    assert_eq!(at(b.sum(x, &[0, 2])), el(1, 1));
    assert_eq!(at(b.sum(x, &[1, 1])), el(1, 1));
    assert_eq!(at(b.sum(d, &[])), Some(Culprit::Arg(1)));
    assert_eq!(at(b.broadcast(x, &[true, false])), Some(Culprit::Arg(1)));
    let (four, six, nine, three) = (b.constant(4), b.constant(6), b.constant(9), b.constant(3));
    assert_eq!(at(b.select(x, 0, four)), Some(Culprit::Arg(2)));
    assert_eq!(at(b.select(x, 2, four)), Some(Culprit::Arg(1)));
    assert_eq!(at(b.select(d, 0, four)), Some(Culprit::Arg(1)));
    assert_eq!(
        at(b.slice(x, 1, six, nine)),
        Some(Culprit::Args { first: 2, last: 3 })
    );
    assert_eq!(at(b.split(x, 1, three)), Some(Culprit::Arg(2)));
    let e = b.split(x, 1, three).unwrap_err().to_string();
    assert_eq!(
        e,
        "split: axis 1 of `x` has extent 8, which is not divisible by 3; the outer extent must \
         divide it"
    );
    // A contraction over DIDx blames the operand; mismatched extents the call.
    let w = input(&mut b, "w", DType::F32, &[("d", S), ("8", S)]);
    let dt = input(&mut b, "dt", DType::F32, &[("8", S), ("d", Dx)]);
    assert_eq!(at(b.matmul(dt, w)), Some(Culprit::Arg(0)));
    assert_eq!(at(b.matmul(x, x)), Some(Culprit::Call));
    let v = input(&mut b, "v", DType::F32, &[("8", S)]);
    assert_eq!(at(b.linear(x, v, None)), Some(Culprit::Arg(1)));
    // Declarations: the dtype, the axis list, one axis.
    let k = b.symbol("k");
    let e = b.declare(x, DType::F32, &[Axis::serial(k)]).unwrap_err();
    assert_eq!(e.culprit(), Some(Culprit::Arg(2)));
    assert!(
        e.to_string().contains("its type is `Tensor<f32, [4, 8]>`"),
        "{e}"
    );
    let ax = axes(&mut b, &[("4", S), ("k", S)]);
    assert_eq!(at(b.declare(x, DType::F32, &ax)), el(2, 1));
    let ax = axes(&mut b, &[("4", St), ("8", St)]);
    assert_eq!(at(b.declare(x, DType::F32, &ax)), el(2, 1));
    let ax = axes(&mut b, &[("s", St), ("m", S)]);
    assert_eq!(at(b.input("in", DType::F32, &ax)), el(2, 0));
    let ax = axes(&mut b, &[("m", S)]);
    let twice = DeviceMesh::devices([0, 1, 0]);
    assert_eq!(at(b.input_on("in", DType::F32, &ax, twice)), el(3, 2));
    let none = DeviceMesh::devices([]);
    assert_eq!(
        at(b.declare_on(x, DType::F32, &ax, none)),
        Some(Culprit::Arg(3))
    );
}

#[test]
fn literal_comparisons_are_recorded() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", DType::F32, &[("8", S), ("16", S)]);
    let y = input(&mut b, "y", DType::F32, &[("16", S), ("4", S)]);
    let m = b.matmul(x, y).unwrap();
    let two = b.constant(2);
    b.split(m, 1, two).unwrap();
    assert_eq!(
        b.literal_facts(),
        [
            LiteralFact::Eq(16, 16),
            LiteralFact::Divides { n: 4, by: 2 }
        ]
    );
}

#[test]
fn re_declaring_the_same_layout_adds_no_copy() {
    let mut b = FusionBuilder::new();
    let a = input(&mut b, "a", DType::F32, &[("m", S), ("n", S)]);
    let st = axes(&mut b, &[("m", St), ("n", S)]);
    let y = b.unary(UnaryOp::Relu, a).unwrap();
    let y = b.declare(y, DType::F32, &st).unwrap();
    let count = b.fusion().tensor_count();
    assert_eq!(b.declare(y, DType::F32, &st).unwrap(), y);
    assert_eq!(b.fusion().tensor_count(), count);
    // Another layout or another mesh copies.
    let serial = axes(&mut b, &[("m", S), ("n", S)]);
    assert_ne!(b.declare(y, DType::F32, &serial).unwrap(), y);
    let on = b
        .declare_on(y, DType::F32, &st, DeviceMesh::devices([0]))
        .unwrap();
    assert_ne!(on, y);
    assert_eq!(b.fusion().tensor(on).mesh, DeviceMesh::devices([0]));
}

#[test]
fn problems_are_all_found_once_each_with_their_site() {
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", DType::F32, &[("d", Dx), ("m", S), ("h", S)]);
    let w = input(&mut b, "w", DType::F32, &[("d", Dx), ("h", S), ("f", S)]);
    let e = input(&mut b, "e", DType::F32, &[("e", Dx), ("f", S)]);
    let flags = [false, true, false, false];
    let xb = b.broadcast(x, &flags).unwrap();
    let h = b.matmul(xb, w).unwrap();
    let g = b.unary(UnaryOp::Gelu, h).unwrap();
    let s = b.reduce(ReduceOp::Sum, e, &[1]).unwrap();
    b.output(g).unwrap();
    b.output(s).unwrap();
    let found = problems(b.fusion());
    // `e`'s DIDx extent, then the matmul's two DIDx axes; `g` inherits those.
    let sites: Vec<Site> = found.iter().map(|p| p.0).collect();
    assert_eq!(
        sites,
        [
            Site::Tensor {
                tensor: e,
                axis: Some(0)
            },
            Site::Tensor {
                tensor: h,
                axis: Some(1)
            }
        ]
    );
    assert!(found[0]
        .1
        .to_string()
        .contains("DIDx extent `e` differs from `d`"));
    assert!(found[1]
        .1
        .to_string()
        .contains("`matmul` takes DIDx axes from two operands"));
    assert_eq!(validate(b.fusion()), Err(found[0].1.clone()));
}

/// `up: [d @ Stream, ..] = matmul(rows, w1); y: [d @ Stream, ..] = matmul(gelu(up), w2)`:
/// the activation between two streamed matmuls is streamed too (one loop, not two), while
/// a matmul feeding a streamed matmul directly is left alone.
#[test]
fn a_streamed_matmul_streams_its_elementwise_operand() {
    let dt = DType::F32;
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", dt, &[("d", Dx), ("m", S), ("h", S)]);
    let w1 = input(&mut b, "w1", dt, &[("d", Dx), ("h", S), ("f", S)]);
    let w2 = input(&mut b, "w2", dt, &[("d", Dx), ("f", S), ("h", S)]);
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let up = b.matmul(rows, w1).unwrap();
    let tu = axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("f", S)]);
    let up = b.declare(up, dt, &tu).unwrap();
    let act = b.unary(UnaryOp::GeluTanh, up).unwrap();
    let y = b.matmul(act, w2).unwrap();
    let ty = axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("h", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    assert_eq!(f.find_parallel_axis(act, ParallelType::Stream), Some(0));
    // Without the activation, the first matmul is not re-annotated by the second.
    let mut b = FusionBuilder::new();
    let x = input(&mut b, "x", dt, &[("m", S), ("h", S)]);
    let w1 = input(&mut b, "w1", dt, &[("h", S), ("f", S)]);
    let w2 = input(&mut b, "w2", dt, &[("f", S), ("h", S)]);
    let up = b.matmul(x, w1).unwrap();
    let y = b.matmul(up, w2).unwrap();
    let ty = axes(&mut b, &[("m", St), ("h", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    assert_eq!(f.find_parallel_axis(up, ParallelType::Stream), None);
}

#[test]
fn a_weight_per_rank_makes_linear_a_batched_matmul_and_its_checks_name_linear() {
    let build = |w: &[(&str, ParallelType)], bias: Option<&[(&str, ParallelType)]>| {
        let mut b = FusionBuilder::new();
        let x = input(&mut b, "x", DType::F32, &[("d", Dx), ("3", S), ("4", S)]);
        let w = input(&mut b, "w", DType::F32, w);
        let bias = bias.map(|s| input(&mut b, "b", DType::F32, s));
        b.linear(x, w, bias)
            .map(|y| (b.fusion().visible_axes(y).len(), y))
    };
    let (rank, _) = build(&[("d", Dx), ("5", S), ("4", S)], None).unwrap();
    assert_eq!(rank, 3, "[d, 3, 5]");
    assert!(build(
        &[("d", Dx), ("5", S), ("4", S)],
        Some(&[("d", Dx), ("5", S)])
    )
    .is_ok());
    for (w, bias, says) in [
        (
            &[("d", Dx), ("5", S), ("3", S)][..],
            None,
            "last axis of the input",
        ),
        (&[("e", Dx), ("5", S), ("4", S)][..], None, "`w`"),
        (
            &[("d", Dx), ("5", S), ("4", S)][..],
            Some(&[("5", S)][..]),
            "`[.., n]`",
        ),
        (
            &[("d", Dx), ("5", S), ("4", S)][..],
            Some(&[("d", Dx), ("6", S)][..]),
            "weight's `n`",
        ),
    ] {
        let err = build(w, bias)
            .expect_err("a bad linear is refused")
            .to_string();
        assert!(err.starts_with("linear"), "{err}");
        assert!(err.contains(says), "{err}");
    }
}
