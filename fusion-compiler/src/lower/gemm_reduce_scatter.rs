//! The ReduceScatter of a GEMM's product inside the GEMM
//! (`LowerOptions::pipelines.scattered_gemm`): the unpipelined GEMM + ReduceScatter of a
//! row-sharded output (`C = ReduceScatter(A B)` with A and B sharded on K) as one
//! persistent GEMM per rank ([`Node::GemmReduceScatter`]) whose epilogue adds each finished
//! tile of the partial product into the output of the rank that owns the tile's rows,
//! instead of a GEMM followed by a ReduceScatter. The product is never stored whole, and the
//! first tiles travel while the last are computed (on 4 H100s 1.04-1.09x of the GEMM alone
//! at D = 2, 1.15-1.43x at D = 4, where the tiles alone take as long as the GEMM:
//! docs/DECISIONS.md, "The storer warps take the owners in turn").
//!
//! It applies at the top level of a program (a pipelined GEMM + ReduceScatter is a stream
//! loop, left alone) to a plain product `[m, k] @ [k, n]` (no epilogue, bias or
//! accumulation; A's leading axes are rows, B one matrix for all of them) whose product
//! nothing but a summing ReduceScatter of the whole world reads, on any transport, that
//! scatters the product's outermost axis (rank j receives the contiguous rows
//! `[j m / D, (j + 1) m / D)`), at the sizes [`gemm_reduce_scatter_fits`] names. The
//! runtime lowers with it only where the device runs the kernel; elsewhere the node runs
//! as the GEMM, then the ReduceScatter. Each choice is noted under the program.

use super::gemm_collective::{fuse, gemm_then_collective, local_extents, rewrite_each, Found};
use super::plain_gemm;
use crate::dtype::DType;
use crate::hir::{Communication, CommunicationKind, GemmReduceScatter, HostProgram, Node};
use crate::ir::{Fusion, Op, ParallelType, ReduceOp, ScalarId};

/// Whether the kernel takes a product of `m` rows, `k` contracted and `n` output columns
/// in `dtype` on a world of `world` ranks: bf16 or f16, 2 to 8 ranks (the most whose
/// outputs it adds into), a whole number of rows per rank, `k` and `n` whole 16-byte
/// vectors.
pub fn gemm_reduce_scatter_fits(m: i64, k: i64, n: i64, dtype: DType, world: usize) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && (2..=8).contains(&world)
        && m > 0
        && m % world as i64 == 0
        && k > 0
        && k % 8 == 0
        && n > 0
        && n % 8 == 0
}

/// Replaces every GEMM + ReduceScatter of `program` it applies to (see the module
/// documentation) with one [`Node::GemmReduceScatter`] when `enabled`, noting each.
pub fn choose_gemm_reduce_scatter(
    program: &mut HostProgram,
    enabled: bool,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) {
    if enabled {
        rewrite_each(program, &|p, at| find(p, at, extent), &rewrite);
    }
}

/// Keeps whole the products the scattered GEMM will reduce-scatter, before the stream
/// pipelines are made: a plain bf16 or f16 GEMM's product that is not an output and that
/// nothing but a summing reduction over its DIDx axis reads (a row-parallel GEMM's partial)
/// loses its Stream annotation, so the pipeline pass leaves the GEMM and its ReduceScatter
/// at the top level for [`choose_gemm_reduce_scatter`], while the loops that feed the GEMM
/// (an AllGather + GEMM before it, as in the MLP block) stay pipelined. Returns whether
/// anything changed. A pair the kernel does not take after all (shapes, devices) then runs
/// unpipelined: plan tuning keeps such a candidate only where it measures faster.
pub fn keep_scattered_products_whole(f: &mut Fusion) -> bool {
    let mut whole = Vec::new();
    for e in f.exprs() {
        let product = e.output;
        let t = f.tensor(product);
        let half = matches!(t.dtype, DType::BF16 | DType::F16);
        let streamed: Vec<_> = (t.axes.iter().copied())
            .filter(|&d| f.iter_domain(d).parallel == ParallelType::Stream)
            .collect();
        if !plain_gemm(e) || !half || streamed.is_empty() || f.is_output(product) {
            continue;
        }
        // The reduction lists visible axes.
        let didx = f
            .find_parallel_axis(product, ParallelType::DIDx)
            .and_then(|at| f.visible_axes(product).iter().position(|&v| v == at));
        let uses = f.uses(product);
        let summed_over_didx = match (&uses[..], didx) {
            ([r], Some(axis)) => matches!(
                &f.expr(*r).op,
                Op::Reduction { op: ReduceOp::Sum, axes } if axes.contains(&axis)
            ),
            _ => false,
        };
        if summed_over_didx {
            whole.extend(streamed);
        }
    }
    for d in &whole {
        f.iter_domain_mut(*d).parallel = ParallelType::Serial;
    }
    !whole.is_empty()
}

/// The GEMM + ReduceScatter whose GEMM is at `at`, if the kernel takes it.
fn find(p: &HostProgram, at: usize, extent: &dyn Fn(ScalarId) -> Option<i64>) -> Option<Found> {
    let pair = gemm_then_collective(p, at, CommunicationKind::ReduceScatter)?;
    if !scatters_leading_rows(p, pair.comm, extent) {
        return None;
    }
    let (a, b, product) = (pair.gemm.inputs[0], pair.gemm.inputs[1], pair.gemm.output);
    let a_extents = local_extents(p, a, extent)?;
    let (&k, rows) = a_extents.split_last()?;
    let b_extents = local_extents(p, b, extent)?;
    let [ref batch @ .., k2, n] = b_extents[..] else {
        return None;
    };
    // B one matrix for every row; the product A's rows by B's columns.
    let one_b = batch.iter().all(|&e| e == 1);
    let product_extents = local_extents(p, product, extent)?;
    let shaped = !rows.is_empty() && product_extents == [rows, &[n]].concat();
    let m = rows.iter().product();
    let dtype = p.ir.tensor(a).dtype;
    (k == k2 && one_b && shaped && gemm_reduce_scatter_fits(m, k, n, dtype, p.world_size))
        .then_some(Found {
            comm_at: pair.comm_at,
            shape: [m, k, n],
        })
}

/// Whether `comm` scatters the first axis a rank holds of its input, of one block per rank:
/// seen as `[m, n]`, the product's rows `[j m / D, (j + 1) m / D)` then go to rank `j`.
/// (Axis fields count the stored axes, a DIDx axis among them.)
fn scatters_leading_rows(
    p: &HostProgram,
    comm: &Communication,
    extent: &dyn Fn(ScalarId) -> Option<i64>,
) -> bool {
    let f = &p.ir;
    let stored = f.visible_axes(comm.input);
    let first = stored
        .iter()
        .position(|&pos| f.axis(comm.input, pos).parallel != ParallelType::DIDx);
    let blocks = first.and_then(|i| f.evaluate(f.axis(comm.input, stored[i]).extent, extent));
    first.is_some() && comm.in_scatter_axis == first && blocks == Some(p.world_size as i64)
}

/// Puts one [`Node::GemmReduceScatter`] where the ReduceScatter was (see [`fuse`]) and
/// notes it.
fn rewrite(p: &mut HostProgram, gemm_at: usize, found: Found) {
    let Node::Communication(comm) = &p.body[found.comm_at] else {
        return;
    };
    let output = comm.output;
    fuse(p, gemm_at, found.comm_at, |gemm, comm| {
        Node::GemmReduceScatter(GemmReduceScatter { gemm, comm })
    });
    let [m, k, n] = found.shape;
    p.notes.push(format!(
        "ReduceScatter of `{}` in its GEMM's epilogue ({m} x {k} x {n}): one kernel per rank \
         (LowerOptions::pipelines.scattered_gemm)",
        p.ir.tensor_name(output),
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_takes_whole_row_blocks_of_bf16_and_f16_products() {
        let fits = |m, k, n, dt, world| gemm_reduce_scatter_fits(m, k, n, dt, world);
        assert!(fits(8192, 2048, 8192, DType::BF16, 4));
        assert!(fits(4096, 1024, 4096, DType::F16, 2));
        assert!(fits(24, 8, 8, DType::BF16, 3));
        assert!(fits(64, 64, 64, DType::BF16, 8));
        // f32; one rank or more than 8; rows not a whole block per rank; k or n not a
        // whole number of 8 elements; empty.
        assert!(!fits(8192, 2048, 8192, DType::F32, 4));
        assert!(!fits(8192, 2048, 8192, DType::BF16, 1));
        assert!(!fits(8192, 2048, 8192, DType::BF16, 16));
        assert!(!fits(8190, 2048, 8192, DType::BF16, 4));
        assert!(!fits(8192, 2044, 8192, DType::BF16, 4));
        assert!(!fits(8192, 2048, 8196, DType::BF16, 4));
        assert!(!fits(0, 2048, 8192, DType::BF16, 4));
        assert!(!fits(8192, 0, 8192, DType::BF16, 4));
        assert!(!fits(8192, 2048, 0, DType::BF16, 4));
    }
}
