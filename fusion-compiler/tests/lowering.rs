//! Lowering, from `fusion-compiler` alone: the pass framework, build-time and lowering-time
//! errors, and the check that finds, before the world size is known, what lowering will
//! reject (`fusion_compiler::lower::check`, which `fusion!` runs at compile time): each
//! fusion it rejects fails to lower on every world of two or more devices, and each
//! rejection names the expression at fault.

use fusion_compiler::builder::Site;
use fusion_compiler::builder::{Axis, FusionBuilder};
use fusion_compiler::ir::{DeviceMesh, Fusion, ParallelType};
use fusion_compiler::lower::{check, lower, LowerOptions};
use fusion_compiler::{DType, Error};

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

const F32: DType = DType::F32;

fn sym_axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    let axis = |&(s, parallel): &(&str, ParallelType)| Axis {
        extent: b.symbol(s),
        parallel,
    };
    spec.iter().map(axis).collect()
}

/// AllGather + matmul: as the P2P pipeline (`[d @ DIDx, m, k] x [k, n]` to
/// `[d @ Stream, m, n]`), or, `chunked`, as the collective in a loop over `s` chunks.
fn ag_matmul(chunked: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let (lead, out): (&[_], &[_]) = match chunked {
        true => (&[("s", S)], &[("s", St), ("d", S)]),
        false => (&[], &[("d", St)]),
    };
    let ta = sym_axes(&mut b, &[lead, &[("d", Dx), ("m", S), ("k", S)]].concat());
    let tb = sym_axes(&mut b, &[("k", S), ("n", S)]);
    let (x, w) = (
        b.input("a", F32, &ta).unwrap(),
        b.input("b", F32, &tb).unwrap(),
    );
    let c = b.matmul(x, w).unwrap();
    let o = sym_axes(&mut b, &[out, &[("m", S), ("n", S)]].concat());
    let c = b.declare(c, F32, &o).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

#[test]
fn unknown_pass_names_are_rejected() {
    let err = lower(
        &ag_matmul(false),
        2,
        &LowerOptions::default().without_pass("StreamParalelType"),
    )
    .unwrap_err();
    assert!(
        matches!(err, fusion_compiler::Error::UnknownPass(..)),
        "{err}"
    );
    assert!(
        err.to_string().contains("StreamParallelType"),
        "lists the known passes: {err}"
    );
    assert!(
        err.to_string()
            .ends_with("did you mean `StreamParallelType`?"),
        "{err}"
    );
}

#[test]
fn disabling_communication_conversion_is_an_error_not_a_wrong_program() {
    let opts = LowerOptions::default().without_pass("ConvertOpToCommunication");
    let err = lower(&ag_matmul(true), 2, &opts).unwrap_err();
    assert!(
        err.to_string().contains("ConvertOpToCommunication"),
        "{err}"
    );
}

#[test]
fn dumps_are_recorded_after_each_pass() {
    let mut opts = LowerOptions::default();
    opts.passes.dump_each = true;
    let lowered = lower(&ag_matmul(false), 4, &opts).unwrap();
    let names: Vec<&str> = lowered.dumps.iter().map(|d| d.pass).collect();
    assert_eq!(
        names,
        [
            "StreamParallelType",
            "ConvertOpToCommunication",
            "FuseEpilogue",
            "FuseElementwise",
            "InsertDeallocations"
        ]
    );
    assert!(lowered.dumps[0].program.contains("FOR StreamIdx"));
    assert!(!lowered.dumps[3].program.contains("Deallocate"));
    assert!(lowered.dumps[4].program.contains("Deallocate"));
}

#[test]
fn stream_parallel_inputs_are_rejected() {
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("m", St), ("n", S)]);
    let err = b.input("x", F32, &a).unwrap_err();
    assert!(
        matches!(err, fusion_compiler::Error::Parallelization { ref tensor, axis: Some(0), .. } if tensor == "x"),
        "{err}"
    );
}

#[test]
fn a_split_stream_axis_is_rejected() {
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("m", S), ("n", S)]);
    let x = b.input("x", F32, &a).unwrap();
    let y = b.set(x).unwrap();
    b.parallelize(y, 0, St).unwrap();
    let two = b.constant(2);
    let err = b.split(y, 0, two).unwrap_err();
    assert!(err.to_string().contains("whole logical axis"), "{err}");
    // Streaming an axis a split produced is rejected when the fusion is built.
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("m", S), ("n", S)]);
    let x = b.input("x", F32, &a).unwrap();
    let two = b.constant(2);
    let y = b.split(x, 0, two).unwrap();
    let z = b.set(y).unwrap();
    b.parallelize(y, 0, St).unwrap();
    b.output(z).unwrap();
    let err = b.build().unwrap_err();
    assert!(err.to_string().contains("Stream"), "{err}");
}

#[test]
fn an_op_the_stream_lowering_cannot_host_is_an_error() {
    // linear streamed over its N axis (the weight's rows) has no slice-wise form.
    let mut b = FusionBuilder::new();
    let tx = sym_axes(&mut b, &[("m", S), ("k", S)]);
    let tw = sym_axes(&mut b, &[("n", S), ("k", S)]);
    let x = b.input("x", F32, &tx).unwrap();
    let w = b.input("w", F32, &tw).unwrap();
    let y = b.linear(x, w, None).unwrap();
    b.parallelize(y, 1, St).unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let err = lower(&f, 2, &LowerOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            fusion_compiler::Error::StreamLowering { axis: Some(1), .. }
        ),
        "{err}"
    );
}

#[test]
fn two_shardings_changing_at_once_are_rejected() {
    let mut b = FusionBuilder::new();
    let a = sym_axes(&mut b, &[("d", Dx), ("d", S)]);
    let x = b.input("x", F32, &a).unwrap();
    let y = b.set(x).unwrap();
    let o = sym_axes(&mut b, &[("d", S), ("d", Dx)]);
    let y = b.declare(y, F32, &o).unwrap();
    b.output(y).unwrap();
    let err = lower(&b.build().unwrap(), 2, &LowerOptions::default()).unwrap_err();
    assert!(err.to_string().contains("all-to-all"), "{err}");
}

// ------------------------------------------------------- what lowering rejects, found early

/// `check` rejects `f` with one error, at expression `expr` of the fusion, containing
/// `says`; lowering rejects it too, on every world of 2 to 8 devices.
fn rejected(f: &Fusion, expr: usize, says: &str) {
    let found = check(f);
    assert_eq!(found.len(), 1, "{found:?}");
    let (site, err) = &found[0];
    assert!(
        matches!(site, Site::Expr(e) if e.index() == expr),
        "{site:?}: {err}"
    );
    assert!(err.to_string().contains(says), "{err}");
    for d in 2..=8 {
        let lowered = lower(f, d, &LowerOptions::default());
        assert!(
            lowered.is_err(),
            "{d} devices lower what the check rejects: {err}"
        );
    }
}

/// `[d @ DIDx, d]` copied to `[d, d @ DIDx]`: an all-to-all.
#[test]
fn moving_a_didx_axis_in_one_copy() {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("d", Dx), ("d", S)]);
    let a = b.input("a", F32, &ta).unwrap();
    let o = sym_axes(&mut b, &[("d", S), ("d", Dx)]);
    let y = b.declare(a, F32, &o).unwrap();
    b.output(y).unwrap();
    rejected(&b.build().unwrap(), 0, "two shardings change at once");
}

/// `sum(a, 2)` of `[d @ DIDx, d, m]` declared `[d, d @ DIDx]`.
#[test]
fn a_reduction_resharding_another_axis() {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("d", Dx), ("d", S), ("m", S)]);
    let a = b.input("a", F32, &ta).unwrap();
    let r = b.sum(a, &[2]).unwrap();
    let o = sym_axes(&mut b, &[("d", S), ("d", Dx)]);
    let r = b.declare(r, F32, &o).unwrap();
    b.output(r).unwrap();
    rejected(&b.build().unwrap(), 0, "keeping the sharding of `a`");
}

/// `matmul(a, b)` of `a: [d @ DIDx, d, k]` declared `[d, d @ DIDx, n]`.
#[test]
fn a_compute_op_whose_input_must_move_its_didx_axis() {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("d", Dx), ("d", S), ("k", S)]);
    let tb = sym_axes(&mut b, &[("k", S), ("n", S)]);
    let (x, w) = (
        b.input("a", F32, &ta).unwrap(),
        b.input("b", F32, &tb).unwrap(),
    );
    let c = b.matmul(x, w).unwrap();
    let o = sym_axes(&mut b, &[("d", S), ("d", Dx), ("n", S)]);
    let c = b.declare(c, F32, &o).unwrap();
    b.output(c).unwrap();
    rejected(
        &b.build().unwrap(),
        0,
        "its input `a` would have to be resharded",
    );
}

/// DIDx on mesh `[0, 1]` to Stream on mesh `[2, 3]`.
#[test]
fn a_p2p_pipeline_across_meshes() {
    let mut b = FusionBuilder::new();
    let (two, m) = (b.constant(2), b.symbol("m"));
    let mesh = DeviceMesh::devices([0, 1]);
    let a = b
        .input_on("a", F32, &[Axis::didx(two), Axis::serial(m)], mesh)
        .unwrap();
    let to = [Axis::stream(two), Axis::serial(m)];
    let y = b
        .declare_on(a, F32, &to, DeviceMesh::devices([2, 3]))
        .unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let found = check(&f);
    assert!(found[0].1.to_string().contains("same mesh"), "{found:?}");
    assert!(lower(&f, 4, &LowerOptions::default()).is_err());
}

/// Sharded on `[0, 1]` to sharded on `[1, 2, 3]`.
#[test]
fn a_sharded_copy_between_meshes_of_different_sizes() {
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("h", Dx), ("m", S)]);
    let a = b
        .input_on("a", F32, &ta, DeviceMesh::devices([0, 1]))
        .unwrap();
    let y = b
        .declare_on(a, F32, &ta, DeviceMesh::devices([1, 2, 3]))
        .unwrap();
    b.output(y).unwrap();
    let f = b.build().unwrap();
    let found = check(&f);
    assert!(
        found[0].1.to_string().contains("meshes of one size"),
        "{found:?}"
    );
    assert!(lower(&f, 4, &LowerOptions::default()).is_err());
}

/// What lowers (an Allgather, a Scatter, the P2P pipeline, a world-size-dependent
/// broadcast) is not rejected; a problem of the whole fusion comes with its tensor.
#[test]
fn check_accepts_what_lowers_and_places_problems() {
    for (from, to) in [(Dx, S), (S, Dx)] {
        let mut b = FusionBuilder::new();
        let ta = sym_axes(&mut b, &[("d", from), ("m", S)]);
        let a = b.input("a", F32, &ta).unwrap();
        let o = sym_axes(&mut b, &[("d", to), ("m", S)]);
        let y = b.declare(a, F32, &o).unwrap();
        b.output(y).unwrap();
        assert_eq!(check(&b.build().unwrap()), []);
    }
    assert_eq!(check(&ag_matmul(false)), []);
    let mut b = FusionBuilder::new();
    let ta = sym_axes(&mut b, &[("m", S)]);
    let a = b.input_on("a", F32, &ta, DeviceMesh::devices([0])).unwrap();
    let y = b.declare_on(a, F32, &ta, DeviceMesh::World).unwrap();
    b.output(y).unwrap();
    assert_eq!(
        check(&b.build().unwrap()),
        [],
        "a broadcast needs the world size"
    );
    let mut b = FusionBuilder::new();
    let x = sym_axes(&mut b, &[("d", Dx), ("m", S)]);
    let a = b.input("a", F32, &x).unwrap();
    let y = sym_axes(&mut b, &[("e", Dx), ("m", S)]);
    let c = b.input("c", F32, &y).unwrap();
    b.output(a).unwrap();
    let found = check(b.fusion());
    let at = Site::Tensor {
        tensor: c,
        axis: Some(0),
    };
    assert_eq!(found.iter().map(|p| p.0).collect::<Vec<_>>(), [at]);
    assert!(matches!(found[0].1, Error::Parallelization { .. }));
}
