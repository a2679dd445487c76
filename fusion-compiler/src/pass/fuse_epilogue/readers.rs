//! Who reads each tensor of a host program, for `FuseEpilogue`: the compute nodes reading
//! its value, whether anything else does, and the chunks and views it is selected into.

use std::collections::{HashMap, HashSet};

use crate::hir::{for_each_node, Node};
use crate::ir::{Expr, TensorId};

/// For every tensor, the compute nodes (by expression) that read its value, and whether
/// anything else (a communication, a view, a launch) reads it. A stream chunk (an
/// `AliasSelect` output), or a view of one (a row range of it), is read wherever its whole
/// tensor is selected again.
pub(super) struct Readers {
    pub(super) exprs: HashMap<TensorId, Vec<Expr>>,
    other: HashSet<TensorId>,
    /// Chunk or view -> the tensor it selects from or views.
    chunk_of: HashMap<TensorId, TensorId>,
    /// How many nodes select chunks of a tensor.
    selects: HashMap<TensorId, usize>,
}

pub(super) fn readers(body: &[Node]) -> Readers {
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
    pub(super) fn part_of(&self, t: TensorId, whole: &HashSet<TensorId>) -> bool {
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
    pub(super) fn only_reader(&self, t: TensorId) -> Option<&Expr> {
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
