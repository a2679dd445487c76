//! P2P exchanges inside a stream loop: the coalesced send/receive pair and the allgather
//! step built on it (whole chunks, or a row range of a chunk per iteration).

use super::group::stream_error;
use super::schedule::Schedule;
use super::views::{narrowed, select, slice_tensor, Slicer};
use crate::error::Result;
use crate::hir::{HostProgram, Node, P2PDirection, Transport, P2P};
use crate::ir::{Expr, Op, ScalarId, ScalarOp, TensorId};

/// Requires the tensor on every device of the world, in order (peers are ranks).
pub(super) fn require_world_mesh(p: &HostProgram, t: TensorId, axis: usize) -> Result<()> {
    if p.mesh_of(t) != (0..p.world_size).collect::<Vec<_>>() {
        return Err(stream_error(
            &p.ir,
            t,
            axis,
            "a P2P pipeline needs the tensor on every device of the world, in order",
        ));
    }
    Ok(())
}

pub(super) fn coalesced_exchange(
    p: &mut HostProgram,
    recv: TensorId,
    recv_peer: ScalarId,
    send: TensorId,
    send_peer: ScalarId,
    transport: Transport,
) -> Vec<Node> {
    let r = p.new_comm_id();
    let s = p.new_comm_id();
    let group = p.new_comm_id();
    vec![
        Node::StartCoalescing,
        Node::P2P(P2P {
            id: r,
            direction: P2PDirection::Recv,
            buffer: recv,
            peer: recv_peer,
            transport,
        }),
        Node::P2P(P2P {
            id: s,
            direction: P2PDirection::Send,
            buffer: send,
            peer: send_peer,
            transport,
        }),
        Node::EndCoalescing { id: group },
        Node::Wait { comm: group },
    ]
}

/// Allgather step: `IF chunk == rank` copy the local shard, `ELSE` receive the chunk from
/// its owner and send the local shard to the device that gathers it now.
#[allow(clippy::too_many_arguments)]
pub(super) fn emit_allgather_step(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    sched: &Schedule,
    e: &Expr,
    s: usize,
    in_axis: usize,
    transport: Transport,
    body: &mut Vec<Node>,
) -> Result<()> {
    let x = e.inputs[0];
    require_world_mesh(p, x, in_axis)?;
    if slicer.rows.is_some() {
        return emit_allgather_rows_step(p, slicer, sched, (e, s, in_axis), transport, body);
    }
    let cond = p.ir.binary(ScalarOp::Eq, sched.chunk, sched.rank);
    if let Some(&buffer) = slicer.small.get(&e.output) {
        // Only this loop reads the gathered chunks: the local one needs no copy (the
        // iteration's slice is the local shard itself); the others land in a slot.
        let out_slice = slice_tensor(&mut p.ir, buffer, s);
        slicer.cache.insert((e.output, s), out_slice);
        let then_body = vec![Node::AliasSelect {
            input: x,
            output: out_slice,
            axis: in_axis,
            index: slicer.zero,
        }];
        let mut else_body = vec![Node::AliasSelect {
            input: buffer,
            output: out_slice,
            axis: s,
            index: slicer.pool_index,
        }];
        else_body.extend(coalesced_exchange(
            p,
            out_slice,
            sched.recv_peer,
            x,
            sched.send_peer,
            transport,
        ));
        body.push(Node::IfThenElse {
            cond,
            then_body,
            else_body,
        });
        return Ok(());
    }
    let out_slice = slicer.slice(p, e.output, s, body);
    let local = slice_tensor(&mut p.ir, x, in_axis);
    let then_body = vec![
        Node::AliasSelect {
            input: x,
            output: local,
            axis: in_axis,
            index: slicer.zero,
        },
        Node::Compute(Expr {
            op: Op::Set,
            inputs: vec![local],
            output: out_slice,
        }),
    ];
    let else_body =
        coalesced_exchange(p, out_slice, sched.recv_peer, x, sched.send_peer, transport);
    body.push(Node::IfThenElse {
        cond,
        then_body,
        else_body,
    });
    Ok(())
}

/// [`emit_allgather_step`] in row ranges: this iteration's rows of the chunk. `IF chunk
/// == rank` the rows of the local shard (viewed in place when only the loop reads the
/// gathered chunks, else copied), `ELSE` received into the rows of the chunk (from row 0
/// of a slot) while this device's same rows go to the device that gathers them now.
/// `gather` is the `set` with its Stream axis and its input's DIDx axis.
fn emit_allgather_rows_step(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    sched: &Schedule,
    (e, s, in_axis): (&Expr, usize, usize),
    transport: Transport,
    body: &mut Vec<Node>,
) -> Result<()> {
    let (x, out) = (e.inputs[0], e.output);
    let target = match slicer.small.get(&out) {
        Some(&buffer) => Gathered::Slots(buffer),
        // A full-size gathered tensor: this iteration's rows of its chunk, as any tensor.
        None => Gathered::Full(slicer.slice(p, out, s, body)),
    };
    let (zero, pool_index) = (slicer.zero, slicer.pool_index);
    let rows = slicer.rows.as_ref();
    let (Some(rows), Some(&qx), Some(&qo)) = (
        rows,
        rows.and_then(|r| r.rows.get(&x)),
        rows.and_then(|r| r.rows.get(&out)),
    ) else {
        return Err(stream_error(
            &p.ir,
            out,
            s,
            "an allgather in row ranges needs the row axis of what it gathers",
        ));
    };
    let below = |q: usize, removed: usize| if q > removed { q - 1 } else { q };
    let (x_rows, out_rows) = (below(qx, in_axis), below(qo, s));
    let (x_extent, out_extent) = (p.ir.axis(x, qx).extent, p.ir.axis(out, qo).extent);
    // This iteration's rows of the local shard, bound to `into` or to a new view.
    let local_rows = |p: &mut HostProgram, into: Option<TensorId>, body: &mut Vec<Node>| {
        let local = select(p, x, in_axis, zero, body);
        rows.emit_into(p, local, x_rows, x_extent, false, into, body)
    };
    let mut then_body = Vec::new();
    let mut else_body = Vec::new();
    let chunk_rows = match target {
        Gathered::Full(view) => {
            let local = local_rows(p, None, &mut then_body);
            then_body.push(Node::Compute(Expr {
                op: Op::Set,
                inputs: vec![local],
                output: view,
            }));
            view
        }
        Gathered::Slots(buffer) => {
            // Only the loop reads the chunks: the local rows in place, the others in a
            // slot, from its row 0.
            let slot = select(p, buffer, s, pool_index, &mut else_body);
            let (start, stop) = rows.range(&mut p.ir, out_extent);
            let len = p.ir.binary(ScalarOp::Sub, stop, start);
            let view = narrowed(&mut p.ir, slot, out_rows, len);
            local_rows(p, Some(view), &mut then_body);
            rows.emit_into(
                p,
                slot,
                out_rows,
                out_extent,
                true,
                Some(view),
                &mut else_body,
            );
            view
        }
    };
    let send = local_rows(p, None, &mut else_body);
    else_body.extend(coalesced_exchange(
        p,
        chunk_rows,
        sched.recv_peer,
        send,
        sched.send_peer,
        transport,
    ));
    slicer.cache.insert((out, s), chunk_rows);
    body.push(own_chunk_or_not(p, sched, then_body, else_body));
    Ok(())
}

/// `IF chunk == rank then_body ELSE else_body`: this device's own chunk, or a transfer.
pub(super) fn own_chunk_or_not(
    p: &mut HostProgram,
    sched: &Schedule,
    then_body: Vec<Node>,
    else_body: Vec<Node>,
) -> Node {
    let cond = p.ir.binary(ScalarOp::Eq, sched.chunk, sched.rank);
    Node::IfThenElse {
        cond,
        then_body,
        else_body,
    }
}

/// Where a gathered tensor lives: full size, or in `numberOfStreams` slots.
enum Gathered {
    /// This iteration's rows of the full-size tensor's chunk.
    Full(TensorId),
    /// The slot buffer.
    Slots(TensorId),
}
