//! What the GEMMs that run a collective of their product in their epilogue share
//! (`gemm_allreduce`, `gemm_reduce_scatter`): finding a top-level GEMM whose product
//! nothing but one summing collective of the whole world reads, the extents a rank holds of
//! its operands, and replacing the pair with one node.

use super::plain_gemm;
use crate::hir::{Communication, CommunicationKind, HostProgram, Node};
use crate::ir::{Expr, IterKind, ParallelType, ReduceOp, ScalarId, TensorId};

/// A GEMM + collective pair that a fused kernel takes.
pub(super) struct Found {
    /// Position of the collective.
    pub(super) comm_at: usize,
    /// Rows, contracted, columns.
    pub(super) shape: [i64; 3],
}

/// Calls `rewrite(program, at, found)` wherever `find(program, at)` finds a pair whose GEMM
/// is at `at` of the top level, in order (a rewrite removes that GEMM, so `at` is looked at
/// again).
pub(super) fn rewrite_each(
    program: &mut HostProgram,
    find: &dyn Fn(&HostProgram, usize) -> Option<Found>,
    rewrite: &dyn Fn(&mut HostProgram, usize, Found),
) {
    let mut at = 0;
    while at < program.body.len() {
        match find(program, at) {
            Some(found) => rewrite(program, at, found),
            None => at += 1,
        }
    }
}

/// A plain GEMM at the top level of a program and the collective of its product after it.
pub(super) struct GemmThenCollective<'a> {
    pub(super) gemm: &'a Expr,
    pub(super) comm: &'a Communication,
    /// Position of the collective.
    pub(super) comm_at: usize,
}

/// The plain GEMM at `at` and the summing `kind` of its product over the whole world (no
/// root) that is the next top-level node to mention the product, when nothing else reads
/// the product and its operands, the product and the collective's output share one dtype.
pub(super) fn gemm_then_collective(
    p: &HostProgram,
    at: usize,
    kind: CommunicationKind,
) -> Option<GemmThenCollective<'_>> {
    let Node::Compute(gemm) = &p.body[at] else {
        return None;
    };
    if !plain_gemm(gemm) {
        return None;
    }
    let product = gemm.output;
    let world: Vec<usize> = (0..p.world_size).collect();
    let comm_at = (at + 1..p.body.len()).find(|&i| p.body[i].tensors().contains(&product))?;
    let Node::Communication(comm) = &p.body[comm_at] else {
        return None;
    };
    let summed = comm.kind == kind
        && comm.reduce_op == Some(ReduceOp::Sum)
        && comm.input == product
        && comm.team == world
        && comm.mesh == world
        && comm.root.is_none();
    let dtype = p.ir.tensor(gemm.inputs[0]).dtype;
    let same = [gemm.inputs[1], product, comm.output]
        .iter()
        .all(|&t| p.ir.tensor(t).dtype == dtype);
    (summed && same && read_only_there(p, product, at, comm_at)).then_some(GemmThenCollective {
        gemm,
        comm,
        comm_at,
    })
}

/// Whether nothing but the nodes at `writer_at` and `reader_at` and allocations mention
/// `t`, and the program neither takes nor returns it.
pub(super) fn read_only_there(
    p: &HostProgram,
    t: TensorId,
    writer_at: usize,
    reader_at: usize,
) -> bool {
    let pinned = p.inputs.contains(&t)
        || p.outputs.contains(&t)
        || p.aliases.iter().any(|&(o, i)| o == t || i == t);
    let mut elsewhere = false;
    for (i, n) in p.body.iter().enumerate() {
        if i == writer_at
            || i == reader_at
            || matches!(n, Node::Allocate { .. } | Node::Deallocate { .. })
        {
            continue;
        }
        crate::hir::for_each_node(std::slice::from_ref(n), &mut |m| {
            elsewhere |= m.tensors().contains(&t);
        });
    }
    !pinned && !elsewhere
}

/// The extents of the axes a rank holds of `t` (not reduction or DIDx axes) at the call's
/// extents; `None` when one is unknown.
pub(super) fn local_extents(
    p: &HostProgram,
    t: TensorId,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> Option<Vec<i64>> {
    p.ir.tensor(t)
        .axes
        .iter()
        .map(|&a| p.ir.iter_domain(a))
        .filter(|d| d.kind != IterKind::Reduction && d.parallel != ParallelType::DIDx)
        .map(|d| p.ir.evaluate(d.extent, extent))
        .collect()
}

/// Puts `fused(gemm, comm)` where the collective at `comm_at` was, removes the GEMM at
/// `gemm_at` and every allocation of its product, and moves the deallocations of the GEMM's
/// operands that stood between the two (an operand the program computed, freed once the
/// GEMM had read it) after the new node, which now reads them.
pub(super) fn fuse(
    p: &mut HostProgram,
    gemm_at: usize,
    comm_at: usize,
    fused: impl FnOnce(Expr, Communication) -> Node,
) {
    let Node::Communication(comm) = p.body[comm_at].clone() else {
        return;
    };
    let Node::Compute(gemm) = p.body.remove(gemm_at) else {
        return;
    };
    let product = gemm.output;
    let mut comm_at = comm_at - 1;
    let operands = gemm.inputs.clone();
    let mut freed = Vec::new();
    let mut i = gemm_at;
    while i < comm_at {
        match &p.body[i] {
            Node::Deallocate { tensor } if operands.contains(tensor) => {
                freed.push(p.body.remove(i));
                comm_at -= 1;
            }
            _ => i += 1,
        }
    }
    p.body[comm_at] = fused(gemm, comm);
    for (j, node) in freed.into_iter().enumerate() {
        p.body.insert(comm_at + 1 + j, node);
    }
    p.body.retain(|n| {
        !matches!(n, Node::Allocate { tensor } | Node::Deallocate { tensor } if *tensor == product)
    });
}
