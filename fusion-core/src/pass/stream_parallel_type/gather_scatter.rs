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
//! (`LowerOptions::reduce_scatter_subchunks`, 2 by default) the loop runs `(D + 1) c`
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
use super::group::LoopGroup;
use super::iteration::{emit_body_expr, fork_loop, join_loop};
use super::ring::{self, allocate_running_sums, drop_didx, RingStep, RunningSums};
use super::schedule::Schedule;
use super::subchunk::SubChunkPlan;
use super::views::{narrowed, slice_tensor, with_axis_extent, RowSlicing, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef};
use crate::ir::{axis_map, Expr, NamedScalar, Op, ScalarId, ScalarOp, TensorId};
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
    if !ctx.options.compute_first_streams {
        return Ok(Some(
            "the gather-scatter pipeline needs compute-first streams \
             (`LowerOptions::compute_first_streams`)",
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
                         them in stream buffers (`LowerOptions::stream_buffers`)",
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
    let requested = ctx.options.reduce_scatter_subchunks.unwrap_or(2).max(1);
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, requested);
    if plan.is_none() && requested > 1 {
        tracing::debug!(
            "gather-scatter pipeline of `{}` runs unsplit: its row axis cannot be split into \
             {requested} contiguous ranges",
            p.ir.tensor_name(rs.expr.output)
        );
    }
    let c = plan.as_ref().map_or(1, |pl| pl.count);

    // ----- scalars: the unit, its step, rows and chunk, and those of the next unit
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
    // The next unit gathers unless it is a local step (0) or the final one (D); next_step
    // is at most D + 1 < 2 D, so `next_step / D` is 1 exactly there.
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
    // The pool stream of unit i - c, whose exchange received this unit's running sum
    // (kept non-negative: i + c (n - 1) = i - c mod n).
    let arrived_index = {
        let n1 = f.binary(ScalarOp::Sub, n, one);
        let cn1 = f.binary(ScalarOp::Mul, cc, n1);
        let back = f.binary(ScalarOp::Add, index, cn1);
        f.binary(ScalarOp::Mod, back, n)
    };
    let rows_of = |sub: ScalarId| {
        plan.as_ref().map(|pl| RowSlicing {
            rows: pl.rows.clone(),
            sub,
            count: cc,
        })
    };
    let rows = rows_of(sub);
    let next_rows = rows_of(next_sub);
    let row_axis = |p: &HostProgram, t: TensorId| -> Option<(usize, ScalarId)> {
        let q = *plan.as_ref()?.rows.get(&t)?;
        Some((q, p.ir.axis(t, q).extent))
    };

    // ----- buffers
    let mut nodes = Vec::new();
    let mut received: HashMap<TensorId, TensorId> = HashMap::new();
    for gth in &gathers {
        let mut resized = vec![(gth.s, two)];
        if let (Some(r), Some((q, extent))) = (&rows, row_axis(p, gth.out)) {
            resized.push((q, r.slot_extent(&mut p.ir, extent)));
        }
        let buf = with_axis_extent(&mut p.ir, gth.out, &resized);
        nodes.push(Node::Allocate { tensor: buf });
        received.insert(gth.out, buf);
    }
    let gathered: HashSet<TensorId> = gathers.iter().map(|gth| gth.out).collect();
    let (body_exprs, _) = g.exprs.split_at(g.exprs.len() - 1);
    let mut shared: HashMap<TensorId, TensorId> = HashMap::new();
    let mut own: HashMap<TensorId, TensorId> = HashMap::new();
    for (e, s) in body_exprs
        .iter()
        .filter(|(e, _)| !gathered.contains(&e.output))
    {
        let t = e.output;
        if !internal.contains(&t) {
            nodes.push(Node::Allocate { tensor: t });
            continue;
        }
        let mut resized = vec![(*s, one)];
        if let (Some(r), Some((q, extent))) = (&rows, row_axis(p, t)) {
            resized.push((q, r.slot_extent(&mut p.ir, extent)));
        }
        let slot = with_axis_extent(&mut p.ir, t, &resized);
        nodes.push(Node::Allocate { tensor: slot });
        shared.insert(t, slot);
        if last.inputs.contains(&t) {
            let buf = with_axis_extent(&mut p.ir, t, &[(*s, one)]);
            if let Some(name) = p.ir.tensor(t).name.clone() {
                p.ir.tensor_mut(buf).name = Some(format!("{name}_local"));
            }
            nodes.push(Node::Allocate { tensor: buf });
            own.insert(t, buf);
        }
    }
    let acc = allocate_running_sums(p, rs, d, &mut nodes);
    let original = p.new_stream(StreamDef::Captured);
    let worker = p.new_stream(StreamDef::Pool(pool_index));
    let next_worker = p.new_stream(StreamDef::Pool(next_pool));
    let arrived = p.new_stream(StreamDef::Pool(arrived_index));
    nodes.push(Node::GetCurrentStream { stream: original });
    nodes.push(fork_loop(index, loop_axis, zero, stop, original, worker));
    let backend = ctx.options.p2p_backend;
    let mut body = Vec::new();

    // ----- 1. the next unit's rows, on the next unit's pool stream
    let mut prefetch = vec![
        Node::SetCurrentStream {
            stream: next_worker,
        },
        Node::Synchronize { stream: original },
    ];
    for gth in &gathers {
        let unit = Unit {
            rows: next_rows.as_ref(),
            row: row_axis(p, gth.out),
        };
        let recv = unit.bind(
            p,
            received[&gth.out],
            gth.s,
            next_slot,
            true,
            None,
            &mut prefetch,
        );
        let unit = Unit {
            rows: next_rows.as_ref(),
            row: row_axis(p, gth.input),
        };
        let send = unit.bind(p, gth.input, gth.in_axis, zero, false, None, &mut prefetch);
        prefetch.extend(coalesced_exchange(
            p, recv, next_chunk, send, next_up, backend,
        ));
    }
    body.push(Node::IfThenElse {
        cond: no_prefetch,
        then_body: Vec::new(),
        else_body: prefetch,
    });
    body.push(Node::SetCurrentStream { stream: original });

    // ----- 2. every expression but the last, on the unit's rows (steps 0..D-1)
    let mut slicer = Slicer {
        chunk,
        pool_index,
        zero,
        small: HashMap::new(),
        rows,
        cache: HashMap::new(),
    };
    let sched = Schedule {
        chunk,
        recv_peer: chunk,
        send_peer: chunk,
        rank,
    };
    let mut compute = Vec::new();
    for gth in &gathers {
        let unit = Unit {
            rows: slicer.rows.as_ref(),
            row: row_axis(p, gth.out),
        };
        let view = unit.view(p, gth.out, gth.s);
        let in_row = row_axis(p, gth.input);
        let local = Unit {
            rows: slicer.rows.as_ref(),
            row: in_row,
        };
        let mut then_body = Vec::new();
        local.bind(
            p,
            gth.input,
            gth.in_axis,
            zero,
            false,
            Some(view),
            &mut then_body,
        );
        let mut else_body = vec![Node::Synchronize { stream: worker }];
        unit.bind(
            p,
            received[&gth.out],
            gth.s,
            slot_index,
            true,
            Some(view),
            &mut else_body,
        );
        compute.push(Node::IfThenElse {
            cond: is_own,
            then_body,
            else_body,
        });
        slicer.cache.insert((gth.out, gth.s), view);
    }
    // Every result's view first, then the expressions, elementwise ones right before
    // their first reader: a chain of them (the gated MLP's `silu(g) * u`) then becomes
    // one kernel, and an activation right after its GEMM folds into the GEMM's epilogue.
    let computed = sink_elementwise(
        body_exprs
            .iter()
            .filter(|(e, _)| !gathered.contains(&e.output))
            .cloned()
            .collect(),
    );
    for (e, s) in &computed {
        let t = e.output;
        if let Some(&slot) = shared.get(&t) {
            let unit = Unit {
                rows: slicer.rows.as_ref(),
                row: row_axis(p, t),
            };
            let view = match own.get(&t) {
                Some(&buf) => unit.own_or_slot(p, (t, *s), buf, slot, is_own, &mut compute),
                None => unit.bind(p, slot, *s, zero, true, None, &mut compute),
            };
            slicer.cache.insert((t, *s), view);
        }
    }
    for (e, s) in &computed {
        emit_body_expr(p, &mut slicer, &sched, e, *s, backend, &mut compute)?;
    }
    body.push(Node::IfThenElse {
        cond: is_final,
        then_body: Vec::new(),
        else_body: compute,
    });

    // ----- 3. the last expression onto the running sum, and the ring step (steps 1..D)
    // Views bound in step 2's branch are not bound at step D: bind this step's anew.
    slicer.cache.clear();
    let mut reduce = vec![Node::Synchronize { stream: arrived }];
    let map = axis_map(&p.ir, &last);
    let mut operands = Vec::new();
    for (i, &t) in last.inputs.iter().enumerate() {
        let v = match map.producer_axis(i, s_last) {
            None => t,
            Some(q) => match (shared.get(&t), own.get(&t)) {
                (Some(&slot), Some(&buf)) => {
                    let unit = Unit {
                        rows: slicer.rows.as_ref(),
                        row: row_axis(p, t),
                    };
                    unit.own_or_slot(p, (t, q), buf, slot, is_final, &mut reduce)
                }
                // A loop result kept whole, or an input of the loop: its chunk (at step D
                // `chunk` is this device's own).
                _ => slicer.slice(p, t, q, &mut reduce),
            },
        };
        operands.push(drop_didx(p, v, zero, &mut reduce));
    }
    let sums = RunningSums {
        acc,
        rs,
        rows: slicer.rows.as_ref(),
        zero,
    };
    // Ring step j - 1 (the last one, into the output block, at j = D).
    let ring_step = RingStep {
        step: sum_step,
        is_first: is_first_sum,
        is_last: is_final,
        next_step: step,
        from,
        to,
        worker,
        compute: original,
    };
    ring_step.emit(p, &sums, operands, backend, &mut reduce)?;
    body.push(Node::IfThenElse {
        cond: is_own,
        then_body: Vec::new(),
        else_body: reduce,
    });
    nodes.push(Node::ForLoop(ForLoop {
        index,
        axis: loop_axis,
        start: zero,
        stop,
        body,
    }));
    nodes.push(join_loop(index, loop_axis, zero, stop, worker));
    Ok(nodes)
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
