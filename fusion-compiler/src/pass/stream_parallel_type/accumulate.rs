//! Sums over a loop's Stream axis folded into the loop as accumulating GEMMs.
//!
//! `w = sum(g, s)` where `g = matmul(a, b)` is computed in a stream loop along its Stream
//! axis `s` and nothing else reads `g` (a weight gradient: the sum over the gathered
//! chunks of `chunk^T dy`): the loop never stores `g`. Its first iteration's GEMM writes
//! `w`, every later one adds onto it (`w = a @ b + w`, `beta = 1`; `Accumulations`), so
//! each chunk's GEMM runs as soon as the chunk is there and no reduction is left after the
//! loop. The GEMMs that add onto one `w` run one after another: on the caller's stream in
//! order where the loop computes there (compute-first loops, the ring, the gather-scatter
//! pipeline), else each iteration's waits for the previous iteration's pool stream first.

use std::collections::{HashMap, HashSet};

use super::group::LoopGroup;
use crate::hir::{for_each_node, HostProgram, Node};
use crate::ir::{Expr, Op, ReduceOp, TensorId};

/// How many times the program's nodes read each tensor, and which tensors the program
/// returns or aliases (a sum may fold only a result nothing else reads).
pub(super) struct Readers {
    count: HashMap<TensorId, usize>,
    pinned: HashSet<TensorId>,
}

impl Readers {
    pub(super) fn new(p: &HostProgram) -> Self {
        let mut count: HashMap<TensorId, usize> = HashMap::new();
        for_each_node(&p.body, &mut |n| {
            let read = match n {
                Node::Compute(e) => e.inputs.clone(),
                other => other.tensors(),
            };
            for t in read {
                *count.entry(t).or_default() += 1;
            }
        });
        let pinned = (p.outputs.iter().copied())
            .chain(p.aliases.iter().flat_map(|&(o, i)| [o, i]))
            .collect();
        Readers { count, pinned }
    }
}

/// The loop among `loops` (last first) that folds `e`, when `e` sums one loop's GEMM
/// result over exactly its Stream axis and is that result's only reader.
pub(super) fn folding_loop<'a>(
    p: &HostProgram,
    mut loops: impl Iterator<Item = &'a mut LoopGroup>,
    readers: &Readers,
    e: &Expr,
) -> Option<&'a mut LoopGroup> {
    let Op::Reduction {
        op: ReduceOp::Sum,
        axes,
    } = &e.op
    else {
        return None;
    };
    let x = e.inputs[0];
    let f = &p.ir;
    if axes.len() != 1
        || readers.count.get(&x) != Some(&1)
        || readers.pinned.contains(&x)
        || f.tensor(x).mesh != f.tensor(e.output).mesh
        || f.tensor(x).dtype != f.tensor(e.output).dtype
    {
        return None;
    }
    let stream = f.visible_axes(x).get(axes[0]).copied();
    loops.find(|g| {
        g.exprs.iter().any(|(d, s)| {
            d.output == x && Some(*s) == stream && matches!(d.op, Op::Matmul) && d.inputs.len() == 2
        })
    })
}
