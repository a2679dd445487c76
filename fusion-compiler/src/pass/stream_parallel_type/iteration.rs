//! One iteration's work in a stream loop: an expression on its stream slices
//! ([`emit_body_expr`]), and the loops that fork the pool streams from the caller's stream
//! before the loop and join them after it.

use super::exchange::emit_allgather_step;
use super::group::stream_error;
use super::schedule::Schedule;
use super::views::Slicer;
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamId, Transport};
use crate::ir::{axis_map, Expr, Fusion, IterDomainId, Op, ParallelType, ScalarId, TensorId};
use crate::resharding::{classify, MeshContext, Resharding};

/// `FOR i: SetCurrentStream(worker); Synchronize(original)`: every pool stream starts
/// after what the caller's stream has queued.
pub(super) fn fork_loop(
    index: ScalarId,
    axis: IterDomainId,
    zero: ScalarId,
    stop: ScalarId,
    original: StreamId,
    worker: StreamId,
) -> Node {
    Node::ForLoop(ForLoop {
        index,
        axis,
        start: zero,
        stop,
        body: vec![
            Node::SetCurrentStream { stream: worker },
            Node::Synchronize { stream: original },
        ],
    })
}

/// `FOR i: Synchronize(worker)` on the caller's stream: it waits for every pool stream.
pub(super) fn join_loop(
    index: ScalarId,
    axis: IterDomainId,
    zero: ScalarId,
    stop: ScalarId,
    worker: StreamId,
) -> Node {
    Node::ForLoop(ForLoop {
        index,
        axis,
        start: zero,
        stop,
        body: vec![Node::Synchronize { stream: worker }],
    })
}

/// One expression of the loop body on this iteration's slices (an allgather step for a
/// `set` from DIDx to the Stream axis; a GEMM whose result the loop accumulates adds onto
/// its sum).
pub(super) fn emit_body_expr(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    sched: &Schedule,
    e: &Expr,
    s: usize,
    transport: Transport,
    body: &mut Vec<Node>,
) -> Result<()> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    if let Resharding::DidxToStream { in_axis, .. } = classify(&p.ir, e, ctx)? {
        return emit_allgather_step(p, slicer, sched, e, s, in_axis, transport, body);
    }
    let map = axis_map(&p.ir, e);
    let mut inputs = Vec::with_capacity(e.inputs.len());
    let mut removed = vec![None; e.inputs.len()];
    for (i, &t) in e.inputs.iter().enumerate() {
        match map.producer_axis(i, s) {
            None => inputs.push(t),
            Some(q) => {
                if p.ir.axis(t, q).parallel == ParallelType::DIDx && p.mesh_of(t).len() > 1 {
                    return Err(stream_error(
                        &p.ir,
                        t,
                        q,
                        "a DIDx axis feeds a Stream axis outside a `set`; reshard it first",
                    ));
                }
                removed[i] = Some(q);
                inputs.push(slicer.slice(p, t, q, body));
            }
        }
    }
    let op = op_without_stream_axis(&p.ir, e, s, &removed)?;
    if let Some(&sum) = slicer.accumulate.targets.get(&e.output) {
        slicer.accumulate.emit(inputs, sum, body);
        return Ok(());
    }
    let output = slicer.slice(p, e.output, s, body);
    body.push(Node::Compute(Expr { op, inputs, output }));
    Ok(())
}

/// The op computing one stream slice: axis arguments shift past the removed axis.
fn op_without_stream_axis(f: &Fusion, e: &Expr, s: usize, removed: &[Option<usize>]) -> Result<Op> {
    let vis_index = |t: TensorId, pos: usize| f.visible_axes(t).iter().position(|&q| q == pos);
    Ok(match &e.op {
        Op::Reduction { op, axes } => {
            let qv = removed[0]
                .and_then(|q| vis_index(e.inputs[0], q))
                .expect("a reduction maps every axis");
            Op::Reduction {
                op: *op,
                axes: axes
                    .iter()
                    .map(|&a| if a > qv { a - 1 } else { a })
                    .collect(),
            }
        }
        Op::Broadcast { flags } => {
            let mut flags = flags.clone();
            flags.remove(s);
            Op::Broadcast { flags }
        }
        Op::Matmul => {
            let (ra, rb) = (
                f.visible_axes(e.inputs[0]).len(),
                f.visible_axes(e.inputs[1]).len(),
            );
            let nb =
                f.tensor(e.output).axes.len() - 1 - usize::from(ra >= 2) - usize::from(rb >= 2);
            let streams_m = ra >= 2 && s == nb;
            let streams_n = rb >= 2 && s == nb + usize::from(ra >= 2);
            if (streams_m && rb > 2) || (streams_n && rb != 2) {
                return Err(stream_error(
                    f,
                    e.output,
                    s,
                    "streaming a matmul's M or N axis needs an unbatched B operand; stream a \
                     batch axis instead",
                ));
            }
            Op::Matmul
        }
        Op::Linear => {
            let nb = f.visible_axes(e.inputs[0]).len() - 1;
            if s >= nb {
                return Err(stream_error(
                    f,
                    e.output,
                    s,
                    "linear can only be streamed over a batch axis of its input",
                ));
            }
            Op::Linear
        }
        Op::Select { .. } | Op::Slice { .. } | Op::Split { .. } | Op::Permute { .. } => {
            return Err(stream_error(
                f,
                e.output,
                s,
                "views cannot be Stream-parallel; stream the op that consumes them",
            ))
        }
        other => other.clone(),
    })
}
