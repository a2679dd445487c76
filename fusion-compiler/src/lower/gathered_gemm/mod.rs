//! AllGather + GEMM as one persistent GEMM fed by the stream loop's copies
//! (`LowerOptions::pipelines.gathered_gemm`).
//!
//! The pipeline the stream pass makes of `matmul(AG(x), w)` receives one peer's block of
//! rows per iteration and runs that block's GEMM after it. Here the loop keeps its
//! transfers and loses its GEMMs: one GEMM over every block is launched on the caller's
//! stream before the loop ([`GatheredGemmLaunch`]); after each receive the loop says so
//! ([`RowsReady`], on the receiving stream: a stream write of a word the GEMM's loader
//! waits for, no SM), and the caller's stream joins the GEMM after the loop
//! ([`GatheredGemmJoin`]). This rank's own block is read where it is, never copied
//! (a device-local copy is a kernel, which would queue behind the GEMM that waits for it).
//!
//! It applies to a top-level loop that is exactly the allgather step and the GEMM of each
//! block: both of its transfers on the copy engines (NCCL's sends and receives are kernels
//! that need the SMs the GEMM holds), bf16 or f16 operands, a `[.., rows, K] x [K, N]`
//! product per block, plain or with a bias `[N]` made before the loop, at most one
//! activation and (whole blocks only) an auxiliary matrix made outside the loop folded in
//! (no accumulation), the gathered rows read by
//! nothing else, one block per iteration or one row range of a block per iteration (the
//! row-range loop of `LowerOptions::pipelines.allgather_subchunks`: each range is said
//! ready on its own, so the GEMM starts on a block's first rows while its last still
//! arrive), right after the loop that makes the pool streams wait for the caller's stream
//! (nothing in the loop may make a stream wait for the caller's after the launch, or the
//! copies would wait for the GEMM that waits for them). The gathered rows land in a buffer of every block (the loop's slots,
//! reused by every `numberOfStreams`-th iteration, cannot hold what one GEMM reads at
//! once). Each choice is noted under the program; a loop it does not apply to is left as
//! it was, without a note (so the program equals the one without the option).
//!
//! [`GatheredGemmLaunch`]: crate::hir::Node::GatheredGemmLaunch
//! [`RowsReady`]: crate::hir::Node::RowsReady
//! [`GatheredGemmJoin`]: crate::hir::Node::GatheredGemmJoin

mod body;
mod find_loops;
mod product;
mod rewrite;

use crate::hir::{GatheredGemmId, HostProgram, StreamId};
use crate::ir::{Epilogue, ScalarId, TensorId};
use find_loops::{find, find_rows};
use rewrite::rewrite;

/// Where a loop's gathered rows land.
#[derive(Clone, Copy, Debug)]
enum Landing {
    /// A buffer of every block (stream buffers off): the loop binds each block's view
    /// before its branch, and copies the own block into it.
    Whole(TensorId),
    /// `numberOfStreams` slots (stream buffers on): the receiving branch binds a slot.
    Slots(TensorId),
}

/// An AllGather + GEMM loop found in a program.
#[derive(Clone, Debug)]
struct Found {
    /// Row ranges per block (1: whole blocks), and with more, where the receiving branch
    /// of a loop with slots lands its range in the block: the range's start and stop.
    pieces: usize,
    range: Option<(ScalarId, ScalarId)>,
    /// Position of the loop in the program's top level, and its index scalar.
    at: usize,
    index: ScalarId,
    landing: Landing,
    /// The local shard, its DIDx axis, and the index (0) its own block is selected at.
    shard: (TensorId, usize, ScalarId),
    /// The view the own branch bound (the shape of one block's rows).
    own_view: TensorId,
    b: TensorId,
    /// The loop's view of `b` when it bound one (a broadcast operand's, dropped by the
    /// fused form).
    b_view: Option<TensorId>,
    output: TensorId,
    /// The output's block axis (after its DIDx axes, if any).
    out_axis: usize,
    /// The block an iteration receives (also the chunk of the output it computes).
    block: ScalarId,
    /// What the loop's GEMM writes (the output's block, or its row range).
    out_rows: TensorId,
    /// The caller's stream.
    caller: StreamId,
    /// What the GEMM applies to the product (see `find_loops::kernel_epilogue`), and its
    /// bias.
    epilogue: Epilogue,
    bias: Option<TensorId>,
    /// A gated product's second weight (see `find_loops::gated_branch`), and the
    /// intermediates the fused form drops: each slot buffer and the view bound of it.
    up: Option<TensorId>,
    parts: Vec<(TensorId, TensorId)>,
    /// The epilogue's auxiliary matrix, made outside the loop (one block per iteration,
    /// bound beside the output's; the fused form drops that view).
    aux: Option<TensorId>,
}

/// Rewrites every AllGather + GEMM loop of `program` it applies to (see the module
/// documentation) when `enabled`, noting each.
/// `row_ranges`: the row ranges per block of the lowering's allgather loops
/// (`LowerOptions::pipelines.allgather_subchunks`).
pub fn choose_gathered_gemm(program: &mut HostProgram, enabled: bool, row_ranges: Option<usize>) {
    if !enabled {
        return;
    }
    let pieces = row_ranges.unwrap_or(1).max(1);
    let mut next = 0u32;
    let mut at = 0;
    while at < program.body.len() {
        let found = match find(program, at) {
            None if pieces > 1 => find_rows(program, at, pieces),
            found => found,
        };
        match found {
            Some(found) => {
                at = rewrite(program, found, GatheredGemmId(next)) + 1;
                next += 1;
            }
            None => at += 1,
        }
    }
}
