//! AllGather + matmul as a P2P pipeline (nvFuser seed 001), the form of DESIGN.md's
//! headline: `a` is sharded over the devices; at stream index `i` every rank receives
//! rank `i`'s block of `a` (a local copy on rank `i`) and multiplies it while the next
//! exchange is in flight.
//!
//! ```sh
//! cargo run --release --example ag_matmul_p2p -- --devices 4 -m 256 -k 256 -n 256 --dump
//! ```

#[path = "common/mod.rs"]
mod common;

use common::{checked, matmul_ref, to_f64, worst_error, Report, Run};
use fusion::prelude::*;

fusion! {
    /// AllGather + matmul, pipelined over the devices with P2P transfers.
    #[allow(dead_code)] // the lesson calls `ag_matmul_p2p::call`, which takes options
    pub fn ag_matmul_p2p<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>, // each rank holds one index of the DIDx axis
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [d @ Stream, m, n]> {
        matmul(a, b)
    }
}

/// AllGather + matmul through a P2P pipeline, checked against a host reference.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Rows per device
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
    let (d, m, k, n) = (run.devices(), dims.m, dims.k, dims.n);
    let a = run.randn(&[d, m, k], 1);
    let b = run.randn(&[k, n], 2);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<(Ranked<3>, Ranked<2>)> {
            Ok((
                rank.shard(&a, 0)?.try_into()?,
                rank.to_device(&b)?.try_into()?,
            ))
        },
        |rank, (a, b)| Ok(ag_matmul_p2p::call(rank, a, b, &opts)?.into_inner()),
        |rank, (a, b)| Ok(ag_matmul_p2p::program(rank, a, b, &opts)?.to_string()),
    )?;
    let macs = (d * m * k * n) as f64;
    let error = checked(macs, || {
        let expected = matmul_ref(&to_f64(&a)?, &to_f64(&b)?, d, m, k, n);
        worst_error(&timed.outputs, &expected)
    })?;
    Ok(Report {
        what: "AllGather + matmul, pipelined over the devices with P2P transfers",
        shapes: format!(
            "a {:?} sharded on axis 0, b {:?} -> c [{d}, {m}, {n}] on every device",
            a.shape(),
            b.shape()
        ),
        error,
        timed,
        flops_per_device: Some(2.0 * macs),
        lowerings: ag_matmul_p2p::lowering_count(),
    })
}
