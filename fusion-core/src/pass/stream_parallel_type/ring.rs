//! The ring reduce-scatter pipeline ([`ReduceScatterPipeline::Ring`]).
//!
//! Step `j` (of `D`) computes the partial of block `(rank + j + 1) % D`, the same block
//! that device `rank + 1` computed at step `j - 1`. Its GEMM adds onto the running sum of
//! that block received from `rank + 1` (`out = out + a @ b`, in the GEMM's epilogue), and
//! the exchange after it sends the new sum on to `rank - 1` while receiving the running sum
//! of the next step's block from `rank + 1`. Every send meets its receive in the same
//! iteration, and the last step's GEMM, on this device's own block, writes the finished
//! result into the output. With `c` sub-chunks the loop runs `D * c` iterations,
//! step-major (`j = i / c`, rows `i % c`), so the transfer of one row range hides behind
//! the GEMMs of the others.
//!
//! ```text
//! FOR i in 0..D*c:
//!   SetCurrentStream S; Synchronize Stream((i - c) mod numberOfStreams)   (the sum arrived)
//!   acc_view = (j == D-1 ? this device's output block : acc[j]), rows of i % c
//!   j == 0 ? acc_view = a[block] @ b : acc_view = a[block] @ b + acc_view
//!   IF j != D-1: SetCurrentStream Stream(i mod numberOfStreams); Synchronize S
//!                recv next step's sum (from rank + 1), send acc_view (to rank - 1)
//!   SetCurrentStream S
//! FOR i: Synchronize Stream(i mod numberOfStreams)
//! ```
//!
//! [`ReduceScatterPipeline::Ring`]: crate::lower::ReduceScatterPipeline::Ring

use std::collections::{HashMap, HashSet};

use super::subchunk::{RowSlicing, SubChunkPlan};
use super::{
    coalesced_exchange, emit_body_expr, fork_loop, join_loop, reduce_scatter_slots,
    require_world_mesh, slice_tensor, stream_error, LoopGroup, ReduceScatterFold, Schedule, Slicer,
};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef};
use crate::ir::{axis_map, Expr, NamedScalar, Op, ParallelType, ScalarId, ScalarOp, TensorId};
use crate::pass::PassContext;

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
    let s_axis = g.exprs.last().expect("a loop has expressions").1;
    require_world_mesh(p, x, rs.didx)?;
    let plan = SubChunkPlan::new(&p.ir, &g.exprs, rs, subchunks);
    let c = plan.as_ref().map_or(1, |pl| pl.count);
    let f = &mut p.ir;
    let index = f.loop_index("StreamIdx");
    let n = f.named(NamedScalar::NumberOfStreams);
    let rank = f.named(NamedScalar::Rank);
    let (zero, one) = (f.constant(0), f.constant(1));
    let d = g.extent;
    let cc = f.constant(c as i64);
    let pool_index = f.binary(ScalarOp::Mod, index, n);
    let (loop_axis, stop, step, rows) = match &plan {
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
    let next_is_last = f.binary(ScalarOp::Eq, next_step, last);
    // The pool stream of iteration i - c (mod numberOfStreams, kept non-negative), whose
    // exchange received this iteration's running sum.
    let c_n1 = {
        let n1 = f.binary(ScalarOp::Sub, n, one);
        f.binary(ScalarOp::Mul, cc, n1)
    };
    let back = f.binary(ScalarOp::Add, index, c_n1);
    let arrived_index = f.binary(ScalarOp::Mod, back, n);

    // Buffers: running sums of steps 0..D-1 (the last step's sum is the output block).
    let (mut nodes, small) = g.allocate_outputs(p, internal, rows.as_ref(), Some(x));
    let last_slots = p.ir.binary(ScalarOp::Sub, d, one);
    let acc = reduce_scatter_slots(&mut p.ir, rs, last_slots);
    if let Some(name) = p.ir.tensor(rs.expr.output).name.clone() {
        p.ir.tensor_mut(acc).name = Some(format!("{name}_running_sums"));
    }
    nodes.push(Node::Allocate { tensor: acc });
    nodes.push(Node::Allocate {
        tensor: rs.expr.output,
    });
    let original = p.new_stream(StreamDef::Captured);
    let worker = p.new_stream(StreamDef::Pool(pool_index));
    let arrived = p.new_stream(StreamDef::Pool(arrived_index));
    nodes.push(Node::GetCurrentStream { stream: original });
    nodes.push(fork_loop(index, loop_axis, zero, stop, original, worker));

    let mut body = vec![
        Node::SetCurrentStream { stream: original },
        Node::Synchronize { stream: arrived },
    ];
    let sched = Schedule {
        chunk: block,
        recv_peer: from,
        send_peer: to,
        rank,
    };
    let mut slicer = Slicer {
        chunk: block,
        pool_index,
        zero,
        small,
        rows,
        cache: HashMap::new(),
    };
    let backend = ctx.options.p2p_backend;
    let (exprs, last) = g.exprs.split_at(g.exprs.len() - 1);
    for (e, s) in exprs {
        emit_body_expr(p, &mut slicer, &sched, e, *s, backend, &mut body)?;
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
        operands.push(drop_didx(p, v, zero, &mut body));
    }
    let sums = RunningSums {
        acc,
        rs,
        rows: slicer.rows.as_ref(),
        zero,
    };
    let target = sums.bind(p, step, is_last, &mut body)?;
    let plain = Node::Compute(Expr {
        op: Op::Matmul,
        inputs: operands.clone(),
        output: target,
    });
    let mut accumulate = operands;
    accumulate.push(target);
    body.push(Node::IfThenElse {
        cond: is_first,
        then_body: vec![plain],
        else_body: vec![Node::Compute(Expr {
            op: Op::Matmul,
            inputs: accumulate,
            output: target,
        })],
    });
    let mut exchange = vec![
        Node::SetCurrentStream { stream: worker },
        Node::Synchronize { stream: original },
    ];
    let next = sums.bind(p, next_step, next_is_last, &mut exchange)?;
    exchange.extend(coalesced_exchange(p, next, from, target, to, backend));
    body.push(Node::IfThenElse {
        cond: is_last,
        then_body: Vec::new(),
        else_body: exchange,
    });
    body.push(Node::SetCurrentStream { stream: original });
    nodes.push(Node::ForLoop(ForLoop {
        index,
        axis: loop_axis,
        start: zero,
        stop,
        body,
    }));
    // Join: the caller's stream waits for every pool stream's transfers.
    nodes.push(join_loop(index, loop_axis, zero, stop, worker));
    Ok(nodes)
}

/// `t` without its DIDx axis (a local extent-1 axis), as a view; `t` if it has none.
fn drop_didx(p: &mut HostProgram, t: TensorId, zero: ScalarId, body: &mut Vec<Node>) -> TensorId {
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

/// The running sums of a ring: `acc[j]` for steps before the last, this device's block of
/// the output for the last; each narrowed to the iteration's rows when sub-chunked.
struct RunningSums<'a> {
    acc: TensorId,
    rs: &'a ReduceScatterFold,
    rows: Option<&'a RowSlicing>,
    zero: ScalarId,
}

impl RunningSums<'_> {
    /// Binds (in both branches of `IF is_last`) one view: the running sum of step `step`.
    fn bind(
        &self,
        p: &mut HostProgram,
        step: ScalarId,
        is_last: ScalarId,
        body: &mut Vec<Node>,
    ) -> Result<TensorId> {
        let out = self.rs.expr.output;
        let out_didx = self.rs.out_didx;
        // The slot axis of `acc` sits where the output block has its reduction axis; the
        // row axis is the block's first visible axis that is not it.
        let slot_pos = super::direct::slot_axis_of_block(&p.ir, out, out_didx);
        let slot = slice_tensor(&mut p.ir, self.acc, slot_pos);
        let block = slice_tensor(&mut p.ir, out, out_didx);
        let Some(rows) = self.rows else {
            body.push(Node::IfThenElse {
                cond: is_last,
                then_body: vec![Node::AliasSelect {
                    input: out,
                    output: slot,
                    axis: out_didx,
                    index: self.zero,
                }],
                else_body: vec![Node::AliasSelect {
                    input: self.acc,
                    output: slot,
                    axis: slot_pos,
                    index: step,
                }],
            });
            return Ok(slot);
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
        let view = super::subchunk::narrowed(&mut p.ir, slot, row_in_slot, len);
        let mut then_body = vec![Node::AliasSelect {
            input: out,
            output: block,
            axis: out_didx,
            index: self.zero,
        }];
        rows.emit_into(
            p,
            block,
            row_in_block,
            extent,
            false,
            Some(view),
            &mut then_body,
        );
        let mut else_body = vec![Node::AliasSelect {
            input: self.acc,
            output: slot,
            axis: slot_pos,
            index: step,
        }];
        rows.emit_into(
            p,
            slot,
            row_in_slot,
            extent,
            false,
            Some(view),
            &mut else_body,
        );
        body.push(Node::IfThenElse {
            cond: is_last,
            then_body,
            else_body,
        });
        Ok(view)
    }
}
