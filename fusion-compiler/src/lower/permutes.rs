//! Where a permute stays a view and where it is copied.
//!
//! A permute is a strided view of its input. GEMMs take such views as they are: the CPU
//! GEMM any strides, cuBLAS a matrix with a unit stride along either axis as a transposed
//! operand. So a permute whose every reader is a `matmul`/`linear` operand (directly or
//! through a `broadcast`) and that keeps the input's last axis among the last two stays a
//! view: `matmul(transpose(x, 1, 2), dy)` costs no copy. So does a Stream-parallel permute
//! whose every reader is such a GEMM streamed along the permute's Stream axis (a weight
//! gradient's transposed activation): the stream loop of each reader views the permuted
//! chunk of the input's chunk. Every other permute becomes a view followed by a copy (`set`) into the
//! permuted layout, which also carries its Stream axis (a view read whole cannot be
//! Stream-parallel) and what the fusion returns.

use crate::ir::{axis_map, Expr, ExprId, Fusion, Op, ParallelType, TensorId};

/// Rewrites every permute of `order` (the lowering's schedule, reshardings inserted) that
/// must be copied into `view = permute(x); y = set(view)`, keeping `y` (its annotations,
/// its readers, its place among the outputs) as the copy.
pub fn materialize_permutes(f: &mut Fusion, order: &mut Vec<ExprId>) {
    let mut i = 0;
    while i < order.len() {
        let id = order[i];
        let e = f.expr(id).clone();
        i += 1;
        let Op::Permute { perm } = &e.op else {
            continue;
        };
        if stays_view(f, order, perm, e.output) {
            continue;
        }
        let y = e.output;
        let domains = f
            .tensor(y)
            .axes
            .iter()
            .map(|&d| {
                let mut d = f.iter_domain(d).clone();
                if d.parallel == ParallelType::Stream {
                    d.parallel = ParallelType::Serial;
                }
                d
            })
            .collect();
        let (dtype, mesh) = (f.tensor(y).dtype, f.tensor(y).mesh.clone());
        let name = f.tensor(y).name.as_ref().map(|n| format!("{n}_view"));
        let view = f.new_tensor(name, dtype, domains, mesh);
        f.expr_mut(id).output = view;
        f.set_definition(view, id);
        let copy = f.add_expr(Expr {
            op: Op::Set,
            inputs: vec![view],
            output: y,
        });
        order.insert(i, copy);
        i += 1;
    }
}

/// True when permute result `y` can stay a view: it is not returned, and its permutation
/// is the identity or GEMM operands are all that read it with the matrix keeping a unit
/// stride; a Stream-parallel one only where each of those GEMMs streams and slices it.
fn stays_view(f: &Fusion, order: &[ExprId], perm: &[usize], y: TensorId) -> bool {
    if !internal(f, y) {
        return false;
    }
    let r = perm.len();
    let identity = perm.iter().enumerate().all(|(j, &a)| j == a);
    let unit_stride = r >= 2 && (perm[r - 1] == r - 1 || perm[r - 2] == r - 1);
    if f.find_parallel_axis(y, ParallelType::Stream).is_some() {
        return unit_stride && only_streamed_gemm_operand(f, order, y);
    }
    identity || (unit_stride && only_gemm_operand(f, order, y))
}

/// True when `t` is read, and only as an operand of `matmul`/`linear` expressions whose
/// Stream axis is `t`'s (each stream loop then slices it).
fn only_streamed_gemm_operand(f: &Fusion, order: &[ExprId], t: TensorId) -> bool {
    let own = f.find_parallel_axis(t, ParallelType::Stream);
    let readers: Vec<&Expr> = (order.iter().map(|&id| f.expr(id)))
        .filter(|e| e.inputs.contains(&t))
        .collect();
    let sliced = |e: &Expr| {
        let map = axis_map(f, e);
        f.find_parallel_axis(e.output, ParallelType::Stream)
            .is_some_and(|s| {
                (e.inputs.iter().enumerate())
                    .filter(|&(_, &x)| x == t)
                    .all(|(i, _)| i < 2 && map.producer_axis(i, s) == own)
            })
    };
    !readers.is_empty()
        && (readers.iter()).all(|e| matches!(e.op, Op::Matmul | Op::Linear) && sliced(e))
}

/// True for a tensor the fusion neither returns nor aliases.
fn internal(f: &Fusion, t: TensorId) -> bool {
    !f.is_output(t) && !f.aliases().iter().any(|&(o, i)| o == t || i == t)
}

/// True when `t` is not returned and every expression of `order` that reads it is a
/// `matmul`/`linear` reading it as an operand (not a bias), or a broadcast whose result is
/// read only that way.
fn only_gemm_operand(f: &Fusion, order: &[ExprId], t: TensorId) -> bool {
    if !internal(f, t) {
        return false;
    }
    let readers: Vec<&Expr> = order
        .iter()
        .map(|&id| f.expr(id))
        .filter(|e| e.inputs.contains(&t))
        .collect();
    !readers.is_empty()
        && readers.iter().all(|e| match e.op {
            Op::Matmul | Op::Linear => !e.inputs[2..].contains(&t),
            Op::Broadcast { .. } => only_gemm_operand(f, order, e.output),
            _ => false,
        })
}
