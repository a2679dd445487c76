//! Sub-chunked P2P reduce-scatter pipelines ([`LowerOptions::reduce_scatter_subchunks`]).
//!
//! With `c` sub-chunks the loop runs `D * c` iterations in `c` rounds. Round `r` is the
//! usual ring of `D` steps (this device's own chunk last) over rows
//! `[r * e / c, (r + 1) * e / c)` of every chunk, `e` being the extent of the first
//! axis after the Stream axis (the GEMM's M rows). The round's last step waits for the
//! round's receives and sums that row range of the slots into the output. So after the
//! last GEMM only one round's last transfer and one round's sum are left, instead of a
//! whole chunk's transfer and the sum of every partial.
//!
//! [`LowerOptions::reduce_scatter_subchunks`]: crate::lower::LowerOptions::reduce_scatter_subchunks

use std::collections::HashMap;

use super::ReduceScatterFold;
use crate::hir::{HostProgram, Node};
use crate::ir::{
    axis_map, Expr, Fusion, IterKind, MemoryType, Op, ParallelType, ScalarId, ScalarOp, TensorId,
};

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

/// The row-range views of one iteration: sub-chunk `sub` of `count`.
pub(super) struct RowSlicing {
    pub rows: HashMap<TensorId, usize>,
    /// The round of the current iteration (`i / D`).
    pub sub: ScalarId,
    pub count: ScalarId,
}

impl RowSlicing {
    /// `[sub * e / c, (sub + 1) * e / c)` for an axis of extent `e`.
    pub fn range(&self, f: &mut Fusion, extent: ScalarId) -> (ScalarId, ScalarId) {
        let one = f.constant(1);
        let next = f.binary(ScalarOp::Add, self.sub, one);
        let lo = f.binary(ScalarOp::Mul, self.sub, extent);
        let hi = f.binary(ScalarOp::Mul, next, extent);
        (
            f.binary(ScalarOp::Div, lo, self.count),
            f.binary(ScalarOp::Div, hi, self.count),
        )
    }

    /// The largest row range of an axis of extent `e`: `ceil(e / c)` (a slot's size).
    pub fn slot_extent(&self, f: &mut Fusion, extent: ScalarId) -> ScalarId {
        let one = f.constant(1);
        let c_minus_1 = f.binary(ScalarOp::Sub, self.count, one);
        let padded = f.binary(ScalarOp::Add, extent, c_minus_1);
        f.binary(ScalarOp::Div, padded, self.count)
    }

    /// Emits `Slice` of `t` along `pos` (an index into its `axes`): this iteration's row
    /// range of an axis of extent `extent`, or, with `from_zero`, a range of the same
    /// length starting at 0 (for a slot buffer sized by [`Self::slot_extent`]).
    pub fn emit(
        &self,
        p: &mut HostProgram,
        t: TensorId,
        pos: usize,
        extent: ScalarId,
        from_zero: bool,
        body: &mut Vec<Node>,
    ) -> TensorId {
        self.emit_into(p, t, pos, extent, from_zero, None, body)
    }

    /// [`Self::emit`] binding the view to `out` (a tensor another branch also binds)
    /// instead of a new one.
    #[allow(clippy::too_many_arguments)]
    pub fn emit_into(
        &self,
        p: &mut HostProgram,
        t: TensorId,
        pos: usize,
        extent: ScalarId,
        from_zero: bool,
        out: Option<TensorId>,
        body: &mut Vec<Node>,
    ) -> TensorId {
        let (start, stop) = self.range(&mut p.ir, extent);
        let (start, stop) = if from_zero {
            let len = p.ir.binary(ScalarOp::Sub, stop, start);
            (p.ir.constant(0), len)
        } else {
            (start, stop)
        };
        let len = p.ir.binary(ScalarOp::Sub, stop, start);
        let view = out.unwrap_or_else(|| narrowed(&mut p.ir, t, pos, len));
        let axis =
            p.ir.visible_axes(t)
                .iter()
                .position(|&q| q == pos)
                .expect("row axes are visible");
        body.push(Node::Compute(Expr {
            op: Op::Slice { axis, start, stop },
            inputs: vec![t],
            output: view,
        }));
        view
    }
}

/// A view like `t` whose axis `pos` has extent `extent`.
pub(super) fn narrowed(f: &mut Fusion, t: TensorId, pos: usize, extent: ScalarId) -> TensorId {
    super::derived_tensor(f, t, None, MemoryType::Local, |i, mut d| {
        if i == pos {
            d.extent = extent;
        }
        Some(d)
    })
}
