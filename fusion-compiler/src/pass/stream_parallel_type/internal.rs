//! The tensors a stream loop produces and only that loop reads: with stream buffers they
//! get `numberOfStreams` slots instead of the full extent, and the gather-scatter
//! pipeline requires its gathered chunks to be such.

use std::collections::{HashMap, HashSet};

use super::group::Item;
use super::permute_views;
use super::views::PermuteViews;
use crate::hir::{for_each_node, HostProgram};
use crate::ir::TensorId;

/// Tensors a loop produces and only that loop uses (not outputs or aliases; a read of a
/// permute view is a read of what it views). With `joined` = `Some((i, j))`, items `i`
/// and `j` count as one (the loop merging them would make).
pub(super) fn loop_internal_tensors(
    p: &HostProgram,
    items: &[Item],
    views: &PermuteViews,
    joined: Option<(usize, usize)>,
) -> HashSet<TensorId> {
    let mut used_by: HashMap<TensorId, HashSet<usize>> = HashMap::new();
    let at = |k: usize| match joined {
        Some((i, j)) if k == j => i,
        _ => k,
    };
    for (k, item) in items.iter().enumerate() {
        let k = at(k);
        let mut touch = |t: TensorId| {
            used_by.entry(t).or_default().insert(k);
            used_by
                .entry(permute_views::source(views, t))
                .or_default()
                .insert(k);
        };
        match item {
            Item::Node(n) => for_each_node(std::slice::from_ref(n), &mut |m| {
                m.tensors().into_iter().for_each(&mut touch)
            }),
            Item::Loop(g) => {
                for (e, _) in &g.exprs {
                    e.inputs.iter().copied().for_each(&mut touch);
                }
                if let Some(rs) = &g.reduce_scatter {
                    touch(rs.expr.inputs[0]);
                }
            }
        }
    }
    let pinned: HashSet<TensorId> = p
        .outputs
        .iter()
        .copied()
        .chain(p.aliases.iter().flat_map(|&(o, i)| [o, i]))
        .collect();
    let mut internal = HashSet::new();
    for (k, item) in items.iter().enumerate() {
        let k = at(k);
        if let Item::Loop(g) = item {
            for (e, _) in &g.exprs {
                let t = e.output;
                let users = used_by.get(&t);
                if !pinned.contains(&t) && users.is_none_or(|u| u.iter().all(|&x| x == k)) {
                    internal.insert(t);
                }
            }
        }
    }
    internal
}
