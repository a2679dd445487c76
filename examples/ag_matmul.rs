//! AllGather + matmul, pipelined over stream chunks (nvFuser's collective-based
//! overlap, seed 000): `a` is sharded over the devices; each of its `s` chunks is gathered
//! with an Allgather on a worker stream while earlier chunks are multiplied.
//!
//! ```sh
//! cargo run --release --example ag_matmul -- --devices 4 -s 4 -m 64 -k 256 -n 256 --dump
//! ```

#[path = "common/mod.rs"]
mod common;

use clap::Parser;
use common::*;
use fusion::prelude::*;

fusion! {
    /// `c = allgather(a) @ b`, pipelined over the `s` chunks of `a`.
    #[allow(dead_code)] // `main` calls `ag_matmul::call`, which takes options
    pub fn ag_matmul<T: Float, s, d, m, k, n>(
        a: Tensor<T, [s, d @ DIDx, m, k]>,
        b: Tensor<T, [k, n]>,
    ) -> Tensor<T, [s @ Stream, d, m, n]> {
        matmul(a, b)
    }
}

/// AllGather + matmul pipelined over stream chunks, checked against a host reference.
#[derive(Parser, Debug)]
struct Cli {
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
    #[command(flatten)]
    common: Common,
}

fn main() -> std::process::ExitCode {
    common::finish::finish(run())
}

fn run() -> fusion::Result<()> {
    let cli = Cli::parse();
    let world = cli.common.world()?;
    let (s, d, m, k, n) = (cli.s, world.size(), cli.m, cli.k, cli.n);
    let dtype = cli.common.dtype.dtype();
    let a = randn(&[s, d, m, k], dtype, 1);
    let b = randn(&[k, n], dtype, 2);
    let opts = cli.common.options();
    let timed = run_timed(
        &world,
        cli.common.iters,
        cli.common.dump,
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
    let error = if macs <= REFERENCE_LIMIT {
        let expected = matmul_ref(&to_f64(&a)?, &to_f64(&b)?, s * d, m, k, n);
        Some(worst_error(&timed.outputs, &expected)?)
    } else {
        None
    };
    let ok = Summary {
        name: "ag_matmul",
        what: "AllGather + matmul, pipelined over stream chunks with collectives",
        world: &world,
        common: &cli.common,
        shapes: format!(
            "a {:?} sharded on axis 1, b {:?} -> c [{s}, {d}, {m}, {n}] on every device",
            a.shape(),
            b.shape()
        ),
        error,
        timed: &timed,
        flops_per_device: Some(2.0 * macs),
        lowerings: ag_matmul::lowering_count(),
    }
    .print();
    exit_on_failure(ok);
    Ok(())
}
