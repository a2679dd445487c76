//! Matmul + ReduceScatter, pipelined over stream chunks: each device holds one block of
//! the contracted dimension, computes partial products for every output block, and a
//! ReduceScatter per chunk sums them so that each device keeps its own block of the
//! result, overlapping the next chunk's matmul. `b` is broadcast over the chunk and
//! output-block axes inside the fusion.
//!
//! ```sh
//! cargo run --release --example matmul_rs -- --devices 4 -s 4 -m 32 -k 256 -n 256
//! ```

#[path = "common/mod.rs"]
mod common;

use common::{checked, matmul_ref, rel_error, to_f64, Report, Run};
use fusion::prelude::*;

fusion! {
    /// `c[:, j] = sum over devices i of a[i, :, j] @ b[i]`, each device keeping
    /// its block `j`; a ReduceScatter per chunk of `s`.
    #[allow(dead_code)] // the lesson calls `matmul_rs::call`, which takes options
    pub fn matmul_rs<T: Float, d, s, m, k, n>(
        a: Tensor<T, [d @ DIDx, s, d, m, k]>,
        b: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [s @ Stream, d @ DIDx, m, n]> {
        let partial: Tensor<T, [d @ DIDx, s @ Stream, d, m, n]> =
            matmul(a, broadcast(b, [false, true, true, false, false]));
        sum(partial, 0)
    }
}

/// Matmul + ReduceScatter pipelined over stream chunks, checked against a host reference.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Chunks (the Stream axis)
    #[arg(short, default_value_t = 4)]
    s: usize,
    /// Rows per chunk and output block
    #[arg(short, default_value_t = 256)]
    m: usize,
    /// Contracted dimension per device
    #[arg(short, default_value_t = 256)]
    k: usize,
    /// Columns of the result
    #[arg(short, default_value_t = 256)]
    n: usize,
}

fn main() -> std::process::ExitCode {
    common::main(lesson)
}

/// `a` and `b` sharded on the contracted dimension; each device keeps its block of `c`.
fn lesson(dims: &Dims, run: &Run) -> fusion::Result<Report> {
    let (s, d, m, k, n) = (dims.s, run.devices(), dims.m, dims.k, dims.n);
    let a = run.randn(&[d, s, d, m, k], 1);
    let b = run.randn(&[d, k, n], 2);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<(Ranked<5>, Ranked<3>)> {
            Ok((
                rank.shard(&a, 0)?.try_into()?,
                rank.shard(&b, 0)?.try_into()?,
            ))
        },
        |rank, (a, b)| Ok(matmul_rs::call(rank, a, b, &opts)?.into_inner()),
        |rank, (a, b)| Ok(matmul_rs::program(rank, a, b, &opts)?.to_string()),
    )?;
    let macs = (d * s * d * m * k * n) as f64;
    let error = checked(macs, || {
        let (av, bv) = (to_f64(&a)?, to_f64(&b)?);
        // expected[s][j] = sum_i a[i][s][j] @ b[i], laid out [s, d, m, n].
        let mut expected = vec![0.0; s * d * m * n];
        for i in 0..d {
            let blocks = &av[i * s * d * m * k..][..s * d * m * k];
            let part = matmul_ref(blocks, &bv[i * k * n..][..k * n], s * d, m, k, n);
            for (e, p) in expected.iter_mut().zip(part) {
                *e += p;
            }
        }
        // Each rank holds its block j = rank of axis 1; put them back together.
        let gathered = concat(&timed.outputs, 1)?;
        rel_error(&gathered, &expected)
    })?;
    Ok(Report {
        what: "matmul + ReduceScatter, pipelined over stream chunks",
        shapes: format!(
            "a {:?} sharded on axis 0, b {:?} sharded on axis 0 -> c [{s}, {d}, {m}, {n}] \
             sharded on axis 1",
            a.shape(),
            b.shape()
        ),
        error,
        timed,
        flops_per_device: Some(2.0 * macs / d as f64),
        lowerings: matmul_rs::lowering_count(),
    })
}
