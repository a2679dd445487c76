//! Streamed products that are only summed kept whole
//! (`LowerOptions::pipelines.summed_products_whole`): a product with a Stream axis that
//! nothing but sums read, each over its Stream axis (a backward's weight gradient, the sum
//! over the gathered blocks) or over its DIDx axis (a ReduceScatter's partial), loses its
//! Stream annotation before the pipelines are made. It then runs as one GEMM over every
//! block after the loops (`FuseEpilogue` folds the sum over blocks into it), its collective
//! whole, while the loops keep the rest: in the MLP block's backward, the GEMM of the
//! gathered dY (`dH = dY W2^T gelu'(H)`) stays a pipeline fed by the gather, and dW2, dW1
//! and dx follow it as whole GEMMs whose collectives run aside (`collectives_aside`).

use crate::ir::{Fusion, Op, ParallelType, ReduceOp};

/// Strips the Stream annotation of every such product of `f` (see the module
/// documentation); returns whether anything changed.
pub fn keep_summed_products_whole(f: &mut Fusion) -> bool {
    let mut whole = Vec::new();
    for e in f.exprs() {
        let product = e.output;
        if !matches!(e.op, Op::Matmul | Op::Linear | Op::Gemm { .. }) || f.is_output(product) {
            continue;
        }
        let visible = f.visible_axes(product);
        let position = |p: ParallelType| {
            (f.find_parallel_axis(product, p)).and_then(|at| visible.iter().position(|&v| v == at))
        };
        let Some(stream) = position(ParallelType::Stream) else {
            continue;
        };
        let didx = position(ParallelType::DIDx);
        let uses = f.uses(product);
        let summed = !uses.is_empty()
            && uses.iter().all(|&r| {
                matches!(&f.expr(r).op, Op::Reduction { op: ReduceOp::Sum, axes }
                    if axes.contains(&stream) || didx.is_some_and(|d| axes.contains(&d)))
            });
        if summed {
            whole.extend(
                (f.tensor(product).axes.iter().copied())
                    .filter(|&d| f.iter_domain(d).parallel == ParallelType::Stream),
            );
        }
    }
    for d in &whole {
        f.iter_domain_mut(*d).parallel = ParallelType::Serial;
    }
    !whole.is_empty()
}
