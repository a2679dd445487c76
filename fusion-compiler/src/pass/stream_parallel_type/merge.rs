//! Adjacent stream loops that do not depend on each other across chunks become one.
//!
//! Grouping (`group_loops`) puts an expression into the open loop only when it reads that
//! loop's results, so independent work on the same chunks (the MLP backward's `dW1`, fed
//! by the gathered input, and its `dX`, reduce-scattered) ends up in loops of its own, one
//! after the other, each with its fork, join and pipeline fill. Two adjacent loops merge,
//! the second's expressions after the first's, when the first may absorb the second
//! ([`LoopGroup::may_absorb`]: same extent, no reduce-scatter in the first, the second
//! reading the first's results only chunk by chunk), and the merged loop lowers under the
//! options no worse than the two did ([`Choice`]): to the gather-scatter pipeline (which
//! hides the gathers behind the reduce-scatter's GEMMs), or to a pipeline at least as
//! overlapped as either loop's, with row ranges where either had them. An AllGather +
//! GEMM loop stays alone where a gathered GEMM may take it
//! (`LowerOptions::pipelines.gathered_gemm`).

use std::collections::HashSet;

use super::choice::{choose, Choice, Pipeline};
use super::group::{Item, LoopGroup};
use super::internal::loop_internal_tensors;
use super::views::PermuteViews;
use crate::error::Result;
use crate::hir::{HostProgram, Node};
use crate::ir::{ParallelType, TensorId};
use crate::pass::context::PassContext;

/// Merges, left to right, every pair of adjacent loops of `items` that may be one; the
/// views between them (weights transposed or broadcast for the second loop's GEMMs) move
/// before the merged loop.
pub(super) fn merge_independent_loops(
    p: &HostProgram,
    ctx: &PassContext,
    items: &mut Vec<Item>,
    views: &PermuteViews,
) -> Result<()> {
    let mut i = 0;
    while i < items.len() {
        let Some(j) = next_loop(p, items, i) else {
            i += 1;
            continue;
        };
        match merged(p, ctx, items, views, (i, j))? {
            Some(m) => {
                // The views between the two loops come first, then the merged loop, which
                // may merge with the loop after it in turn.
                let between: Vec<Item> = items.drain(i + 1..j).collect();
                items.remove(i + 1);
                items[i] = Item::Loop(m);
                let n = between.len();
                items.splice(i..i, between);
                i += n;
            }
            None => i += 1,
        }
    }
    Ok(())
}

/// The position of the loop after loop `i` of `items`, when only views that read none of
/// loop `i`'s results lie between them.
fn next_loop(p: &HostProgram, items: &[Item], i: usize) -> Option<usize> {
    let Item::Loop(a) = &items[i] else {
        return None;
    };
    let sums: HashSet<TensorId> = a.accumulate.iter().map(|s| s.output).collect();
    for (j, item) in items.iter().enumerate().skip(i + 1) {
        match item {
            Item::Loop(_) => return Some(j),
            Item::Node(Node::Compute(e))
                if e.op.is_view()
                    && (e.inputs.iter())
                        .all(|t| !a.produced.contains_key(t) && !sums.contains(t))
                    && p.ir
                        .find_parallel_axis(e.output, ParallelType::Stream)
                        .is_none() => {}
            Item::Node(_) => return None,
        }
    }
    None
}

/// Loops `i` and `j` of `items` as one loop, when they may be one.
fn merged(
    p: &HostProgram,
    ctx: &PassContext,
    items: &[Item],
    views: &PermuteViews,
    (i, j): (usize, usize),
) -> Result<Option<LoopGroup>> {
    let (Item::Loop(a), Item::Loop(b)) = (&items[i], &items[j]) else {
        return Ok(None);
    };
    if !a.may_absorb(&p.ir, b) {
        return Ok(None);
    }
    let internal = |joined| {
        if ctx.options.streams.buffers {
            loop_internal_tensors(p, items, views, joined)
        } else {
            HashSet::new()
        }
    };
    let apart = internal(None);
    let (Ok(ca), Ok(cb)) = (choose(p, a, ctx, &apart)?, choose(p, b, ctx, &apart)?) else {
        return Ok(None);
    };
    let mut m = a.clone();
    m.absorb(b.clone());
    let Ok(cm) = choose(p, &m, ctx, &internal(Some((i, j))))? else {
        return Ok(None);
    };
    Ok(no_worse(ctx, ca, cb, cm).then_some(m))
}

/// True when a merged loop lowering as `cm` is no worse than its two loops lowering as
/// `ca` and `cb`.
fn no_worse(ctx: &PassContext, ca: Choice, cb: Choice, cm: Choice) -> bool {
    let gathered_gemm = |c: Choice| c.has_allgather && c.pipeline == Pipeline::Standard;
    if ctx.options.pipelines.gathered_gemm && (gathered_gemm(ca) || gathered_gemm(cb)) {
        return false;
    }
    if cm.pipeline == Pipeline::GatherScatter {
        return true;
    }
    cm.pipeline >= ca.pipeline.max(cb.pipeline)
        && (cm.row_ranges || !(ca.row_ranges || cb.row_ranges))
}
