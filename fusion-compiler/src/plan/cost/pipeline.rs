//! What the model charges for a stream loop: each iteration estimated with its index
//! bound, then the iterations flowing through two stages, compute and communication.
//!
//! A body that communicates before its first GEMM (AllGather + GEMM: receive a chunk,
//! multiply it) feeds compute from communication: iteration `i`'s compute starts once its
//! transfer and the previous compute are done. A body that computes first (GEMM +
//! ReduceScatter) feeds communication from compute. Each stage runs one iteration at a
//! time (GEMMs share the SMs; a pipeline's receives land in order). For `n` equal
//! iterations of compute `g` and communication `c` this is `max(n g, n c) + min(g, c)`;
//! an iteration that communicates nothing (the one that keeps its own chunk) adds only its
//! compute. Host time per iteration is added on top.

use super::{Estimate, Model};
use crate::hir::{ForLoop, Node, P2PDirection};
use crate::ir::Op;

/// Iterations estimated one by one at most; later ones repeat the last estimated.
const ITERATIONS_ESTIMATED: usize = 256;

impl Model<'_> {
    /// The estimate of the stream loop `l`.
    pub(super) fn stream_loop(&self, l: &ForLoop) -> Estimate {
        let (start, stop) = (self.value(l.start), self.value(l.stop));
        let first = start.unwrap_or(0);
        let n = match (start, stop) {
            (Some(a), Some(b)) if b > a => (b - a) as usize,
            _ => 1,
        };
        let steps: Vec<Estimate> = (0..n.min(ITERATIONS_ESTIMATED))
            .map(|i| {
                self.indices.borrow_mut().push((l.index, first + i as i64));
                let body = self.nodes(&l.body);
                self.indices.borrow_mut().pop();
                body
            })
            .collect();
        let last = steps.last().copied().unwrap_or_default();
        let all = steps
            .iter()
            .chain(std::iter::repeat_n(&last, n - steps.len()));
        let communicates_first = first_stage(&l.body) == Some(Stage::Communication);
        let (mut compute, mut comm) = (0.0_f64, 0.0_f64);
        let mut total = Estimate::default();
        for s in all {
            let other = (s.seconds - s.gemm_seconds - s.comm_seconds).max(0.0);
            if communicates_first {
                comm += s.comm_seconds;
                compute = compute.max(comm) + s.gemm_seconds + other;
            } else {
                compute += s.gemm_seconds + other;
                comm = comm.max(compute) + s.comm_seconds;
            }
            total += *s;
        }
        Estimate {
            seconds: compute.max(comm) + n as f64 * self.profile.host_per_iteration,
            gemm_seconds: total.gemm_seconds,
            comm_seconds: total.comm_seconds,
            iterations: n + total.iterations,
        }
    }
}

/// The two stages of a pipelined loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Compute,
    Communication,
}

/// Which stage `nodes` use first (in program order, both branches of a condition), if any.
fn first_stage(nodes: &[Node]) -> Option<Stage> {
    nodes.iter().find_map(|n| match n {
        Node::Communication(_) => Some(Stage::Communication),
        Node::P2P(t) if t.direction == P2PDirection::Recv => Some(Stage::Communication),
        Node::Compute(e) if matches!(e.op, Op::Matmul | Op::Linear | Op::Gemm { .. }) => {
            Some(Stage::Compute)
        }
        Node::ForLoop(l) => first_stage(&l.body),
        Node::IfThenElse {
            then_body,
            else_body,
            ..
        } => first_stage(then_body).or_else(|| first_stage(else_body)),
        _ => None,
    })
}
