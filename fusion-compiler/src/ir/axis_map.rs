//! Which input axis each output axis of an expression comes from.
//!
//! Sharding propagation, resharding detection and the stream lowering all ask the same
//! question ("does this output axis come from that input axis?"); this module answers it
//! once per op.

use super::fusion::Fusion;
use super::op::{Expr, Op};

/// For each input of an expression, the input axis (index into its `axes`) behind each
/// output axis, or `None` when the output axis does not come from that input.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AxisMap {
    pub per_input: Vec<Vec<Option<usize>>>,
}

impl AxisMap {
    /// The axis of input `input` that output axis `out_axis` comes from.
    pub fn producer_axis(&self, input: usize, out_axis: usize) -> Option<usize> {
        self.per_input[input].get(out_axis).copied().flatten()
    }

    /// The output axes that come from axis `in_axis` of input `input` (two for a split).
    pub fn consumer_axes(&self, input: usize, in_axis: usize) -> Vec<usize> {
        self.per_input[input]
            .iter()
            .enumerate()
            .filter(|(_, m)| **m == Some(in_axis))
            .map(|(j, _)| j)
            .collect()
    }
}

/// Computes the axis map of `e` in fusion `f`.
pub fn axis_map(f: &Fusion, e: &Expr) -> AxisMap {
    let out_rank = f.tensor(e.output).axes.len();
    let vis: Vec<Vec<usize>> = e.inputs.iter().map(|&t| f.visible_axes(t)).collect();
    let mut per_input: Vec<Vec<Option<usize>>> = vec![vec![None; out_rank]; e.inputs.len()];
    match &e.op {
        Op::Set | Op::Unary(_) | Op::Cast | Op::Reduction { .. } | Op::Slice { .. } => {
            for (j, m) in per_input[0].iter_mut().enumerate() {
                *m = vis[0].get(j).copied();
            }
        }
        Op::Binary(_) => {
            for (v, m) in vis.iter().zip(per_input.iter_mut()) {
                let offset = out_rank.saturating_sub(v.len());
                for (j, slot) in m.iter_mut().enumerate().skip(offset) {
                    *slot = v.get(j - offset).copied();
                }
            }
        }
        Op::Broadcast { flags } => {
            let mut next = 0;
            for (j, &is_new) in flags.iter().enumerate() {
                if !is_new {
                    per_input[0][j] = vis[0].get(next).copied();
                    next += 1;
                }
            }
        }
        Op::Select { axis, .. } => {
            for (j, m) in per_input[0].iter_mut().enumerate() {
                let src = if j < *axis { j } else { j + 1 };
                *m = vis[0].get(src).copied();
            }
        }
        Op::Split { axis, .. } => {
            for (j, m) in per_input[0].iter_mut().enumerate() {
                let src = match j {
                    j if j <= *axis => j,
                    j if j == axis + 1 => *axis,
                    j => j - 1,
                };
                *m = vis[0].get(src).copied();
            }
        }
        Op::Permute { perm } => {
            for (m, &src) in per_input[0].iter_mut().zip(perm) {
                *m = vis[0].get(src).copied();
            }
        }
        Op::Matmul => map_matmul(&vis, out_rank, &mut per_input),
        Op::Linear | Op::Gemm { linear: true, .. } => map_linear(&vis, out_rank, &mut per_input),
        Op::Gemm { linear: false, .. } => {
            map_matmul(&vis[..2], out_rank, &mut per_input[..2]);
            // A bias `[N]` maps onto the output's N axis, before the contracted one.
            if let (Some(b), Some(n)) = (vis.get(2), out_rank.checked_sub(2)) {
                if let Some(&last) = b.last() {
                    per_input[2][n] = Some(last);
                }
            }
        }
    }
    AxisMap { per_input }
}

/// Output of matmul: `[batch.., M?, N?, rK]` (M absent for 1-D A, N absent for 1-D B).
fn map_matmul(vis: &[Vec<usize>], out_rank: usize, per_input: &mut [Vec<Option<usize>>]) {
    let (a, b) = (&vis[0], &vis[1]);
    let (a_batch, a_m, a_k) = if a.len() >= 2 {
        (&a[..a.len() - 2], Some(a[a.len() - 2]), a[a.len() - 1])
    } else {
        (&a[..0], None, a[0])
    };
    let (b_batch, b_k, b_n) = if b.len() >= 2 {
        (&b[..b.len() - 2], b[b.len() - 2], Some(b[b.len() - 1]))
    } else {
        (&b[..0], b[0], None)
    };
    let nb = out_rank - 1 - usize::from(a_m.is_some()) - usize::from(b_n.is_some());
    for j in 0..nb {
        if j + a_batch.len() >= nb {
            per_input[0][j] = Some(a_batch[j + a_batch.len() - nb]);
        }
        if j + b_batch.len() >= nb {
            per_input[1][j] = Some(b_batch[j + b_batch.len() - nb]);
        }
    }
    let mut j = nb;
    if let Some(m) = a_m {
        per_input[0][j] = Some(m);
        j += 1;
    }
    if let Some(n) = b_n {
        per_input[1][j] = Some(n);
        j += 1;
    }
    per_input[0][j] = Some(a_k);
    per_input[1][j] = Some(b_k);
}

/// Output of linear: `[batch.., N, rK]` from x `[batch.., K]`, w `[N, K]`, bias `[N]`.
fn map_linear(vis: &[Vec<usize>], out_rank: usize, per_input: &mut [Vec<Option<usize>>]) {
    let x = &vis[0];
    let nb = x.len() - 1;
    for j in 0..nb {
        per_input[0][j] = Some(x[j]);
    }
    per_input[1][nb] = Some(vis[1][0]);
    per_input[0][out_rank - 1] = Some(x[nb]);
    per_input[1][out_rank - 1] = Some(vis[1][1]);
    if vis.len() > 2 {
        per_input[2][nb] = Some(vis[2][0]);
    }
}
