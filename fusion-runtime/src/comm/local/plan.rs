//! What one rank does in a collective before it joins: its role, the checks on the
//! collective and on its own input, and the signature every member must agree on.

use std::collections::HashSet;
use std::sync::Arc;

use fusion_compiler::hir::{Communication, CommunicationKind as K};

use super::fabric::Block;
use crate::tensor::Tensor;

/// Whether a rank gives data to a collective and whether it gets data back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Role {
    pub contributes: bool,
    pub receives: bool,
}

/// `rank`'s role in `comm` (see the table in `comm/mod.rs`).
pub(super) fn role(comm: &Communication, rank: usize) -> Role {
    let in_mesh = comm.mesh.contains(&rank);
    let is_root = comm.root == Some(rank);
    let (contributes, receives) = match comm.kind {
        K::Allgather | K::Allreduce | K::ReduceScatter => (in_mesh, in_mesh),
        K::Gather | K::Reduce => (in_mesh, is_root),
        K::Scatter | K::Broadcast => (is_root, in_mesh),
        K::SendRecv => (is_root, comm.receiver == Some(rank)),
    };
    Role {
        contributes,
        receives,
    }
}

/// Everything about `comm` that its members must agree on (besides the team, which
/// already keys the rendezvous).
pub(super) fn signature(comm: &Communication) -> String {
    format!(
        "{} (mesh {:?}, root {:?}, receiver {:?}, op {:?}, sharded axis {:?}, scatter axis {:?}, \
         out axis {:?})",
        comm.kind.name(),
        comm.mesh,
        comm.root,
        comm.receiver,
        comm.reduce_op.map(|op| op.name()),
        comm.in_sharded_axis,
        comm.in_scatter_axis,
        comm.out_sharded_axis
    )
}

/// Checks that `comm` is well formed: mesh and root inside the team, the fields its kind
/// needs present.
pub(super) fn check_structure(comm: &Communication) -> Result<(), String> {
    let mut seen = HashSet::new();
    for m in &comm.mesh {
        if !seen.insert(m) {
            return Err(format!(
                "device {m} appears twice in the mesh {:?}",
                comm.mesh
            ));
        }
        if !comm.team.contains(m) {
            return Err(format!("the mesh device {m} is not in the team"));
        }
    }
    let kind = comm.kind;
    if matches!(
        kind,
        K::Gather | K::Reduce | K::Scatter | K::Broadcast | K::SendRecv
    ) {
        match comm.root {
            None => return Err("the collective needs a root but has none".into()),
            Some(r) if !comm.team.contains(&r) => {
                return Err(format!("the root {r} is not in the team"))
            }
            Some(_) => {}
        }
    }
    if kind == K::SendRecv {
        match comm.receiver {
            None => return Err("the collective needs a receiver but has none".into()),
            Some(r) if !comm.team.contains(&r) => {
                return Err(format!("the receiver {r} is not in the team"))
            }
            Some(_) => {}
        }
    }
    if matches!(kind, K::Allreduce | K::Reduce | K::ReduceScatter) && comm.reduce_op.is_none() {
        return Err("the collective needs a reduce op but has none".into());
    }
    if matches!(kind, K::Allgather | K::Gather) && comm.in_sharded_axis.is_none() {
        return Err("the collective needs the input's sharded axis but has none".into());
    }
    if matches!(kind, K::Scatter | K::ReduceScatter) && comm.in_scatter_axis.is_none() {
        return Err("the collective needs the input's scatter axis but has none".into());
    }
    if !matches!(kind, K::Broadcast | K::SendRecv) && comm.mesh.is_empty() {
        return Err("the collective has an empty mesh".into());
    }
    Ok(())
}

/// The axis a copy (Broadcast, SendRecv) moves from `in_sharded_axis` to
/// `out_sharded_axis`, when both are given; other kinds' inputs are sharded at `a`.
pub(super) fn unit_axis(comm: &Communication) -> Option<usize> {
    match comm.kind {
        K::Broadcast | K::SendRecv => comm
            .in_sharded_axis
            .filter(|_| comm.out_sharded_axis.is_some()),
        _ => comm.in_sharded_axis,
    }
}

fn check_input_shape(comm: &Communication, shape: &[usize]) -> Result<(), String> {
    let d = comm.mesh.len();
    let a = unit_axis(comm);
    if let Some(a) = a {
        if shape.get(a) != Some(&1) {
            return Err(format!(
                "its input of shape {shape:?} must have size 1 at its sharded axis {a}"
            ));
        }
    }
    if let (K::Scatter | K::ReduceScatter, Some(s)) = (comm.kind, comm.in_scatter_axis) {
        if a == Some(s) {
            return Err(format!("the scatter axis {s} is also the sharded axis"));
        }
        if shape.get(s) != Some(&d) {
            return Err(format!(
                "its input of shape {shape:?} must have size {d} (the mesh size) at its scatter \
                 axis {s}"
            ));
        }
    }
    Ok(())
}

/// Checks `comm` and reads `rank`'s input if its role contributes one; the error is
/// deposited so that every member reports it rather than waiting.
pub(super) fn contribution(
    comm: &Communication,
    rank: usize,
    input: Option<&Tensor>,
) -> Result<Option<Arc<Block>>, String> {
    check_structure(comm)?;
    if !role(comm, rank).contributes {
        return Ok(None);
    }
    let input = input.ok_or_else(|| "it must give an input but gave none".to_string())?;
    let shape = input.shape().to_vec();
    check_input_shape(comm, &shape)?;
    let data = input.to_f32_vec().map_err(|e| e.to_string())?;
    Ok(Some(Arc::new(Block { shape, data })))
}
