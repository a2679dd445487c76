//! The direct reduce-scatter pipeline's step: each partial goes straight to the device
//! that owns its block, into one slot per source; the slots are summed after the loop, or
//! per round of row ranges inside it.

use super::exchange::{coalesced_exchange, own_chunk_or_not, require_world_mesh};
use super::group::{stream_error, ReduceScatterFold};
use super::schedule::Schedule;
use super::views::{select, slice_tensor, RowSlicing, Slicer};
use crate::error::Result;
use crate::hir::{ForLoop, HostProgram, Node, StreamDef, Transport};
use crate::ir::{
    Expr, Fusion, IterDomain, IterKind, NamedScalar, Op, ParallelType, ScalarId, ScalarOp, TensorId,
};

/// The receive buffer of a folded reduce-scatter: one slot per source device, holding a
/// chunk of the partial result; laid out like the output's local view with the slot axis
/// where the output has its reduction axis.
pub(super) fn reduce_scatter_slots(
    f: &mut Fusion,
    rs: &ReduceScatterFold,
    extent: ScalarId,
) -> TensorId {
    let out = rs.expr.output;
    let x = rs.expr.inputs[0];
    let mut axes = Vec::new();
    for (i, &d) in f.tensor(out).axes.iter().enumerate() {
        if i == rs.out_didx {
            continue;
        }
        let mut dom = f.iter_domain(d).clone();
        if dom.kind == IterKind::Reduction {
            dom = IterDomain::new(extent);
        }
        dom.parallel = ParallelType::Serial;
        axes.push(dom);
    }
    let dtype = f.tensor(x).dtype;
    let mesh = f.tensor(out).mesh.clone();
    let name = f.tensor(out).name.as_ref().map(|n| format!("{n}_partials"));
    f.new_tensor(name, dtype, axes, mesh)
}

/// Position of the slot axis in a reduce-scatter's slot buffer: where the output's block
/// (the output without its DIDx axis `out_didx`) has its reduction axis.
pub(super) fn slot_axis_of_block(f: &Fusion, out: TensorId, out_didx: usize) -> usize {
    f.tensor(out)
        .axes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != out_didx)
        .position(|(_, &d)| f.iter_domain(d).is_reduction())
        .unwrap_or(0)
}

/// Position of the slot axis in a reduce-scatter's slot buffer: where the output's local
/// view has its reduction axis.
pub(super) fn slot_axis(f: &Fusion, view: TensorId) -> usize {
    f.tensor(view)
        .axes
        .iter()
        .position(|&d| f.iter_domain(d).is_reduction())
        .unwrap_or(0)
}

/// What one reduce-scatter step writes to: the slots, and with sub-chunks the round sum.
pub(super) struct ReduceScatterStep<'a> {
    pub(super) rs: &'a ReduceScatterFold,
    pub(super) slots: TensorId,
    pub(super) round: Option<RoundSum>,
}

/// The sum at the end of each round of a sub-chunked reduce-scatter pipeline.
pub(super) struct RoundSum {
    /// The loop index.
    pub(super) index: ScalarId,
    /// The device count (the ring's length).
    pub(super) extent: ScalarId,
    /// This device's block of the output (the output without its DIDx axis).
    pub(super) block: TensorId,
    /// The row axis in the output's `axes`.
    pub(super) out_rows: usize,
}

/// Reduce-scatter step: the iteration's partial chunk goes to its owner (or, for this
/// device's own chunk, into its slot), and this device receives a partial of its chunk.
/// With sub-chunks, everything is the round's row range, and the own-chunk step (the
/// round's last) also waits for the round's receives and sums the round's rows.
pub(super) fn emit_reduce_scatter_step(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    sched: &Schedule,
    step: &ReduceScatterStep,
    transport: Transport,
    body: &mut Vec<Node>,
) -> Result<()> {
    let (rs, slots) = (step.rs, step.slots);
    let x = rs.expr.inputs[0];
    require_world_mesh(p, x, rs.didx)?;
    let s =
        p.ir.find_parallel_axis(x, ParallelType::Stream)
            .ok_or_else(|| {
                stream_error(&p.ir, x, rs.didx, "the reduced tensor lost its Stream axis")
            })?;
    let chunk = slicer.slice(p, x, s, body);
    // Drop the (local, extent 1) DIDx axis: the partial of one chunk.
    let didx_in_chunk = if rs.didx < s { rs.didx } else { rs.didx - 1 };
    let partial = slice_tensor(&mut p.ir, chunk, didx_in_chunk);
    body.push(Node::AliasSelect {
        input: chunk,
        output: partial,
        axis: didx_in_chunk,
        index: slicer.zero,
    });
    // The slot axis sits where the output's local view has its reduction axis.
    let out = rs.expr.output;
    let in_block = |q: usize| if q > rs.out_didx { q - 1 } else { q };
    let slot_pos = slot_axis_of_block(&p.ir, out, rs.out_didx);
    // A slot (one source's partial), narrowed to the round's rows when sub-chunked.
    let slot_view =
        |p: &mut HostProgram, slicer: &Slicer, index: ScalarId, body: &mut Vec<Node>| {
            let v = select(p, slots, slot_pos, index, body);
            match (&step.round, &slicer.rows) {
                (Some(round), Some(rows)) => {
                    let q = in_block(round.out_rows);
                    let in_slot = if q > slot_pos { q - 1 } else { q };
                    let extent = p.ir.axis(out, round.out_rows).extent;
                    rows.emit(p, v, in_slot, extent, false, body)
                }
                _ => v,
            }
        };
    let mut then_body = Vec::new();
    let own = slot_view(p, slicer, sched.rank, &mut then_body);
    then_body.push(Node::Compute(Expr {
        op: Op::Set,
        inputs: vec![partial],
        output: own,
    }));
    if let (Some(round), Some(rows)) = (&step.round, &slicer.rows) {
        emit_round_sum(p, rows, round, rs, slots, slot_pos, &mut then_body);
    }
    let mut else_body = Vec::new();
    let incoming = slot_view(p, slicer, sched.recv_peer, &mut else_body);
    else_body.extend(coalesced_exchange(
        p,
        incoming,
        sched.recv_peer,
        partial,
        sched.send_peer,
        transport,
    ));
    body.push(own_chunk_or_not(p, sched, then_body, else_body));
    Ok(())
}

/// The end of a round: wait for the pool streams of the round's other `D - 1` steps
/// (their receives), then sum the round's rows of every slot into the output block.
pub(super) fn emit_round_sum(
    p: &mut HostProgram,
    rows: &RowSlicing,
    round: &RoundSum,
    rs: &ReduceScatterFold,
    slots: TensorId,
    slot_pos: usize,
    body: &mut Vec<Node>,
) {
    // FOR j in 0..D-1: Synchronize Stream((i - 1 - j) % numberOfStreams)
    let back = p.ir.loop_index("j");
    let one = p.ir.constant(1);
    let zero = p.ir.constant(0);
    let previous = p.ir.binary(ScalarOp::Sub, round.index, one);
    let earlier = p.ir.binary(ScalarOp::Sub, previous, back);
    let n = p.ir.named(NamedScalar::NumberOfStreams);
    let pool = p.ir.binary(ScalarOp::Mod, earlier, n);
    let stream = p.new_stream(StreamDef::Pool(pool));
    let others = p.ir.binary(ScalarOp::Sub, round.extent, one);
    let axis = p.ir.add_iter_domain(IterDomain::new(others));
    body.push(Node::ForLoop(ForLoop {
        index: back,
        axis,
        start: zero,
        stop: others,
        body: vec![Node::Synchronize { stream }],
    }));
    let out = rs.expr.output;
    let q = if round.out_rows > rs.out_didx {
        round.out_rows - 1
    } else {
        round.out_rows
    };
    let extent = p.ir.axis(out, round.out_rows).extent;
    let partials = rows.emit(p, slots, q, extent, false, body);
    let block = rows.emit(p, round.block, q, extent, false, body);
    body.push(sum_slots(rs, partials, block, slot_pos));
}

/// `block = sum(partials, slot_axis)` with the folded reduction's operator.
pub(super) fn sum_slots(
    rs: &ReduceScatterFold,
    partials: TensorId,
    block: TensorId,
    slot: usize,
) -> Node {
    let Op::Reduction { op, .. } = rs.expr.op else {
        unreachable!("folded reductions are reductions")
    };
    Node::Compute(Expr {
        op: Op::Reduction {
            op,
            axes: vec![slot],
        },
        inputs: vec![partials],
        output: block,
    })
}
