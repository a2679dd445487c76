//! The engine's conformance cases as builder code, shared by `tests/conformance.rs` (which
//! checks their programs and numbers) and `tests/macro_equivalence.rs` (which checks that
//! the `fusion!` versions build the same fusions). Each function builds one case.

use fusion::core::builder::{Axis, FusionBuilder};
use fusion::core::ir::{DeviceMesh, Fusion, ParallelType};
use fusion::DType;

use ParallelType::{DIDx as Dx, Serial as S, Stream as St};

/// The cases' dtype: `FUSION_TEST_DTYPE`, f32 by default.
#[allow(non_snake_case)]
fn F32() -> DType {
    super::test_dtype()
}

/// An axis list from `(symbol, parallel type)` pairs.
pub fn axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    spec.iter()
        .map(|&(s, p)| Axis {
            extent: b.symbol(s),
            parallel: p,
        })
        .collect()
}

// ---------------------------------------------------------------- single-device stream lowering

pub fn single_set_op() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    b.parallelize(t1, 0, St).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn two_set_ops() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    b.parallelize(t1, 0, St).unwrap();
    let t2 = b.set(t1).unwrap();
    b.parallelize(t2, 0, St).unwrap();
    b.output(t2).unwrap();
    b.build().unwrap()
}

pub fn three_set_ops_with_disjoint_for_loops() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    b.parallelize(t1, 0, St).unwrap();
    let t2 = b.set(t1).unwrap();
    let t3 = b.set(t2).unwrap();
    b.parallelize(t3, 0, St).unwrap();
    b.output(t3).unwrap();
    b.build().unwrap()
}

pub fn single_binary_op() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.input("t1", F32(), &a).unwrap();
    let t2 = b.add(t0, t1).unwrap();
    b.parallelize(t2, 0, St).unwrap();
    b.output(t2).unwrap();
    b.build().unwrap()
}

pub fn reduction() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[1]).unwrap();
    b.parallelize(t1, 0, St).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn matmul_m() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", F32(), &ta).unwrap();
    let w = b.input("b", F32(), &tb).unwrap();
    let c = b.matmul(x, w).unwrap();
    b.parallelize(c, 0, St).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

// ---------------------------------------------------------------- collective-based pipelines (seed 000)

pub fn stream_parallel_allgather() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("s", S), ("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    let o = axes(&mut b, &[("s", St), ("d", S), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn stream_parallel_allreduce() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("s", S), ("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[1]).unwrap();
    let o = axes(&mut b, &[("s", St), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn stream_parallel_reduce_scatter() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("s", S), ("d", Dx), ("d", S), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[1]).unwrap();
    let o = axes(&mut b, &[("s", St), ("d", Dx), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn ag_matmul() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("s", S), ("d", Dx), ("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", F32(), &ta).unwrap();
    let w = b.input("b", F32(), &tb).unwrap();
    let c = b.matmul(x, w).unwrap();
    let o = axes(&mut b, &[("s", St), ("d", S), ("m", S), ("n", S)]);
    let c = b.declare(c, F32(), &o).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

pub fn matmul_ar() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("s", S), ("d", Dx), ("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let x = b.input("a", F32(), &ta).unwrap();
    let w = b.input("b", F32(), &tb).unwrap();
    let p = b.matmul(x, w).unwrap();
    let po = axes(&mut b, &[("s", St), ("d", Dx), ("m", S), ("n", S)]);
    let p = b.declare(p, F32(), &po).unwrap();
    let r = b.sum(p, &[1]).unwrap();
    let ro = axes(&mut b, &[("s", St), ("m", S), ("n", S)]);
    let r = b.declare(r, F32(), &ro).unwrap();
    b.output(r).unwrap();
    b.build().unwrap()
}

pub fn matmul_rs_through_broadcast() -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("s", S), ("d", S), ("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let x = b.input("a", F32(), &ta).unwrap();
    let w = b.input("b", F32(), &tb).unwrap();
    let wb = b.broadcast(w, &[false, true, true, false, false]).unwrap();
    let p = b.matmul(x, wb).unwrap();
    let po = axes(
        &mut b,
        &[("d", Dx), ("s", St), ("d", S), ("m", S), ("n", S)],
    );
    let p = b.declare(p, F32(), &po).unwrap();
    let r = b.sum(p, &[0]).unwrap();
    let ro = axes(&mut b, &[("s", St), ("d", Dx), ("m", S), ("n", S)]);
    let r = b.declare(r, F32(), &ro).unwrap();
    b.output(r).unwrap();
    b.build().unwrap()
}

pub fn ag_linear_with_bias() -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("s", S), ("d", Dx), ("m", S), ("k", S)]);
    let tw = axes(&mut b, &[("n", S), ("k", S)]);
    let tbias = axes(&mut b, &[("n", S)]);
    let x = b.input("x", F32(), &tx).unwrap();
    let w = b.input("w", F32(), &tw).unwrap();
    let bias = b.input("bias", F32(), &tbias).unwrap();
    let y = b.linear(x, w, Some(bias)).unwrap();
    let o = axes(&mut b, &[("s", St), ("d", S), ("m", S), ("n", S)]);
    let y = b.declare(y, F32(), &o).unwrap();
    b.output(y).unwrap();
    b.build().unwrap()
}

// ---------------------------------------------------------------- P2P pipelines (seed 001)

pub fn allgather_p2p() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    let o = axes(&mut b, &[("d", St), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn ag_matmul_p2p(dtype: DType) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", dtype, &ta).unwrap();
    let w = b.input("b", dtype, &tb).unwrap();
    let c = b.matmul(x, w).unwrap();
    let o = axes(&mut b, &[("d", St), ("m", S), ("n", S)]);
    let c = b.declare(c, dtype, &o).unwrap();
    b.output(c).unwrap();
    b.build().unwrap()
}

// ---------------------------------------------------------------- reshardings without streams

pub fn reshard_allgather() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    let o = axes(&mut b, &[("d", S), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn reshard_allreduce() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[0]).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

pub fn reshard_reduce_scatter() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("d", S), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[0]).unwrap();
    let o = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// Scatter from device 0, the first of the input's mesh.
pub fn reshard_scatter() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", S), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    let o = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// Gather to device 0.
pub fn reshard_gather() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.set(t0).unwrap();
    let o = axes(&mut b, &[("d", S), ("m", S)]);
    let t1 = b.declare(t1, F32(), &o).unwrap();
    b.set_mesh(t1, DeviceMesh::devices([0]));
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// Broadcast from device `root` to all.
pub fn reshard_broadcast(root: usize) -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("m", S), ("n", S)]);
    let t0 = b
        .input_on("t0", F32(), &a, DeviceMesh::devices([root]))
        .unwrap();
    let t1 = b.set(t0).unwrap();
    b.set_mesh(t1, DeviceMesh::World);
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// Reduce to device 0.
pub fn reshard_reduce() -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", Dx), ("m", S)]);
    let t0 = b.input("t0", F32(), &a).unwrap();
    let t1 = b.sum(t0, &[0]).unwrap();
    b.set_mesh(t1, DeviceMesh::devices([0]));
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// Sharded on mesh `from` -> sharded on mesh `to` (same size).
pub fn reshard_send_recv(from: &[usize], to: &[usize]) -> Fusion {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("h", Dx), ("m", S)]);
    let t0 = b
        .input_on("t0", F32(), &a, DeviceMesh::devices(from.to_vec()))
        .unwrap();
    let t1 = b.set(t0).unwrap();
    b.set_mesh(t1, DeviceMesh::devices(to.to_vec()));
    b.output(t1).unwrap();
    b.build().unwrap()
}

/// GEMM + ReduceScatter as a P2P pipeline: each device's partial product, chunked by
/// destination along a Stream axis, summed over the DIDx axis into a DIDx-sharded result.
pub fn matmul_rs_p2p() -> Fusion {
    let dt = F32();
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", Dx), ("d", S), ("m", S), ("k", S)]);
    let tb = axes(&mut b, &[("d", Dx), ("k", S), ("n", S)]);
    let x = b.input("a", dt, &ta).unwrap();
    let w = b.input("b", dt, &tb).unwrap();
    let wb = b.broadcast(w, &[false, true, false, false]).unwrap();
    let p = b.matmul(x, wb).unwrap();
    let po = axes(&mut b, &[("d", Dx), ("d", St), ("m", S), ("n", S)]);
    let p = b.declare(p, dt, &po).unwrap();
    let r = b.sum(p, &[0]).unwrap();
    let ro = axes(&mut b, &[("d", Dx), ("m", S), ("n", S)]);
    let r = b.declare(r, dt, &ro).unwrap();
    b.output(r).unwrap();
    b.build().unwrap()
}
