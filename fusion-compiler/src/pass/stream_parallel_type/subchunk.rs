//! Row ranges of P2P pipelines: sub-chunked reduce-scatters
//! ([`LowerOptions::pipelines.reduce_scatter_subchunks`]) and, at the end, the row axes of
//! a gathering loop ([`gather_rows`]).
//!
//! With `c` sub-chunks the loop runs `D * c` iterations in `c` rounds. Round `r` is the
//! usual ring of `D` steps (this device's own chunk last) over rows
//! `[r * e / c, (r + 1) * e / c)` of every chunk, `e` being the extent of the first
//! axis after the Stream axis (the GEMM's M rows). The round's last step waits for the
//! round's receives and sums that row range of the slots into the output. So after the
//! last GEMM only one round's last transfer and one round's sum are left, instead of a
//! whole chunk's transfer and the sum of every partial.
//!
//! [`LowerOptions::pipelines.reduce_scatter_subchunks`]: crate::lower::LowerOptions::pipelines.reduce_scatter_subchunks

use std::collections::HashMap;

use super::group::{Gather, ReduceScatterFold};
use crate::ir::{axis_map, Expr, Fusion, IterKind, ParallelType, TensorId};

/// Which axis of each loop tensor is split into row ranges, decided once per loop.
#[derive(Clone, Debug)]
pub(super) struct SubChunkPlan {
    pub count: usize,
    /// Tensor -> position (in its `axes`) of the axis split into row ranges.
    pub rows: HashMap<TensorId, usize>,
    /// Position of the row axis in the reduce-scatter output's `axes`.
    pub out_rows: usize,
}

impl SubChunkPlan {
    /// The plan for a loop whose expressions feed the folded reduce-scatter `rs`, or
    /// `None` when some expression does not carry the row axis straight through, or the
    /// transferred partials would not be contiguous row ranges (the pipeline then runs
    /// unsplit).
    pub fn new(
        f: &Fusion,
        exprs: &[(Expr, usize)],
        rs: &ReduceScatterFold,
        count: usize,
    ) -> Option<Self> {
        if count < 2 {
            return None;
        }
        let rows = row_axes(f, exprs)?;
        let x = rs.expr.inputs[0];
        let rx = *rows.get(&x)?;
        let s = f.find_parallel_axis(x, ParallelType::Stream)?;
        if !leads_after_units(f, x, rx, &[s, rs.didx]) {
            return None;
        }
        let map = axis_map(f, &rs.expr);
        let out = rs.expr.output;
        let out_rows =
            (0..f.tensor(out).axes.len()).find(|&o| map.producer_axis(0, o) == Some(rx))?;
        if !leads_after_units(f, out, out_rows, &[rs.out_didx]) {
            return None;
        }
        Some(SubChunkPlan {
            count,
            rows,
            out_rows,
        })
    }
}

/// The row axis of every loop tensor (position in its `axes`), or `None` when some
/// expression does not carry the rows of its output straight through from its sliced
/// inputs, or reads rows of an input the loop does not slice per iteration.
fn row_axes(f: &Fusion, exprs: &[(Expr, usize)]) -> Option<HashMap<TensorId, usize>> {
    let mut rows: HashMap<TensorId, usize> = HashMap::new();
    for (e, s) in exprs {
        let r = row_axis(f, e.output, *s)?;
        let map = axis_map(f, e);
        for (i, &t) in e.inputs.iter().enumerate() {
            let sliced = map.producer_axis(i, *s).is_some();
            let q = map.producer_axis(i, r).filter(|&q| !is_unit(f, t, q));
            match (sliced, q, rows.get(&t)) {
                // A loop tensor whose rows this expression does not carry through.
                (_, None, Some(_)) => return None,
                (_, None, None) => {}
                // Rows of an input the loop does not slice per iteration.
                (false, Some(_), _) => return None,
                (true, Some(q), Some(&known)) if q != known => return None,
                (true, Some(q), _) => {
                    rows.insert(t, q);
                }
            }
        }
        rows.insert(e.output, r);
    }
    Some(rows)
}

/// The row axis of every tensor of a loop that gathers (and does not reduce-scatter), split
/// into `count` ranges ([`LowerOptions::pipelines.allgather_subchunks`]): `None` when
/// `count < 2`, when the rows do not go straight through the loop, or when a gather's row
/// range would not be contiguous in the local shard it sends or in the chunk it receives
/// into (the loop then runs unsplit).
///
/// [`LowerOptions::pipelines.allgather_subchunks`]: crate::lower::LowerOptions::pipelines.allgather_subchunks
pub(super) fn gather_rows(
    f: &Fusion,
    exprs: &[(Expr, usize)],
    gathers: &[Gather],
    count: usize,
) -> Option<HashMap<TensorId, usize>> {
    if count < 2 || gathers.is_empty() {
        return None;
    }
    let rows = row_axes(f, exprs)?;
    for g in gathers {
        let (&qx, &qo) = (rows.get(&g.input)?, rows.get(&g.out)?);
        if !leads_after_units(f, g.input, qx, &[g.in_axis])
            || !leads_after_units(f, g.out, qo, &[g.s])
        {
            return None;
        }
    }
    Some(rows)
}

/// The first serial iteration axis after the Stream axis `s` of `t`.
fn row_axis(f: &Fusion, t: TensorId, s: usize) -> Option<usize> {
    (s + 1..f.tensor(t).axes.len()).find(|&q| {
        let d = f.axis(t, q);
        d.kind == IterKind::Iteration && d.parallel == ParallelType::Serial && !is_unit(f, t, q)
    })
}

/// True for axes of extent 1 where the tensor is stored (broadcast, literal 1, DIDx).
fn is_unit(f: &Fusion, t: TensorId, q: usize) -> bool {
    let d = f.axis(t, q);
    d.kind == IterKind::Broadcast
        || d.parallel == ParallelType::DIDx
        || f.const_value(d.extent) == Some(1)
}

/// True when every stored axis of `t` before `axis`, except those in `skip`, has extent 1,
/// so that a row range of `axis` is contiguous once the `skip` axes are selected.
fn leads_after_units(f: &Fusion, t: TensorId, axis: usize, skip: &[usize]) -> bool {
    (0..axis).all(|q| skip.contains(&q) || f.axis(t, q).is_reduction() || is_unit(f, t, q))
}
