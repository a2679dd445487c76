//! Where a race happened, in words: the node the evaluator runs and the loop indices
//! around it (the error types themselves are `crate::error::race`'s).

use fusion_compiler::hir::{HostProgram, Node, P2PDirection};
use fusion_compiler::ir::ScalarId;

/// Where the evaluator is: the node it runs and the indices of the loops around it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Place<'a> {
    /// `None` before the first node (the caller) and after the last (the call's end).
    pub node: Option<&'a Node>,
    pub loops: Vec<(ScalarId, i64)>,
}

impl Place<'_> {
    /// `T6 = matmul(T5, b) [StreamIdx = 2]`, or `outside` for a place without a node.
    pub fn label(&self, p: &HostProgram, outside: &str) -> String {
        let Some(node) = self.node else {
            return outside.to_string();
        };
        let mut s = node_label(p, node);
        if !self.loops.is_empty() {
            let idx: Vec<String> = self
                .loops
                .iter()
                .map(|&(i, v)| format!("{} = {v}", p.ir.display_scalar(i)))
                .collect();
            s.push_str(&format!(" [{}]", idx.join(", ")));
        }
        s
    }
}

/// A node in one line: its kind and the tensors it names.
fn node_label(p: &HostProgram, node: &Node) -> String {
    let name = |t| p.ir.tensor_name(t);
    let list = |ts: &[fusion_compiler::ir::TensorId]| -> String {
        ts.iter().map(|&t| name(t)).collect::<Vec<_>>().join(", ")
    };
    match node {
        Node::Compute(e) => format!("{} = {}({})", name(e.output), e.op.name(), list(&e.inputs)),
        Node::Launch {
            segment,
            inputs,
            outputs,
        } => format!(
            "({}) = Segment{}({})",
            list(outputs),
            segment.index(),
            list(inputs)
        ),
        Node::Communication(c) => format!(
            "Communication {} ({} {} -> {})",
            c.id.index(),
            c.kind.name(),
            name(c.input),
            name(c.output)
        ),
        Node::P2P(x) => {
            let (dir, to) = match x.direction {
                P2PDirection::Send => ("send", "to"),
                P2PDirection::Recv => ("recv", "from"),
            };
            format!(
                "P2PCommunication {} ({dir} {} {to} {})",
                x.id.index(),
                name(x.buffer),
                p.ir.display_scalar(x.peer)
            )
        }
        Node::Allocate { tensor } => format!("Allocate {}", name(*tensor)),
        Node::Deallocate { tensor } => format!("Deallocate {}", name(*tensor)),
        Node::EndCoalescing { id } => format!("EndCoalescing {}", id.index()),
        Node::Wait { comm } => format!("Wait Communication {}", comm.index()),
        Node::Synchronize { stream } => format!("Synchronize Stream {}", stream.index()),
        Node::GatheredGemmLaunch(g) => format!(
            "{} = GatheredGemm {} launch({}, own {}, {}{}{}{})",
            name(g.output),
            g.id.index(),
            name(g.gathered),
            name(g.own),
            name(g.b),
            g.up.map_or(String::new(), |u| format!(", gated by {}", name(u))),
            g.bias
                .map_or(String::new(), |b| format!(", bias {}", name(b))),
            g.aux
                .map_or(String::new(), |x| format!(", aux {}", name(x)))
        ),
        Node::RowsReady { id, block, piece } => format!(
            "RowsReady GatheredGemm {}, block {}{}",
            id.index(),
            p.ir.display_scalar(*block),
            piece.map_or(String::new(), |q| format!(
                ", piece {}",
                p.ir.display_scalar(q)
            ))
        ),
        Node::GatheredGemmJoin { id } => format!("Join GatheredGemm {}", id.index()),
        other => format!("{:?}", other.kind()),
    }
}
