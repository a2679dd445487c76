//! Views and buffers of a stream loop's tensors: the per-iteration slices ([`Slicer`]),
//! permuted ones included, where accumulated GEMM results go ([`Accumulations`]), the row
//! ranges of a sub-chunked loop ([`RowSlicing`]), and the derived tensors they are made of.

use std::collections::HashMap;

use crate::hir::{HostProgram, Node};
use crate::ir::{
    Expr, Fusion, IterDomain, IterKind, MemoryType, Op, ScalarId, ScalarOp, TensorId, TensorView,
};

/// The Stream-parallel permutes a loop reads, by result: `view = permute(source, perm)`
/// (see `permute_views`).
pub(super) type PermuteViews = HashMap<TensorId, Expr>;

/// Creates (once per tensor and axis) the stream slice of a tensor.
pub(super) struct Slicer {
    pub(super) chunk: ScalarId,
    pub(super) pool_index: ScalarId,
    pub(super) zero: ScalarId,
    /// Loop-internal tensors -> their `numberOfStreams`-slot buffers.
    pub(super) small: HashMap<TensorId, TensorId>,
    /// Row ranges of a sub-chunked reduce-scatter pipeline.
    pub(super) rows: Option<RowSlicing>,
    pub(super) cache: HashMap<(TensorId, usize), TensorId>,
    /// Stream-parallel permutes the loop reads: their slices are views of slices.
    pub(super) views: PermuteViews,
    /// GEMM results the loop adds onto sums instead of storing.
    pub(super) accumulate: Accumulations,
}

impl Slicer {
    pub(super) fn slice(
        &mut self,
        p: &mut HostProgram,
        t: TensorId,
        pos: usize,
        body: &mut Vec<Node>,
    ) -> TensorId {
        if let Some(&s) = self.cache.get(&(t, pos)) {
            return s;
        }
        if let Some(view) = self.views.get(&t).cloned() {
            return self.slice_permuted(p, &view, pos, body);
        }
        let (source, index) = match self.small.get(&t) {
            Some(&b) => (b, self.pool_index),
            None => {
                let d = p.ir.axis(t, pos);
                let broadcast =
                    d.kind == IterKind::Broadcast || p.ir.const_value(d.extent) == Some(1);
                (t, if broadcast { self.zero } else { self.chunk })
            }
        };
        let mut s = slice_tensor(&mut p.ir, source, pos);
        body.push(Node::AliasSelect {
            input: source,
            output: s,
            axis: pos,
            index,
        });
        if let Some(rows) = &self.rows {
            if let Some(&q) = rows.rows.get(&t) {
                // The row axis in the slice, and in the full tensor (for its extent).
                let in_slice = if q > pos { q - 1 } else { q };
                let extent = p.ir.axis(t, q).extent;
                let slotted = self.small.contains_key(&t);
                s = rows.emit(p, s, in_slice, extent, slotted, body);
            }
        }
        self.cache.insert((t, pos), s);
        s
    }
}

impl Slicer {
    /// The slice of permute view `view` (`= permute(source, perm)`) along its axis `pos`:
    /// the permute of the source's slice along the axis it comes from.
    fn slice_permuted(
        &mut self,
        p: &mut HostProgram,
        view: &Expr,
        pos: usize,
        body: &mut Vec<Node>,
    ) -> TensorId {
        let Op::Permute { perm } = &view.op else {
            unreachable!("permute views are permutes")
        };
        let (t, src) = (view.output, view.inputs[0]);
        let j = (p.ir.visible_axes(t).iter())
            .position(|&q| q == pos)
            .expect("a permute's axes are visible");
        let from = perm[j];
        let src_pos = p.ir.visible_axes(src)[from];
        let src_slice = self.slice(p, src, src_pos, body);
        // The permutation of the remaining axes, renumbered past the removed one.
        let rest: Vec<usize> = (perm.iter().enumerate())
            .filter(|&(k, _)| k != j)
            .map(|(_, &a)| if a > from { a - 1 } else { a })
            .collect();
        let out = slice_tensor(&mut p.ir, t, pos);
        body.push(Node::Compute(Expr {
            op: Op::Permute { perm: rest },
            inputs: vec![src_slice],
            output: out,
        }));
        self.cache.insert((t, pos), out);
        out
    }
}

/// The GEMM results a loop adds onto sums over its Stream axis instead of storing them
/// (see `accumulate`).
pub(super) struct Accumulations {
    /// GEMM result -> the sum its chunks are added onto.
    pub(super) targets: HashMap<TensorId, TensorId>,
    /// Non-zero at the loop's first iteration (`index == 0`), which writes the sums.
    pub(super) first: ScalarId,
}

impl Accumulations {
    /// The accumulations of the folded sums `sums` of a loop whose index is `index`.
    pub(super) fn new(p: &mut HostProgram, sums: &[Expr], index: ScalarId) -> Self {
        let zero = p.ir.constant(0);
        Accumulations {
            targets: sums.iter().map(|s| (s.inputs[0], s.output)).collect(),
            first: p.ir.binary(ScalarOp::Eq, index, zero),
        }
    }

    /// `IF first: target = a @ b ELSE: target = a @ b + target`.
    pub(super) fn emit(&self, inputs: Vec<TensorId>, target: TensorId, body: &mut Vec<Node>) {
        let gemm = |inputs: Vec<TensorId>| {
            Node::Compute(Expr {
                op: Op::Matmul,
                inputs,
                output: target,
            })
        };
        let onto = inputs.iter().copied().chain([target]).collect();
        body.push(Node::IfThenElse {
            cond: self.first,
            then_body: vec![gemm(inputs)],
            else_body: vec![gemm(onto)],
        });
    }
}

/// A new tensor derived from `t`: each axis mapped by `axis` (`None` drops it).
pub(super) fn derived_tensor(
    f: &mut Fusion,
    t: TensorId,
    name: Option<String>,
    memory: MemoryType,
    axis: impl Fn(usize, IterDomain) -> Option<IterDomain>,
) -> TensorId {
    let src = f.tensor(t).clone();
    let mut axes = Vec::with_capacity(src.axes.len());
    for (i, &d) in src.axes.iter().enumerate() {
        if let Some(dom) = axis(i, f.iter_domain(d).clone()) {
            axes.push(f.add_iter_domain(dom));
        }
    }
    f.add_tensor(TensorView {
        name,
        dtype: src.dtype,
        axes,
        mesh: src.mesh,
        memory,
    })
}

/// A new tensor: `t` without axis `pos`, as a view (`_l_` in dumps).
pub(super) fn slice_tensor(f: &mut Fusion, t: TensorId, pos: usize) -> TensorId {
    derived_tensor(f, t, None, MemoryType::Local, |i, d| {
        (i != pos).then_some(d)
    })
}

/// Emits `AliasSelect` of index `index` of `t`'s axis `pos` into a new view, returned.
pub(super) fn select(
    p: &mut HostProgram,
    t: TensorId,
    pos: usize,
    index: ScalarId,
    body: &mut Vec<Node>,
) -> TensorId {
    let v = slice_tensor(&mut p.ir, t, pos);
    body.push(Node::AliasSelect {
        input: t,
        output: v,
        axis: pos,
        index,
    });
    v
}

/// A new buffer like `t` with the given `(axis, extent)` changes.
pub(super) fn with_axis_extent(
    f: &mut Fusion,
    t: TensorId,
    resized: &[(usize, ScalarId)],
) -> TensorId {
    let name = f.tensor(t).name.as_ref().map(|n| format!("{n}_slots"));
    derived_tensor(f, t, name, MemoryType::Global, |i, mut d| {
        if let Some(&(_, extent)) = resized.iter().find(|(pos, _)| *pos == i) {
            d.extent = extent;
        }
        Some(d)
    })
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
    derived_tensor(f, t, None, MemoryType::Local, |i, mut d| {
        if i == pos {
            d.extent = extent;
        }
        Some(d)
    })
}
