//! The shapes a rank stores, from a call's bound symbols: the values of a program's leaf
//! scalars, the local shape of a tensor, and what preallocated outputs must look like.

use fusion_compiler::hir::HostProgram;
use fusion_compiler::ir::{IterKind, NamedScalar, ParallelType, Scalar, ScalarId, TensorId};

use super::bind::{mesh_devices, SymbolBindings};
use crate::error::{Error, Result};

/// The values of a program's leaf scalars for a call: the dimension symbols, the rank and
/// the stream count.
pub(crate) fn bound_leaves(
    p: &HostProgram,
    symbols: &SymbolBindings,
    rank: usize,
    number_of_streams: usize,
) -> Vec<Option<i64>> {
    (0..p.ir.scalar_count())
        .map(|i| {
            let s = ScalarId::from_index(i);
            match p.ir.scalar_node(s) {
                Scalar::Symbol(_) => symbols.get(s),
                Scalar::Named(NamedScalar::Rank) => Some(rank as i64),
                Scalar::Named(NamedScalar::NumberOfStreams) => Some(number_of_streams as i64),
                _ => None,
            }
        })
        .collect()
}

/// The shape a rank stores for `t` (DIDx and broadcast axes have extent 1), with `eval`
/// giving the values of extents.
pub(super) fn local_shape_of(
    p: &HostProgram,
    t: TensorId,
    eval: &dyn Fn(ScalarId) -> Result<i64>,
) -> Result<Vec<usize>> {
    let f = &p.ir;
    f.visible_axes(t)
        .into_iter()
        .map(|pos| {
            let d = f.axis(t, pos);
            if d.parallel == ParallelType::DIDx || d.kind == IterKind::Broadcast {
                return Ok(1);
            }
            let v = eval(d.extent)?;
            usize::try_from(v).map_err(|_| {
                Error::bad_tensor(f.tensor_name(t), Some(pos), format!("negative extent {v}"))
            })
        })
        .collect()
}

/// An output's dtype and the shape one rank stores.
pub type OutputLayout = (fusion_compiler::DType, Vec<usize>);

/// The dtype and shape of each output of `program` on `rank`, or `None` where the rank
/// holds no part of it (a sub-mesh): what preallocated outputs must look like.
pub fn output_layouts(
    p: &HostProgram,
    symbols: &SymbolBindings,
    rank: usize,
    number_of_streams: usize,
) -> Result<Vec<Option<OutputLayout>>> {
    let leaves = bound_leaves(p, symbols, rank, number_of_streams);
    let eval = |s: ScalarId| -> Result<i64> {
        p.ir.evaluate(s, &|leaf| leaves[leaf.index()])
            .ok_or_else(|| {
                Error::Internal(format!(
                    "cannot evaluate {} on rank {rank}",
                    p.ir.display_scalar(s)
                ))
            })
    };
    p.outputs
        .iter()
        .map(|&t| {
            if !mesh_devices(&p.ir, t, p.world_size).contains(&rank) {
                return Ok(None);
            }
            Ok(Some((p.ir.tensor(t).dtype, local_shape_of(p, t, &eval)?)))
        })
        .collect()
}
