//! The engine's conformance cases as builder code, shared by `tests/conformance.rs` (which
//! checks their programs and numbers) and `tests/macro_equivalence.rs` (which checks that
//! the `fusion!` versions build the same fusions). Each function builds one case.

use fusion::compiler::builder::{Axis, FusionBuilder};
use fusion::compiler::ir::{DeviceMesh, Fusion, ParallelType, UnaryOp};
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
    matmul_rs_p2p_in(F32())
}

/// [`matmul_rs_p2p`] in `dt`.
pub fn matmul_rs_p2p_in(dt: DType) -> Fusion {
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

// ---------------------------------------------------------------- transformer layers

/// The second half of a tensor-parallel block: `partial = matmul(act, w)` streamed over
/// the row blocks, `sum` over the DIDx axis into this device's row block (a
/// reduce-scatter), as the output.
fn reduce_scatter_block(
    mut b: FusionBuilder,
    dt: DType,
    act: fusion::compiler::ir::TensorId,
    w: fusion::compiler::ir::TensorId,
) -> Fusion {
    let p = b.matmul(act, w).unwrap();
    let tp = axes(&mut b, &[("d", St), ("d", Dx), ("m", S), ("h", S)]);
    let p = b.declare(p, dt, &tp).unwrap();
    b.name(p, "partial");
    let y = b.sum(p, &[1]).unwrap();
    let ty = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    let y = b.output(y).unwrap();
    b.name(y, "output");
    b.build().unwrap()
}

/// Declares the activation of a block `[d@Stream, d@DIDx, m, f]`: the Stream annotation
/// also streams the matmuls it is computed from.
fn stream_activation(
    b: &mut FusionBuilder,
    dt: DType,
    a: fusion::compiler::ir::TensorId,
) -> fusion::compiler::ir::TensorId {
    let ta = axes(b, &[("d", St), ("d", Dx), ("m", S), ("f", S)]);
    let a = b.declare(a, dt, &ta).unwrap();
    b.name(a, "act");
    a
}

/// The MLP block's inputs: x `[d@DIDx, m, h]`, W1 `[d@DIDx, h, f]`, W2 `[d@DIDx, f, h]`.
fn mlp_inputs(b: &mut FusionBuilder, dt: DType) -> [fusion::compiler::ir::TensorId; 3] {
    let tx = axes(b, &[("d", Dx), ("m", S), ("h", S)]);
    let t1 = axes(b, &[("d", Dx), ("h", S), ("f", S)]);
    let t2 = axes(b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w1 = b.input("w1", dt, &t1).unwrap();
    let w2 = b.input("w2", dt, &t2).unwrap();
    [x, w1, w2]
}

/// The sequence-parallel MLP block `ReduceScatter(act(AllGather(x) W1) W2)`: x `[d@DIDx, m,
/// h]` (rows), W1 `[d@DIDx, h, f]` (column blocks), W2 `[d@DIDx, f, h]` (row blocks). The
/// gathered rows' DIDx axis becomes the Stream axis of the first matmul, W1's stays DIDx
/// (the `fusion!` form: `let act: [d @ Stream, d @ DIDx, m, f] = act(matmul(broadcast(x), w1))`).
pub fn tp_mlp(dt: DType, act: UnaryOp) -> Fusion {
    let mut b = FusionBuilder::new();
    let [x, w1, w2] = mlp_inputs(&mut b, dt);
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let h = b.matmul(rows, w1).unwrap();
    let a = b.unary(act, h).unwrap();
    let a = stream_activation(&mut b, dt, a);
    reduce_scatter_block(b, dt, a, w2)
}

/// The MLP block with the weights broadcast instead of x (the layer benchmark's form
/// `bcast_w`): x's row blocks become the Stream axis at position 1, the weights' blocks
/// stay DIDx at position 0, and the partial sums reduce axis 0.
pub fn tp_mlp_bcast_w(dt: DType, act: UnaryOp) -> Fusion {
    let mut b = FusionBuilder::new();
    let [x, w1, w2] = mlp_inputs(&mut b, dt);
    let w1 = b.broadcast(w1, &[false, true, false, false]).unwrap();
    let h = b.matmul(x, w1).unwrap();
    let a = b.unary(act, h).unwrap();
    let ta = axes(&mut b, &[("d", Dx), ("d", St), ("m", S), ("f", S)]);
    let a = b.declare(a, dt, &ta).unwrap();
    b.name(a, "act");
    let w2 = b.broadcast(w2, &[false, true, false, false]).unwrap();
    let p = b.matmul(a, w2).unwrap();
    let tp = axes(&mut b, &[("d", Dx), ("d", St), ("m", S), ("h", S)]);
    let p = b.declare(p, dt, &tp).unwrap();
    b.name(p, "partial");
    let y = b.sum(p, &[0]).unwrap();
    let ty = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    let y = b.output(y).unwrap();
    b.name(y, "output");
    b.build().unwrap()
}

/// The MLP block with x given with an extent-1 axis (`[d@DIDx, 1, m, h]`) that W1's blocks
/// broadcast against, no `broadcast` op (the layer benchmark's form `x4`); its output's
/// first matmul axes are [d@Stream, d@DIDx, m, f].
pub fn tp_mlp_x4(dt: DType, act: UnaryOp) -> Fusion {
    let mut b = FusionBuilder::new();
    let one = b.constant(1);
    let mut tx = axes(&mut b, &[("d", Dx), ("m", S), ("m", S), ("h", S)]);
    tx[1].extent = one;
    let t1 = axes(&mut b, &[("d", Dx), ("h", S), ("f", S)]);
    let t2 = axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w1 = b.input("w1", dt, &t1).unwrap();
    let w2 = b.input("w2", dt, &t2).unwrap();
    let h = b.matmul(x, w1).unwrap();
    let a = b.unary(act, h).unwrap();
    let a = stream_activation(&mut b, dt, a);
    reduce_scatter_block(b, dt, a, w2)
}

/// The MLP block with a bias: `ReduceScatter(act(AllGather(x) W1 + b1) W2)`, b1 `[d@DIDx,
/// f]` (W1's column block's bias, broadcast over the rows: the form the first GEMM's
/// epilogue takes).
pub fn tp_mlp_bias(dt: DType, act: UnaryOp) -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let t1 = axes(&mut b, &[("d", Dx), ("h", S), ("f", S)]);
    let tb = axes(&mut b, &[("d", Dx), ("f", S)]);
    let t2 = axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w1 = b.input("w1", dt, &t1).unwrap();
    let b1 = b.input("b1", dt, &tb).unwrap();
    let w2 = b.input("w2", dt, &t2).unwrap();
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    let h = b.matmul(rows, w1).unwrap();
    let bias = b.broadcast(b1, &[false, true, false]).unwrap();
    let h = b.add(h, bias).unwrap();
    let a = b.unary(act, h).unwrap();
    let a = stream_activation(&mut b, dt, a);
    reduce_scatter_block(b, dt, a, w2)
}

/// The gated MLP block `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`; the two
/// projections share one gather of the rows.
pub fn tp_gated_mlp(dt: DType) -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let tg = axes(&mut b, &[("d", Dx), ("h", S), ("f", S)]);
    let td = axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let wg = b.input("wg", dt, &tg).unwrap();
    let wu = b.input("wu", dt, &tg).unwrap();
    let wd = b.input("wd", dt, &td).unwrap();
    let rows = b.broadcast(x, &[false, true, false, false]).unwrap();
    b.name(rows, "rows");
    let g = b.matmul(rows, wg).unwrap();
    let g = b.unary(UnaryOp::Silu, g).unwrap();
    let u = b.matmul(rows, wu).unwrap();
    let a = b.mul(g, u).unwrap();
    let a = stream_activation(&mut b, dt, a);
    reduce_scatter_block(b, dt, a, wd)
}

/// The column-parallel QKV projection from gathered rows: `AG(x) Wqkv`, Wqkv split by
/// columns; each device keeps every row of its column block `[d@Stream, d@DIDx, m, q]`.
pub fn tp_qkv(dt: DType) -> Fusion {
    qkv_as(dt, false)
}

/// [`tp_qkv`] with the weights broadcast instead of the rows: `matmul(x, broadcast(w))`
/// into `[d@DIDx, d@Stream, m, q]` (the Stream axis second).
pub fn tp_qkv_bcast_w(dt: DType) -> Fusion {
    qkv_as(dt, true)
}

/// The QKV projection with the rows broadcast against W's blocks, or (`weights_broadcast`)
/// the weights against x's.
fn qkv_as(dt: DType, weights_broadcast: bool) -> Fusion {
    let mut b = FusionBuilder::new();
    let tx = axes(&mut b, &[("d", Dx), ("m", S), ("h", S)]);
    let tw = axes(&mut b, &[("d", Dx), ("h", S), ("q", S)]);
    let x = b.input("x", dt, &tx).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    let flags = [false, true, false, false];
    let (y, blocks) = if weights_broadcast {
        let w = b.broadcast(w, &flags).unwrap();
        (b.matmul(x, w).unwrap(), [("d", Dx), ("d", St)])
    } else {
        let rows = b.broadcast(x, &flags).unwrap();
        (b.matmul(rows, w).unwrap(), [("d", St), ("d", Dx)])
    };
    let ty = axes(&mut b, &[blocks[0], blocks[1], ("m", S), ("q", S)]);
    let y = b.declare(y, dt, &ty).unwrap();
    let y = b.output(y).unwrap();
    b.name(y, "output");
    b.build().unwrap()
}

/// The row-parallel output projection + ReduceScatter: `RS(a Wo)`, a `[d, d@DIDx, m, f]`
/// (every row, a column block), Wo `[d@DIDx, f, h]` (the matching row block).
pub fn tp_out_proj(dt: DType) -> Fusion {
    let mut b = FusionBuilder::new();
    let ta = axes(&mut b, &[("d", S), ("d", Dx), ("m", S), ("f", S)]);
    let tw = axes(&mut b, &[("d", Dx), ("f", S), ("h", S)]);
    let a = b.input("a", dt, &ta).unwrap();
    let w = b.input("w", dt, &tw).unwrap();
    reduce_scatter_block(b, dt, a, w)
}
