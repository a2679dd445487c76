//! `FuseElementwise`: groups runs of dependent elementwise ops into one `Launch` segment.
//!
//! A run is a maximal sequence of consecutive pointwise compute nodes (local `set`, unary,
//! binary, cast) in one node list, each reading something an earlier node of the run
//! wrote. Broadcasts are views (no kernel) and stay outside segments; segment inputs are
//! broadcast to the iteration shape when the segment runs. A broadcast of a value from
//! before a run does not end the run: it moves before the run's launch (e.g. an RMS norm's
//! `x * x + broadcast(eps)` after `x = cast(a + b)` is one kernel, not two). Values used only inside the run become segment-internal: a fusing
//! backend keeps them in registers instead of memory.

use std::collections::HashSet;

use super::context::{Pass, PassContext};
use crate::error::Result;
use crate::hir::{for_each_node, for_each_node_mut, HostProgram, Node, Segment, SegmentId};
use crate::ir::{Expr, Op, TensorId};

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
        for_each_node_mut(&mut body, &mut |list| {
            fuse_list(list, &mut segments);
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

fn fuse_list(list: &mut Vec<Node>, segments: &mut Vec<Segment>) {
    let old = std::mem::take(list);
    let mut run: Vec<Expr> = Vec::new();
    for node in old {
        match node {
            Node::Compute(e) if broadcast_of_earlier(&e, &run) => list.push(Node::Compute(e)),
            Node::Compute(e) if fusible(&e) => {
                let continues =
                    run.is_empty() || e.inputs.iter().any(|t| run.iter().any(|r| r.output == *t));
                if !continues {
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
