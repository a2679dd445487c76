//! What both readers of a loop body share (`find_loops`, `product`): its own-or-receive
//! branch, and whether a buffer is made outside the loop for it alone.

use crate::hir::{for_each_node, HostProgram, Node};
use crate::ir::{ScalarId, TensorId};

/// A loop body's own-or-receive branch and the output block's view after it.
pub(super) struct Branch<'a> {
    pub(super) cond: &'a ScalarId,
    pub(super) then_body: &'a [Node],
    pub(super) else_body: &'a [Node],
    pub(super) output: &'a TensorId,
    pub(super) out_block: &'a TensorId,
    pub(super) block: &'a ScalarId,
}

impl<'a> Branch<'a> {
    /// The branch of `[IF cond THEN then_body ELSE else_body, out_block = select(output, ..,
    /// block), ..]`.
    pub(super) fn new(
        (cond, then_body, else_body): (&'a ScalarId, &'a [Node], &'a [Node]),
        (output, out_block, block): (&'a TensorId, &'a TensorId, &'a ScalarId),
    ) -> Self {
        Branch {
            cond,
            then_body,
            else_body,
            output,
            out_block,
            block,
        }
    }
}

impl<'a> Branch<'a> {
    /// The same branch with another output and its block's view.
    pub(super) fn with_output(self, output: &'a TensorId, out_block: &'a TensorId) -> Self {
        Branch {
            output,
            out_block,
            ..self
        }
    }
}

/// Whether nothing outside the loop at `at` touches `t` but its allocation and release,
/// and it is no input or output of the program.
pub(super) fn only_allocated_outside(p: &HostProgram, at: usize, t: TensorId) -> bool {
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
