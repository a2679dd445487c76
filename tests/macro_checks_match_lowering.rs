//! The reshardings `fusion!` rejects at compile time (rule 4, see `fusion-macros`' unit
//! tests and `tests/ui/two_shardings_at_once.rs`) are exactly ones the engine cannot lower:
//! each case here is the builder version of a rejected fusion, and lowering it fails.

use fusion::core::builder::{Axis, FusionBuilder};
use fusion::core::ir::{DeviceMesh, Fusion, ParallelType};
use fusion::core::lower::{lower, LowerOptions};
use fusion::DType;

use ParallelType::{DIDx as Dx, Serial as S};

const F32: DType = DType::F32;

fn axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    spec.iter()
        .map(|&(s, p)| Axis {
            extent: b.symbol(s),
            parallel: p,
        })
        .collect()
}

fn lowering_error(f: &Fusion) -> String {
    match lower(f, 4, &LowerOptions::default()) {
        Ok(_) => panic!("the engine lowers a fusion the macro rejects"),
        Err(e) => e.to_string(),
    }
}

/// `fn f<d>(a: Tensor<f32, [d @ DIDx, d]>) -> Tensor<f32, [d, d @ DIDx]> { a }`
#[test]
fn moving_a_didx_axis_in_one_copy() {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("d", S)]);
    let a = b.input("a", F32, &ta).unwrap();
    let o = axes(&mut b, &[("d", S), ("d", Dx)]);
    let y = b.declare(a, F32, &o).unwrap();
    b.output(y).unwrap();
    assert!(lowering_error(&b.build().unwrap()).contains("two shardings change at once"));
}

/// `sum(a, 2)` of `[d @ DIDx, d, m]` declared `[d, d @ DIDx]`.
#[test]
fn a_reduction_resharding_another_axis() {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("d", S), ("m", S)]);
    let a = b.input("a", F32, &ta).unwrap();
    let r = b.sum(a, &[2]).unwrap();
    let o = axes(&mut b, &[("d", S), ("d", Dx)]);
    let r = b.declare(r, F32, &o).unwrap();
    b.output(r).unwrap();
    assert!(lowering_error(&b.build().unwrap()).contains("two shardings change at once"));
}

/// `matmul(a, b)` of `a: [d @ DIDx, d, k]` declared `[d, d @ DIDx, n]`.
#[test]
fn a_compute_op_whose_input_must_move_its_didx_axis() {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("d", S), ("k", S)]);
    let tb = axes(&mut b, &[("k", S), ("n", S)]);
    let (x, w) = (
        b.input("a", F32, &ta).unwrap(),
        b.input("b", F32, &tb).unwrap(),
    );
    let c = b.matmul(x, w).unwrap();
    let o = axes(&mut b, &[("d", S), ("d", Dx), ("n", S)]);
    let c = b.declare(c, F32, &o).unwrap();
    b.output(c).unwrap();
    assert!(lowering_error(&b.build().unwrap()).contains("two shardings change at once"));
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
    let y = b
        .declare(a, F32, &[Axis::stream(two), Axis::serial(m)])
        .unwrap();
    b.set_mesh(y, DeviceMesh::devices([2, 3]));
    b.output(y).unwrap();
    assert!(lowering_error(&b.build().unwrap()).contains("same mesh"));
}

/// Sharded on `[0, 1]` to sharded on `[1, 2, 3]`.
#[test]
fn a_sharded_copy_between_meshes_of_different_sizes() {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("h", Dx), ("m", S)]);
    let a = b
        .input_on("a", F32, &ta, DeviceMesh::devices([0, 1]))
        .unwrap();
    let y = b.declare(a, F32, &ta).unwrap();
    b.set_mesh(y, DeviceMesh::devices([1, 2, 3]));
    b.output(y).unwrap();
    assert!(lowering_error(&b.build().unwrap()).contains("meshes of different sizes"));
}
