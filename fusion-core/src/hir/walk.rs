//! Depth-first traversal of node lists.

use super::Node;

/// Calls `f` on every node, parents before their nested nodes.
pub fn for_each_node(nodes: &[Node], f: &mut dyn FnMut(&Node)) {
    for n in nodes {
        f(n);
        for child in n.children() {
            for_each_node(child, f);
        }
    }
}

/// Calls `f` on every node list (the top level and every nested body), mutably.
pub fn for_each_node_mut(
    nodes: &mut Vec<Node>,
    f: &mut dyn FnMut(&mut Vec<Node>) -> crate::error::Result<()>,
) -> crate::error::Result<()> {
    f(nodes)?;
    for n in nodes.iter_mut() {
        match n {
            Node::ForLoop(l) => for_each_node_mut(&mut l.body, f)?,
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => {
                for_each_node_mut(then_body, f)?;
                for_each_node_mut(else_body, f)?;
            }
            _ => {}
        }
    }
    Ok(())
}
