//! P2P exchanges inside a stream loop: the coalesced send/receive pair and the allgather
//! step built on it.

use super::group::stream_error;
use super::schedule::Schedule;
use super::views::{slice_tensor, Slicer};
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
