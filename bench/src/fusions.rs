//! The fusions the tools time (the overlap and layer benchmarks, host costs), written with
//! the builder. Shapes are per rank; `d` is the device count.
//!
//! AG+GEMM: A is `[M, K]` row-sharded (each rank holds `[M/d, K]`), B `[K, N]` replicated.
//! GEMM+RS: A is `[M, K]` column-sharded (each rank `[M, K/d]`), B `[K/d, N]` per rank, and
//! the result `A B` is reduce-scattered over M.

use fusion::compiler::builder::{Axis, FusionBuilder};
use fusion::compiler::ir::BinaryOp;
use fusion::compiler::ir::{Fusion, ParallelType};
use fusion::{DType, Result};

use ParallelType::{DIDx as D, Serial as S, Stream as St};

/// One axis per `(symbol name, parallel type)`, the symbol made (or found) by name.
pub fn axes(b: &mut FusionBuilder, spec: &[(&str, ParallelType)]) -> Vec<Axis> {
    spec.iter()
        .map(|&(s, p)| Axis {
            extent: b.symbol(s),
            parallel: p,
        })
        .collect()
}

/// Allgather alone: `[d@DIDx, m, k] -> [d, m, k]`.
pub fn allgather(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", D), ("m", S), ("k", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.set(x)?;
    let o = axes(&mut b, &[("d", S), ("m", S), ("k", S)]);
    let y = b.declare(y, dt, &o)?;
    b.output(y)?;
    Ok(b.build()?)
}

/// One device's GEMM: `[g, m, k] @ [k, n] -> [g, m, n]`.
pub fn gemm(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("g", S), ("m", S), ("k", S)]);
    let w = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.input("b", dt, &w)?;
    let c = b.matmul(x, y)?;
    b.output(c)?;
    Ok(b.build()?)
}

/// AG+GEMM as a P2P pipeline over the devices: `[d@DIDx, m, k] @ [k, n] -> [d@Stream, m, n]`.
/// With stream lowering off it is the sequential version (allgather, then one GEMM).
pub fn ag_matmul_p2p(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", D), ("m", S), ("k", S)]);
    let w = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.input("b", dt, &w)?;
    let c = b.matmul(x, y)?;
    let o = axes(&mut b, &[("d", St), ("m", S), ("n", S)]);
    let c = b.declare(c, dt, &o)?;
    b.output(c)?;
    Ok(b.build()?)
}

/// AG+GEMM as a collective pipeline of `s` chunks: `[s, d@DIDx, m, k] -> [s@Stream, d, m, n]`.
pub fn ag_matmul_collective(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("s", S), ("d", D), ("m", S), ("k", S)]);
    let w = axes(&mut b, &[("k", S), ("n", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.input("b", dt, &w)?;
    let c = b.matmul(x, y)?;
    let o = axes(&mut b, &[("s", St), ("d", S), ("m", S), ("n", S)]);
    let c = b.declare(c, dt, &o)?;
    b.output(c)?;
    Ok(b.build()?)
}

/// ReduceScatter alone: partials `[d@DIDx, d, m, n] -> [d@DIDx, m, n]` summed over devices.
pub fn reduce_scatter(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", D), ("d", S), ("m", S), ("n", S)]);
    let x = b.input("p", dt, &a)?;
    let r = b.sum(x, &[0])?;
    let o = axes(&mut b, &[("d", D), ("m", S), ("n", S)]);
    let r = b.declare(r, dt, &o)?;
    b.output(r)?;
    Ok(b.build()?)
}

/// GEMM+RS as a P2P pipeline: partial chunk `j` (destination `j`) computed on a Stream
/// axis and summed at its owner. With stream lowering off: one GEMM, then ReduceScatter.
pub fn matmul_rs_p2p(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", D), ("d", S), ("m", S), ("k", S)]);
    let w = axes(&mut b, &[("d", D), ("k", S), ("n", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.input("b", dt, &w)?;
    let yb = b.broadcast(y, &[false, true, false, false])?;
    let p = b.matmul(x, yb)?;
    let po = axes(&mut b, &[("d", D), ("d", St), ("m", S), ("n", S)]);
    let p = b.declare(p, dt, &po)?;
    let r = b.sum(p, &[0])?;
    let ro = axes(&mut b, &[("d", D), ("m", S), ("n", S)]);
    let r = b.declare(r, dt, &ro)?;
    b.output(r)?;
    Ok(b.build()?)
}

/// GEMM+RS as a collective pipeline of `s` chunks (a ReduceScatter per chunk).
pub fn matmul_rs_collective(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("d", D), ("s", S), ("d", S), ("m", S), ("k", S)]);
    let w = axes(&mut b, &[("d", D), ("k", S), ("n", S)]);
    let x = b.input("a", dt, &a)?;
    let y = b.input("b", dt, &w)?;
    let yb = b.broadcast(y, &[false, true, true, false, false])?;
    let p = b.matmul(x, yb)?;
    let po = axes(&mut b, &[("d", D), ("s", St), ("d", S), ("m", S), ("n", S)]);
    let p = b.declare(p, dt, &po)?;
    let r = b.sum(p, &[0])?;
    let ro = axes(&mut b, &[("s", St), ("d", D), ("m", S), ("n", S)]);
    let r = b.declare(r, dt, &ro)?;
    b.output(r)?;
    Ok(b.build()?)
}

/// `(Σ (x - y)², Σ y²)` in f32 over 4-D tensors: the relative error's two parts.
pub fn squared_error(dt: DType) -> Result<Fusion> {
    let mut b = FusionBuilder::new();
    let a = axes(&mut b, &[("p", S), ("q", S), ("r", S), ("t", S)]);
    let x = b.input("x", dt, &a)?;
    let y = b.input("y", dt, &a)?;
    let (x, y) = (b.cast(x, DType::F32)?, b.cast(y, DType::F32)?);
    let diff = b.binary(BinaryOp::Sub, x, y)?;
    let mut sums = Vec::new();
    for v in [diff, y] {
        let sq = b.mul(v, v)?;
        let mut s = b.sum(sq, &[3])?;
        for axis in [2, 1, 0] {
            s = b.sum(s, &[axis])?;
        }
        sums.push(s);
    }
    b.output(sums[0])?;
    b.output(sums[1])?;
    Ok(b.build()?)
}
