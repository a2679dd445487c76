//! Finding the AllGather + GEMM loops the fused form applies to (see the module above):
//! whole blocks per iteration ([`find`]) or row ranges of them ([`find_rows`]); what an
//! iteration computes is read by `product`.

use super::body::{only_allocated_outside, Branch};
use super::product::{gated_branch, kernel_epilogue, Product};
use super::{Found, Landing};
use crate::dtype::DType;
use crate::hir::{
    for_each_node, ForLoop, HostProgram, Node, P2PDirection, StreamDef, StreamId, Transport,
};
use crate::ir::{Expr, NamedScalar, Op, ParallelType, Scalar, ScalarId, ScalarOp, TensorId};

/// The loop at top-level position `at`, when the fused form applies to it.
pub(super) fn find(p: &HostProgram, at: usize) -> Option<Found> {
    let (l, middle, caller) = loop_on_pool(p, at)?;
    // [gathered view], the own-or-receive branch, the output's view, the GEMM.
    let (whole_view, rest) = match middle {
        [Node::AliasSelect {
            input,
            output,
            axis: 0,
            index,
        }, rest @ ..] => (Some((*input, *output, *index)), rest),
        _ => (None, middle),
    };
    let (branch, product, b_view, out_axis, aux) = match branch_then_output(p, rest) {
        Some(after) if matches!(after.rest, [Node::Compute(_)]) => {
            let [Node::Compute(gemm)] = after.rest else {
                return None;
            };
            one_product(p, l, after, gemm)?
        }
        _ => {
            let (branch, product) = gated_branch(p, at, rest)?;
            (branch, product, None, 0, None)
        }
    };
    let Branch {
        cond,
        then_body,
        else_body,
        output,
        out_block: out_view,
        block,
    } = branch;
    let Product {
        rows,
        b,
        epilogue,
        bias,
        up,
        parts,
    } = product;
    if up.is_some_and(|u| u == rows || p.ir.tensor(u).dtype != p.ir.tensor(b).dtype) {
        return None;
    }
    if *cond != rank_test(p, *block)? {
        return None;
    }
    let received = exchange(else_body, *block)?;
    let (landing, shard, own_view) = match whole_view {
        Some((whole, view, index)) => {
            let shard = own_copy(then_body, view)?;
            let ok = index == *block && view == rows && received.recv == rows;
            (ok && else_body.len() == 5).then_some((Landing::Whole(whole), shard.0, shard.1))?
        }
        None => {
            let [Node::AliasSelect {
                input: slots,
                output: slot,
                axis: 0,
                ..
            }, ..] = else_body
            else {
                return None;
            };
            let [Node::AliasSelect {
                input: x,
                output: own,
                axis,
                index,
            }] = then_body
            else {
                return None;
            };
            let ok = *slot == rows && *own == rows && received.recv == rows;
            (ok && else_body.len() == 6).then_some((
                Landing::Slots(*slots),
                (*x, *axis, *index),
                *own,
            ))?
        }
    };
    if received.send != shard.0 || !operands_fit(p, at, (rows, b, *output, *out_view), landing) {
        return None;
    }
    if aux.is_some_and(|x| !aux_fits(p, l, x, (rows, b, *output))) {
        return None;
    }
    Some(Found {
        pieces: 1,
        range: None,
        at,
        index: l.index,
        landing,
        shard,
        own_view,
        b,
        b_view,
        output: *output,
        out_axis,
        block: *block,
        out_rows: *out_view,
        caller,
        epilogue,
        bias,
        up,
        parts,
        aux,
    })
}

/// What a whole-block loop's iteration computes with its one GEMM `gemm` after the branch
/// (`after`): the branch (its output the GEMM's), the product, the view of B the loop bound,
/// the output's block axis and the auxiliary matrix made outside the loop. With an
/// auxiliary matrix the loop binds two block views, the output's and the auxiliary
/// matrix's, in either order.
fn one_product<'a>(
    p: &HostProgram,
    l: &ForLoop,
    after: AfterBranch<'a>,
    gemm: &Expr,
) -> Option<OneProduct<'a>> {
    let AfterBranch {
        branch,
        views,
        out_axis,
        other,
        ..
    } = after;
    let (epilogue, bias, aux_view) = kernel_epilogue(p, l, gemm)?;
    let (branch, aux) = match (other, aux_view) {
        (None, None) => (branch, None),
        (Some(o), Some(view)) if *o.output == gemm.output && *branch.out_block == view => {
            let aux = *branch.output;
            (branch.with_output(o.input, o.output), Some(aux))
        }
        (Some(o), Some(view)) if *o.output == view => (branch, Some(*o.input)),
        _ => return None,
    };
    if gemm.output != *branch.out_block {
        return None;
    }
    let (b, b_view) = operand_behind(&views, gemm.inputs[1])?;
    let product = Product {
        rows: gemm.inputs[0],
        b,
        epilogue,
        bias,
        up: None,
        parts: Vec::new(),
    };
    Some((branch, product, b_view, out_axis, aux))
}

/// What [`one_product`] finds: the branch, the product, the view of B the loop bound, the
/// output's block axis and the auxiliary matrix.
type OneProduct<'a> = (
    Branch<'a>,
    Product,
    Option<TensorId>,
    usize,
    Option<TensorId>,
);

/// The loop at top-level position `at` in its row-range form (`pieces` ranges per block,
/// iteration `i` the range `i % pieces` of block `(rank - i / pieces) % d`), when the fused
/// form applies to it. Without slots the loop binds the range of the gathered block
/// (`[select, slice]` before its branch, the own branch copying the shard's range there);
/// with slots the receiving branch binds a slot's first rows and the own branch the
/// shard's range in place.
pub(super) fn find_rows(p: &HostProgram, at: usize, pieces: usize) -> Option<Found> {
    let (l, middle, caller) = loop_on_pool(p, at)?;
    let ranges = match p.ir.scalar_node(l.stop) {
        Scalar::Binary(ScalarOp::Mul, _, c) => {
            *p.ir.scalar_node(*c) == Scalar::Const(pieces as i64)
        }
        _ => false,
    };
    if !ranges {
        return None;
    }
    let (head, rest) = match middle {
        [a @ Node::AliasSelect { .. }, b @ Node::Compute(_), rest @ ..] => (Some((a, b)), rest),
        _ => (None, middle),
    };
    let AfterBranch {
        branch:
            Branch {
                cond,
                then_body,
                else_body,
                output,
                out_block,
                block,
            },
        views,
        out_axis,
        other: None,
        rest: [Node::Compute(out_slice), Node::Compute(gemm)],
    } = branch_then_output(p, rest)?
    else {
        return None;
    };
    // The range of the output's block: its rows follow the DIDx axes the view keeps.
    let Op::Slice { axis, start, stop } = out_slice.op else {
        return None;
    };
    if axis != out_axis || out_slice.inputs != [*out_block] || gemm.output != out_slice.output {
        return None;
    }
    if *cond != rank_test(p, *block)? {
        return None;
    }
    // An auxiliary matrix is taken with whole blocks only.
    let (epilogue, bias, None) = kernel_epilogue(p, l, gemm)? else {
        return None;
    };
    let rows = gemm.inputs[0];
    let (b, b_view) = operand_behind(&views, gemm.inputs[1])?;
    let received = exchange(else_body, *block)?;
    let before = &else_body[..else_body.len() - 5];
    // The receiving branch's send: the same range of the local shard.
    let (send_head, send_nodes) = before.split_at(before.len().checked_sub(2)?);
    let [Node::AliasSelect {
        input: x,
        output: sent_block,
        axis,
        index,
    }, Node::Compute(sent)] = send_nodes
    else {
        return None;
    };
    let slices =
        |e: &Expr, of: TensorId| matches!(e.op, Op::Slice { axis: 0, .. }) && e.inputs == [of];
    if !slices(sent, *sent_block) || received.send != sent.output || received.recv != rows {
        return None;
    }
    let shard = (*x, *axis, *index);
    let (landing, own_view) = rows_landing(head, send_head, then_body, (*x, rows, *block))?;
    if !operands_fit(p, at, (rows, b, *output, *out_block), landing) {
        return None;
    }
    Some(Found {
        pieces,
        range: Some((start, stop)),
        at,
        index: l.index,
        landing,
        shard,
        own_view,
        b,
        b_view,
        output: *output,
        out_axis,
        block: *block,
        out_rows: gemm.output,
        caller,
        epilogue,
        bias,
        up: None,
        parts: Vec::new(),
        aux: None,
    })
}

/// Where a row-range loop lands its rows (see [`find_rows`]): the head before its branch
/// (`[select, slice]` of the gathered block, without slots), the receiving branch's nodes
/// before its send (a slot and its first rows, with slots), and the own branch; with the
/// shard `x`, the received rows and the block index. The landing and the own block's view.
fn rows_landing(
    head: Option<(&Node, &Node)>,
    send_head: &[Node],
    then_body: &[Node],
    (x, rows, block): (TensorId, TensorId, ScalarId),
) -> Option<(Landing, TensorId)> {
    let slices =
        |e: &Expr, of: TensorId| matches!(e.op, Op::Slice { axis: 0, .. }) && e.inputs == [of];
    match (head, send_head) {
        // No slots: the gathered block's range bound before the branch; the own branch
        // copies the shard's range into it.
        (
            Some((
                Node::AliasSelect {
                    input: whole,
                    output: view,
                    axis: 0,
                    index,
                },
                Node::Compute(range),
            )),
            [],
        ) => {
            let [Node::AliasSelect {
                input: own_x,
                output: own_block,
                ..
            }, Node::Compute(own_range), Node::Compute(copy)] = then_body
            else {
                return None;
            };
            let ok = *index == block
                && slices(range, *view)
                && range.output == rows
                && *own_x == x
                && slices(own_range, *own_block)
                && copy.op == Op::Set
                && copy.inputs == [own_range.output]
                && copy.output == rows;
            ok.then_some((Landing::Whole(*whole), *own_block))
        }
        // Slots: the receiving branch binds a slot's first rows; the own branch the
        // shard's range in place.
        (
            None,
            [Node::AliasSelect {
                input: slots,
                output: slot,
                axis: 0,
                ..
            }, Node::Compute(slot_rows)],
        ) => {
            let [Node::AliasSelect {
                input: own_x,
                output: own_block,
                ..
            }, Node::Compute(own_range)] = then_body
            else {
                return None;
            };
            let ok = slices(slot_rows, *slot)
                && slot_rows.output == rows
                && *own_x == x
                && slices(own_range, *own_block)
                && own_range.output == rows;
            ok.then_some((Landing::Slots(*slots), *own_block))
        }
        _ => None,
    }
}

/// `[IF .. ELSE .., views.., out_block = select(output, axis, block), rest..]`: the branch,
/// the operand views, the output's block axis (`out_axis`), another view of the same block (`select(t,
/// axis, block)` right before the output's: an auxiliary matrix's, or the output's when the
/// auxiliary matrix's comes second), and the nodes after them. A view selects
/// index 0 of the axis a broadcast made before the loop inserted into an operand (an
/// operand broadcast against the loop's Stream axis, e.g. the weights of
/// `matmul(x, broadcast(w1, ..))`): its base operand is read instead. The output's axes
/// before its block axis are DIDx (one index of them per rank, stored with extent 1), so
/// its blocks lie one after another as with the block axis first.
fn branch_then_output<'a>(p: &HostProgram, nodes: &'a [Node]) -> Option<AfterBranch<'a>> {
    let [Node::IfThenElse {
        cond,
        then_body,
        else_body,
    }, rest @ ..] = nodes
    else {
        return None;
    };
    let mut views = Vec::new();
    let mut rest = rest;
    while let [Node::AliasSelect {
        input,
        output,
        axis,
        index,
    }, more @ ..] = rest
    {
        match broadcast_base(p, *input, *axis, *index) {
            Some(base) => views.push(OperandView {
                view: *output,
                base,
            }),
            None => break,
        }
        rest = more;
    }
    let [Node::AliasSelect {
        input: first,
        output: first_view,
        axis,
        index: block,
    }, rest @ ..] = rest
    else {
        return None;
    };
    let (other, (output, out_block), rest) = match rest {
        [Node::AliasSelect {
            input,
            output,
            axis: a,
            index,
        }, more @ ..]
            if a == axis && index == block =>
        {
            let other = BlockView {
                input: first,
                output: first_view,
            };
            (Some(other), (input, output), more)
        }
        _ => (None, (first, first_view), rest),
    };
    let per_rank = |t: TensorId| (0..*axis).all(|a| p.ir.axis(t, a).parallel == ParallelType::DIDx);
    if !per_rank(*output) || other.is_some_and(|o| !per_rank(*o.input)) {
        return None;
    }
    let branch = Branch::new((cond, then_body, else_body), (output, out_block, block));
    Some(AfterBranch {
        branch,
        views,
        out_axis: *axis,
        other,
        rest,
    })
}

/// What [`branch_then_output`] reads of a loop body.
struct AfterBranch<'a> {
    branch: Branch<'a>,
    views: Vec<OperandView>,
    out_axis: usize,
    other: Option<BlockView<'a>>,
    rest: &'a [Node],
}

/// A view of one block of a tensor made outside the loop, bound beside the output's.
#[derive(Clone, Copy)]
struct BlockView<'a> {
    input: &'a TensorId,
    output: &'a TensorId,
}

/// Whether the kernel takes `aux` (made outside loop `l`) as the auxiliary matrix of the GEMM
/// `rows @ b -> output`: of the output's dtype, none of the operands, and bound in the loop
/// by its block view alone.
fn aux_fits(
    p: &HostProgram,
    l: &ForLoop,
    aux: TensorId,
    (rows, b, output): (TensorId, TensorId, TensorId),
) -> bool {
    let mut uses = 0;
    for_each_node(&l.body, &mut |n| {
        uses += usize::from(n.tensors().contains(&aux))
    });
    uses == 1
        && ![rows, b, output].contains(&aux)
        && p.ir.tensor(aux).dtype == p.ir.tensor(output).dtype
}

/// An operand's view bound in the loop ([`branch_then_output`]) and the tensor made before
/// the loop that it reads.
struct OperandView {
    view: TensorId,
    base: TensorId,
}

/// The tensor `select(input, axis, index)` reads when `input` is a top-level broadcast
/// whose one inserted axis is `axis` and `index` is 0: the broadcast's input.
fn broadcast_base(
    p: &HostProgram,
    input: TensorId,
    axis: usize,
    index: ScalarId,
) -> Option<TensorId> {
    if p.ir.const_value(index) != Some(0) {
        return None;
    }
    p.body.iter().find_map(|n| match n {
        Node::Compute(e) if e.output == input => match &e.op {
            Op::Broadcast { flags }
                if flags.get(axis) == Some(&true) && flags.iter().filter(|&&f| f).count() == 1 =>
            {
                e.inputs.first().copied()
            }
            _ => None,
        },
        _ => None,
    })
}

/// The GEMM's B operand `b` as the kernel reads it: the base of its view when the loop
/// bound it as one (and the view, which the fused form drops), else `b` itself. None when
/// a view is bound that the GEMM does not read.
fn operand_behind(views: &[OperandView], b: TensorId) -> Option<(TensorId, Option<TensorId>)> {
    match views {
        [] => Some((b, None)),
        [v] if v.view == b => Some((v.base, Some(v.view))),
        _ => None,
    }
}

/// The loop at top-level position `at` when it runs on a pool stream that waited for the
/// caller's stream (see [`fork_before`]) and joins it at its end: the loop, its body between
/// the stream switches, and the caller's stream.
fn loop_on_pool(p: &HostProgram, at: usize) -> Option<(&ForLoop, &[Node], StreamId)> {
    let Node::ForLoop(l) = &p.body[at] else {
        return None;
    };
    let (caller, worker) = fork_before(p, at)?;
    let [Node::SetCurrentStream { stream: first }, middle @ .., Node::SetCurrentStream { stream: back }, Node::Synchronize { stream: joined }] =
        l.body.as_slice()
    else {
        return None;
    };
    ((*first, *back, *joined) == (worker, caller, worker)).then_some((l, middle, caller))
}

/// Whether the kernel takes the loop's GEMM `rows @ b -> output` (written through
/// `out_view`): B neither operand's view, bf16 or f16 throughout, and the landing buffer
/// touched by nothing outside the loop at `at`.
fn operands_fit(
    p: &HostProgram,
    at: usize,
    (rows, b, output, out_view): (TensorId, TensorId, TensorId, TensorId),
    landing: Landing,
) -> bool {
    let dtype = p.ir.tensor(rows).dtype;
    let same = [b, output].iter().all(|&t| p.ir.tensor(t).dtype == dtype);
    let landed = match landing {
        Landing::Whole(t) | Landing::Slots(t) => t,
    };
    b != rows
        && b != out_view
        && same
        && matches!(dtype, DType::BF16 | DType::F16)
        && only_allocated_outside(p, at, landed)
}

/// The caller's stream and the loop's pool stream, where the node before `at` is the loop
/// that makes every pool stream wait for the caller's stream, and the caller's stream was
/// captured before it.
fn fork_before(p: &HostProgram, at: usize) -> Option<(StreamId, StreamId)> {
    let Node::ForLoop(fork) = p.body.get(at.checked_sub(1)?)? else {
        return None;
    };
    let [Node::SetCurrentStream { stream: worker }, Node::Synchronize { stream: caller }] =
        fork.body.as_slice()
    else {
        return None;
    };
    let pool = matches!(p.streams[worker.index()], StreamDef::Pool(_));
    let captured = p.streams[caller.index()] == StreamDef::Captured;
    (pool && captured).then_some((*caller, *worker))
}

/// `block == rank`: the own branch's condition.
fn rank_test(p: &HostProgram, block: ScalarId) -> Option<ScalarId> {
    let scalars = (0..p.ir.scalar_count()).map(ScalarId::from_index);
    let rank = scalars
        .clone()
        .find(|&s| *p.ir.scalar_node(s) == Scalar::Named(NamedScalar::Rank))?;
    scalars
        .into_iter()
        .find(|&s| *p.ir.scalar_node(s) == Scalar::Binary(ScalarOp::Eq, block, rank))
}

/// The receive and the send of a receiving branch.
struct Exchange {
    recv: TensorId,
    send: TensorId,
}

/// The coalesced copy-engine receive of `block` and send that end `branch`.
fn exchange(branch: &[Node], block: ScalarId) -> Option<Exchange> {
    let tail = branch.get(branch.len().checked_sub(5)?..)?;
    let [Node::StartCoalescing, Node::P2P(x), Node::P2P(y), Node::EndCoalescing { id }, Node::Wait { comm }] =
        tail
    else {
        return None;
    };
    let (recv, send) = match (x.direction, y.direction) {
        (P2PDirection::Recv, P2PDirection::Send) => (x, y),
        (P2PDirection::Send, P2PDirection::Recv) => (y, x),
        _ => return None,
    };
    let copies = recv.transport == Transport::CopyEngine && send.transport == Transport::CopyEngine;
    (copies && id == comm && recv.peer == block).then_some(Exchange {
        recv: recv.buffer,
        send: send.buffer,
    })
}

/// The own branch of a loop with a buffer of every block: the shard's block selected, then
/// copied into `view`. The shard, its axis and index, and the selected view.
fn own_copy(branch: &[Node], view: TensorId) -> Option<((TensorId, usize, ScalarId), TensorId)> {
    let [Node::AliasSelect {
        input,
        output,
        axis,
        index,
    }, Node::Compute(copy)] = branch
    else {
        return None;
    };
    let copies = copy.op == Op::Set && copy.inputs == [*output] && copy.output == view;
    copies.then_some(((*input, *axis, *index), *output))
}
