//! The gather-scatter pipeline: one stream loop that gathers its input chunk by chunk (the
//! P2P allgather) and reduce-scatters its result chunk by chunk (a ring), e.g. the
//! sequence-parallel MLP block `ReduceScatter(gelu(AllGather(x) W1) W2)`.
//!
//! Chunk `q` of the stream axis is both the rows gathered from device `q` and the block of
//! the result that device `q` keeps. On rank `r` of `D`, step `j` handles chunk
//! `(r - j) mod D`: the allgather's ring order, the local chunk first. Step `j < D` runs
//! every expression but the last on the chunk's rows, which arrived while step `j - 1`
//! computed (step 0 needs no transfer). The reduce-scatter is a ring in the same
//! direction: step `j >= 1` runs the last expression, a GEMM, on the chunk and adds it onto
//! the running sum of that block that device `r - 1` computed at its step `j - 1`
//! (`beta = 1`, in the GEMM's epilogue), then passes the sum on to `r + 1`. The local
//! chunk's GEMM waits until step `D`, when the sum of every other device has arrived, and
//! finishes it into this device's block of the output (`out = sum + a @ b`); every sum
//! lands in a buffer of the program's own. So every transfer hides behind a GEMM: the
//! rows of step `j + 1` behind step `j`'s GEMMs, a running sum behind the first GEMM of the
//! step that adds onto it. Expressions the last one does not read (a backward's weight
//! gradients, accumulating block by block) run after the step's ring send, so the sum
//! crosses the link behind them too, the last step's included; those of them that read no
//! result of the loop, only its gathered rows and its inputs (the saving backward's dW2 =
//! act^T dY, not dW1 = x^T dH), run once after the loop instead, one GEMM summed over every
//! block: their gathered rows land in a buffer of every block (the own block copied in at
//! step 0), and the weight gradient is read and written once, not once per block
//! (`LowerOptions::pipelines.weight_gradients`: all in the loop, or all after it, the loop's
//! results they read then kept for every block). The local chunk's inputs of the last GEMM live in buffers of
//! their own; the other chunks' intermediates share one slot, since every GEMM runs in
//! order on the caller's stream, and gathered rows use two slots, since the next unit's
//! rows land while the current one computes. With `c` row ranges per chunk
//! (`LowerOptions::pipelines.reduce_scatter_subchunks`, 2 by default) the loop runs `(D + 1) c`
//! units, step-major, so that the last running sum's transfer of one range also hides
//! behind the GEMM of another.
//!
//! ```text
//! FOR i in 0..(D+1)*c:          j = i / c, rows k = i % c, chunk = (r + D - j) % D
//!   IF 0 < j(i+1) < D: on Stream((i+1) % n), after S: receive unit i+1's rows into slot
//!                      (i+1) % 2 from chunk(i+1); send this device's rows k(i+1) to r + j(i+1)
//!   SetCurrentStream S
//!   IF j < D: rows = (j == 0 ? local rows : after Stream(i % n), slot i % 2)
//!             every expression but the last (into own buffers when j == 0, else one slot)
//!   IF j > 0: after Stream((i - c) % n) (the running sum arrived)
//!             sum = (j == D ? this device's output rows : acc[j - 1] rows)
//!             sum = last(...) (+ acc[j - 1] rows when j > 1)
//!             IF j < D: on Stream(i % n), after S: send sum to r + 1, receive the next
//!                       step's sum (acc[j] rows) from r - 1
//!   IF j < D: the expressions the last one does not read (e.g. dW += x^T dH)
//! FOR i: Synchronize Stream(i % n)
//! the weight gradients that read no loop result, each summed over every block
//! ```
//!
//! Files, from the bottom up: `scalars` (the loop's scalars and streams), `unit` (the
//! views of one unit's rows), `sink` (the order of a step's expressions), `steps` (the
//! loop's gathers, buffers and three steps); this file decides whether a loop is this
//! pipeline and assembles it.

mod scalars;
mod sink;
mod steps;
mod unit;

use std::collections::{HashMap, HashSet};

use super::after_loop;
use super::exchange::require_world_mesh;
use super::group::{Gather, LoopGroup};
use super::iteration::{fork_loop, join_loop};
use super::ring;
use super::subchunk::SubChunkPlan;
use super::views::{Accumulations, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef};
use crate::ir::{Expr, TensorId};
use crate::options::WeightGradients;
use crate::pass::context::PassContext;
use crate::resharding::{classify, MeshContext, Resharding};
use scalars::{UnitScalars, UnitStreams};
use steps::GatherScatter;

/// Why a loop that gathers and reduce-scatters cannot be this pipeline, or `None` when it
/// can: compute-first streams, gathered chunks only this loop reads, gathers of tensors
/// from outside the loop, local compute otherwise, and a last expression that is the
/// matmul whose result is reduce-scattered (the ring adds onto the running sum in it).
pub(super) fn unsupported(
    p: &HostProgram,
    g: &LoopGroup,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
) -> Result<Option<&'static str>> {
    let Some(rs) = &g.reduce_scatter else {
        return Ok(Some("it does not reduce-scatter"));
    };
    if !ctx.options.streams.compute_first {
        return Ok(Some(
            "the gather-scatter pipeline needs compute-first streams \
             (`LowerOptions::streams.compute_first`)",
        ));
    }
    let mesh = MeshContext {
        world_size: Some(p.world_size),
    };
    let last = g.exprs.len() - 1;
    for (k, (e, _)) in g.exprs.iter().enumerate() {
        match classify(&p.ir, e, mesh)? {
            Resharding::DidxToStream { .. } => {
                if k == last {
                    return Ok(Some(
                        "the loop's last expression must be a matmul, not a gather",
                    ));
                }
                if g.produced.contains_key(&e.inputs[0]) {
                    return Ok(Some(
                        "it gathers a tensor the same loop computes; gather inputs of the loop",
                    ));
                }
                if !internal.contains(&e.output) {
                    return Ok(Some(
                        "its gathered chunks are read outside the loop; the pipeline keeps \
                         them in stream buffers (`LowerOptions::streams.buffers`)",
                    ));
                }
            }
            Resharding::Local => {}
            _ => {
                return Ok(Some(
                    "besides its gathers, every expression of the loop must be local",
                ))
            }
        }
    }
    if !ring::applies(p, g, rs) {
        return Ok(Some(
            "its last expression must be the 2-D matmul (per chunk) whose result is \
             reduce-scattered: each step adds its GEMM onto the running sum in the GEMM's \
             epilogue, so an op after that matmul cannot be in the same loop",
        ));
    }
    Ok(None)
}

/// Emits the gather-scatter pipeline for `g` (see [`unsupported`]).
pub(super) fn emit(
    g: LoopGroup,
    p: &mut HostProgram,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
) -> Result<Vec<Node>> {
    let rs = g
        .reduce_scatter
        .as_ref()
        .expect("a gather-scatter loop reduce-scatters");
    let x = rs.expr.inputs[0];
    require_world_mesh(p, x, rs.didx)?;
    let gathers = g.gathers(p)?;
    for gth in &gathers {
        require_world_mesh(p, gth.input, gth.in_axis)?;
    }
    let (last, s_last) = g.exprs.last().expect("a loop has expressions").clone();
    let requested = ctx
        .options
        .pipelines
        .reduce_scatter_subchunks
        .unwrap_or(2)
        .max(1);
    // Permuted views' rows are not the loop's rows: whole chunks then.
    let requested = if g.whole_chunks() { 1 } else { requested };
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, requested);
    if plan.is_none() && requested > 1 {
        tracing::debug!(
            "gather-scatter pipeline of `{}` runs unsplit: its row axis cannot be split into \
             {requested} contiguous ranges",
            p.ir.tensor_name(rs.expr.output)
        );
    }
    let after = match (&plan, ctx.options.pipelines.weight_gradients) {
        (None, WeightGradients::AfterLoopFromInputs) => after_loop(p, &g, &last, &gathers, false),
        (None, WeightGradients::AfterLoop) => after_loop(p, &g, &last, &gathers, true),
        _ => Vec::new(),
    };
    let u = UnitScalars::new(p, &g, plan.as_ref().map_or(1, |pl| pl.count));
    let pipe = GatherScatter {
        g: &g,
        rs,
        gathers,
        last,
        s_last,
        plan,
        u,
        transport: ctx.options.transports.p2p,
        after,
    };
    let mut nodes = Vec::new();
    let bufs = pipe.allocate(p, internal, &mut nodes);
    let u = &pipe.u;
    let streams = UnitStreams {
        original: p.new_stream(StreamDef::Captured),
        worker: p.new_stream(StreamDef::Pool(u.pool_index)),
        next_worker: p.new_stream(StreamDef::Pool(u.next_pool)),
        arrived: p.new_stream(StreamDef::Pool(u.arrived_index)),
    };
    let original = streams.original;
    nodes.push(Node::GetCurrentStream { stream: original });
    nodes.push(fork_loop(
        u.index,
        u.loop_axis,
        u.zero,
        u.stop,
        original,
        streams.worker,
    ));
    let mut body = Vec::new();
    pipe.emit_prefetch(p, &bufs, &streams, &mut body);
    body.push(Node::SetCurrentStream { stream: original });
    let mut slicer = Slicer {
        chunk: u.chunk,
        pool_index: u.pool_index,
        zero: u.zero,
        small: HashMap::new(),
        rows: pipe.rows_of(u.sub),
        cache: HashMap::new(),
        views: g.views.clone(),
        accumulate: Accumulations::new(p, &g.accumulate, u.index),
    };
    let later = pipe.emit_compute(p, &bufs, &mut slicer, streams.worker, &mut body)?;
    // Views bound in step 2's branch are not bound at step D: bind this step's anew.
    slicer.cache.clear();
    pipe.emit_reduce(p, &bufs, &mut slicer, &streams, &mut body)?;
    if matches!(&later, Node::IfThenElse { else_body, .. } if !else_body.is_empty()) {
        body.push(later);
    }
    nodes.push(Node::ForLoop(ForLoop {
        index: u.index,
        axis: u.loop_axis,
        start: u.zero,
        stop: u.stop,
        body,
    }));
    nodes.push(join_loop(
        u.index,
        u.loop_axis,
        u.zero,
        u.stop,
        streams.worker,
    ));
    after_loop::emit(&g, &pipe.after, &mut nodes);
    Ok(nodes)
}

/// The expressions of loop `g` that run once after it, over every block, instead of block
/// by block: the GEMMs the last expression `last` does not read (directly or through
/// others) that the loop accumulates over its Stream axis (a weight gradient), whose
/// operands the loop slices along their first axis and are its gathered rows, its inputs
/// or permute views of them, or with `all` also other results of the loop (kept for every
/// block then: a buffer of every block; without `all` such a weight gradient stays block
/// by block). With `all`, none unless every such GEMM fits. Each then runs as one GEMM summed over the blocks, reading the gathered rows
/// from a buffer of every block, without reading and writing its sum once per block.
fn after_loop(
    p: &HostProgram,
    g: &LoopGroup,
    last: &Expr,
    gathers: &[Gather],
    all: bool,
) -> Vec<(Expr, usize)> {
    use crate::ir::Op;
    use crate::pass::stream_parallel_type::permute_views::source;
    let gathered: HashSet<TensorId> = gathers.iter().map(|gth| gth.out).collect();
    let body = &g.exprs[..g.exprs.len() - 1];
    let views = &g.views;
    let mut wanted: HashSet<TensorId> = (last.inputs.iter())
        .flat_map(|&t| [t, source(views, t)])
        .collect();
    let mut later = Vec::new();
    for (e, s) in body.iter().rev() {
        if gathered.contains(&e.output) {
            continue;
        }
        if wanted.contains(&e.output) {
            wanted.extend(e.inputs.iter().flat_map(|&t| [t, source(views, t)]));
        } else {
            later.push((e.clone(), *s));
        }
    }
    later.reverse();
    let fits = |x: &(Expr, usize)| match &x.0.op {
        // A permute view such a GEMM reads, made over every block after the loop too.
        Op::Permute { .. } => all,
        _ => after_loop::fits(p, g, &gathered, all, x),
    };
    if all {
        return match later.iter().all(fits) {
            true => later,
            false => Vec::new(),
        };
    }
    later.into_iter().filter(fits).collect()
}
