//! The standard stream loop, for every loop group that is neither a ring nor a
//! gather-scatter pipeline: one iteration per chunk (or, with row ranges, `D * c`: in
//! rounds for a reduce-scatter, chunk by chunk for an allgather), whose body runs the
//! loop's expressions on their slices (allgather steps included) and the direct
//! reduce-scatter step, between a fork and a join of the pool streams; a folded
//! reduce-scatter's partials are summed after the loop (or per round).

use std::collections::{HashMap, HashSet};

use super::direct::{
    emit_reduce_scatter_step, reduce_scatter_slots, slot_axis, sum_slots, ReduceScatterStep,
    RoundSum,
};
use super::group::{LoopGroup, ReduceScatterFold};
use super::iteration::{emit_body_expr, fork_loop, join_loop};
use super::schedule::Schedule;
use super::subchunk::{gather_rows, SubChunkPlan};
use super::views::{slice_tensor, Accumulations, RowSlicing, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef, StreamId, Transport};
use crate::ir::{IterDomainId, NamedScalar, ScalarId, ScalarOp, TensorId};
use crate::pass::context::PassContext;
use crate::resharding::MeshContext;

/// Emits the standard loop for `g`; `has_allgather` when one of its expressions gathers,
/// `subchunks` the row ranges per block a folded reduce-scatter asks for, or without one
/// the row ranges per chunk of its allgathers.
pub(super) fn emit(
    g: LoopGroup,
    p: &mut HostProgram,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
    has_allgather: bool,
    subchunks: usize,
) -> Result<Vec<Node>> {
    let plan = subchunk_plan(&g, p, subchunks);
    let gather = if plan.is_none() && has_allgather {
        gather_plan(&g, p, subchunks)?
    } else {
        None
    };
    let split = match (&plan, &gather) {
        (Some(plan), _) => Some(RowSplit {
            count: plan.count,
            rows: &plan.rows,
            step_major: false,
        }),
        (None, Some(rows)) => Some(RowSplit {
            count: subchunks,
            rows,
            step_major: true,
        }),
        (None, None) => None,
    };
    let it = Iterations::new(p, &g, split);
    let sched = Schedule::new(
        p,
        ctx.options.pipelines.p2p_schedule,
        it.step,
        g.extent,
        has_allgather,
        g.reduce_scatter.is_some(),
    );
    let original = p.new_stream(StreamDef::Captured);
    let worker = p.new_stream(StreamDef::Pool(it.pool_index));
    let zero = p.ir.constant(0);

    // Buffers: full size, or `numberOfStreams` slots for loop-internal intermediates.
    let (mut nodes, small) = g.allocate_outputs(p, internal, it.rows.as_ref(), None);
    let rs_buffers = allocate_reduce_scatter(p, &g, it.rows.is_some(), zero, &mut nodes);
    nodes.push(Node::GetCurrentStream { stream: original });
    nodes.push(fork_loop(
        it.index, it.axis, zero, it.stop, original, worker,
    ));
    // Compute-first: the leading local exprs run on the caller's stream, in order; the
    // pool stream takes over at the first communication (the folded reduce-scatter
    // included). The slot a prefix writes was last read by the communication of
    // iteration `i - numberOfStreams`, on this same pool stream: wait for it first.
    // (Full-size buffers are never reused, and need no wait.)
    let prefix = if ctx.options.streams.compute_first {
        let mesh = MeshContext {
            world_size: Some(p.world_size),
        };
        g.compute_prefix_len(p, mesh)?
    } else {
        0
    };
    let loop_body = LoopBody {
        g: &g,
        sched: &sched,
        original,
        worker,
        prefix,
        prefix_reuses_slots: g.exprs[..prefix]
            .iter()
            .any(|(e, _)| small.contains_key(&e.output)),
        reduce_scatter: reduce_scatter_step(&g, &it, plan.as_ref(), rs_buffers),
        transport: ctx.options.transports.p2p,
        previous: (!g.accumulate.is_empty()).then(|| previous_pool_stream(p, it.index)),
    };
    let mut slicer = Slicer {
        chunk: sched.chunk,
        pool_index: it.pool_index,
        zero,
        small,
        rows: it.rows,
        cache: HashMap::new(),
        views: g.views.clone(),
        accumulate: Accumulations::new(p, &g.accumulate, it.index),
    };
    let body = loop_body.emit(p, &mut slicer)?;
    nodes.push(Node::ForLoop(ForLoop {
        index: it.index,
        axis: it.axis,
        start: zero,
        stop: it.stop,
        body,
    }));
    if prefix > 0 {
        nodes.push(join_loop(it.index, it.axis, zero, it.stop, worker));
    }
    if let (Some(rs), Some(bufs), None) = (&g.reduce_scatter, rs_buffers, &plan) {
        // The partials of this device's chunk, one per source, summed locally.
        let view = select_block(p, rs, zero, &mut nodes);
        let red_axis = slot_axis(&p.ir, view);
        nodes.push(sum_slots(rs, bufs.slots, view, red_axis));
    }
    Ok(nodes)
}

/// The row ranges a folded reduce-scatter's blocks are split into (`None` without a
/// reduce-scatter, with one range, or when its rows cannot be split).
fn subchunk_plan(g: &LoopGroup, p: &HostProgram, c: usize) -> Option<SubChunkPlan> {
    let rs = g.reduce_scatter.as_ref()?;
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, c);
    if plan.is_none() && c > 1 {
        tracing::debug!(
            "reduce-scatter pipeline of `{}` runs unsplit: its row axis cannot be split into \
             {c} contiguous ranges",
            p.ir.tensor_name(rs.expr.output)
        );
    }
    plan
}

/// The row ranges of a split loop: `count` per chunk, the row axis of each loop tensor,
/// and the order of the iterations.
struct RowSplit<'a> {
    count: usize,
    rows: &'a HashMap<TensorId, usize>,
    /// `false`: round-major, every chunk's range 0, then every chunk's range 1 (a
    /// reduce-scatter sums a round once every chunk's range arrived); `true`: step-major,
    /// every range of one chunk, then the next chunk's (an allgather).
    step_major: bool,
}

/// The row axes of a loop that gathers and does not reduce-scatter, split into `c` ranges
/// per chunk (`None` unsplit), with a note under the program when it splits. Its
/// iterations go step-major (the module doc of `stream_parallel_type` says why).
fn gather_plan(
    g: &LoopGroup,
    p: &mut HostProgram,
    c: usize,
) -> Result<Option<HashMap<TensorId, usize>>> {
    if c < 2 {
        return Ok(None);
    }
    let gathers = g.gathers(p)?;
    let rows = gather_rows(&p.ir, &g.exprs, &gathers, c);
    let name = p.ir.tensor_name(g.exprs[g.exprs.len() - 1].0.output);
    match &rows {
        Some(_) => p.notes.push(format!(
            "allgather pipeline of `{name}` in {c} row ranges per chunk \
             (LowerOptions::pipelines.allgather_subchunks)"
        )),
        None => tracing::debug!(
            "allgather pipeline of `{name}` runs unsplit: its row axis cannot be split into \
             {c} contiguous ranges"
        ),
    }
    Ok(rows)
}

/// The loop's iterations: one per chunk, or with row ranges `D * c`: round-major (round
/// `i / D`, ring step `i % D`) or step-major (ring step `i / c`, range `i % c`).
struct Iterations {
    index: ScalarId,
    /// The pool stream of iteration `i`: `i % numberOfStreams`.
    pool_index: ScalarId,
    axis: IterDomainId,
    stop: ScalarId,
    /// The ring step of iteration `i` (`i` itself without row ranges).
    step: ScalarId,
    rows: Option<RowSlicing>,
}

impl Iterations {
    fn new(p: &mut HostProgram, g: &LoopGroup, plan: Option<RowSplit>) -> Self {
        let index = p.ir.loop_index("StreamIdx");
        let n = p.ir.named(NamedScalar::NumberOfStreams);
        let pool_index = p.ir.binary(ScalarOp::Mod, index, n);
        let Some(plan) = plan else {
            return Iterations {
                index,
                pool_index,
                axis: g.axis,
                stop: g.extent,
                step: index,
                rows: None,
            };
        };
        let c = p.ir.constant(plan.count as i64);
        let stop = p.ir.binary(ScalarOp::Mul, g.extent, c);
        let mut dom = p.ir.iter_domain(g.axis).clone();
        dom.extent = stop;
        let axis = p.ir.add_iter_domain(dom);
        let (step, sub) = if plan.step_major {
            (
                p.ir.binary(ScalarOp::Div, index, c),
                p.ir.binary(ScalarOp::Mod, index, c),
            )
        } else {
            (
                p.ir.binary(ScalarOp::Mod, index, g.extent),
                p.ir.binary(ScalarOp::Div, index, g.extent),
            )
        };
        Iterations {
            index,
            pool_index,
            axis,
            stop,
            step,
            rows: Some(RowSlicing {
                rows: plan.rows.clone(),
                sub,
                count: c,
            }),
        }
    }
}

/// Where a folded reduce-scatter's partials land: one slot per source, and with row
/// ranges this device's block of the output, which each round sums its rows into.
#[derive(Clone, Copy)]
struct ReduceScatterBuffers {
    slots: TensorId,
    block: Option<TensorId>,
}

/// Allocates (into `nodes`) the slots and the output of `g`'s folded reduce-scatter, and
/// with row ranges binds this device's block of the output.
fn allocate_reduce_scatter(
    p: &mut HostProgram,
    g: &LoopGroup,
    row_ranges: bool,
    zero: ScalarId,
    nodes: &mut Vec<Node>,
) -> Option<ReduceScatterBuffers> {
    let rs = g.reduce_scatter.as_ref()?;
    let slots = reduce_scatter_slots(&mut p.ir, rs, g.extent);
    nodes.push(Node::Allocate { tensor: slots });
    nodes.push(Node::Allocate {
        tensor: rs.expr.output,
    });
    let block = row_ranges.then(|| select_block(p, rs, zero, nodes));
    Some(ReduceScatterBuffers { slots, block })
}

/// The reduce-scatter step of every iteration: into the slots, and with row ranges the
/// round's sum into the output block.
fn reduce_scatter_step<'a>(
    g: &'a LoopGroup,
    it: &Iterations,
    plan: Option<&SubChunkPlan>,
    bufs: Option<ReduceScatterBuffers>,
) -> Option<ReduceScatterStep<'a>> {
    let (rs, bufs) = (g.reduce_scatter.as_ref()?, bufs?);
    let round = match (plan, bufs.block) {
        (Some(plan), Some(block)) => Some(RoundSum {
            index: it.index,
            extent: g.extent,
            block,
            out_rows: plan.out_rows,
        }),
        _ => None,
    };
    Some(ReduceScatterStep {
        rs,
        slots: bufs.slots,
        round,
    })
}

/// The body of the standard loop, once its buffers and streams exist.
struct LoopBody<'a> {
    g: &'a LoopGroup,
    sched: &'a Schedule,
    /// The caller's stream.
    original: StreamId,
    /// The iteration's pool stream.
    worker: StreamId,
    /// How many leading local expressions run on the caller's stream (compute-first).
    prefix: usize,
    /// Whether the prefix writes a slot that an earlier iteration's communication reads.
    prefix_reuses_slots: bool,
    reduce_scatter: Option<ReduceScatterStep<'a>>,
    transport: Transport,
    /// The previous iteration's pool stream, where the loop accumulates: a GEMM adding
    /// onto a sum on the pool stream waits for it (the GEMM before it, which added onto
    /// the same sum there).
    previous: Option<StreamId>,
}

impl LoopBody<'_> {
    /// The prefix on the caller's stream, the rest and the reduce-scatter step on the pool
    /// stream, and back to the caller's stream.
    fn emit(&self, p: &mut HostProgram, slicer: &mut Slicer) -> Result<Vec<Node>> {
        let (original, worker, prefix) = (self.original, self.worker, self.prefix);
        let mut body = vec![Node::SetCurrentStream {
            stream: if prefix > 0 { original } else { worker },
        }];
        if self.prefix_reuses_slots {
            body.push(Node::Synchronize { stream: worker });
        }
        for (k, (e, s)) in self.g.exprs.iter().enumerate() {
            if prefix > 0 && k == prefix {
                body.push(Node::SetCurrentStream { stream: worker });
                body.push(Node::Synchronize { stream: original });
            }
            let adds_on_pool = k >= prefix && slicer.accumulate.targets.contains_key(&e.output);
            if let (true, Some(previous)) = (adds_on_pool, self.previous) {
                body.push(Node::IfThenElse {
                    cond: slicer.accumulate.first,
                    then_body: Vec::new(),
                    else_body: vec![Node::Synchronize { stream: previous }],
                });
            }
            emit_body_expr(p, slicer, self.sched, e, *s, self.transport, &mut body)?;
        }
        if let Some(step) = &self.reduce_scatter {
            if prefix == self.g.exprs.len() {
                body.push(Node::SetCurrentStream { stream: worker });
                body.push(Node::Synchronize { stream: original });
            }
            emit_reduce_scatter_step(p, slicer, self.sched, step, self.transport, &mut body)?;
        }
        body.push(Node::SetCurrentStream { stream: original });
        if prefix == 0 {
            body.push(Node::Synchronize { stream: worker });
        }
        Ok(body)
    }
}

/// Binds (at the program's top level, into `nodes`) this device's block of a folded
/// reduce-scatter's output: the output without its DIDx axis.
fn select_block(
    p: &mut HostProgram,
    rs: &ReduceScatterFold,
    zero: ScalarId,
    nodes: &mut Vec<Node>,
) -> TensorId {
    let out = rs.expr.output;
    let view = slice_tensor(&mut p.ir, out, rs.out_didx);
    nodes.push(Node::AliasSelect {
        input: out,
        output: view,
        axis: rs.out_didx,
        index: zero,
    });
    view
}

/// `Stream((i + numberOfStreams - 1) % numberOfStreams)`: the pool stream of iteration
/// `i - 1` of a loop with index `i`.
fn previous_pool_stream(p: &mut HostProgram, index: ScalarId) -> StreamId {
    let n = p.ir.named(NamedScalar::NumberOfStreams);
    let one = p.ir.constant(1);
    let back = p.ir.binary(ScalarOp::Sub, n, one);
    let shifted = p.ir.binary(ScalarOp::Add, index, back);
    let pool = p.ir.binary(ScalarOp::Mod, shifted, n);
    p.new_stream(StreamDef::Pool(pool))
}
