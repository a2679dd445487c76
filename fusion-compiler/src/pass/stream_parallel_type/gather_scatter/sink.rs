//! The order of a step's expressions: elementwise ops right before their first reader, so
//! a chain of them becomes one kernel and an activation after a GEMM folds into its
//! epilogue. A read of a permute view is a read of what it views.

use std::collections::HashSet;

use crate::ir::{Expr, Op, TensorId};
use crate::pass::stream_parallel_type::permute_views::source;
use crate::pass::stream_parallel_type::views::PermuteViews;

/// `exprs` (in a valid order) with every elementwise op (unary, binary, cast) moved down
/// to just before the first expression that reads it (or a permute view of it, `views`);
/// the order stays valid.
pub(super) fn sink_elementwise(
    exprs: Vec<(Expr, usize)>,
    views: &PermuteViews,
) -> Vec<(Expr, usize)> {
    let reads = |e: &Expr| -> Vec<TensorId> {
        (e.inputs.iter())
            .flat_map(|&t| [t, source(views, t)])
            .collect()
    };
    let elementwise = |e: &Expr| matches!(e.op, Op::Unary(_) | Op::Binary(_) | Op::Cast);
    let mut out = Vec::with_capacity(exprs.len());
    let mut pending: Vec<(Expr, usize)> = Vec::new();
    for (e, s) in exprs {
        if elementwise(&e) {
            pending.push((e, s));
            continue;
        }
        // The pending ops `e` reads, directly or through each other, in their order.
        let mut needed: HashSet<TensorId> = reads(&e).into_iter().collect();
        let mut take = vec![false; pending.len()];
        for (k, (p, _)) in pending.iter().enumerate().rev() {
            if needed.contains(&p.output) {
                take[k] = true;
                needed.extend(reads(p));
            }
        }
        let mut keep = Vec::new();
        for ((p, ps), t) in pending.drain(..).zip(take) {
            if t {
                out.push((p, ps));
            } else {
                keep.push((p, ps));
            }
        }
        pending = keep;
        out.push((e, s));
    }
    out.extend(pending);
    out
}
