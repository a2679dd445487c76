//! Matmul + AllReduce, pipelined over stream chunks (row-parallel linear layer): each
//! device holds one block of the contracted dimension of `a` and `b`, multiplies its
//! blocks chunk by chunk, and the partial products are summed across devices with an
//! Allreduce per chunk, overlapping the next chunk's matmul.
//!
//! ```sh
//! cargo run --release --example matmul_ar -- --devices 4 -s 4 -m 128 -k 256 -n 256
//! ```

#[path = "common/mod.rs"]
mod common;

use common::{checked, matmul_ref, to_f64, worst_error, Report, Run};
use fusion::prelude::*;

fusion! {
    /// `c = sum over devices of a[:, d] @ b[d]`, an Allreduce per chunk of `s`.
    #[allow(dead_code)] // the lesson calls `matmul_ar::call`, which takes options
    pub fn matmul_ar<T: Float, s, d, m, k, n>(
        a: Tensor<T, [s, d @ DIDx, m, k]>,
        b: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [s @ Stream, m, n]> {
        let partial: Tensor<T, [s @ Stream, d @ DIDx, m, n]> = matmul(a, b);
        sum(partial, 1)
    }
}

/// Matmul + AllReduce pipelined over stream chunks, checked against a host reference.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Chunks (the Stream axis)
    #[arg(short, default_value_t = 4)]
    s: usize,
    /// Rows per chunk
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

/// `a` and `b` sharded on the contracted dimension; every device gets the summed `c`.
fn lesson(dims: &Dims, run: &Run) -> fusion::Result<Report> {
    let (s, d, m, k, n) = (dims.s, run.devices(), dims.m, dims.k, dims.n);
    let a = run.randn(&[s, d, m, k], 1);
    let b = run.randn(&[d, k, n], 2);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<(Ranked<4>, Ranked<3>)> {
            Ok((
                rank.shard(&a, 1)?.try_into()?,
                rank.shard(&b, 0)?.try_into()?,
            ))
        },
        |rank, (a, b)| Ok(matmul_ar::call(rank, a, b, &opts)?.into_inner()),
        |rank, (a, b)| Ok(matmul_ar::program(rank, a, b, &opts)?.to_string()),
    )?;
    let macs = (s * d * m * k * n) as f64;
    let error = checked(macs, || {
        let (av, bv) = (to_f64(&a)?, to_f64(&b)?);
        let mut expected = vec![0.0; s * m * n];
        for si in 0..s {
            for di in 0..d {
                let block = &av[(si * d + di) * m * k..][..m * k];
                let part = matmul_ref(block, &bv[di * k * n..][..k * n], 1, m, k, n);
                for (e, p) in expected[si * m * n..][..m * n].iter_mut().zip(part) {
                    *e += p;
                }
            }
        }
        worst_error(&timed.outputs, &expected)
    })?;
    Ok(Report {
        what: "matmul + AllReduce, pipelined over stream chunks",
        shapes: format!(
            "a {:?} sharded on axis 1, b {:?} sharded on axis 0 -> c [{s}, {m}, {n}] on every \
             device",
            a.shape(),
            b.shape()
        ),
        error,
        timed,
        flops_per_device: Some(2.0 * macs / d as f64),
        lowerings: matmul_ar::lowering_count(),
    })
}
