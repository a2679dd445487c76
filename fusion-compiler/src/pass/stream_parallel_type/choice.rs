//! Which pipeline a loop group lowers to under the options, and whether it runs row
//! ranges ([`Choice`]): `emit_loop` dispatches on it, and merging two loops compares the
//! merged loop's choice with the two loops' own.

use std::collections::HashSet;

use super::gather_scatter;
use super::group::LoopGroup;
use super::ring;
use super::subchunk::{gather_rows, SubChunkPlan};
use crate::error::Result;
use crate::hir::HostProgram;
use crate::ir::TensorId;
use crate::options::ReduceScatterPipeline;
use crate::pass::context::PassContext;
use crate::resharding::{classify, MeshContext, Resharding};

/// The pipelines a loop group can lower to, from the least to the most overlapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Pipeline {
    /// The standard loop without a reduce-scatter (local compute, allgathers).
    Standard,
    /// The standard loop with the direct reduce-scatter (partials summed after the loop
    /// or per round).
    Direct,
    /// The reduce-scatter ring (`ring`).
    Ring,
    /// The loop that gathers and reduce-scatters (`gather_scatter`).
    GatherScatter,
}

/// How a loop group lowers.
#[derive(Clone, Copy, Debug)]
pub(super) struct Choice {
    pub(super) pipeline: Pipeline,
    /// Whether one of its expressions gathers (a P2P allgather).
    pub(super) has_allgather: bool,
    /// Whether its chunks are split into row ranges.
    pub(super) row_ranges: bool,
}

/// The choice for `g`, or why it cannot lower (a loop that gathers and reduce-scatters
/// that the gather-scatter pipeline does not support).
pub(super) fn choose(
    p: &HostProgram,
    g: &LoopGroup,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
) -> Result<std::result::Result<Choice, &'static str>> {
    let mesh = MeshContext {
        world_size: Some(p.world_size),
    };
    let mut has_allgather = false;
    for (e, _) in &g.exprs {
        has_allgather |= matches!(classify(&p.ir, e, mesh)?, Resharding::DidxToStream { .. });
    }
    let (pipeline, mut subchunks) = ctx.options.reduce_scatter_plan(p.world_size);
    if g.whole_chunks() {
        subchunks = 1;
    }
    let Some(rs) = &g.reduce_scatter else {
        let gathers = g.gathers(p)?;
        let rows = has_allgather
            && gather_rows(
                &p.ir,
                &g.exprs,
                &gathers,
                ctx.options.allgather_row_ranges(),
            )
            .is_some()
            && !g.whole_chunks();
        return Ok(Ok(Choice {
            pipeline: Pipeline::Standard,
            has_allgather,
            row_ranges: rows,
        }));
    };
    if has_allgather {
        if let Some(reason) = gather_scatter::unsupported(p, g, ctx, internal)? {
            return Ok(Err(reason));
        }
        let requested = ctx.options.pipelines.reduce_scatter_subchunks.unwrap_or(2);
        let requested = if g.whole_chunks() { 1 } else { requested };
        return Ok(Ok(Choice {
            pipeline: Pipeline::GatherScatter,
            has_allgather,
            row_ranges: SubChunkPlan::new(&p.ir, &g.exprs, rs, requested).is_some(),
        }));
    }
    let ring = pipeline == ReduceScatterPipeline::Ring
        && ctx.options.streams.compute_first
        && g.compute_prefix_len(p, mesh)? == g.exprs.len()
        && ring::applies(p, g, rs);
    Ok(Ok(Choice {
        pipeline: if ring {
            Pipeline::Ring
        } else {
            Pipeline::Direct
        },
        has_allgather,
        row_ranges: SubChunkPlan::new(&p.ir, &g.exprs, rs, subchunks).is_some(),
    }))
}
