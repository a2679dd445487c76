//! Weight gradients after their loop: a GEMM that a loop accumulates over its Stream axis
//! (a weight gradient, `accumulate`) runs once after the loop over every block, as one
//! GEMM summed over the blocks, instead of block by block (which reads and writes the sum
//! once per block and cuts the GEMM into blocks of under a few waves). It reads the
//! gathered rows from a buffer of every block, so the loop keeps them whole. Chosen by
//! `LowerOptions::pipelines.weight_gradients` for the gather-scatter pipeline
//! (`gather_scatter::after_loop`), and with `WeightGradients::AfterLoop` for the standard
//! loop of an AllGather ([`split_off`]).

use std::collections::HashSet;

use super::group::LoopGroup;
use super::permute_views::source;
use crate::hir::{HostProgram, Node};
use crate::ir::{axis_map, Epilogue, Expr, Op, TensorId};

/// Whether `(e, s)` of loop `g` can run after it: a GEMM of two operands the loop
/// accumulates over its Stream axis `s` = 0, whose operands the loop slices along their
/// first axis, and (unless `all`) that reads no result of the loop other than its gathered
/// rows `gathered` (a permute view counts as what it views).
pub(super) fn fits(
    p: &HostProgram,
    g: &LoopGroup,
    gathered: &HashSet<TensorId>,
    all: bool,
    (e, s): &(Expr, usize),
) -> bool {
    if !matches!(e.op, Op::Matmul) || e.inputs.len() != 2 || *s != 0 {
        return false;
    }
    let body = &g.exprs;
    let computed = |t: TensorId| {
        let t = source(&g.views, t);
        !gathered.contains(&t) && body.iter().any(|(x, _)| x.output == t)
    };
    let accumulated = g.accumulate.iter().any(|a| a.inputs[0] == e.output);
    let map = axis_map(&p.ir, e);
    let first = (0..2).all(|i| map.producer_axis(i, *s) == Some(0));
    let reads_results = e.inputs.iter().any(|&t| computed(t));
    accumulated && first && (all || !reads_results)
}

/// The tensors the expressions `after` read (a permute view's read is also a read of what
/// it views).
pub(super) fn read_by(g: &LoopGroup, after: &[(Expr, usize)]) -> HashSet<TensorId> {
    (after.iter())
        .flat_map(|(e, _)| e.inputs.iter().flat_map(|&t| [t, source(&g.views, t)]))
        .collect()
}

/// After loop `g` (its transfers joined on the caller's stream): the expressions `after`
/// over every block, each accumulated GEMM as one GEMM summed over the blocks into its
/// sum, a permute view one reads made whole right before it.
pub(super) fn emit(g: &LoopGroup, after: &[(Expr, usize)], nodes: &mut Vec<Node>) {
    let mut viewed = HashSet::new();
    for (e, _) in after {
        for t in &e.inputs {
            if let Some(v) = g.views.get(t).filter(|_| viewed.insert(*t)) {
                nodes.push(Node::Compute(v.clone()));
            }
        }
        match g.accumulate.iter().find(|a| a.inputs[0] == e.output) {
            Some(sum) => nodes.push(Node::Compute(Expr {
                op: Op::Gemm {
                    linear: false,
                    epilogue: Epilogue {
                        sums_batch: true,
                        ..Epilogue::default()
                    },
                },
                inputs: e.inputs.clone(),
                output: sum.output,
            })),
            None => nodes.push(Node::Compute(e.clone())),
        }
    }
}

/// For the standard loop of an AllGather (no reduce-scatter): the weight gradients that
/// [`fits`] (reading only gathered rows and inputs), taken out of `g`, and `g` without
/// them (their sums and the permute views only they read gone too). `None` when there is
/// none, or when nothing else would be left in the loop.
pub(super) fn split_off(
    p: &HostProgram,
    g: &LoopGroup,
    gathered: &HashSet<TensorId>,
) -> Option<(LoopGroup, Vec<(Expr, usize)>)> {
    let (after, kept): (Vec<_>, Vec<_>) = (g.exprs.iter().cloned())
        .partition(|x| !gathered.contains(&x.0.output) && fits(p, g, gathered, false, x));
    if after.is_empty() || kept.iter().all(|(e, _)| gathered.contains(&e.output)) {
        return None;
    }
    let mut rest = LoopGroup {
        axis: g.axis,
        extent: g.extent,
        exprs: kept,
        produced: g.produced.clone(),
        reduce_scatter: None,
        accumulate: Vec::new(),
        views: Default::default(),
    };
    let moved: HashSet<TensorId> = after.iter().map(|(e, _)| e.output).collect();
    for (e, _) in &after {
        rest.produced.remove(&e.output);
    }
    rest.accumulate = (g.accumulate.iter())
        .filter(|a| !moved.contains(&a.inputs[0]))
        .cloned()
        .collect();
    let still_read: HashSet<TensorId> = (rest.exprs.iter())
        .flat_map(|(e, _)| e.inputs.iter().copied())
        .collect();
    rest.views = (g.views.iter())
        .filter(|(t, _)| still_read.contains(t))
        .map(|(t, v)| (*t, v.clone()))
        .collect();
    Some((rest, after))
}
