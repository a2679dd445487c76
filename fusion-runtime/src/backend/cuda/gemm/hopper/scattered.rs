//! The persistent GEMM whose epilogue does a ReduceScatter (`gemm.cu`'s `HOPPER_GEMM_RS`,
//! interleaved walk) as the CUDA backend's scattered GEMM (`Node::GemmReduceScatter`,
//! `lower::gemm_reduce_scatter`), launched as `bench/hopper_gemm/rs_harness.cu` launches
//! its interleaved mode.
//!
//! Rank r computes its partial product `A_r B_r` ([m, k] @ [k, n]) tile by tile, the
//! owners of the tiles' rows in turn, and its storer warps add each finished tile, in the
//! operands' type, into the owner's output over NVLink; each rank's storers zero its own
//! output first and count that at every rank, and the kernel ends once every rank's adds
//! into it are done, so the output is whole when the launching stream passes it. The
//! ranks meet through their peer-memory workspaces ([`ScatterLinks`]): each publishes its
//! output's address there at every call, and the call's epoch is a counter the kernel
//! keeps there, so a replayed graph meets its peers like a walked call. That needs every
//! rank's output in reach, so only worlds of one process hand out links.
//!
//! A wait that outlasts the world's timeout sets the device's scattered-GEMM status word
//! (pinned host memory, watched by the world's health, which names the rank waited for).
//! Where the kernel does not apply (another GPU, operands it cannot map, a world of more
//! than [`SCATTER_MAX_RANKS`] ranks) the launch answers `false` and the evaluator runs the
//! GEMM, then the ReduceScatter.

use std::sync::{Arc, OnceLock};

use super::eligibility::{self, MapView, Plan};
use super::gathered::{request, status_in, AgStatus};
use super::kernel::Entry;
use super::launch::RsParams;
use crate::backend::cuda::gemm::GemmDevice;
use crate::device::{ScatterLinks, ScatteredGemmCall, StreamHandle, SCATTER_MAX_RANKS};
use crate::error::Result;

/// A device's state of its scattered GEMMs: the status word.
#[derive(Default)]
pub(crate) struct ScatteredState {
    status: OnceLock<Arc<AgStatus>>,
}

/// Whether `dev` runs scattered GEMMs as one kernel: a GPU of compute capability 9.0.
pub(crate) fn runs(dev: &dyn GemmDevice) -> bool {
    matches!(dev.hopper().sms(dev.shared()), Ok(Some(_)))
}

/// Launches `call` on `stream` where the kernel applies (`Ok(false)` where it does not).
pub(crate) fn launch(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    call: &ScatteredGemmCall<'_>,
    links: &ScatterLinks,
) -> Result<bool> {
    let Some(sms) = dev.hopper().sms(dev.shared())? else {
        return Ok(false);
    };
    let Some((plan, out)) = plan_of(call) else {
        return Ok(false);
    };
    let waited_for = |peer| {
        format!(
            "the GEMM + ReduceScatter waiting for rank {peer} (device-side: its output's \
             address, its zeroed output or its adds never came: the peer failed, hangs, or \
             runs another program)"
        )
    };
    let status = status_in(dev, &dev.hopper().scattered.status, waited_for)?;
    let f = dev
        .hopper()
        .function(dev, plan.variant, Entry::ReduceScatter)?;
    let name = plan.variant.entry_name(Entry::ReduceScatter);
    let timeout_ns = dev.health().timeout().as_nanos().min(u64::MAX as u128) as u64;
    let mut params = RsParams::new(
        &plan,
        (call.rank, call.world, out.addr),
        links,
        (status.device, timeout_ns),
    )?;
    // Every rank runs the same grid (the kernel counts a peer's blocks by its own), and
    // every block stays resident: one per SM.
    let tiles = plan.tiles();
    let grid = tiles.min(u64::from(sms)) as u32;
    let raw = dev.raw_stream(stream)?;
    // SAFETY: the parameters are the ReduceScatter entry's (maps of A, B and this rank's
    // output block, the extents, then `RsArgs`); the maps describe `call`'s tensors, which
    // the program keeps until its stream passed the kernel; the links are the world's
    // workspaces, alive as long as it.
    unsafe { super::launch_entry(dev, (f, &name), grid, raw, &mut params.pointers()) }?;
    Ok(true)
}

/// The kernel's plan of `call` (the whole partial GEMM, `[m, k] @ [k, n]`) and the map of
/// this rank's output block, where it applies: bf16 or f16, one dtype, A row-major and
/// contiguous (`[m, k]`, or `[world, m / world, k]` one block per owner), B one matrix
/// (`[k, n]` after axes of extent 1), the output `[m / world, n]` (after axes of extent 1)
/// row-major and contiguous, at most [`SCATTER_MAX_RANKS`] ranks.
fn plan_of(call: &ScatteredGemmCall<'_>) -> Option<(Plan, MapView)> {
    let (a, b, out) = (call.a, call.b, call.output);
    if call.world > SCATTER_MAX_RANKS || call.rank >= call.world || a.rank() < 2 || b.rank() < 2 {
        return None;
    }
    let k = a.shape()[a.rank() - 1];
    let n = b.shape()[b.rank() - 1];
    let m = a.numel() / k.max(1);
    let rows = m / call.world;
    let b_matrix = b.shape()[b.rank() - 2] == k && b.numel() == k * n;
    // [m / world, n] after axes of extent 1 (a DIDx axis the rank holds one index of).
    let out_ok = out.numel() == rows * n && out.shape().last() == Some(&n) && out.is_contiguous();
    if rows == 0 || rows * call.world != m || !b_matrix || !out_ok || !a.is_contiguous() {
        return None;
    }
    let out_addr = out.device_ptr()?;
    // The rules see the whole product as one matrix ([m, k] @ [k, n] into [m, n]); the
    // output map is then this rank's block of it.
    let (a_shape, a_strides) = ([m, k], [k as isize, 1]);
    let (b_shape, b_strides) = (
        [k, n],
        [b.strides()[b.rank() - 2], b.strides()[b.rank() - 1]],
    );
    let (whole, whole_strides) = ([m, n], [n as isize, 1]);
    let mut plan = eligibility::plan(&request(
        a,
        (&a_shape, &a_strides, a.device_ptr()?),
        (&b_shape, &b_strides, b.device_ptr()?),
        (&whole, &whole_strides, out_addr),
    ))
    .ok()?;
    let block = MapView {
        addr: out_addr,
        outer: rows as u64,
        ..plan.c
    };
    plan.c = block;
    Some((plan, block))
}
