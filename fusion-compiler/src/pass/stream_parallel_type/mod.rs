//! `StreamParallelType`: turns expressions with a Stream axis into host for-loops.
//!
//! Consecutive top-level expressions whose Stream axes map onto each other share one loop;
//! any other expression in between closes it. Then two adjacent loops that iterate the
//! same extent merge when the second reads the first's results only chunk by chunk and
//! the merged loop lowers no worse under the options (`merge`: e.g. the MLP backward's
//! `dW1` on the gathered input and its reduce-scattered `dX`). For each loop (seeds
//! 000-002):
//!
//! ```text
//! Allocate every output of the loop's expressions
//! GetCurrentStream into S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams)); Synchronize S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams))
//!        slice inputs and outputs along the stream axis (AliasSelect), run the body
//!        SetCurrentStream(S); Synchronize Stream(i % numberOfStreams)
//! ```
//!
//! Two resharding patterns become P2P pipelines inside the loop:
//! - a `set` turning a DIDx axis into the Stream axis (an allgather, seed 001): the
//!   device's own chunk is a local copy (or, when only the loop reads the gathered stream
//!   buffer, the local shard itself), every other chunk a coalesced receive + send;
//! - a sum over the DIDx axis whose output is sharded along the loop's Stream axis (a
//!   reduce-scatter): each iteration sends the partial result chunk to the device that
//!   owns it and receives that device's partial for this one; a local sum follows the loop.
//!
//! With [`P2pSchedule::Ring`] an allgather's iteration `i` gathers the chunk of device
//! `rank - i`, so the local chunk comes first; a reduce-scatter's iteration `i` computes
//! the partial of device `rank + i + 1`, so the local chunk comes last. Either way every
//! send meets its receive in the same iteration.
//!
//! With `LowerOptions::pipelines.allgather_subchunks` = `c > 1`, an allgather loop that
//! does not reduce-scatter (AllGather + GEMM) runs `D * c` iterations, chunk by chunk:
//! iteration `i` gathers rows `[r m / c, (r + 1) m / c)` (`r = i % c`) of the chunk of ring
//! step `i / c` into those rows of the chunk (from row 0 of a slot) and runs the loop's
//! expressions on those rows, so one range's GEMM, not a chunk's, follows the last
//! transfer. Why chunk by chunk (step-major) and not range by range (round-major, as the
//! reduce-scatter's rounds): either order transfers the same `(D - 1) c` row ranges one
//! after another, so the last one lands at the same time and leaves one range's GEMM,
//! `1/(D c)` of the whole, after it; the last GEMM starts as early as the GEMMs before it
//! let it. What differs is the work the GPU has while the first transfers are in flight:
//! step-major puts every range of the local chunk first (`1/D` of the GEMM, as unsplit) to
//! cover the first transfer, where round-major has only `1/(D c)` there and puts the other
//! local ranges between rounds, where their pool stream (`i % numberOfStreams`) may queue
//! them behind a receive. A GEMM-bound loop that starts idle pushes every later GEMM back,
//! the last one included.
//! A loop that gathers and reduce-scatters ignores the option: its row ranges are the
//! reduce-scatter's.
//!
//! With `compute_first_streams` (the default), a loop whose local compute precedes its
//! communication runs that compute on the caller's stream `S`, in order, and only the
//! communication on the pool stream, which waits for `S`; a join loop after it makes `S`
//! wait for every pool stream.
//! With stream buffers on, intermediates produced and consumed inside one loop get
//! `numberOfStreams` slots instead of the full extent.
//!
//! Two more things belong to the loops without being loop expressions. A Stream-parallel
//! permute (a view, `permute_views`) is sliced by each loop that reads it: the permute of
//! its input's slice. And a `sum` over exactly a loop's Stream axis of a GEMM result
//! nothing else reads (a weight gradient) is folded into that loop, wherever it comes
//! (`accumulate`): the first iteration's GEMM writes the sum, the others add onto it in
//! order, and the GEMM result is never stored. Such a loop runs whole chunks (no row
//! ranges): its GEMMs contract the chunk's rows, which are not the rows a range splits.
//!
//! Submodules, from the bottom up: `views` (per-iteration slices, permuted ones and
//! accumulated results, row ranges and derived buffers), `schedule` (chunk and peers per
//! iteration), `group` (the expressions of one loop), `subchunk` (row ranges of a block),
//! `exchange` (the coalesced send/receive and the allgather step), `iteration` (one
//! expression per iteration, fork and join loops), `direct` and `ring` (the two
//! reduce-scatter pipelines), `stream_loop` (the standard loop), `gather_scatter` (a loop
//! that gathers and reduce-scatters), `after_loop` (a loop's weight gradients run once
//! after it), `choice` (which of these a loop lowers to), and for
//! the grouping `permute_views` and `accumulate` (which permutes are views, which sums
//! fold), `internal` (the results only their loop reads) and `merge` (adjacent
//! independent loops into one).

mod accumulate;
mod after_loop;
mod choice;
mod direct;
mod exchange;
mod gather_scatter;
mod group;
mod internal;
mod iteration;
mod merge;
mod permute_views;
mod ring;
mod schedule;
mod stream_loop;
mod subchunk;
mod views;

use std::collections::HashSet;

use choice::Pipeline;
use group::{stream_error, Item, LoopGroup, ReduceScatterFold};
use internal::loop_internal_tensors;
use views::PermuteViews;

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{HostProgram, Node};
use crate::ir::{axis_map, Expr, Op, ParallelType, TensorId};
use crate::options::{ReduceScatterPipeline, WeightGradients};

/// The stream-lowering pass.
pub struct StreamParallelType;

impl Pass for StreamParallelType {
    fn name(&self) -> &'static str {
        "StreamParallelType"
    }

    fn run(&self, p: &mut HostProgram, ctx: &PassContext) -> Result<()> {
        let views = permute_views::collect(p, &p.body);
        let readers = accumulate::Readers::new(p);
        let body = std::mem::take(&mut p.body);
        let mut items = group_loops(p, body, &views, &readers)?;
        fold_reduce_scatters(p, &mut items)?;
        merge::merge_independent_loops(p, ctx, &mut items, &views)?;
        let internal = if ctx.options.streams.buffers {
            loop_internal_tensors(p, &items, &views, None)
        } else {
            HashSet::new()
        };
        let mut out = Vec::new();
        for item in items {
            match item {
                Item::Node(n) => out.push(n),
                Item::Loop(g) => out.extend(emit_loop(g, p, ctx, &internal)?),
            }
        }
        p.body = out;
        Ok(())
    }
}

/// Groups the body into loops. Permute views are no items (each loop views them; a node
/// outside the loops that reads one gets the view right before it), and a sum a loop
/// accumulates is folded into that loop where it comes.
fn group_loops(
    p: &HostProgram,
    body: Vec<Node>,
    views: &PermuteViews,
    readers: &accumulate::Readers,
) -> Result<Vec<Item>> {
    let mut items: Vec<Item> = Vec::new();
    let mut placed: HashSet<TensorId> = HashSet::new();
    for node in body {
        let stream = match &node {
            Node::Compute(e) if views.contains_key(&e.output) => {
                register_view(p, &mut items, e);
                continue;
            }
            Node::Compute(e) => p.ir.find_parallel_axis(e.output, ParallelType::Stream),
            _ => None,
        };
        let Some(s) = stream else {
            if let Node::Compute(e) = &node {
                let loops = items.iter_mut().rev().filter_map(|i| match i {
                    Item::Loop(g) => Some(g),
                    Item::Node(_) => None,
                });
                if let Some(g) = accumulate::folding_loop(p, loops, readers, e) {
                    g.accumulate.push(e.clone());
                    continue;
                }
                for t in &e.inputs {
                    if let Some(v) = views.get(t).filter(|_| placed.insert(*t)) {
                        items.push(Item::Node(Node::Compute(v.clone())));
                    }
                }
            }
            // A view that does not read the open loop's results (e.g. a weight broadcast
            // for the loop's next matmul) moves before that loop instead of closing it.
            if let (Node::Compute(e), Some(Item::Loop(g))) = (&node, items.last()) {
                if e.op.is_view() && e.inputs.iter().all(|t| !g.produced.contains_key(t)) {
                    let at = items.len() - 1;
                    items.insert(at, Item::Node(node));
                    continue;
                }
            }
            items.push(Item::Node(node));
            continue;
        };
        let Node::Compute(e) = node else {
            unreachable!("stream axes come from compute nodes")
        };
        if let Some(Item::Loop(g)) = items.last_mut() {
            if g.accepts(&p.ir, &e, s)? {
                add_to_loop(g, e, s, views);
                continue;
            }
        }
        let mut g = LoopGroup::new(&p.ir, &e, s)?;
        add_to_loop(&mut g, e, s, views);
        items.push(Item::Loop(g));
    }
    Ok(items)
}

/// Adds `e` to loop `g`, with the permute views it reads.
fn add_to_loop(g: &mut LoopGroup, e: Expr, s: usize, views: &PermuteViews) {
    for t in &e.inputs {
        if let Some(v) = views.get(t) {
            g.views.insert(*t, v.clone());
        }
    }
    g.push(e, s);
}

/// A permute view of a result of the open loop is that loop's too: an expression reading
/// it continues the loop.
fn register_view(p: &HostProgram, items: &mut [Item], view: &Expr) {
    if let Some(Item::Loop(g)) = items.last_mut() {
        if g.produced.contains_key(&view.inputs[0]) {
            if let Some(s) = p.ir.find_parallel_axis(view.output, ParallelType::Stream) {
                g.produced.insert(view.output, s);
            }
        }
    }
}

/// Folds `sum` over DIDx right after a loop, sharding the loop's Stream axis, into it.
fn fold_reduce_scatters(p: &HostProgram, items: &mut Vec<Item>) -> Result<()> {
    let mut i = 0;
    while i + 1 < items.len() {
        let fold = match (&items[i], &items[i + 1]) {
            (Item::Loop(g), Item::Node(Node::Compute(e))) => reduce_scatter_pattern(p, g, e)?,
            _ => None,
        };
        if let Some(f) = fold {
            items.remove(i + 1);
            if let Item::Loop(g) = &mut items[i] {
                g.reduce_scatter = Some(f);
            }
        }
        i += 1;
    }
    Ok(())
}

fn reduce_scatter_pattern(
    p: &HostProgram,
    g: &LoopGroup,
    e: &Expr,
) -> Result<Option<ReduceScatterFold>> {
    let Op::Reduction { axes, .. } = &e.op else {
        return Ok(None);
    };
    let x = e.inputs[0];
    let (Some(&s), [a]) = (g.produced.get(&x), axes.as_slice()) else {
        return Ok(None);
    };
    let f = &p.ir;
    let didx = f.visible_axes(x)[*a];
    let world: Vec<usize> = (0..p.world_size).collect();
    if f.axis(x, didx).parallel != ParallelType::DIDx
        || p.mesh_of(x) != world
        || p.mesh_of(e.output) != world
    {
        return Ok(None);
    }
    let map = axis_map(f, e);
    let Some(out_didx) = f.find_parallel_axis(e.output, ParallelType::DIDx) else {
        return Ok(None);
    };
    if map.producer_axis(0, out_didx) != Some(s)
        || f.find_parallel_axis(e.output, ParallelType::Stream)
            .is_some()
    {
        return Ok(None);
    }
    Ok(Some(ReduceScatterFold {
        expr: e.clone(),
        didx,
        out_didx,
    }))
}

/// Emits one loop group: the gather-scatter pipeline when it gathers and reduce-scatters,
/// the ring when it reduce-scatters with [`ReduceScatterPipeline::Ring`] and the ring
/// applies, the standard loop otherwise (`choice`).
fn emit_loop(
    g: LoopGroup,
    p: &mut HostProgram,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
) -> Result<Vec<Node>> {
    let choice = match choice::choose(p, &g, ctx, internal)? {
        Ok(c) => c,
        Err(reason) => {
            return Err(stream_error(
                &p.ir,
                g.exprs[0].0.output,
                g.exprs[0].1,
                &format!(
                    "this stream loop gathers (P2P allgather) and reduce-scatters, but {reason}"
                ),
            ))
        }
    };
    let (pipeline, mut subchunks) = ctx.options.reduce_scatter_plan(p.world_size);
    match choice.pipeline {
        Pipeline::GatherScatter => {
            if pipeline == ReduceScatterPipeline::Direct {
                tracing::debug!(
                    "a loop that also gathers reduce-scatters in a ring: the direct \
                     pipeline's sum after the loop would leave work after the last GEMM"
                );
            }
            return gather_scatter::emit(g, p, ctx, internal);
        }
        Pipeline::Ring => {
            if g.whole_chunks() {
                subchunks = 1;
            }
            return ring::emit(g, p, ctx, internal, subchunks);
        }
        Pipeline::Direct if pipeline == ReduceScatterPipeline::Ring => {
            if let Some(rs) = &g.reduce_scatter {
                tracing::debug!(
                    "reduce-scatter pipeline of `{}` runs direct: the ring needs \
                     compute-first streams and a matmul as the loop's last expression",
                    p.ir.tensor_name(rs.expr.output)
                );
            }
        }
        Pipeline::Direct | Pipeline::Standard => {}
    }
    // With `WeightGradients::AfterLoop`, an AllGather loop's weight gradients that read
    // only its gathered rows and inputs run after it, over every block (`after_loop`).
    if choice.has_allgather
        && g.reduce_scatter.is_none()
        && ctx.options.pipelines.weight_gradients == WeightGradients::AfterLoop
    {
        let gathered: HashSet<TensorId> = g.gathers(p)?.iter().map(|gth| gth.out).collect();
        if let Some((rest, after)) = after_loop::split_off(p, &g, &gathered) {
            // The gathered rows they read land in a buffer of every block.
            let read_after = after_loop::read_by(&g, &after);
            let internal: HashSet<TensorId> = internal.difference(&read_after).copied().collect();
            let subchunks = match rest.whole_chunks() {
                true => 1,
                false => ctx.options.allgather_row_ranges(),
            };
            let mut nodes = stream_loop::emit(rest, p, ctx, &internal, true, subchunks)?;
            for (e, _) in &after {
                if let Some(sum) = g.accumulate.iter().find(|a| a.inputs[0] == e.output) {
                    nodes.push(Node::Allocate { tensor: sum.output });
                }
            }
            after_loop::emit(&g, &after, &mut nodes);
            return Ok(nodes);
        }
    }
    // Without a reduce-scatter, the row ranges are the allgather's (the AllGather + GEMM
    // pipeline); a loop that gathers and reduce-scatters took the gather-scatter path above.
    let subchunks = match (g.reduce_scatter.is_some(), g.whole_chunks()) {
        (_, true) => 1,
        (true, false) => subchunks,
        (false, false) => ctx.options.allgather_row_ranges(),
    };
    stream_loop::emit(g, p, ctx, internal, choice.has_allgather, subchunks)
}
