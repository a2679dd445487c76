//! `InsertDeallocations`: frees each intermediate buffer right after its last use.
//!
//! Works on the top-level node list. A buffer's uses include uses of every view of it
//! (slices, selects, splits, broadcasts), and a use anywhere inside a loop or branch counts
//! as a use by that top-level node. A buffer used by pool streams is freed only after the
//! join that makes the caller's stream wait for them (the stream-sync nodes right after
//! the last use), so the stream-ordered free cannot hand its memory to new work while a
//! transfer still reads it. Inputs, outputs, and buffers an output views or aliases are
//! never freed.

use std::collections::{HashMap, HashSet};

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{for_each_node, HostProgram, Node};
use crate::ir::TensorId;

/// The deallocation pass.
pub struct InsertDeallocations;

impl Pass for InsertDeallocations {
    fn name(&self) -> &'static str {
        "InsertDeallocations"
    }

    fn run(&self, p: &mut HostProgram, _ctx: &PassContext) -> Result<()> {
        let roots = view_roots(p);
        let root = |t: TensorId| -> TensorId {
            let mut t = t;
            while let Some(&r) = roots.get(&t) {
                t = r;
            }
            t
        };
        let mut protected: HashSet<TensorId> = HashSet::new();
        for &t in p.inputs.iter().chain(&p.outputs) {
            protected.insert(root(t));
        }
        for &(o, i) in &p.aliases {
            protected.insert(root(o));
            protected.insert(root(i));
        }
        // Buffers owned by the program: allocated, or produced by a top-level compute op.
        let mut owned: Vec<TensorId> = Vec::new();
        for n in &p.body {
            match n {
                Node::Allocate { tensor } => owned.push(*tensor),
                Node::Compute(e) if !e.op.is_view() => owned.push(e.output),
                Node::Launch { outputs, .. } => owned.extend(outputs.iter().copied()),
                _ => {}
            }
        }
        let mut last_use: HashMap<TensorId, usize> = HashMap::new();
        for (i, n) in p.body.iter().enumerate() {
            for_each_node(std::slice::from_ref(n), &mut |m| {
                for t in m.tensors() {
                    last_use.insert(root(t), i);
                }
            });
        }
        let mut inserts: Vec<(usize, TensorId)> = Vec::new();
        let mut seen = HashSet::new();
        for t in owned {
            let r = root(t);
            if r != t || protected.contains(&r) || !seen.insert(r) {
                continue;
            }
            if let Some(&i) = last_use.get(&r) {
                let mut at = i;
                while p.body.get(at + 1).is_some_and(is_stream_join) {
                    at += 1;
                }
                inserts.push((at, r));
            }
        }
        inserts.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
        for (i, t) in inserts {
            p.body.insert(i + 1, Node::Deallocate { tensor: t });
        }
        Ok(())
    }
}

/// A node that only orders streams: a `Synchronize`, or a loop of nothing else.
fn is_stream_join(n: &Node) -> bool {
    match n {
        Node::Synchronize { .. } => true,
        Node::ForLoop(l) => l
            .body
            .iter()
            .all(|m| matches!(m, Node::Synchronize { .. } | Node::SetCurrentStream { .. })),
        _ => false,
    }
}

/// View -> the tensor it views, for every view the program creates.
fn view_roots(p: &HostProgram) -> HashMap<TensorId, TensorId> {
    let mut roots = HashMap::new();
    for_each_node(&p.body, &mut |n| match n {
        Node::AliasSelect { input, output, .. } => {
            roots.insert(*output, *input);
        }
        Node::Compute(e) if e.op.is_view() => {
            roots.insert(e.output, e.inputs[0]);
        }
        Node::Launch { segment, .. } => {
            for e in &p.segments[segment.index()].exprs {
                if e.op.is_view() {
                    roots.insert(e.output, e.inputs[0]);
                }
            }
        }
        _ => {}
    });
    roots
}
