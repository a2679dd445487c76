//! AllGather as a P2P pipeline (nvFuser seed 001): a DIDx-sharded tensor becomes a
//! Stream-parallel one; at stream index `i`, rank `i` copies its own block and every
//! other rank exchanges blocks with it through coalesced send/recv pairs.
//!
//! ```sh
//! cargo run --release --example allgather_p2p -- --devices 4 -m 262144 --dump
//! ```

#[path = "common/mod.rs"]
mod common;

use common::{to_f64, worst_error, Report, Run};
use fusion::prelude::*;

fusion! {
    /// Every device gets every device's block, one P2P exchange per stream index.
    #[allow(dead_code)] // the lesson calls `allgather_p2p::call`, which takes options
    pub fn allgather_p2p<T: Float, d, m>(x: Tensor<T, [d @ DIDx, m]>) -> Tensor<T, [d @ Stream, m]> {
        set(x)
    }
}

/// AllGather through a P2P pipeline, checked against the full input.
#[derive(clap::Args, Debug)]
struct Dims {
    /// Elements per device
    #[arg(short, default_value_t = 1 << 18)]
    m: usize,
}

fn main() -> std::process::ExitCode {
    common::main(lesson)
}

/// `x` sharded on its device axis; every device gets all of it (the check is `x` itself).
fn lesson(dims: &Dims, run: &Run) -> fusion::Result<Report> {
    let (d, m) = (run.devices(), dims.m);
    let x = run.randn(&[d, m], 1);
    let opts = run.options();
    let timed = run.timed(
        |rank| -> fusion::Result<Ranked<2>> { rank.shard(&x, 0)?.try_into() },
        |rank, x| Ok(allgather_p2p::call(rank, x, &opts)?.into_inner()),
        |rank, x| Ok(allgather_p2p::program(rank, x, &opts)?.to_string()),
    )?;
    let error = Some(worst_error(&timed.outputs, &to_f64(&x)?)?);
    let bytes = (d * m * run.dtype().size_bytes()) as f64;
    let ms = timed.median.as_secs_f64() * 1e3;
    Ok(Report {
        what: "AllGather as a P2P pipeline over stream indices",
        shapes: format!(
            "x {:?} sharded on axis 0 -> [{d}, {m}] on every device ({:.1} MB gathered per \
             device, {:.2} GB/s)",
            x.shape(),
            bytes / 1e6,
            if ms > 0.0 { bytes / (ms * 1e6) } else { 0.0 }
        ),
        error,
        timed,
        flops_per_device: None,
        lowerings: allgather_p2p::lowering_count(),
    })
}
