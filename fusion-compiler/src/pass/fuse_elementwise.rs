//! `FuseElementwise`: groups runs of dependent elementwise ops into one `Launch` segment.
//!
//! A run is a maximal sequence of consecutive pointwise compute nodes (local `set`, unary,
//! binary, cast) in one node list, each reading something an earlier node of the run
//! wrote. Broadcasts are views (no kernel) and stay outside segments; segment inputs are
//! broadcast to the iteration shape when the segment runs. A broadcast of a value from
//! before a run does not end the run: it moves before the run's launch (e.g. an RMS norm's
//! `x * x + broadcast(eps)` after `x = cast(a + b)` is one kernel, not two). Values used
//! only inside the run become segment-internal: a fusing backend keeps them in registers
//! instead of memory.
//!
//! A reduction over the trailing axes of a run's value joins the run too, with the
//! broadcast of its result back over those axes, and the run goes on through the ops that
//! read that broadcast (at most [`MAX_ROW_REDUCTIONS`] a run): an RMS norm's residual add,
//! sum of squares and scaling, or a softmax, is one segment, which the runtime runs as one
//! row kernel (`RowProgram`) where the shapes allow. An op reading a reduction itself,
//! rather than its broadcast, starts a new run.

use std::collections::HashSet;

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{for_each_node, for_each_node_mut, HostProgram, Node, Segment, SegmentId};
use crate::ir::{Expr, Fusion, Op, TensorId};

/// The most reductions one segment takes (each is a pass over the row in a row kernel).
pub const MAX_ROW_REDUCTIONS: usize = 4;

/// The fusion pass.
pub struct FuseElementwise;

fn fusible(e: &Expr) -> bool {
    e.op.is_elementwise()
}

impl Pass for FuseElementwise {
    fn name(&self) -> &'static str {
        "FuseElementwise"
    }

    fn run(&self, p: &mut HostProgram, _ctx: &PassContext) -> Result<()> {
        // Tensors bound by something other than their compute node must stay in memory.
        let mut pinned: HashSet<TensorId> = p.outputs.iter().copied().collect();
        for_each_node(&p.body, &mut |n| match n {
            Node::Allocate { tensor } => {
                pinned.insert(*tensor);
            }
            Node::AliasSelect { output, .. } => {
                pinned.insert(*output);
            }
            _ => {}
        });
        let mut body = std::mem::take(&mut p.body);
        let mut segments: Vec<Segment> = Vec::new();
        let ir = &p.ir;
        for_each_node_mut(&mut body, &mut |list| {
            fuse_list(list, &mut segments, ir);
            Ok(())
        })?;
        // Tensors read outside each segment must be segment outputs.
        let mut reads: Vec<(usize, TensorId)> = Vec::new();
        for_each_node(&body, &mut |n| {
            let launch = match n {
                Node::Launch { segment, .. } => Some(segment.index()),
                _ => None,
            };
            for t in n.tensors() {
                reads.push((launch.map_or(usize::MAX, |s| s), t));
            }
        });
        for (i, mut seg) in segments.into_iter().enumerate() {
            let produced: Vec<TensorId> = seg.exprs.iter().map(|e| e.output).collect();
            seg.outputs = produced
                .into_iter()
                .filter(|t| pinned.contains(t) || reads.iter().any(|&(s, r)| s != i && r == *t))
                .collect();
            let id = p.add_segment(seg);
            debug_assert_eq!(id.index(), i);
        }
        // Launch nodes were created with placeholder outputs; fill them in.
        let segs = p.segments.clone();
        for_each_node_mut(&mut body, &mut |list| {
            for n in list.iter_mut() {
                if let Node::Launch {
                    segment, outputs, ..
                } = n
                {
                    *outputs = segs[segment.index()].outputs.clone();
                }
            }
            Ok(())
        })?;
        p.body = body;
        Ok(())
    }
}

/// A broadcast that reads nothing `run` writes: it may run before the run.
fn broadcast_of_earlier(e: &Expr, run: &[Expr]) -> bool {
    matches!(e.op, Op::Broadcast { .. })
        && !run.is_empty()
        && !(e.inputs.iter()).any(|t| run.iter().any(|r| r.output == *t))
}

/// The reduced axes of `e` when it reduces the trailing visible axes of its input.
fn trailing_reduction(e: &Expr, ir: &Fusion) -> Option<usize> {
    let Op::Reduction { axes, .. } = &e.op else {
        return None;
    };
    let rank = ir.visible_axes(e.inputs[0]).len();
    let mut sorted = axes.clone();
    sorted.sort_unstable();
    let k = sorted.len();
    let trailing =
        k > 0 && k <= rank && (sorted.iter().enumerate()).all(|(i, &a)| a == rank - k + i);
    trailing.then_some(k)
}

/// A broadcast of a reduction of `run` back over its reduced axes (`[rows.., 1..]`).
fn broadcast_of_run_reduction(e: &Expr, run: &[Expr], ir: &Fusion) -> bool {
    let Op::Broadcast { flags } = &e.op else {
        return false;
    };
    let Some(red) = run.iter().find(|r| r.output == e.inputs[0]) else {
        return false;
    };
    let Some(k) = trailing_reduction(red, ir) else {
        return false;
    };
    flags.len() >= k && (flags.iter().enumerate()).all(|(i, &new)| new == (i >= flags.len() - k))
}

/// Whether `e` reads a reduction of `run` itself (not its broadcast).
fn reads_run_reduction(e: &Expr, run: &[Expr]) -> bool {
    (e.inputs.iter())
        .any(|t| (run.iter()).any(|r| r.output == *t && matches!(r.op, Op::Reduction { .. })))
}

fn fuse_list(list: &mut Vec<Node>, segments: &mut Vec<Segment>, ir: &Fusion) {
    let old = std::mem::take(list);
    let mut run: Vec<Expr> = Vec::new();
    let reads_run =
        |e: &Expr, run: &[Expr]| (e.inputs.iter()).any(|t| run.iter().any(|r| r.output == *t));
    for node in old {
        match node {
            Node::Compute(e) if broadcast_of_earlier(&e, &run) => list.push(Node::Compute(e)),
            Node::Compute(e) if broadcast_of_run_reduction(&e, &run, ir) => run.push(e),
            Node::Compute(e) if trailing_reduction(&e, ir).is_some() => {
                // Every reduction of a run combines the same rows.
                let rows = |r: &Expr| {
                    let k = trailing_reduction(r, ir).unwrap_or(0);
                    ir.visible_axes(r.inputs[0]).len() - k
                };
                let earlier: Vec<&Expr> = (run.iter())
                    .filter(|r| matches!(r.op, Op::Reduction { .. }))
                    .collect();
                let joins = reads_run(&e, &run)
                    && !reads_run_reduction(&e, &run)
                    && earlier.len() < MAX_ROW_REDUCTIONS
                    && earlier.iter().all(|r| {
                        rows(r) == rows(&e)
                            && trailing_reduction(r, ir) == trailing_reduction(&e, ir)
                    });
                if !joins {
                    flush_run(&mut run, list, segments);
                }
                run.push(e);
            }
            Node::Compute(e) if fusible(&e) => {
                let continues = run.is_empty() || reads_run(&e, &run);
                if !continues || reads_run_reduction(&e, &run) {
                    flush_run(&mut run, list, segments);
                }
                run.push(e);
            }
            other => {
                flush_run(&mut run, list, segments);
                list.push(other);
            }
        }
    }
    flush_run(&mut run, list, segments);
}

/// Emits a run: one `Launch` for two or more ops, the op itself otherwise. Segment outputs
/// are filled in once every segment of the program is known.
fn flush_run(run: &mut Vec<Expr>, list: &mut Vec<Node>, segments: &mut Vec<Segment>) {
    if run.len() < 2 {
        list.extend(run.drain(..).map(Node::Compute));
        return;
    }
    let produced: HashSet<TensorId> = run.iter().map(|e| e.output).collect();
    let mut inputs = Vec::new();
    for e in run.iter() {
        for &t in &e.inputs {
            if !produced.contains(&t) && !inputs.contains(&t) {
                inputs.push(t);
            }
        }
    }
    let id = SegmentId(segments.len() as u32);
    segments.push(Segment {
        exprs: std::mem::take(run),
        inputs: inputs.clone(),
        outputs: Vec::new(),
    });
    list.push(Node::Launch {
        segment: id,
        inputs,
        outputs: Vec::new(),
    });
}
