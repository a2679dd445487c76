//! `FuseEpilogue`: folds the elementwise ops that consume a GEMM's result into the GEMM's
//! epilogue, so that the product is never stored and read back.
//!
//! A `matmul` or `linear` whose result only one elementwise op reads becomes an
//! [`Op::Gemm`] computing that op's result directly: a bias add (`t + b` with `b` a
//! vector `[N]` broadcast over the rows, before any activation), unary activations, and a
//! cast (the last step: the GEMM then stores in that dtype). The chain continues through
//! each folded op whose result again has one elementwise reader. The values in between are
//! kept in f32 (rounded once, at the store), which is what a GEMM epilogue does.
//!
//! A unary op whose result a binary elementwise op reads (the gated MLP's
//! `silu(g) * u`) stays out: `FuseElementwise` fuses it with that op into one kernel,
//! where folding it would leave two passes on backends without that epilogue (cuBLASLt has
//! bias, relu and the tanh GELU; other activations run in a kernel right after the GEMM).
//! The derivative ops of backward passes (`gelu_grad`, ..) are never folded as activations.
//!
//! Two forms of training's MLP block fold with an auxiliary matrix
//! ([`crate::ir::EpilogueAux`]), both the tanh GELU's (cuBLASLt's `GELU_AUX` and `DGELU`):
//! - the pre-activation saved: a GEMM result that is also an output (or a chunk of one:
//!   the saving forward's `h`) and that one `gelu_tanh` reads becomes one GEMM writing
//!   `gelu_tanh(h)` and `h` (`h` its last input, written; the persistent AllGather+GEMM
//!   of `pipelines.gathered_gemm` takes it too, storing `h` from its epilogue);
//! - the derivative applied: the backward's `mul(d_act, gelu_tanh_grad(h))` (either operand
//!   order), with `d_act` a GEMM's result and the derivative computed between the GEMM and
//!   the `mul`, each read by the `mul` only, becomes one GEMM reading `h` and multiplying
//!   its product by `gelu_tanh'(h)`. Only a plain product takes it (no bias or activation
//!   before; cuBLASLt's `DGELU` has none), and nothing folds after it.
//!
//! A matmul whose only reader sums it over its first axis, a Stream axis left whole (the
//! gathered blocks of an unpipelined weight gradient, `dW = sum_b x_b^T dy_b`) that both
//! operands step along, becomes one GEMM summed over that axis
//! ([`Epilogue::sums_batch`]): the runtime runs it as one GEMM whose K runs over every
//! block where the blocks lie one after another along K, so no batch of products is
//! stored and summed. It moves to the sum's place past anything that leaves its operands
//! alone.
//!
//! Otherwise, between the GEMM and its reader there may be only view bindings (the stream loop's
//! slot views); the GEMM moves to its reader's place. The views, slot buffers and
//! allocations that only served the folded product are removed.

mod readers;

use std::collections::HashSet;

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{for_each_node, for_each_node_mut, HostProgram, Node};
use crate::ir::{
    BinaryOp, Epilogue, EpilogueAux, Expr, Fusion, IterKind, Op, ParallelType, ReduceOp, TensorId,
    UnaryOp,
};
use readers::{readers, Readers};

/// The epilogue-folding pass.
pub struct FuseEpilogue;

impl Pass for FuseEpilogue {
    fn name(&self) -> &'static str {
        "FuseEpilogue"
    }

    fn run(&self, p: &mut HostProgram, _ctx: &PassContext) -> Result<()> {
        let mut pinned: HashSet<TensorId> = p.inputs.iter().chain(&p.outputs).copied().collect();
        pinned.extend(p.aliases.iter().flat_map(|&(o, i)| [o, i]));
        let mut folded: Vec<TensorId> = Vec::new();
        loop {
            let readers = readers(&p.body);
            let mut body = std::mem::take(&mut p.body);
            let mut changed = false;
            for_each_node_mut(&mut body, &mut |list| {
                while let Some(dead) = fold_one(&p.ir, list, &readers, &pinned) {
                    folded.extend(dead);
                    changed = true;
                }
                Ok(())
            })?;
            p.body = body;
            if !changed {
                break;
            }
        }
        prune(p, folded, &pinned);
        Ok(())
    }
}

/// A GEMM node's parts: `(linear, epilogue, inputs)`, for the ops that can take more
/// epilogue (not accumulating, not already storing in another dtype, not already
/// multiplying by a derivative, not summed over a batch axis).
fn gemm_parts(f: &Fusion, e: &Expr) -> Option<(bool, Epilogue, Vec<TensorId>)> {
    match &e.op {
        Op::Matmul if e.inputs.len() == 2 => Some((false, Epilogue::default(), e.inputs.clone())),
        Op::Linear => {
            let ep = Epilogue {
                bias: e.inputs.len() == 3,
                ..Epilogue::default()
            };
            Some((true, ep, e.inputs.clone()))
        }
        Op::Gemm { linear, epilogue }
            if f.tensor(e.output).dtype == f.tensor(e.inputs[0]).dtype
                && !epilogue.sums_batch
                && !matches!(epilogue.aux, Some(EpilogueAux::Derivative(_))) =>
        {
            Some((*linear, epilogue.clone(), e.inputs.clone()))
        }
        _ => None,
    }
}

/// Folds one GEMM of `list` into its reader; returns the products no longer computed.
/// `pinned`: the program's inputs, outputs and aliases.
fn fold_one(
    f: &Fusion,
    list: &mut Vec<Node>,
    readers: &Readers,
    pinned: &HashSet<TensorId>,
) -> Option<Vec<TensorId>> {
    for i in 0..list.len() {
        let Node::Compute(g) = &list[i] else {
            continue;
        };
        let Some((linear, mut epilogue, mut inputs)) = gemm_parts(f, g) else {
            continue;
        };
        let t = g.output;
        // A product that is also an output (or a part of one) keeps its store; it may
        // still hand its pre-activation to an epilogue that stores both.
        let kept = pinned.contains(&t) || readers.part_of(t, pinned);
        let Some(reader) = readers.only_reader(t) else {
            continue;
        };
        // The reader, after nothing but view bindings that leave the GEMM's inputs alone
        // (and the derivative a folded product is multiplied by).
        let Some(j) =
            (i + 1..list.len()).find(|&j| matches!(&list[j], Node::Compute(e) if e == reader))
        else {
            continue;
        };
        let slope = match &reader.op {
            Op::Binary(BinaryOp::Mul) if !kept => slope_of(f, list, (i, j), reader, readers)
                .filter(|&(_, (s, _))| !pinned.contains(&s) && !readers.part_of(s, pinned)),
            _ => None,
        };
        let between = |n: usize| slope.is_none_or(|(k, _)| n != k);
        // A sum over the product's first batch axis: the GEMM moves past anything that
        // leaves its operands alone.
        let summed =
            !linear && epilogue == Epilogue::default() && !kept && sums_first_batch(f, g, reader);
        let movable = |n: usize| match summed {
            true => !writes_any(&list[n], &inputs),
            false => binds_only(&list[n], &inputs),
        };
        if !(i + 1..j).filter(|&n| between(n)).all(movable) {
            continue;
        }
        let mut dead = vec![t];
        match &reader.op {
            Op::Unary(UnaryOp::GeluTanh)
                if kept && epilogue.activations.is_empty() && epilogue.aux.is_none() =>
            {
                // The GEMM writes the product where the activation read it.
                let t_stays = (i + 1..j).all(|n| binds_only(&list[n], &[t]));
                if feeds_binary(readers, reader.output) || !t_stays {
                    continue;
                }
                epilogue.activations.push(UnaryOp::GeluTanh);
                epilogue.aux = Some(EpilogueAux::PreActivation);
                inputs.push(t);
                dead.clear();
            }
            _ if kept => continue,
            Op::Reduction { .. } if summed => epilogue.sums_batch = true,
            Op::Unary(u) => {
                if u.is_derivative() || feeds_binary(readers, reader.output) {
                    continue;
                }
                epilogue.activations.push(*u);
            }
            Op::Cast => {}
            Op::Binary(BinaryOp::Add)
                if !epilogue.bias && epilogue.activations.is_empty() && epilogue.aux.is_none() =>
            {
                let other = if reader.inputs[0] == t {
                    reader.inputs[1]
                } else {
                    reader.inputs[0]
                };
                if other == t || !is_row_vector(f, other, t) {
                    continue;
                }
                epilogue.bias = true;
                inputs.push(other);
            }
            Op::Binary(BinaryOp::Mul) if epilogue == Epilogue::default() => {
                let Some((k, (s, h))) = slope else {
                    continue;
                };
                epilogue.aux = Some(EpilogueAux::Derivative(UnaryOp::GeluTanhGrad));
                inputs.push(h);
                dead.push(s);
                list[j] = gemm_node(linear, epilogue, inputs, reader.output);
                list.remove(k);
                list.remove(i);
                return Some(dead);
            }
            _ => continue,
        }
        list[j] = gemm_node(linear, epilogue, inputs, reader.output);
        list.remove(i);
        return Some(dead);
    }
    None
}

/// The fused GEMM node.
fn gemm_node(linear: bool, epilogue: Epilogue, inputs: Vec<TensorId>, output: TensorId) -> Node {
    Node::Compute(Expr {
        op: Op::Gemm { linear, epilogue },
        inputs,
        output,
    })
}

/// For `mul` (at `j`) of the product of the GEMM at `i` and `gelu_tanh_grad(h)` computed
/// between them: the derivative's position and `(its result, h)`, when the product only
/// multiplies, `h` has the product's axes (no broadcast) and nothing else reads the
/// derivative. The autodiff's adjoint of `gelu_tanh` is `mul(gradient, gelu_tanh_grad(x))`;
/// either operand order folds.
fn slope_of(
    f: &Fusion,
    list: &[Node],
    (i, j): (usize, usize),
    mul: &Expr,
    readers: &Readers,
) -> Option<(usize, (TensorId, TensorId))> {
    let Node::Compute(g) = &list[i] else {
        return None;
    };
    let t = g.output;
    let s = match mul.inputs[..] {
        [a, b] if a == t && b != t => b,
        [a, b] if b == t && a != t => a,
        _ => return None,
    };
    let k = (i + 1..j).find(|&k| matches!(&list[k], Node::Compute(e) if e.output == s))?;
    let Node::Compute(d) = &list[k] else {
        return None;
    };
    let h = *d.inputs.first()?;
    let same_axes = {
        let (vh, vt) = (f.visible_axes(h), f.visible_axes(t));
        vh.len() == vt.len()
            && vh.iter().all(|&q| f.axis(h, q).kind != IterKind::Broadcast)
            && f.tensor(mul.output).dtype == f.tensor(t).dtype
    };
    let only = readers.only_reader(s).is_some_and(|e| e == mul);
    // The GEMM reads `h` where the `mul` was: nothing may bind it again in between.
    let h_stays = (k + 1..j).all(|n| binds_only(&list[n], &[h]));
    (d.op == Op::Unary(UnaryOp::GeluTanhGrad) && same_axes && only && h_stays)
        .then_some((k, (s, h)))
}

/// Whether `sum` adds the GEMM `g`'s product over its first visible axis, a Stream axis
/// left whole (the blocks of a gathered operand: a weight gradient of an unpipelined
/// program) that both operands step along (neither broadcasts it), into the product's
/// dtype.
fn sums_first_batch(f: &Fusion, g: &Expr, sum: &Expr) -> bool {
    let Op::Reduction {
        op: ReduceOp::Sum,
        axes,
    } = &sum.op
    else {
        return false;
    };
    let out = f.visible_axes(g.output);
    let rank = out.len();
    let blocks = out
        .first()
        .is_some_and(|&q| f.axis(g.output, q).parallel == ParallelType::Stream);
    let batch_of = |t: TensorId| {
        let vis = f.visible_axes(t);
        vis.len() == rank && f.axis(t, vis[0]).kind == IterKind::Iteration
    };
    axes[..] == [0]
        && blocks
        && rank >= 3
        && g.inputs.len() == 2
        && g.inputs.iter().all(|&t| batch_of(t))
        && f.tensor(sum.output).dtype == f.tensor(g.output).dtype
}

/// True for a node that writes none of `inputs` (conservatively: a node other than a
/// computation, a collective or a view binding that mentions one of them counts as
/// writing it).
fn writes_any(n: &Node, inputs: &[TensorId]) -> bool {
    match n {
        Node::Compute(e) => inputs.contains(&e.output),
        Node::Communication(c) => inputs.contains(&c.output),
        Node::AliasSelect { output, .. } => inputs.contains(output),
        Node::Wait { .. } | Node::Synchronize { .. } | Node::SetCurrentStream { .. } => false,
        other => {
            let mut hit = false;
            for_each_node(std::slice::from_ref(other), &mut |m| {
                hit |= m.tensors().iter().any(|t| inputs.contains(t));
            });
            hit
        }
    }
}

/// True for a binding node (a view, an allocation, a branch of them) that binds none of
/// `inputs`.
fn binds_only(n: &Node, inputs: &[TensorId]) -> bool {
    match n {
        Node::AliasSelect { output, .. } => !inputs.contains(output),
        Node::Compute(e) if e.op.is_view() => !inputs.contains(&e.output),
        Node::Allocate { tensor } => !inputs.contains(tensor),
        Node::IfThenElse {
            then_body,
            else_body,
            ..
        } => then_body
            .iter()
            .chain(else_body)
            .all(|m| binds_only(m, inputs)),
        _ => false,
    }
}

/// True when a binary elementwise op reads `t`.
fn feeds_binary(readers: &Readers, t: TensorId) -> bool {
    readers
        .exprs
        .get(&t)
        .is_some_and(|es| es.iter().any(|e| matches!(e.op, Op::Binary(_))))
}

/// True when `b` is a vector along `t`'s last axis broadcast over the others: every other
/// axis is a broadcast, of extent 1, or sharded (DIDx: a rank stores one index of it, so a
/// per-rank bias block `[d @ DIDx, 1, n]` of a column-parallel layer is a row vector on
/// every rank), and the last has `t`'s last extent and dtype.
fn is_row_vector(f: &Fusion, b: TensorId, t: TensorId) -> bool {
    let (vb, vt) = (f.visible_axes(b), f.visible_axes(t));
    let (Some(&lb), Some(&lt)) = (vb.last(), vt.last()) else {
        return false;
    };
    let unit = |q: usize| {
        let d = f.axis(b, q);
        d.kind == IterKind::Broadcast
            || d.parallel == ParallelType::DIDx
            || f.const_value(d.extent) == Some(1)
    };
    vb.len() <= vt.len()
        && f.tensor(b).dtype == f.tensor(t).dtype
        && f.axis(b, lb).extent == f.axis(t, lt).extent
        && !unit(lb)
        && vb[..vb.len() - 1].iter().all(|&q| unit(q))
}

/// Removes what only served the folded products: the views binding them, then buffers
/// and views nothing else refers to any more, and branches left empty.
fn prune(p: &mut HostProgram, folded: Vec<TensorId>, pinned: &HashSet<TensorId>) {
    let mut dead: HashSet<TensorId> = folded.into_iter().collect();
    while !dead.is_empty() {
        let mut sources: Vec<TensorId> = Vec::new();
        let _ = for_each_node_mut(&mut p.body, &mut |list| {
            list.retain(|n| {
                let bound = match n {
                    Node::AliasSelect { input, output, .. } => Some((*input, *output)),
                    Node::Compute(e) if e.op.is_view() => Some((e.inputs[0], e.output)),
                    Node::Allocate { tensor } => {
                        (dead.contains(tensor)).then_some((*tensor, *tensor))
                    }
                    _ => None,
                };
                match bound {
                    Some((src, out)) if dead.contains(&out) => {
                        if src != out {
                            sources.push(src);
                        }
                        false
                    }
                    _ => true,
                }
            });
            list.retain(|n| {
                !matches!(n, Node::IfThenElse { then_body, else_body, .. }
                    if then_body.is_empty() && else_body.is_empty())
            });
            Ok(())
        });
        // A source is dead when nothing reads it any more (its allocation and the nodes
        // binding it do not count).
        let mut referenced: HashSet<TensorId> = HashSet::new();
        for_each_node(&p.body, &mut |n| match n {
            Node::Allocate { .. } | Node::Deallocate { .. } => {}
            Node::AliasSelect { input, .. } => {
                referenced.insert(*input);
            }
            Node::Compute(e) if e.op.is_view() => {
                referenced.insert(e.inputs[0]);
            }
            other => referenced.extend(other.tensors()),
        });
        dead = sources
            .into_iter()
            .filter(|t| !pinned.contains(t) && !referenced.contains(t))
            .collect();
    }
}
