//! AllGather + GEMM as one persistent GEMM fed by the stream loop's copies
//! (`LowerOptions::pipelines.gathered_gemm`).
//!
//! The pipeline the stream pass makes of `matmul(AG(x), w)` receives one peer's block of
//! rows per iteration and runs that block's GEMM after it. Here the loop keeps its
//! transfers and loses its GEMMs: one GEMM over every block is launched on the caller's
//! stream before the loop ([`Node::GatheredGemmLaunch`]); after each receive the loop says
//! so ([`Node::RowsReady`], on the receiving stream: a stream write of a word the GEMM's
//! loader waits for, no SM), and the caller's stream joins the GEMM after the loop
//! ([`Node::GatheredGemmJoin`]). This rank's own block is read where it is, never copied
//! (a device-local copy is a kernel, which would queue behind the GEMM that waits for it).
//!
//! It applies to a top-level loop that is exactly the allgather step and the GEMM of each
//! block: both of its transfers on the copy engines (NCCL's sends and receives are kernels
//! that need the SMs the GEMM holds), bf16 or f16 operands, a plain `[.., rows, K] x [K, N]`
//! product per block (no epilogue, bias or accumulation), the gathered rows read by
//! nothing else, one block per iteration (no row ranges), right after the loop that makes
//! the pool streams wait for the caller's stream (nothing in the loop may make a stream
//! wait for the caller's after the launch, or the copies would wait for the GEMM that
//! waits for them). The gathered rows land in a buffer of every block (the loop's slots,
//! reused by every `numberOfStreams`-th iteration, cannot hold what one GEMM reads at
//! once). Each choice is noted under the program; a loop it does not apply to is left as
//! it was, without a note (so the program equals the one without the option).

use crate::dtype::DType;
use crate::hir::{
    for_each_node, ForLoop, GatheredGemm, GatheredGemmId, HostProgram, Node, P2PDirection,
    StreamDef, StreamId, Transport,
};
use crate::ir::{MemoryType, NamedScalar, Op, Scalar, ScalarId, ScalarOp, TensorId, TensorView};

/// Where a loop's gathered rows land.
#[derive(Clone, Copy, Debug)]
enum Landing {
    /// A buffer of every block (stream buffers off): the loop binds each block's view
    /// before its branch, and copies the own block into it.
    Whole(TensorId),
    /// `numberOfStreams` slots (stream buffers on): the receiving branch binds a slot.
    Slots(TensorId),
}

/// An AllGather + GEMM loop found in a program.
#[derive(Clone, Debug)]
struct Found {
    /// Position of the loop in the program's top level.
    at: usize,
    landing: Landing,
    /// The local shard, its DIDx axis, and the index (0) its own block is selected at.
    shard: (TensorId, usize, ScalarId),
    /// The view the own branch bound (the shape of one block's rows).
    own_view: TensorId,
    b: TensorId,
    output: TensorId,
    /// The block an iteration receives (also the chunk of the output it computes).
    block: ScalarId,
    /// The caller's stream.
    caller: StreamId,
}

/// Rewrites every AllGather + GEMM loop of `program` it applies to (see the module
/// documentation) when `enabled`, noting each.
pub fn choose_gathered_gemm(program: &mut HostProgram, enabled: bool) {
    if !enabled {
        return;
    }
    let mut next = 0u32;
    let mut at = 0;
    while at < program.body.len() {
        match find(program, at) {
            Some(found) => {
                at = rewrite(program, found, GatheredGemmId(next)) + 1;
                next += 1;
            }
            None => at += 1,
        }
    }
}

/// The loop at top-level position `at`, when the fused form applies to it.
fn find(p: &HostProgram, at: usize) -> Option<Found> {
    let Node::ForLoop(l) = &p.body[at] else {
        return None;
    };
    let (caller, worker) = fork_before(p, at)?;
    let body = &l.body;
    let [Node::SetCurrentStream { stream: first }, middle @ .., Node::SetCurrentStream { stream: back }, Node::Synchronize { stream: joined }] =
        body.as_slice()
    else {
        return None;
    };
    if (*first, *back, *joined) != (worker, caller, worker) {
        return None;
    }
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
    let [Node::IfThenElse {
        cond,
        then_body,
        else_body,
    }, Node::AliasSelect {
        input: output,
        output: out_view,
        axis: 0,
        index: block,
    }, Node::Compute(gemm)] = rest
    else {
        return None;
    };
    let plain = match &gemm.op {
        Op::Matmul => true,
        Op::Gemm {
            linear: false,
            epilogue,
        } => !epilogue.bias && epilogue.activations.is_empty(),
        _ => false,
    };
    if !plain || gemm.inputs.len() != 2 || gemm.output != *out_view {
        return None;
    }
    let (rows, b) = (gemm.inputs[0], gemm.inputs[1]);
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
            }, ..] = else_body.as_slice()
            else {
                return None;
            };
            let [Node::AliasSelect {
                input: x,
                output: own,
                axis,
                index,
            }] = then_body.as_slice()
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
    if received.send != shard.0 || b == rows || b == *out_view {
        return None;
    }
    let dtype = p.ir.tensor(rows).dtype;
    let same = [b, *output].iter().all(|&t| p.ir.tensor(t).dtype == dtype);
    if !same || !matches!(dtype, DType::BF16 | DType::F16) {
        return None;
    }
    let landed = match landing {
        Landing::Whole(t) | Landing::Slots(t) => t,
    };
    if !only_allocated_outside(p, at, landed) {
        return None;
    }
    Some(Found {
        at,
        landing,
        shard,
        own_view,
        b,
        output: *output,
        block: *block,
        caller,
    })
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

/// Whether nothing outside the loop at `at` touches `t` but its allocation and release,
/// and it is no input or output of the program.
fn only_allocated_outside(p: &HostProgram, at: usize, t: TensorId) -> bool {
    let pinned = p.inputs.contains(&t)
        || p.outputs.contains(&t)
        || p.aliases.iter().any(|&(o, i)| o == t || i == t);
    let mut used = false;
    for (i, n) in p.body.iter().enumerate() {
        if i == at || matches!(n, Node::Allocate { .. } | Node::Deallocate { .. }) {
            continue;
        }
        for_each_node(std::slice::from_ref(n), &mut |m| {
            used |= m.tensors().contains(&t);
        });
    }
    !pinned && !used
}

/// A new tensor like `t` (fresh axes), with axis 0's extent `extent` when given.
fn like(
    p: &mut HostProgram,
    t: TensorId,
    extent: Option<ScalarId>,
    name: Option<String>,
) -> TensorId {
    let src = p.ir.tensor(t).clone();
    let mut axes = Vec::with_capacity(src.axes.len());
    for (i, &a) in src.axes.iter().enumerate() {
        let mut d = p.ir.iter_domain(a).clone();
        if let (0, Some(e)) = (i, extent) {
            d.extent = e;
        }
        axes.push(p.ir.add_iter_domain(d));
    }
    p.ir.add_tensor(TensorView {
        name,
        axes,
        memory: if extent.is_some() {
            MemoryType::Global
        } else {
            MemoryType::Local
        },
        ..src
    })
}

/// Rewrites the loop of `found` into the fused form; the position of the join after it.
fn rewrite(p: &mut HostProgram, found: Found, id: GatheredGemmId) -> usize {
    let gathered = match found.landing {
        Landing::Whole(t) => t,
        Landing::Slots(slots) => {
            let blocks = p.ir.axis(found.output, 0).extent;
            let name = (p.ir.tensor(slots).name.clone())
                .map(|n| format!("{}_gathered", n.trim_end_matches("_slots")));
            let whole = like(p, slots, Some(blocks), name);
            for n in &mut p.body {
                match n {
                    Node::Allocate { tensor } | Node::Deallocate { tensor } if *tensor == slots => {
                        *tensor = whole;
                    }
                    _ => {}
                }
            }
            whole
        }
    };
    let own = like(p, found.own_view, None, None);
    if let Node::ForLoop(l) = &mut p.body[found.at] {
        rewrite_body(l, &found, gathered, id);
    }
    let (x, axis, index) = found.shard;
    let launch = [
        Node::AliasSelect {
            input: x,
            output: own,
            axis,
            index,
        },
        Node::SetCurrentStream {
            stream: found.caller,
        },
        Node::GatheredGemmLaunch(GatheredGemm {
            id,
            gathered,
            own,
            b: found.b,
            output: found.output,
        }),
    ];
    let at = found.at + launch.len();
    p.body.splice(found.at..found.at, launch);
    p.body.insert(at + 1, Node::GatheredGemmJoin { id });
    p.notes.push(format!(
        "GatheredGemm {} of `{}`: the AllGather+GEMM loop as one persistent GEMM that reads \
         each peer's rows once they landed and this rank's in place \
         (LowerOptions::pipelines.gathered_gemm)",
        id.index(),
        p.ir.tensor_name(found.output)
    ));
    at + 1
}

/// The loop's body without its GEMMs: the own branch binds nothing, the receiving branch
/// lands the rows in `gathered`'s block and says so after its wait.
fn rewrite_body(l: &mut ForLoop, found: &Found, gathered: TensorId, id: GatheredGemmId) {
    let mut body = Vec::with_capacity(l.body.len());
    for n in std::mem::take(&mut l.body) {
        match n {
            // The output's view and the GEMM (the launched GEMM writes every block).
            Node::AliasSelect { input, .. } if input == found.output => {}
            Node::Compute(_) => {}
            Node::IfThenElse {
                cond, else_body, ..
            } => {
                let mut receive: Vec<Node> = else_body
                    .into_iter()
                    .map(|m| match m {
                        Node::AliasSelect { output, .. }
                            if matches!(found.landing, Landing::Slots(_)) =>
                        {
                            Node::AliasSelect {
                                input: gathered,
                                output,
                                axis: 0,
                                index: found.block,
                            }
                        }
                        m => m,
                    })
                    .collect();
                receive.push(Node::RowsReady {
                    id,
                    block: found.block,
                });
                body.push(Node::IfThenElse {
                    cond,
                    then_body: Vec::new(),
                    else_body: receive,
                });
            }
            n => body.push(n),
        }
    }
    l.body = body;
}
