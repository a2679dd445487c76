//! The ring reduce-scatter pipeline ([`ReduceScatterPipeline::Ring`]).
//!
//! Step `j` (of `D`) computes the partial of block `(rank + j + 1) % D`, the same block
//! that device `rank + 1` computed at step `j - 1`. Its GEMM adds onto the running sum of
//! that block received from `rank + 1` (`acc = acc + a @ b`, in the GEMM's epilogue), and
//! the exchange after it sends the new sum on to `rank - 1` while receiving the running sum
//! of the next step's block from `rank + 1`. Every send meets its receive in the same
//! iteration, and the last step's GEMM, on this device's own block, finishes the sum that
//! arrived into the output (`out = acc + a @ b`: C and D of one GEMM). Every sum lands in
//! a buffer of the program's own, never in the caller's output, so the copy engines keep
//! the same receive buffers from call to call and the whole ring can be captured. With `c` sub-chunks the loop runs `D * c` iterations,
//! step-major (`j = i / c`, rows `i % c`), so the transfer of one row range hides behind
//! the GEMMs of the others.
//!
//! ```text
//! FOR i in 0..D*c:
//!   SetCurrentStream C; IF j > 0: Synchronize Stream((i - c) mod numberOfStreams)   (the sum arrived)
//!   sum = (j == D-1 ? this device's output block : acc[j]), rows of i % c
//!   j == 0 ? sum = a[block] @ b
//!          : sum = a[block] @ b + acc[j]          (in place unless j == D-1)
//!   IF j != D-1: SetCurrentStream Stream(i mod numberOfStreams); Synchronize C
//!                recv next step's sum into acc[j+1] (from rank + 1), send sum (to rank - 1)
//!   SetCurrentStream S
//! FOR i: Synchronize Stream(i mod numberOfStreams)
//! ```
//!
//! `C` is the caller's stream `S`, or with `LowerOptions::streams.ring_compute_streams` at 2,
//! `ComputeStream (i % 2)` (both forked from `S` before the loop and joined after it), so
//! that consecutive GEMMs overlap each other's first and last waves.
//!
//! [`ReduceScatterPipeline::Ring`]: crate::lower::ReduceScatterPipeline::Ring

use std::collections::{HashMap, HashSet};

use super::direct::{reduce_scatter_slots, slot_axis_of_block};
use super::exchange::{coalesced_exchange, require_world_mesh};
use super::group::{stream_error, LoopGroup, ReduceScatterFold};
use super::iteration::{emit_body_expr, fork_loop, join_loop};
use super::schedule::Schedule;
use super::subchunk::SubChunkPlan;
use super::views::{narrowed, slice_tensor, Accumulations, RowSlicing, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef, StreamId, Transport, COMPUTE_STREAMS};
use crate::ir::{
    axis_map, Expr, IterDomainId, NamedScalar, Op, ParallelType, ScalarId, ScalarOp, TensorId,
};
use crate::pass::context::PassContext;

/// Whether the ring applies to this loop: the reduced tensor is the result of the loop's
/// last expression, a matmul whose chunk is a plain 2-D GEMM (`[DIDx, Stream, M, N]`).
pub(super) fn applies(p: &HostProgram, g: &LoopGroup, rs: &ReduceScatterFold) -> bool {
    let f = &p.ir;
    let x = rs.expr.inputs[0];
    let Some((last, s)) = g.exprs.last() else {
        return false;
    };
    let map = axis_map(f, last);
    // Each operand is a matrix once its stream slice and DIDx axis are taken away.
    let matrices = last.inputs.iter().enumerate().all(|(i, &t)| {
        let sliced = usize::from(map.producer_axis(i, *s).is_some());
        let sharded = usize::from(f.find_parallel_axis(t, ParallelType::DIDx).is_some());
        f.visible_axes(t).len() == 2 + sliced + sharded
    });
    last.output == x
        && matches!(last.op, Op::Matmul)
        && last.inputs.len() == 2
        && matrices
        && f.visible_axes(x).len() == 4
        && f.find_parallel_axis(x, ParallelType::DIDx).is_some()
        && f.visible_axes(rs.expr.output)
            .iter()
            .filter(|&&q| f.axis(rs.expr.output, q).parallel != ParallelType::DIDx)
            .count()
            == 2
}

/// Emits the ring pipeline for `g` (which [`applies`]).
pub(super) fn emit(
    g: LoopGroup,
    p: &mut HostProgram,
    ctx: &PassContext,
    internal: &HashSet<TensorId>,
    subchunks: usize,
) -> Result<Vec<Node>> {
    let rs = g
        .reduce_scatter
        .as_ref()
        .expect("the ring is a reduce-scatter pipeline");
    let x = rs.expr.inputs[0];
    require_world_mesh(p, x, rs.didx)?;
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, subchunks);
    let (sc, rows) = RingScalars::new(p, &g, plan.as_ref());

    // Buffers: the running sums of steps 0..D-1, and the output.
    let (mut nodes, small) = g.allocate_outputs(p, internal, rows.as_ref(), Some(x));
    let acc = allocate_running_sums(p, rs, g.extent, &mut nodes);
    let original = p.new_stream(StreamDef::Captured);
    let worker = p.new_stream(StreamDef::Pool(sc.pool_index));
    let arrived = p.new_stream(StreamDef::Pool(sc.arrived_index));
    let compute = ComputeStreams::new(p, ctx, g.exprs.len(), sc.index, original);
    nodes.push(Node::GetCurrentStream { stream: original });
    nodes.push(fork_loop(
        sc.index,
        sc.loop_axis,
        sc.zero,
        sc.stop,
        original,
        worker,
    ));
    compute.fork(original, &mut nodes);

    let mut slicer = Slicer {
        chunk: sc.block,
        pool_index: sc.pool_index,
        zero: sc.zero,
        small,
        rows,
        cache: HashMap::new(),
        views: g.views.clone(),
        accumulate: Accumulations::new(p, &g.accumulate, sc.index),
    };
    let streams = RingStreams {
        original,
        worker,
        arrived,
        compute: compute.current,
    };
    let transport = ctx.options.transports.p2p;
    let body = emit_body(p, &g, &sc, &mut slicer, acc, &streams, transport)?;
    nodes.push(Node::ForLoop(ForLoop {
        index: sc.index,
        axis: sc.loop_axis,
        start: sc.zero,
        stop: sc.stop,
        body,
    }));
    // Join: the caller's stream waits for every pool stream's transfers (and for the
    // compute streams' GEMMs).
    nodes.push(join_loop(sc.index, sc.loop_axis, sc.zero, sc.stop, worker));
    compute.join(&mut nodes);
    Ok(nodes)
}

/// The scalars of a ring's loop: its iterations (`D`, or `D * c` step-major with row
/// ranges), the step's block and neighbours, and the step predicates.
struct RingScalars {
    index: ScalarId,
    rank: ScalarId,
    zero: ScalarId,
    /// The pool stream of iteration `i`.
    pool_index: ScalarId,
    loop_axis: IterDomainId,
    stop: ScalarId,
    /// The ring step `j` of iteration `i`, and `j + 1`.
    step: ScalarId,
    next_step: ScalarId,
    /// The block step `j` computes: `(rank + 1 + j) % D`.
    block: ScalarId,
    /// The neighbours: the running sums come from `rank + 1` and go to `rank - 1`.
    from: ScalarId,
    to: ScalarId,
    is_first: ScalarId,
    is_last: ScalarId,
    /// The pool stream of iteration `i - c`, whose exchange received this iteration's
    /// running sum.
    arrived_index: ScalarId,
}

impl RingScalars {
    /// The scalars, and the row ranges of iteration `i` when `plan` splits the blocks.
    fn new(
        p: &mut HostProgram,
        g: &LoopGroup,
        plan: Option<&SubChunkPlan>,
    ) -> (Self, Option<RowSlicing>) {
        let c = plan.map_or(1, |pl| pl.count);
        let f = &mut p.ir;
        let index = f.loop_index("StreamIdx");
        let n = f.named(NamedScalar::NumberOfStreams);
        let rank = f.named(NamedScalar::Rank);
        let (zero, one) = (f.constant(0), f.constant(1));
        let d = g.extent;
        let cc = f.constant(c as i64);
        let pool_index = f.binary(ScalarOp::Mod, index, n);
        let (loop_axis, stop, step, rows) = match plan {
            None => (g.axis, d, index, None),
            Some(pl) => {
                let stop = f.binary(ScalarOp::Mul, d, cc);
                let mut dom = f.iter_domain(g.axis).clone();
                dom.extent = stop;
                let axis = f.add_iter_domain(dom);
                let step = f.binary(ScalarOp::Div, index, cc);
                let sub = f.binary(ScalarOp::Mod, index, cc);
                let rows = RowSlicing {
                    rows: pl.rows.clone(),
                    sub,
                    count: cc,
                };
                (axis, stop, step, Some(rows))
            }
        };
        // Block of step j, the neighbours, and the step predicates.
        let r1 = f.binary(ScalarOp::Add, rank, one);
        let r1j = f.binary(ScalarOp::Add, r1, step);
        let block = f.binary(ScalarOp::Mod, r1j, d);
        let from = f.binary(ScalarOp::Mod, r1, d);
        let rd = f.binary(ScalarOp::Add, rank, d);
        let rd1 = f.binary(ScalarOp::Sub, rd, one);
        let to = f.binary(ScalarOp::Mod, rd1, d);
        let last = f.binary(ScalarOp::Sub, d, one);
        let next_step = f.binary(ScalarOp::Add, step, one);
        let is_first = f.binary(ScalarOp::Eq, step, zero);
        let is_last = f.binary(ScalarOp::Eq, step, last);
        // The pool stream of iteration i - c (mod numberOfStreams, kept non-negative).
        let c_n1 = {
            let n1 = f.binary(ScalarOp::Sub, n, one);
            f.binary(ScalarOp::Mul, cc, n1)
        };
        let back = f.binary(ScalarOp::Add, index, c_n1);
        let arrived_index = f.binary(ScalarOp::Mod, back, n);
        let scalars = RingScalars {
            index,
            rank,
            zero,
            pool_index,
            loop_axis,
            stop,
            step,
            next_step,
            block,
            from,
            to,
            is_first,
            is_last,
            arrived_index,
        };
        (scalars, rows)
    }
}

/// The streams of a ring's loop: the caller's, the iteration's pool stream, the pool
/// stream that received the iteration's running sum, and the one its GEMM runs on.
struct RingStreams {
    original: StreamId,
    worker: StreamId,
    arrived: StreamId,
    compute: StreamId,
}

/// The loop body: wait for the running sum (after the first step), every expression but
/// the last on the block's slices, then the ring step (the GEMM onto the sum, and the
/// exchange) of the last expression, a matmul.
fn emit_body(
    p: &mut HostProgram,
    g: &LoopGroup,
    sc: &RingScalars,
    slicer: &mut Slicer,
    acc: TensorId,
    streams: &RingStreams,
    transport: Transport,
) -> Result<Vec<Node>> {
    let rs = g
        .reduce_scatter
        .as_ref()
        .expect("the ring is a reduce-scatter pipeline");
    let s_axis = g.exprs.last().expect("a loop has expressions").1;
    // The first step's sums start here: nothing arrived for them (and the stream of
    // iteration i - c may be one the loop never uses, which a graph capture refuses).
    let mut body = vec![
        Node::SetCurrentStream {
            stream: streams.compute,
        },
        Node::IfThenElse {
            cond: sc.is_first,
            then_body: Vec::new(),
            else_body: vec![Node::Synchronize {
                stream: streams.arrived,
            }],
        },
    ];
    let sched = Schedule {
        chunk: sc.block,
        recv_peer: sc.from,
        send_peer: sc.to,
        rank: sc.rank,
    };
    let (exprs, last) = g.exprs.split_at(g.exprs.len() - 1);
    for (e, s) in exprs {
        emit_body_expr(p, slicer, &sched, e, *s, transport, &mut body)?;
    }
    let mm = &last[0].0;
    // The GEMM's operands for this chunk, without their (local, extent-1) DIDx axes.
    let map = axis_map(&p.ir, mm);
    let mut operands = Vec::new();
    for (i, &t) in mm.inputs.iter().enumerate() {
        let v = match map.producer_axis(i, s_axis) {
            Some(q) => slicer.slice(p, t, q, &mut body),
            None => t,
        };
        operands.push(drop_didx(p, v, sc.zero, &mut body));
    }
    let sums = RunningSums {
        acc,
        rs,
        rows: slicer.rows.as_ref(),
        zero: sc.zero,
    };
    let ring_step = RingStep {
        step: sc.step,
        is_first: sc.is_first,
        is_last: sc.is_last,
        next_step: sc.next_step,
        from: sc.from,
        to: sc.to,
        worker: streams.worker,
        compute: streams.compute,
    };
    ring_step.emit(p, &sums, operands, transport, &mut body)?;
    if streams.compute != streams.original {
        // Back on the caller's stream, for the join right after the loop.
        body.push(Node::SetCurrentStream {
            stream: streams.original,
        });
    }
    Ok(body)
}

/// The streams a ring's GEMMs run on: the caller's, or (with
/// [`LowerOptions::streams.ring_compute_streams`] at 2 and the GEMM alone in the loop) the two
/// compute streams, iteration `i` on `ComputeStream (i % 2)`. GEMM `i + 1` then starts
/// while GEMM `i`'s last tiles finish; the two write different running sums, and the
/// exchange of iteration `i` waits for the stream its GEMM ran on. With anything else in
/// the loop the caller's stream stays: its intermediates' slots are reused every
/// `numberOfStreams` iterations, which two alternating streams would not order.
///
/// [`LowerOptions::streams.ring_compute_streams`]: crate::lower::LowerOptions::streams.ring_compute_streams
struct ComputeStreams {
    /// The stream of the loop's iteration.
    current: StreamId,
    /// Every compute stream, to fork from and join into the caller's (empty when the
    /// GEMMs run on the caller's stream).
    all: Vec<StreamId>,
}

impl ComputeStreams {
    fn new(
        p: &mut HostProgram,
        ctx: &PassContext,
        loop_exprs: usize,
        index: ScalarId,
        original: StreamId,
    ) -> Self {
        let wanted = ctx
            .options
            .streams
            .ring_compute_streams
            .clamp(1, COMPUTE_STREAMS);
        if wanted == 1 || loop_exprs != 1 {
            if wanted > 1 {
                tracing::debug!(
                    "the ring's GEMMs stay on the caller's stream: its loop computes more \
                     than the GEMM"
                );
            }
            return ComputeStreams {
                current: original,
                all: Vec::new(),
            };
        }
        let count = p.ir.constant(wanted as i64);
        let turn = p.ir.binary(ScalarOp::Mod, index, count);
        let current = p.new_stream(StreamDef::Compute(turn));
        let all = (0..wanted as i64)
            .map(|k| {
                let k = p.ir.constant(k);
                p.new_stream(StreamDef::Compute(k))
            })
            .collect();
        ComputeStreams { current, all }
    }

    /// Every compute stream waits for the caller's work so far (the GEMMs' operands).
    fn fork(&self, original: StreamId, nodes: &mut Vec<Node>) {
        for &s in &self.all {
            nodes.push(Node::SetCurrentStream { stream: s });
            nodes.push(Node::Synchronize { stream: original });
        }
        if !self.all.is_empty() {
            nodes.push(Node::SetCurrentStream { stream: original });
        }
    }

    /// The caller's stream (current) waits for every compute stream.
    fn join(&self, nodes: &mut Vec<Node>) {
        for &s in &self.all {
            nodes.push(Node::Synchronize { stream: s });
        }
    }
}

/// Allocates (into `nodes`) the running sums of a ring over `d` devices, one block per
/// step (the last step's arrives there too and is finished into this device's block of
/// the output), and the output itself.
pub(super) fn allocate_running_sums(
    p: &mut HostProgram,
    rs: &ReduceScatterFold,
    d: ScalarId,
    nodes: &mut Vec<Node>,
) -> TensorId {
    let acc = reduce_scatter_slots(&mut p.ir, rs, d);
    if let Some(name) = p.ir.tensor(rs.expr.output).name.clone() {
        p.ir.tensor_mut(acc).name = Some(format!("{name}_running_sums"));
    }
    nodes.push(Node::Allocate { tensor: acc });
    nodes.push(Node::Allocate {
        tensor: rs.expr.output,
    });
    acc
}

/// One ring step once its GEMM's operands are bound: the GEMM onto the running sum of
/// `step` (in place, `acc[step] += a @ b`; a plain GEMM when `is_first`; into this device's
/// block of the output when `is_last`, `out = acc[step] + a @ b`) on the current stream,
/// `compute`, then, unless `is_last`, on the iteration's pool stream after the GEMM, the
/// exchange that sends the new sum to `to` and receives the sum of `next_step` from
/// `from` into `acc[next_step]`; the step ends back on `compute`.
pub(super) struct RingStep {
    pub(super) step: ScalarId,
    pub(super) is_first: ScalarId,
    pub(super) is_last: ScalarId,
    pub(super) next_step: ScalarId,
    pub(super) from: ScalarId,
    pub(super) to: ScalarId,
    pub(super) worker: StreamId,
    pub(super) compute: StreamId,
}

impl RingStep {
    pub(super) fn emit(
        &self,
        p: &mut HostProgram,
        sums: &RunningSums,
        operands: Vec<TensorId>,
        transport: Transport,
        body: &mut Vec<Node>,
    ) -> Result<()> {
        let target = sums.bind(p, self.step, self.is_last, body)?;
        let gemm = |addend: Option<TensorId>| {
            let mut inputs = operands.clone();
            inputs.extend(addend);
            Node::Compute(Expr {
                op: Op::Matmul,
                inputs,
                output: target,
            })
        };
        // The last step finishes the sum that arrived into the output block.
        let mut finish = Vec::new();
        let arrived = sums.bind_slot(p, self.step, &mut finish)?;
        finish.push(gemm(Some(arrived)));
        body.push(Node::IfThenElse {
            cond: self.is_first,
            then_body: vec![gemm(None)],
            else_body: vec![Node::IfThenElse {
                cond: self.is_last,
                then_body: finish,
                else_body: vec![gemm(Some(target))],
            }],
        });
        let mut exchange = vec![
            Node::SetCurrentStream {
                stream: self.worker,
            },
            Node::Synchronize {
                stream: self.compute,
            },
        ];
        let next = sums.bind_slot(p, self.next_step, &mut exchange)?;
        exchange.extend(coalesced_exchange(
            p, next, self.from, target, self.to, transport,
        ));
        body.push(Node::IfThenElse {
            cond: self.is_last,
            then_body: Vec::new(),
            else_body: exchange,
        });
        body.push(Node::SetCurrentStream {
            stream: self.compute,
        });
        Ok(())
    }
}

/// `t` without its DIDx axis (a local extent-1 axis), as a view; `t` if it has none.
pub(super) fn drop_didx(
    p: &mut HostProgram,
    t: TensorId,
    zero: ScalarId,
    body: &mut Vec<Node>,
) -> TensorId {
    let Some(q) = p.ir.find_parallel_axis(t, ParallelType::DIDx) else {
        return t;
    };
    let v = slice_tensor(&mut p.ir, t, q);
    body.push(Node::AliasSelect {
        input: t,
        output: v,
        axis: q,
        index: zero,
    });
    v
}

/// The running sums of a ring: `acc[j]` for every step `j`, and this device's block of the
/// output, which the last step writes; each narrowed to the iteration's rows when
/// sub-chunked.
pub(super) struct RunningSums<'a> {
    pub(super) acc: TensorId,
    pub(super) rs: &'a ReduceScatterFold,
    pub(super) rows: Option<&'a RowSlicing>,
    pub(super) zero: ScalarId,
}

/// The tensors one binding of a running sum creates.
struct SumViews {
    /// `acc` without its slot axis, and the output without its DIDx axis.
    slot: TensorId,
    block: TensorId,
    /// Position of the slot axis in `acc`.
    slot_pos: usize,
    /// The row axis in the block and in a slot, with the block's row extent; `None`
    /// without sub-chunks.
    rows: Option<(usize, usize, ScalarId)>,
    /// What the running sum is bound to: `slot` itself, or its rows.
    view: TensorId,
}

impl RunningSums<'_> {
    fn views(&self, p: &mut HostProgram) -> Result<SumViews> {
        let out = self.rs.expr.output;
        let out_didx = self.rs.out_didx;
        // The slot axis of `acc` sits where the output block has its reduction axis; the
        // row axis is the block's first visible axis that is not it.
        let slot_pos = slot_axis_of_block(&p.ir, out, out_didx);
        let slot = slice_tensor(&mut p.ir, self.acc, slot_pos);
        let block = slice_tensor(&mut p.ir, out, out_didx);
        let Some(rows) = self.rows else {
            return Ok(SumViews {
                slot,
                block,
                slot_pos,
                rows: None,
                view: slot,
            });
        };
        let row_in_block = (0..p.ir.tensor(block).axes.len())
            .find(|&q| q != slot_pos && !p.ir.axis(block, q).is_reduction())
            .ok_or_else(|| {
                stream_error(
                    &p.ir,
                    out,
                    out_didx,
                    "the ring needs a row axis in this device's block of the output",
                )
            })?;
        let row_in_slot = if row_in_block > slot_pos {
            row_in_block - 1
        } else {
            row_in_block
        };
        let extent = p.ir.axis(block, row_in_block).extent;
        let (start, stop) = rows.range(&mut p.ir, extent);
        let len = p.ir.binary(ScalarOp::Sub, stop, start);
        let view = narrowed(&mut p.ir, slot, row_in_slot, len);
        Ok(SumViews {
            slot,
            block,
            slot_pos,
            rows: Some((row_in_block, row_in_slot, extent)),
            view,
        })
    }

    /// Binds `v.view` to the running sum of `step` (`acc[step]`, its rows).
    fn emit_slot(&self, p: &mut HostProgram, v: &SumViews, step: ScalarId, body: &mut Vec<Node>) {
        body.push(Node::AliasSelect {
            input: self.acc,
            output: v.slot,
            axis: v.slot_pos,
            index: step,
        });
        if let (Some(rows), Some((_, row_in_slot, extent))) = (self.rows, v.rows) {
            rows.emit_into(p, v.slot, row_in_slot, extent, false, Some(v.view), body);
        }
    }

    /// Binds `v.view` to this device's block of the output (its rows).
    fn emit_block(&self, p: &mut HostProgram, v: &SumViews, body: &mut Vec<Node>) {
        let out = self.rs.expr.output;
        match (self.rows, v.rows) {
            (Some(rows), Some((row_in_block, _, extent))) => {
                body.push(Node::AliasSelect {
                    input: out,
                    output: v.block,
                    axis: self.rs.out_didx,
                    index: self.zero,
                });
                rows.emit_into(p, v.block, row_in_block, extent, false, Some(v.view), body);
            }
            _ => body.push(Node::AliasSelect {
                input: out,
                output: v.view,
                axis: self.rs.out_didx,
                index: self.zero,
            }),
        }
    }

    /// Binds one view to the running sum of step `step`, `acc[step]` (its rows).
    pub(super) fn bind_slot(
        &self,
        p: &mut HostProgram,
        step: ScalarId,
        body: &mut Vec<Node>,
    ) -> Result<TensorId> {
        let v = self.views(p)?;
        self.emit_slot(p, &v, step, body);
        Ok(v.view)
    }

    /// Binds (in both branches of `IF is_last`) one view: where step `step` writes its sum,
    /// this device's output block at the last step, else `acc[step]`.
    pub(super) fn bind(
        &self,
        p: &mut HostProgram,
        step: ScalarId,
        is_last: ScalarId,
        body: &mut Vec<Node>,
    ) -> Result<TensorId> {
        let v = self.views(p)?;
        let mut then_body = Vec::new();
        self.emit_block(p, &v, &mut then_body);
        let mut else_body = Vec::new();
        self.emit_slot(p, &v, step, &mut else_body);
        body.push(Node::IfThenElse {
            cond: is_last,
            then_body,
            else_body,
        });
        Ok(v.view)
    }
}
