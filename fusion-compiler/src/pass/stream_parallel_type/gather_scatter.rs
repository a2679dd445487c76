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
//! step that adds onto it. The local chunk's inputs of the last GEMM live in buffers of
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
//! FOR i: Synchronize Stream(i % n)
//! ```

use std::collections::{HashMap, HashSet};

use super::exchange::{coalesced_exchange, require_world_mesh};
use super::group::{LoopGroup, ReduceScatterFold};
use super::iteration::{emit_body_expr, fork_loop, join_loop};
use super::ring::{self, allocate_running_sums, drop_didx, RingStep, RunningSums};
use super::schedule::Schedule;
use super::subchunk::SubChunkPlan;
use super::views::{narrowed, slice_tensor, with_axis_extent, RowSlicing, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef, StreamId, Transport};
use crate::ir::{axis_map, Expr, IterDomainId, NamedScalar, Op, ScalarId, ScalarOp, TensorId};
use crate::pass::context::PassContext;
use crate::resharding::{classify, MeshContext, Resharding};

/// One gathered input of the loop: `out = set(input)` turns `input`'s DIDx axis `in_axis`
/// into the Stream axis `s` of `out`.
struct Gather {
    input: TensorId,
    in_axis: usize,
    out: TensorId,
    s: usize,
}

/// The loop's gathers (its `set`s from a DIDx axis to the Stream axis).
fn gathers(p: &HostProgram, g: &LoopGroup) -> Result<Vec<Gather>> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    let mut out = Vec::new();
    for (e, s) in &g.exprs {
        if let Resharding::DidxToStream { in_axis, .. } = classify(&p.ir, e, ctx)? {
            out.push(Gather {
                input: e.inputs[0],
                in_axis,
                out: e.output,
                s: *s,
            });
        }
    }
    Ok(out)
}

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
    let gathers = gathers(p, &g)?;
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
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, requested);
    if plan.is_none() && requested > 1 {
        tracing::debug!(
            "gather-scatter pipeline of `{}` runs unsplit: its row axis cannot be split into \
             {requested} contiguous ranges",
            p.ir.tensor_name(rs.expr.output)
        );
    }
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
    };
    pipe.emit_compute(p, &bufs, &mut slicer, streams.worker, &mut body)?;
    // Views bound in step 2's branch are not bound at step D: bind this step's anew.
    slicer.cache.clear();
    pipe.emit_reduce(p, &bufs, &mut slicer, &streams, &mut body)?;
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
    Ok(nodes)
}

/// The scalars of the loop: the unit `i`, its step, rows and chunk, and those of the next
/// unit, the ring's neighbours and the step predicates.
struct UnitScalars {
    index: ScalarId,
    rank: ScalarId,
    zero: ScalarId,
    one: ScalarId,
    two: ScalarId,
    /// The number of row ranges per chunk, `c`.
    count: ScalarId,
    loop_axis: IterDomainId,
    stop: ScalarId,
    /// Unit `i`: step `j = i / c`, rows `i % c`, chunk `(r + D - j) % D`.
    step: ScalarId,
    sub: ScalarId,
    chunk: ScalarId,
    /// The pool stream of unit `i`, and its slot of the gathered rows (`i % 2`).
    pool_index: ScalarId,
    slot_index: ScalarId,
    /// Unit `i + 1`: rows, chunk, the device that gathers this device's rows then, its
    /// pool stream and its slot.
    next_sub: ScalarId,
    next_chunk: ScalarId,
    next_up: ScalarId,
    next_pool: ScalarId,
    next_slot: ScalarId,
    /// Nonzero when unit `i + 1` gathers nothing (a local step, or the final one).
    no_prefetch: ScalarId,
    is_own: ScalarId,
    is_final: ScalarId,
    is_first_sum: ScalarId,
    /// The ring step of the running sum unit `i` adds onto (`j - 1`).
    sum_step: ScalarId,
    /// The neighbours: running sums come from `r - 1` and go to `r + 1`.
    from: ScalarId,
    to: ScalarId,
    /// The pool stream of unit `i - c`, whose exchange received this unit's running sum.
    arrived_index: ScalarId,
}

impl UnitScalars {
    fn new(p: &mut HostProgram, g: &LoopGroup, c: usize) -> Self {
        let f = &mut p.ir;
        let index = f.loop_index("StreamIdx");
        let n = f.named(NamedScalar::NumberOfStreams);
        let rank = f.named(NamedScalar::Rank);
        let (zero, one, two) = (f.constant(0), f.constant(1), f.constant(2));
        let d = g.extent;
        let cc = f.constant(c as i64);
        let d_plus_1 = f.binary(ScalarOp::Add, d, one);
        let stop = f.binary(ScalarOp::Mul, d_plus_1, cc);
        let mut dom = f.iter_domain(g.axis).clone();
        dom.extent = stop;
        let loop_axis = f.add_iter_domain(dom);
        let rank_plus_d = f.binary(ScalarOp::Add, rank, d);
        let step = f.binary(ScalarOp::Div, index, cc);
        let sub = f.binary(ScalarOp::Mod, index, cc);
        let chunk = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, step);
            f.binary(ScalarOp::Mod, back, d)
        };
        let pool_index = f.binary(ScalarOp::Mod, index, n);
        let slot_index = f.binary(ScalarOp::Mod, index, two);
        let next = f.binary(ScalarOp::Add, index, one);
        let next_step = f.binary(ScalarOp::Div, next, cc);
        let next_sub = f.binary(ScalarOp::Mod, next, cc);
        let next_chunk = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, next_step);
            f.binary(ScalarOp::Mod, back, d)
        };
        let next_up = {
            let up = f.binary(ScalarOp::Add, rank, next_step);
            f.binary(ScalarOp::Mod, up, d)
        };
        let next_pool = f.binary(ScalarOp::Mod, next, n);
        let next_slot = f.binary(ScalarOp::Mod, next, two);
        // The next unit gathers unless it is a local step (0) or the final one (D);
        // next_step is at most D + 1 < 2 D, so `next_step / D` is 1 exactly there.
        let no_prefetch = {
            let local = f.binary(ScalarOp::Eq, next_step, zero);
            let past = f.binary(ScalarOp::Div, next_step, d);
            f.binary(ScalarOp::Add, local, past)
        };
        let is_own = f.binary(ScalarOp::Eq, step, zero);
        let is_final = f.binary(ScalarOp::Eq, step, d);
        let is_first_sum = f.binary(ScalarOp::Eq, step, one);
        let sum_step = f.binary(ScalarOp::Sub, step, one);
        let from = {
            let back = f.binary(ScalarOp::Sub, rank_plus_d, one);
            f.binary(ScalarOp::Mod, back, d)
        };
        let to = {
            let up = f.binary(ScalarOp::Add, rank, one);
            f.binary(ScalarOp::Mod, up, d)
        };
        // Kept non-negative: i + c (n - 1) = i - c mod n.
        let arrived_index = {
            let n1 = f.binary(ScalarOp::Sub, n, one);
            let cn1 = f.binary(ScalarOp::Mul, cc, n1);
            let back = f.binary(ScalarOp::Add, index, cn1);
            f.binary(ScalarOp::Mod, back, n)
        };
        UnitScalars {
            index,
            rank,
            zero,
            one,
            two,
            count: cc,
            loop_axis,
            stop,
            step,
            sub,
            chunk,
            pool_index,
            slot_index,
            next_sub,
            next_chunk,
            next_up,
            next_pool,
            next_slot,
            no_prefetch,
            is_own,
            is_final,
            is_first_sum,
            sum_step,
            from,
            to,
            arrived_index,
        }
    }
}

/// The streams of the loop: the caller's, the pool streams of units `i` and `i + 1`, and
/// the pool stream that received unit `i`'s running sum.
struct UnitStreams {
    original: StreamId,
    worker: StreamId,
    next_worker: StreamId,
    arrived: StreamId,
}

/// The buffers of the loop besides the caller's.
struct Buffers {
    /// Gathered tensor -> its two slots of received rows.
    received: HashMap<TensorId, TensorId>,
    gathered: HashSet<TensorId>,
    /// Loop-internal result -> the one slot the other chunks' units share.
    shared: HashMap<TensorId, TensorId>,
    /// Inputs of the last expression -> the buffer of this device's own chunk.
    own: HashMap<TensorId, TensorId>,
    /// The running sums.
    acc: TensorId,
}

/// One gather-scatter loop being emitted: its group, gathers, last expression (the matmul
/// whose result is reduce-scattered), row ranges and scalars.
struct GatherScatter<'a> {
    g: &'a LoopGroup,
    rs: &'a ReduceScatterFold,
    gathers: Vec<Gather>,
    last: Expr,
    s_last: usize,
    plan: Option<SubChunkPlan>,
    u: UnitScalars,
    transport: Transport,
}

impl GatherScatter<'_> {
    /// The row ranges of the unit whose rows index is `sub` (`None` unsplit).
    fn rows_of(&self, sub: ScalarId) -> Option<RowSlicing> {
        self.plan.as_ref().map(|pl| RowSlicing {
            rows: pl.rows.clone(),
            sub,
            count: self.u.count,
        })
    }

    /// The row axis of `t` and its full extent, when the loop is split into row ranges.
    fn row_axis(&self, p: &HostProgram, t: TensorId) -> Option<(usize, ScalarId)> {
        let q = *self.plan.as_ref()?.rows.get(&t)?;
        Some((q, p.ir.axis(t, q).extent))
    }

    /// The rows of one unit of `t`, for the unit whose row ranges are `rows`.
    fn unit<'r>(&self, p: &HostProgram, rows: Option<&'r RowSlicing>, t: TensorId) -> Unit<'r> {
        Unit {
            rows,
            row: self.row_axis(p, t),
        }
    }

    /// Allocates (into `nodes`) the received rows' slots, the loop results (whole, or a
    /// shared slot and, for the last expression's inputs, an own-chunk buffer), the
    /// running sums and the output.
    fn allocate(
        &self,
        p: &mut HostProgram,
        internal: &HashSet<TensorId>,
        nodes: &mut Vec<Node>,
    ) -> Buffers {
        let (one, two) = (self.u.one, self.u.two);
        let rows = self.rows_of(self.u.sub);
        let mut received: HashMap<TensorId, TensorId> = HashMap::new();
        for gth in &self.gathers {
            let mut resized = vec![(gth.s, two)];
            if let (Some(r), Some((q, extent))) = (&rows, self.row_axis(p, gth.out)) {
                resized.push((q, r.slot_extent(&mut p.ir, extent)));
            }
            let buf = with_axis_extent(&mut p.ir, gth.out, &resized);
            nodes.push(Node::Allocate { tensor: buf });
            received.insert(gth.out, buf);
        }
        let gathered: HashSet<TensorId> = self.gathers.iter().map(|gth| gth.out).collect();
        let mut shared: HashMap<TensorId, TensorId> = HashMap::new();
        let mut own: HashMap<TensorId, TensorId> = HashMap::new();
        for (e, s) in self
            .body_exprs()
            .filter(|(e, _)| !gathered.contains(&e.output))
        {
            let t = e.output;
            if !internal.contains(&t) {
                nodes.push(Node::Allocate { tensor: t });
                continue;
            }
            let mut resized = vec![(*s, one)];
            if let (Some(r), Some((q, extent))) = (&rows, self.row_axis(p, t)) {
                resized.push((q, r.slot_extent(&mut p.ir, extent)));
            }
            let slot = with_axis_extent(&mut p.ir, t, &resized);
            nodes.push(Node::Allocate { tensor: slot });
            shared.insert(t, slot);
            if self.last.inputs.contains(&t) {
                let buf = with_axis_extent(&mut p.ir, t, &[(*s, one)]);
                if let Some(name) = p.ir.tensor(t).name.clone() {
                    p.ir.tensor_mut(buf).name = Some(format!("{name}_local"));
                }
                nodes.push(Node::Allocate { tensor: buf });
                own.insert(t, buf);
            }
        }
        let acc = allocate_running_sums(p, self.rs, self.g.extent, nodes);
        Buffers {
            received,
            gathered,
            shared,
            own,
            acc,
        }
    }

    /// Every expression of the loop but the last.
    fn body_exprs(&self) -> impl Iterator<Item = &(Expr, usize)> {
        self.g.exprs[..self.g.exprs.len() - 1].iter()
    }

    /// Step 1: the next unit's rows, on the next unit's pool stream (unless it gathers
    /// nothing): receive them into its slot, send this device's rows to the device that
    /// gathers them then.
    fn emit_prefetch(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        streams: &UnitStreams,
        body: &mut Vec<Node>,
    ) {
        let u = &self.u;
        let next_rows = self.rows_of(u.next_sub);
        let mut prefetch = vec![
            Node::SetCurrentStream {
                stream: streams.next_worker,
            },
            Node::Synchronize {
                stream: streams.original,
            },
        ];
        for gth in &self.gathers {
            let unit = self.unit(p, next_rows.as_ref(), gth.out);
            let slots = bufs.received[&gth.out];
            let recv = unit.bind(p, slots, gth.s, u.next_slot, true, None, &mut prefetch);
            let unit = self.unit(p, next_rows.as_ref(), gth.input);
            let send = unit.bind(
                p,
                gth.input,
                gth.in_axis,
                u.zero,
                false,
                None,
                &mut prefetch,
            );
            prefetch.extend(coalesced_exchange(
                p,
                recv,
                u.next_chunk,
                send,
                u.next_up,
                self.transport,
            ));
        }
        body.push(Node::IfThenElse {
            cond: u.no_prefetch,
            then_body: Vec::new(),
            else_body: prefetch,
        });
    }

    /// Step 2 (steps 0..D-1): every expression but the last, on the unit's rows: the
    /// gathered rows (local at step 0, else the slot they arrived in), then each result's
    /// view, then the expressions.
    fn emit_compute(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        worker: StreamId,
        body: &mut Vec<Node>,
    ) -> Result<()> {
        let u = &self.u;
        let sched = Schedule {
            chunk: u.chunk,
            recv_peer: u.chunk,
            send_peer: u.chunk,
            rank: u.rank,
        };
        let mut compute = Vec::new();
        for gth in &self.gathers {
            self.bind_gathered(p, bufs, slicer, gth, worker, &mut compute);
        }
        // Every result's view first, then the expressions, elementwise ones right before
        // their first reader: a chain of them (the gated MLP's `silu(g) * u`) then becomes
        // one kernel, and an activation right after its GEMM folds into the GEMM's
        // epilogue.
        let computed = sink_elementwise(
            self.body_exprs()
                .filter(|(e, _)| !bufs.gathered.contains(&e.output))
                .cloned()
                .collect(),
        );
        for (e, s) in &computed {
            let t = e.output;
            if let Some(&slot) = bufs.shared.get(&t) {
                let unit = self.unit(p, slicer.rows.as_ref(), t);
                let view = match bufs.own.get(&t) {
                    Some(&buf) => unit.own_or_slot(p, (t, *s), buf, slot, u.is_own, &mut compute),
                    None => unit.bind(p, slot, *s, u.zero, true, None, &mut compute),
                };
                slicer.cache.insert((t, *s), view);
            }
        }
        for (e, s) in &computed {
            emit_body_expr(p, slicer, &sched, e, *s, self.transport, &mut compute)?;
        }
        body.push(Node::IfThenElse {
            cond: u.is_final,
            then_body: Vec::new(),
            else_body: compute,
        });
        Ok(())
    }

    /// Binds the unit's rows of one gather: the local shard's rows at step 0, else (after
    /// the unit's pool stream) the slot they arrived in.
    fn bind_gathered(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        gth: &Gather,
        worker: StreamId,
        compute: &mut Vec<Node>,
    ) {
        let u = &self.u;
        let unit = self.unit(p, slicer.rows.as_ref(), gth.out);
        let view = unit.view(p, gth.out, gth.s);
        let local = self.unit(p, slicer.rows.as_ref(), gth.input);
        let mut then_body = Vec::new();
        let shard = (gth.input, gth.in_axis);
        local.bind(
            p,
            shard.0,
            shard.1,
            u.zero,
            false,
            Some(view),
            &mut then_body,
        );
        let mut else_body = vec![Node::Synchronize { stream: worker }];
        let slots = bufs.received[&gth.out];
        unit.bind(
            p,
            slots,
            gth.s,
            u.slot_index,
            true,
            Some(view),
            &mut else_body,
        );
        compute.push(Node::IfThenElse {
            cond: u.is_own,
            then_body,
            else_body,
        });
        slicer.cache.insert((gth.out, gth.s), view);
    }

    /// Step 3 (steps 1..D): the last expression onto the running sum that arrived, and the
    /// ring step that passes the sum on (at step D into this device's output block).
    fn emit_reduce(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        streams: &UnitStreams,
        body: &mut Vec<Node>,
    ) -> Result<()> {
        let u = &self.u;
        let mut reduce = vec![Node::Synchronize {
            stream: streams.arrived,
        }];
        let map = axis_map(&p.ir, &self.last);
        let mut operands = Vec::new();
        for (i, &t) in self.last.inputs.iter().enumerate() {
            let v = match map.producer_axis(i, self.s_last) {
                None => t,
                Some(q) => match (bufs.shared.get(&t), bufs.own.get(&t)) {
                    (Some(&slot), Some(&buf)) => {
                        let unit = self.unit(p, slicer.rows.as_ref(), t);
                        unit.own_or_slot(p, (t, q), buf, slot, u.is_final, &mut reduce)
                    }
                    // A loop result kept whole, or an input of the loop: its chunk (at
                    // step D `chunk` is this device's own).
                    _ => slicer.slice(p, t, q, &mut reduce),
                },
            };
            operands.push(drop_didx(p, v, u.zero, &mut reduce));
        }
        let sums = RunningSums {
            acc: bufs.acc,
            rs: self.rs,
            rows: slicer.rows.as_ref(),
            zero: u.zero,
        };
        // Ring step j - 1 (the last one, into the output block, at j = D).
        let ring_step = RingStep {
            step: u.sum_step,
            is_first: u.is_first_sum,
            is_last: u.is_final,
            next_step: u.step,
            from: u.from,
            to: u.to,
            worker: streams.worker,
            compute: streams.original,
        };
        ring_step.emit(p, &sums, operands, self.transport, &mut reduce)?;
        body.push(Node::IfThenElse {
            cond: u.is_own,
            then_body: Vec::new(),
            else_body: reduce,
        });
        Ok(())
    }
}

/// `exprs` (in a valid order) with every elementwise op (unary, binary, cast) moved down
/// to just before the first expression that reads it; the order stays valid.
fn sink_elementwise(exprs: Vec<(Expr, usize)>) -> Vec<(Expr, usize)> {
    let elementwise = |e: &Expr| matches!(e.op, Op::Unary(_) | Op::Binary(_) | Op::Cast);
    let mut out = Vec::with_capacity(exprs.len());
    let mut pending: Vec<(Expr, usize)> = Vec::new();
    for (e, s) in exprs {
        if elementwise(&e) {
            pending.push((e, s));
            continue;
        }
        // The pending ops `e` reads, directly or through each other, in their order.
        let mut needed: HashSet<TensorId> = e.inputs.iter().copied().collect();
        let mut take = vec![false; pending.len()];
        for (k, (p, _)) in pending.iter().enumerate().rev() {
            if needed.contains(&p.output) {
                take[k] = true;
                needed.extend(p.inputs.iter().copied());
            }
        }
        let mut keep = Vec::new();
        for ((p, ps), t) in pending.drain(..).zip(take) {
            if t {
                out.push((p, ps));
            } else {
                keep.push((p, ps));
            }
        }
        pending = keep;
        out.push((e, s));
    }
    out.extend(pending);
    out
}

/// The rows of one unit of a tensor: the row axis (position in the tensor's `axes`, and
/// its full extent) and the unit's row range, when the loop is split into row ranges.
struct Unit<'a> {
    rows: Option<&'a RowSlicing>,
    row: Option<(usize, ScalarId)>,
}

impl Unit<'_> {
    /// A view tensor for one unit of `t`: without axis `axis`, rows narrowed to the range.
    fn view(&self, p: &mut HostProgram, t: TensorId, axis: usize) -> TensorId {
        let v = slice_tensor(&mut p.ir, t, axis);
        match (self.rows, self.row) {
            (Some(rows), Some((q, extent))) => {
                let (start, stop) = rows.range(&mut p.ir, extent);
                let len = p.ir.binary(ScalarOp::Sub, stop, start);
                let q = if q > axis { q - 1 } else { q };
                narrowed(&mut p.ir, v, q, len)
            }
            _ => v,
        }
    }

    /// Binds one view of unit `(t, axis)`: `IF own`: rows of `t`'s own-chunk buffer `buf`,
    /// `ELSE`: the shared slot `slot` (from row 0).
    fn own_or_slot(
        &self,
        p: &mut HostProgram,
        (t, axis): (TensorId, usize),
        buf: TensorId,
        slot: TensorId,
        own: ScalarId,
        body: &mut Vec<Node>,
    ) -> TensorId {
        let view = self.view(p, t, axis);
        let zero = p.ir.constant(0);
        let mut then_body = Vec::new();
        self.bind(p, buf, axis, zero, false, Some(view), &mut then_body);
        let mut else_body = Vec::new();
        self.bind(p, slot, axis, zero, true, Some(view), &mut else_body);
        body.push(Node::IfThenElse {
            cond: own,
            then_body,
            else_body,
        });
        view
    }

    /// Binds one unit of `buf` (laid out like the tensor of [`Self::row`]): index `index`
    /// of axis `axis`, then the unit's rows, at the range's offset or, in a slot buffer
    /// (`from_zero`), from row 0. Binds `into` when given, else a new view.
    #[allow(clippy::too_many_arguments)]
    fn bind(
        &self,
        p: &mut HostProgram,
        buf: TensorId,
        axis: usize,
        index: ScalarId,
        from_zero: bool,
        into: Option<TensorId>,
        body: &mut Vec<Node>,
    ) -> TensorId {
        match (self.rows, self.row) {
            (Some(rows), Some((q, extent))) => {
                let sel = slice_tensor(&mut p.ir, buf, axis);
                body.push(Node::AliasSelect {
                    input: buf,
                    output: sel,
                    axis,
                    index,
                });
                let q = if q > axis { q - 1 } else { q };
                rows.emit_into(p, sel, q, extent, from_zero, into, body)
            }
            _ => {
                let out = into.unwrap_or_else(|| slice_tensor(&mut p.ir, buf, axis));
                body.push(Node::AliasSelect {
                    input: buf,
                    output: out,
                    axis,
                    index,
                });
                out
            }
        }
    }
}
