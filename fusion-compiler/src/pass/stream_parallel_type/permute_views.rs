//! Stream-parallel permutes that stay views (`lower::permutes` keeps one where every
//! reader is a GEMM that slices it, e.g. a weight gradient's transposed activation). Such
//! a permute is no loop expression: each stream loop that slices it views the permuted
//! slice of its input's slice (`Slicer::slice`; a gathered chunk is read transposed where
//! it arrived), and a node outside the loops that reads it whole gets the whole view right
//! before it.

use super::views::PermuteViews;
use crate::hir::{HostProgram, Node};
use crate::ir::{Op, ParallelType, TensorId};

/// The top-level permutes of `body` whose result has a Stream axis.
pub(super) fn collect(p: &HostProgram, body: &[Node]) -> PermuteViews {
    (body.iter())
        .filter_map(|n| match n {
            Node::Compute(e)
                if matches!(e.op, Op::Permute { .. })
                    && p.ir
                        .find_parallel_axis(e.output, ParallelType::Stream)
                        .is_some() =>
            {
                Some((e.output, e.clone()))
            }
            _ => None,
        })
        .collect()
}

/// `t`, or for a permute view the tensor it views.
pub(super) fn source(views: &PermuteViews, t: TensorId) -> TensorId {
    views.get(&t).map_or(t, |e| e.inputs[0])
}
