//! Where a program's peer copies land: the buffers a peer writes into, following views back
//! to the tensor that owns the memory, and whether the caller or the program owns them.

use std::collections::HashMap;

use fusion_compiler::hir::{for_each_node, HostProgram, Node, P2PDirection};
use fusion_compiler::ir::TensorId;

use crate::comm::is_peer_copy;

/// A program's receive buffers of peer copies (the tensors owning the memory a peer
/// copies into, [`crate::comm::is_peer_copy`]), split by who owns them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerCopyReceives {
    /// Allocated by the program itself: they can be kept from one call to the next.
    pub internal: std::collections::HashSet<TensorId>,
    /// Inputs or outputs (or the memory behind an output), which the caller owns and may
    /// move between calls.
    pub external: Vec<TensorId>,
}

impl PeerCopyReceives {
    /// Whether the program's peer copies land in memory of its own only.
    pub fn all_internal(&self) -> bool {
        self.external.is_empty()
    }
}

/// [`PeerCopyReceives`] of `p`.
pub fn peer_copy_receives(p: &HostProgram) -> PeerCopyReceives {
    let roots = received_by_peer_copies(p);
    if roots.is_empty() {
        return PeerCopyReceives::default();
    }
    let parents = view_parents(p);
    let mut owned_by_caller = std::collections::HashSet::new();
    let mut stack: Vec<TensorId> = p.inputs.iter().chain(&p.outputs).copied().collect();
    while let Some(t) = stack.pop() {
        if owned_by_caller.insert(t) {
            if let Some(ps) = parents.get(&t) {
                stack.extend(ps.iter().copied());
            }
        }
    }
    let mut external: Vec<TensorId> = roots
        .iter()
        .copied()
        .filter(|t| owned_by_caller.contains(t))
        .collect();
    external.sort_by_key(|t| t.index());
    let internal = roots
        .into_iter()
        .filter(|t| !owned_by_caller.contains(t))
        .collect();
    PeerCopyReceives { internal, external }
}

/// Every view's parents (a view may be defined in both branches of an `IfThenElse`).
fn view_parents(p: &HostProgram) -> HashMap<TensorId, Vec<TensorId>> {
    let mut parents: HashMap<TensorId, Vec<TensorId>> = HashMap::new();
    for_each_node(&p.body, &mut |n| match n {
        Node::AliasSelect { input, output, .. } => {
            parents.entry(*output).or_default().push(*input);
        }
        Node::Compute(e) if e.op.is_view() => {
            if let Some(&i) = e.inputs.first() {
                parents.entry(e.output).or_default().push(i);
            }
        }
        _ => {}
    });
    parents
}

/// The tensors a program allocates whose memory a peer copies into: the allocations behind
/// the receive buffers of peer-copy P2P transfers and the outputs of peer-copy collectives,
/// following views back to the tensor that owns the memory. Views are followed as they are
/// defined where the transfer runs (a view defined in both branches of an `IfThenElse`
/// over different tensors leads, at a receive inside one branch, to that branch's tensor).
pub fn received_by_peer_copies(p: &HostProgram) -> std::collections::HashSet<TensorId> {
    let mut defs = HashMap::new();
    let mut roots = std::collections::HashSet::new();
    received_in(&p.body, &mut defs, &mut roots);
    roots
}

/// Walks `nodes` with the view definitions `defs` in effect, adding the roots behind every
/// peer-copy receive to `roots`.
fn received_in(
    nodes: &[Node],
    defs: &mut HashMap<TensorId, Vec<TensorId>>,
    roots: &mut std::collections::HashSet<TensorId>,
) {
    for n in nodes {
        match n {
            Node::AliasSelect { input, output, .. } => {
                defs.insert(*output, vec![*input]);
            }
            Node::Compute(e) if e.op.is_view() => {
                if let Some(&i) = e.inputs.first() {
                    defs.insert(e.output, vec![i]);
                }
            }
            Node::P2P(x) if x.direction == P2PDirection::Recv && is_peer_copy(x.transport) => {
                roots.extend(roots_of(x.buffer, defs));
            }
            Node::Communication(c) if is_peer_copy(c.transport) => {
                roots.extend(roots_of(c.output, defs));
            }
            Node::ForLoop(l) => {
                // Twice: a view defined late in the body reaches the next iteration.
                received_in(&l.body, defs, roots);
                received_in(&l.body, defs, roots);
            }
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => {
                let mut other = defs.clone();
                received_in(then_body, defs, roots);
                received_in(else_body, &mut other, roots);
                for (t, ps) in other {
                    let mine = defs.entry(t).or_default();
                    for q in ps {
                        if !mine.contains(&q) {
                            mine.push(q);
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// The tensors owning the memory of `t` under the view definitions `defs`.
fn roots_of(t: TensorId, defs: &HashMap<TensorId, Vec<TensorId>>) -> Vec<TensorId> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![t];
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        match defs.get(&t) {
            Some(ps) => stack.extend(ps.iter().copied()),
            None => out.push(t),
        }
    }
    out
}

/// Whether `program` has peer copies between ranks ([`crate::comm::is_peer_copy`]).
pub fn has_peer_copies(program: &HostProgram) -> bool {
    let mut found = false;
    if program.world_size > 1 {
        for_each_node(&program.body, &mut |n| match n {
            Node::P2P(p) if is_peer_copy(p.transport) => found = true,
            Node::Communication(c) if is_peer_copy(c.transport) => found = true,
            _ => {}
        });
    }
    found
}
