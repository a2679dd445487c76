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
//! The derivative ops of backward passes (`gelu_grad`, ..) are never folded.
//!
//! Between the GEMM and its reader there may be only view bindings (the stream loop's
//! slot views); the GEMM moves to its reader's place. The views, slot buffers and
//! allocations that only served the folded product are removed.

use std::collections::{HashMap, HashSet};

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{for_each_node, for_each_node_mut, HostProgram, Node};
use crate::ir::{BinaryOp, Epilogue, Expr, Fusion, IterKind, Op, ParallelType, TensorId};

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
                while let Some(t) = fold_one(&p.ir, list, &readers, &pinned) {
                    folded.push(t);
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

/// For every tensor, the compute nodes (by expression) that read its value, and whether
/// anything else (a communication, a view, a launch) reads it. A stream chunk (an
/// `AliasSelect` output), or a view of one (a row range of it), is read wherever its whole
/// tensor is selected again.
struct Readers {
    exprs: HashMap<TensorId, Vec<Expr>>,
    other: HashSet<TensorId>,
    /// Chunk or view -> the tensor it selects from or views.
    chunk_of: HashMap<TensorId, TensorId>,
    /// How many nodes select chunks of a tensor.
    selects: HashMap<TensorId, usize>,
}

fn readers(body: &[Node]) -> Readers {
    let mut r = Readers {
        exprs: HashMap::new(),
        other: HashSet::new(),
        chunk_of: HashMap::new(),
        selects: HashMap::new(),
    };
    for_each_node(body, &mut |n| match n {
        Node::Compute(e) => {
            for &t in &e.inputs {
                if e.op.is_view() {
                    r.other.insert(t);
                } else {
                    r.exprs.entry(t).or_default().push(e.clone());
                }
            }
            if e.op.is_view() {
                if let Some(&whole) = e.inputs.first() {
                    r.chunk_of.insert(e.output, whole);
                }
            }
        }
        Node::AliasSelect { input, output, .. } => {
            r.other.insert(*input);
            r.chunk_of.insert(*output, *input);
            *r.selects.entry(*input).or_default() += 1;
        }
        Node::Communication(c) => {
            r.other.insert(c.input);
        }
        Node::P2P(x) => {
            r.other.insert(x.buffer);
        }
        Node::Launch { inputs, .. } => r.other.extend(inputs.iter().copied()),
        _ => {}
    });
    r
}

impl Readers {
    /// True when `t` is a chunk or a view (at any step of the chain) of one of `whole`:
    /// a GEMM writing a chunk of an output stores what the output must hold.
    fn part_of(&self, t: TensorId, whole: &HashSet<TensorId>) -> bool {
        let mut part = t;
        while let Some(&w) = self.chunk_of.get(&part) {
            if whole.contains(&w) {
                return true;
            }
            part = w;
        }
        false
    }

    /// The one expression that reads `t`, if nothing else does (for a chunk or a view of
    /// one: nothing else reads the tensor it comes from, e.g. a later loop selecting chunks
    /// of it again, at any step of the chain of selects and views).
    fn only_reader(&self, t: TensorId) -> Option<&Expr> {
        if self.other.contains(&t) {
            return None;
        }
        let mut part = t;
        while let Some(&whole) = self.chunk_of.get(&part) {
            if self.selects.get(&whole).copied().unwrap_or(0) > 1 || self.exprs.contains_key(&whole)
            {
                return None;
            }
            part = whole;
        }
        match self.exprs.get(&t).map(Vec::as_slice) {
            Some([e]) => Some(e),
            _ => None,
        }
    }
}

/// A GEMM node's parts: `(linear, epilogue, inputs)`, for the ops that can take more
/// epilogue (not accumulating, not already storing in another dtype).
fn gemm_parts(f: &Fusion, e: &Expr) -> Option<(bool, Epilogue, Vec<TensorId>)> {
    match &e.op {
        Op::Matmul if e.inputs.len() == 2 => Some((false, Epilogue::default(), e.inputs.clone())),
        Op::Linear => {
            let ep = Epilogue {
                bias: e.inputs.len() == 3,
                activations: Vec::new(),
            };
            Some((true, ep, e.inputs.clone()))
        }
        Op::Gemm { linear, epilogue }
            if f.tensor(e.output).dtype == f.tensor(e.inputs[0]).dtype =>
        {
            Some((*linear, epilogue.clone(), e.inputs.clone()))
        }
        _ => None,
    }
}

/// Folds one GEMM of `list` into its reader; returns the product no longer computed.
fn fold_one(
    f: &Fusion,
    list: &mut Vec<Node>,
    readers: &Readers,
    pinned: &HashSet<TensorId>,
) -> Option<TensorId> {
    for i in 0..list.len() {
        let Node::Compute(g) = &list[i] else {
            continue;
        };
        let Some((linear, mut epilogue, mut inputs)) = gemm_parts(f, g) else {
            continue;
        };
        let t = g.output;
        if pinned.contains(&t) || readers.part_of(t, pinned) {
            continue;
        }
        let Some(reader) = readers.only_reader(t) else {
            continue;
        };
        // The reader, after nothing but view bindings that leave the GEMM's inputs alone.
        let Some(j) =
            (i + 1..list.len()).find(|&j| matches!(&list[j], Node::Compute(e) if e == reader))
        else {
            continue;
        };
        if !list[i + 1..j].iter().all(|n| binds_only(n, &inputs)) {
            continue;
        }
        match &reader.op {
            Op::Unary(u) => {
                if u.is_derivative() || feeds_binary(readers, reader.output) {
                    continue;
                }
                epilogue.activations.push(*u);
            }
            Op::Cast => {}
            Op::Binary(BinaryOp::Add) if !epilogue.bias && epilogue.activations.is_empty() => {
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
            _ => continue,
        }
        let fused = Node::Compute(Expr {
            op: Op::Gemm { linear, epilogue },
            inputs,
            output: reader.output,
        });
        list[j] = fused;
        list.remove(i);
        return Some(t);
    }
    None
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
