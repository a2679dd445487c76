//! AllGather + matmul, pipelined over stream chunks (nvFuser's collective-based
//! overlap, seed 000): `a` is sharded over the devices; each of its `s` chunks is gathered
//! with an Allgather on a worker stream while earlier chunks are multiplied.
//!
//! ```sh
//! cargo run --release --example ag_matmul -- --devices 4 -s 4 -m 64 -k 256 -n 256 --dump
//! ```

#[path = "common/mod.rs"]
mod common;

use common::{checked, matmul_ref, to_f64, worst_error, Report, Run};
use fusion::prelude::*;

fusion! {
    /// `c = allgather(a) @ b`, pipelined over the `s` chunks of `a`.
    #[allow(dead_code)] // the lesson calls `ag_matmul::call`, which takes options
    pub fn ag_matmul<T: Float, s, d, m, k, n>(
        a: Tensor<T, [s, d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [s @ Stream, d, m, n]> {
        matmul(a, b)
    }
}

/// AllGather + matmul pipelined over stream chunks, checked against a host reference.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Chunks (the Stream axis)
    #[arg(short, default_value_t = 4)]
    s: usize,
    /// Rows per chunk and device
    #[arg(short, default_value_t = 256)]
    m: usize,
    /// Contracted dimension
    #[arg(short, default_value_t = 256)]
    k: usize,
    /// Columns of the result
    #[arg(short, default_value_t = 256)]
    n: usize,
}

fn main() -> std::process::ExitCode {
    common::main(lesson)
}

/// `a` sharded on its device axis, `b` on every device; every device gets all of `c`.
fn lesson(dims: &Dims, run: &Run) -> fusion::Result<Report> {
    let (s, d, m, k, n) = (dims.s, run.devices(), dims.m, dims.k, dims.n);
    let a = run.randn(&[s, d, m, k], 1);
    let b = run.randn(&[k, n], 2);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<(Ranked<4>, Ranked<2>)> {
            Ok((
                rank.shard(&a, 1)?.try_into()?,
                rank.to_device(&b)?.try_into()?,
            ))
        },
        |rank, (a, b)| Ok(ag_matmul::call(rank, a, b, &opts)?.into_inner()),
        |rank, (a, b)| Ok(ag_matmul::program(rank, a, b, &opts)?.to_string()),
    )?;
    let macs = (s * d * m * k * n) as f64;
    let error = checked(macs, || {
        let expected = matmul_ref(&to_f64(&a)?, &to_f64(&b)?, s * d, m, k, n);
        worst_error(&timed.outputs, &expected)
    })?;
    Ok(Report {
        what: "AllGather + matmul, pipelined over stream chunks with collectives",
        shapes: format!(
            "a {:?} sharded on axis 1, b {:?} -> c [{s}, {d}, {m}, {n}] on every device",
            a.shape(),
            b.shape()
        ),
        error,
        timed,
        flops_per_device: Some(2.0 * macs),
        lowerings: ag_matmul::lowering_count(),
    })
}
