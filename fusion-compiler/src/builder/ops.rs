//! The builder's ops: shape inference, DIDx propagation and the per-op checks.

use super::{FusionBuilder, LiteralFact};
use crate::dtype::DTypeSpec;
use crate::error::{AxisRef, Culprit, DTypeRef, Error, Result};
use crate::ir::{
    axis_map, BinaryOp, IterDomain, IterKind, Op, ParallelType, ReduceOp, ScalarId, ScalarOp,
    TensorId, UnaryOp,
};

/// What elementwise operands (and batch axes) need.
const BROADCAST_HINT: &str = "; elementwise operands must have equal extents on each axis \
                              (aligned from the right), or extent 1 to broadcast";

impl FusionBuilder {
    /// A copy; a resharding when the result is annotated differently.
    pub fn set(&mut self, x: TensorId) -> Result<TensorId> {
        let dtype = self.dtype(x);
        self.pointwise(Op::Set, &[x], dtype)
    }

    /// An elementwise function of one operand.
    pub fn unary(&mut self, op: UnaryOp, x: TensorId) -> Result<TensorId> {
        let dtype = self.dtype(x);
        self.pointwise(Op::Unary(op), &[x], dtype)
    }

    /// Converts to `dtype`.
    pub fn cast(&mut self, x: TensorId, dtype: impl Into<DTypeSpec>) -> Result<TensorId> {
        let dtype = self.known(dtype.into())?;
        self.pointwise(Op::Cast, &[x], dtype)
    }

    /// An elementwise function of two operands, broadcasting size-1 and broadcast axes and
    /// right-aligning operands of lower rank.
    pub fn binary(&mut self, op: BinaryOp, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.same_dtype(op.name(), a, b)?;
        let dtype = self.dtype(a);
        self.pointwise(Op::Binary(op), &[a, b], dtype)
    }

    /// `a + b`.
    pub fn add(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Add, a, b)
    }

    /// `a * b`.
    pub fn mul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.binary(BinaryOp::Mul, a, b)
    }

    /// Reduces visible axes `axes` with `op`; they remain as reduction axes.
    pub fn reduce(&mut self, op: ReduceOp, x: TensorId, axes: &[usize]) -> Result<TensorId> {
        let name = op.name();
        let vis = self.f.visible_axes(x);
        if axes.is_empty() {
            return Err(Error::Argument {
                op: name.into(),
                reason: "list at least one axis to reduce".into(),
                culprit: Culprit::Arg(1),
            });
        }
        for (k, &a) in axes.iter().enumerate() {
            let at = Culprit::Element { arg: 1, index: k };
            if axes[..k].contains(&a) {
                return Err(Error::Argument {
                    op: name.into(),
                    reason: format!("axis {a} is listed twice; list each reduced axis once"),
                    culprit: at,
                });
            }
            self.visible_pos(x, a, name, at)?;
            // A sum over a Stream axis adds up the loop's chunks (lowering accumulates them
            // as they come); any other reduction would need every chunk at once.
            if op != ReduceOp::Sum && self.f.axis(x, vis[a]).parallel == ParallelType::Stream {
                return Err(Error::Parallelization {
                    tensor: self.f.tensor_name(x),
                    axis: Some(a),
                    reason: format!(
                        "{name} over a Stream axis cannot be pipelined; reduce another axis"
                    ),
                    culprit: Some(at),
                });
            }
        }
        let mut domains = Vec::with_capacity(vis.len());
        for (i, &p) in vis.iter().enumerate() {
            let src = self.f.axis(x, p).clone();
            domains.push(if axes.contains(&i) {
                IterDomain {
                    extent: src.extent,
                    parallel: ParallelType::Serial,
                    kind: IterKind::Reduction,
                }
            } else {
                src
            });
        }
        let out = self.new_like(x, None, domains);
        let axes = axes.to_vec();
        self.define(Op::Reduction { op, axes }, vec![x], out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Sum over visible axes.
    pub fn sum(&mut self, x: TensorId, axes: &[usize]) -> Result<TensorId> {
        self.reduce(ReduceOp::Sum, x, axes)
    }

    /// Inserts broadcast axes (extent 1) where `flags` is true; `flags` covers the output.
    pub fn broadcast(&mut self, x: TensorId, flags: &[bool]) -> Result<TensorId> {
        let vis = self.f.visible_axes(x);
        let kept = flags.iter().filter(|&&b| !b).count();
        if kept != vis.len() {
            return Err(Error::Argument {
                op: "broadcast".into(),
                reason: format!(
                    "`{}` has rank {}, but these flags keep {kept} axes; give one `false` per \
                     axis of the input and a `true` per new axis",
                    self.f.tensor_name(x),
                    vis.len()
                ),
                culprit: Culprit::Arg(1),
            });
        }
        let one = self.f.constant(1);
        let mut next = vis.iter();
        let domains = flags
            .iter()
            .map(|&is_new| match is_new {
                false => self.f.axis(x, *next.next().expect("counted above")).clone(),
                true => IterDomain {
                    extent: one,
                    parallel: ParallelType::Serial,
                    kind: IterKind::Broadcast,
                },
            })
            .collect();
        let out = self.new_like(x, None, domains);
        let flags = flags.to_vec();
        self.define(Op::Broadcast { flags }, vec![x], out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Matrix product with torch semantics: 1-D operands are promoted, batch axes
    /// broadcast; the result ends with the contracted axis as a reduction axis.
    pub fn matmul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.same_dtype("matmul", a, b)?;
        let (va, vb) = (self.f.visible_axes(a), self.f.visible_axes(b));
        for (i, (t, v)) in [(a, &va), (b, &vb)].into_iter().enumerate() {
            if v.is_empty() {
                return Err(self.rank_error("matmul", t, "at least 1", 0, i));
            }
        }
        let a_k = *va.last().expect("non-empty");
        let b_k = if vb.len() >= 2 {
            vb[vb.len() - 2]
        } else {
            vb[0]
        };
        self.check_extents(
            "matmul",
            (a, a_k),
            (b, b_k),
            "; the last axis of the left operand must equal the second-to-last axis of the \
             right one (`[.., m, k] x [.., k, n]`)",
        )?;
        let batch = |v: &[usize]| v[..v.len().saturating_sub(2)].to_vec();
        let (a_batch, b_batch) = (batch(&va), batch(&vb));
        let nb = a_batch.len().max(b_batch.len());
        let mut domains = Vec::new();
        for j in 0..nb {
            let pa = (j + a_batch.len() >= nb).then(|| a_batch[j + a_batch.len() - nb]);
            let pb = (j + b_batch.len() >= nb).then(|| b_batch[j + b_batch.len() - nb]);
            domains.push(self.broadcast_axis("matmul", (a, pa), (b, pb))?);
        }
        if va.len() >= 2 {
            domains.push(self.f.axis(a, va[va.len() - 2]).clone());
        }
        if vb.len() >= 2 {
            domains.push(self.f.axis(b, vb[vb.len() - 1]).clone());
        }
        domains.push(reduction_of(self.f.axis(a, a_k)));
        self.reject_sharded_contraction("matmul", &[(a, a_k), (b, b_k)])?;
        let out = self.new_like(a, None, domains);
        self.define(Op::Matmul, vec![a, b], out);
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    /// `x @ w^T + bias`: x `[.., K]`, w `[N, K]`, bias `[N]`; or a weight with batch axes,
    /// w `[.., N, K]` (a weight per rank: `[d @ DIDx, N, K]`), bias `[.., N]`, which is
    /// `matmul(x, transpose(w))` (+ the bias, broadcast over the rows): the batch axes
    /// broadcast against x's as matmul's do.
    pub fn linear(&mut self, x: TensorId, w: TensorId, bias: Option<TensorId>) -> Result<TensorId> {
        self.same_dtype("linear", x, w)?;
        let (vx, vw) = (self.f.visible_axes(x), self.f.visible_axes(w));
        if vx.is_empty() {
            return Err(self.rank_error("linear", x, "at least 1 (`[.., k]`)", 0, 0));
        }
        if vw.len() > 2 {
            return self.batched_linear(x, w, bias);
        }
        if vw.len() != 2 {
            return Err(self.rank_error(
                "linear",
                w,
                "2 (`[n, k]`) or more (`[.., n, k]`)",
                vw.len(),
                1,
            ));
        }
        let x_k = *vx.last().expect("non-empty");
        self.check_extents(
            "linear",
            (x, x_k),
            (w, vw[1]),
            "; the last axis of the input must equal the last axis of the weight (`[.., k]` \
             and `[n, k]`)",
        )?;
        let mut inputs = vec![x, w];
        if let Some(bias) = bias {
            self.same_dtype("linear", x, bias)?;
            let vbias = self.f.visible_axes(bias);
            if vbias.len() != 1 {
                return Err(self.rank_error("linear", bias, "1 (`[n]`)", vbias.len(), 2));
            }
            self.check_extents(
                "linear",
                (bias, vbias[0]),
                (w, vw[0]),
                "; the bias must have the weight's first extent (`[n]` for `[n, k]`)",
            )?;
            inputs.push(bias);
        }
        let mut domains: Vec<IterDomain> = vx[..vx.len() - 1]
            .iter()
            .map(|&p| self.f.axis(x, p).clone())
            .collect();
        domains.push(self.f.axis(w, vw[0]).clone());
        domains.push(reduction_of(self.f.axis(x, x_k)));
        self.reject_sharded_contraction("linear", &[(x, x_k), (w, vw[1])])?;
        let out = self.new_like(x, None, domains);
        self.define(Op::Linear, inputs, out);
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    /// [`Self::linear`] with a weight `[.., n, k]`: its checks named for `linear`, then
    /// `matmul(x, transpose(w))` and the bias `[.., n]` added across the rows.
    fn batched_linear(
        &mut self,
        x: TensorId,
        w: TensorId,
        bias: Option<TensorId>,
    ) -> Result<TensorId> {
        let (vx, vw) = (self.f.visible_axes(x), self.f.visible_axes(w));
        let rw = vw.len();
        self.check_extents(
            "linear",
            (x, *vx.last().expect("non-empty")),
            (w, vw[rw - 1]),
            "; the last axis of the input must equal the last axis of the weight (`[.., k]` \
             and `[.., n, k]`)",
        )?;
        let x_batch = &vx[..vx.len().saturating_sub(2)];
        let w_batch = &vw[..rw - 2];
        let nb = x_batch.len().max(w_batch.len());
        for j in 0..nb {
            let px = (j + x_batch.len() >= nb).then(|| x_batch[j + x_batch.len() - nb]);
            let pw = (j + w_batch.len() >= nb).then(|| w_batch[j + w_batch.len() - nb]);
            self.broadcast_axis("linear", (x, px), (w, pw))?;
        }
        if let Some(bias) = bias {
            self.same_dtype("linear", x, bias)?;
            let vb = self.f.visible_axes(bias);
            if vb.len() != rw - 1 {
                let want = format!("{} (`[.., n]` for a weight `[.., n, k]`)", rw - 1);
                return Err(self.rank_error("linear", bias, &want, vb.len(), 2));
            }
            self.check_extents(
                "linear",
                (bias, vb[rw - 2]),
                (w, vw[rw - 2]),
                "; the bias must end in the weight's `n` (`[.., n]` for `[.., n, k]`)",
            )?;
            for (j, &pw) in w_batch.iter().enumerate() {
                self.broadcast_axis("linear", (bias, Some(vb[j])), (w, Some(pw)))?;
            }
        }
        let wt = self.transpose(w, rw - 2, rw - 1)?;
        let y = self.matmul(x, wt)?;
        let Some(bias) = bias else {
            return Ok(y);
        };
        if vx.len() == 1 {
            // No rows: the product is `[.., n]` like the bias.
            return self.add(y, bias);
        }
        let rb = rw - 1;
        let mut flags = vec![false; rb];
        flags.insert(rb - 1, true);
        let rows = self.broadcast(bias, &flags)?;
        self.add(y, rows)
    }

    /// Picks index `index` of visible axis `axis`, removing the axis.
    pub fn select(&mut self, x: TensorId, axis: usize, index: ScalarId) -> Result<TensorId> {
        let pos = self.view_axis("select", x, axis)?;
        let ext = self.f.axis(x, pos).extent;
        if let (Some(i), Some(n)) = (self.f.const_value(index), self.f.const_value(ext)) {
            if i < 0 || i >= n {
                return Err(Error::Argument {
                    op: "select".into(),
                    reason: format!(
                        "index {i} is out of range for axis {axis} of `{}` (extent {n}); use \
                         0..{n}",
                        self.f.tensor_name(x)
                    ),
                    culprit: Culprit::Arg(2),
                });
            }
            self.facts.push(LiteralFact::Lt(i, n));
        }
        let domains = self
            .f
            .visible_axes(x)
            .into_iter()
            .filter(|&p| p != pos)
            .map(|p| self.f.axis(x, p).clone())
            .collect();
        let out = self.new_like(x, None, domains);
        self.define(Op::Select { axis, index }, vec![x], out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Keeps `start..stop` of visible axis `axis`.
    pub fn slice(
        &mut self,
        x: TensorId,
        axis: usize,
        start: ScalarId,
        stop: ScalarId,
    ) -> Result<TensorId> {
        let pos = self.view_axis("slice", x, axis)?;
        let ext = self.f.axis(x, pos).extent;
        if let (Some(s), Some(e)) = (self.f.const_value(start), self.f.const_value(stop)) {
            let n = self.f.const_value(ext);
            if s < 0 || e < s || n.is_some_and(|n| e > n) {
                return Err(Error::Argument {
                    op: "slice".into(),
                    reason: format!(
                        "the range {s}..{e} does not fit axis {axis} of `{}` (extent `{:#}`); \
                         use 0 <= start <= stop <= extent",
                        self.f.tensor_name(x),
                        self.f.display_scalar(ext)
                    ),
                    culprit: Culprit::Args { first: 2, last: 3 },
                });
            }
            self.facts.push(LiteralFact::Le(s, e));
            self.facts.extend(n.map(|n| LiteralFact::Le(e, n)));
        }
        let len = self.f.binary(ScalarOp::Sub, stop, start);
        let domains = self
            .f
            .visible_axes(x)
            .into_iter()
            .map(|p| {
                let mut d = self.f.axis(x, p).clone();
                if p == pos {
                    d.extent = len;
                }
                d
            })
            .collect();
        let out = self.new_like(x, None, domains);
        self.define(Op::Slice { axis, start, stop }, vec![x], out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Splits visible axis `axis` of extent `n` into `[outer, n / outer]`.
    pub fn split(&mut self, x: TensorId, axis: usize, outer: ScalarId) -> Result<TensorId> {
        let pos = self.view_axis("split", x, axis)?;
        let src = self.f.axis(x, pos).clone();
        if let (Some(n), Some(o)) = (self.f.const_value(src.extent), self.f.const_value(outer)) {
            if o <= 0 || n % o != 0 {
                return Err(Error::Argument {
                    op: "split".into(),
                    reason: format!(
                        "axis {axis} of `{}` has extent {n}, which is not divisible by {o}; \
                         the outer extent must divide it",
                        self.f.tensor_name(x)
                    ),
                    culprit: Culprit::Arg(2),
                });
            }
            self.facts.push(LiteralFact::Divides { n, by: o });
        }
        let inner = self.f.binary(ScalarOp::Div, src.extent, outer);
        let mut domains = Vec::new();
        for p in self.f.visible_axes(x) {
            if p == pos {
                domains.push(IterDomain::new(outer));
                domains.push(IterDomain::new(inner));
            } else {
                domains.push(self.f.axis(x, p).clone());
            }
        }
        let out = self.new_like(x, None, domains);
        self.define(Op::Split { axis, outer }, vec![x], out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Reorders the visible axes of `x`: result axis `j` is axis `perm[j]` of `x`. Every
    /// axis keeps its extent and parallel type (a DIDx axis stays DIDx where it moves, and
    /// a Stream axis stays Stream). Lowering feeds it to a GEMM as a transposed operand,
    /// without a copy, and copies it elsewhere.
    pub fn permute(&mut self, x: TensorId, perm: &[usize]) -> Result<TensorId> {
        let rank = self.f.visible_axes(x).len();
        if perm.len() != rank {
            return Err(Error::Argument {
                op: "permute".into(),
                reason: format!(
                    "`{}` has rank {rank}, but the permutation lists {} axes; list every axis \
                     of the input once, in the order of the result (`[{}]` keeps them)",
                    self.f.tensor_name(x),
                    perm.len(),
                    (0..rank)
                        .map(|a| a.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                culprit: Culprit::Arg(1),
            });
        }
        for (k, &a) in perm.iter().enumerate() {
            let at = Culprit::Element { arg: 1, index: k };
            self.visible_pos(x, a, "permute", at)?;
            if perm[..k].contains(&a) {
                return Err(Error::Argument {
                    op: "permute".into(),
                    reason: format!(
                        "axis {a} of `{}` is listed twice; a permutation lists each axis \
                         once (here each of 0..{rank})",
                        self.f.tensor_name(x)
                    ),
                    culprit: at,
                });
            }
        }
        Ok(self.reorder(x, perm))
    }

    /// Swaps visible axes `a` and `b` of `x` (the [`FusionBuilder::permute`] doing that;
    /// `a == b` leaves `x`'s axes in place).
    pub fn transpose(&mut self, x: TensorId, a: usize, b: usize) -> Result<TensorId> {
        let rank = self.f.visible_axes(x).len();
        self.visible_pos(x, a, "transpose", Culprit::Arg(1))?;
        self.visible_pos(x, b, "transpose", Culprit::Arg(2))?;
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        Ok(self.reorder(x, &perm))
    }

    // ----- helpers -----

    /// `permute(x, perm)` for a checked permutation.
    fn reorder(&mut self, x: TensorId, perm: &[usize]) -> TensorId {
        let vis = self.f.visible_axes(x);
        let domains = perm
            .iter()
            .map(|&a| self.f.axis(x, vis[a]).clone())
            .collect();
        let out = self.new_like(x, None, domains);
        let perm = perm.to_vec();
        self.define(Op::Permute { perm }, vec![x], out);
        out
    }

    fn pointwise(&mut self, op: Op, inputs: &[TensorId], dtype: DTypeSpec) -> Result<TensorId> {
        let name = op.name();
        let ranks: Vec<usize> = inputs
            .iter()
            .map(|&t| self.f.visible_axes(t).len())
            .collect();
        let out_rank = *ranks.iter().max().expect("at least one input");
        let mut domains = Vec::with_capacity(out_rank);
        for j in 0..out_rank {
            let mut acc: Option<(TensorId, usize)> = None;
            for (&t, &r) in inputs.iter().zip(&ranks) {
                if j + r < out_rank {
                    continue;
                }
                let p = self.f.visible_axes(t)[j + r - out_rank];
                acc = Some(match acc {
                    None => (t, p),
                    Some(prev) => {
                        self.broadcast_axis(&name, (prev.0, Some(prev.1)), (t, Some(p)))?;
                        if self.is_broadcast_like(prev.0, prev.1) {
                            (t, p)
                        } else {
                            prev
                        }
                    }
                });
            }
            let (t, p) = acc.expect("some input covers every output axis");
            let mut d = self.f.axis(t, p).clone();
            if d.kind == IterKind::Reduction {
                d.kind = IterKind::Iteration;
            }
            domains.push(d);
        }
        let out = self.new_like(inputs[0], Some(dtype), domains);
        self.define(op, inputs.to_vec(), out);
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    fn new_like(
        &mut self,
        like: TensorId,
        dtype: Option<DTypeSpec>,
        domains: Vec<IterDomain>,
    ) -> TensorId {
        let dtype = dtype.unwrap_or(self.dtype(like));
        let mesh = self.f.tensor(like).mesh.clone();
        self.new_tensor(None, dtype, domains, mesh)
    }

    /// Outputs are not Stream-parallel until annotated.
    fn clear_stream(&mut self, out: TensorId) {
        for d in self.f.tensor(out).axes.clone() {
            if self.f.iter_domain(d).parallel == ParallelType::Stream {
                self.f.iter_domain_mut(d).parallel = ParallelType::Serial;
            }
        }
    }

    /// An output axis is DIDx when an input axis it comes from is DIDx.
    fn propagate_didx(&mut self, out: TensorId) {
        let e = self
            .f
            .expr(self.f.definition(out).expect("just defined"))
            .clone();
        let map = axis_map(&self.f, &e);
        let axes = self.f.tensor(out).axes.clone();
        for (j, &d) in axes.iter().enumerate() {
            if self.f.iter_domain(d).is_reduction() {
                self.f.iter_domain_mut(d).parallel = ParallelType::Serial;
                continue;
            }
            let sharded = e.inputs.iter().enumerate().any(|(i, &t)| {
                map.producer_axis(i, j)
                    .is_some_and(|p| self.f.axis(t, p).parallel == ParallelType::DIDx)
            });
            let p = &mut self.f.iter_domain_mut(d).parallel;
            if sharded {
                *p = ParallelType::DIDx;
            } else if *p == ParallelType::DIDx {
                *p = ParallelType::Serial;
            }
        }
    }

    /// The output axis of two operand axes that must match or broadcast.
    fn broadcast_axis(
        &mut self,
        op: &str,
        a: (TensorId, Option<usize>),
        b: (TensorId, Option<usize>),
    ) -> Result<IterDomain> {
        match (a.1, b.1) {
            (Some(pa), Some(pb)) => {
                if self.is_broadcast_like(a.0, pa) {
                    return Ok(self.f.axis(b.0, pb).clone());
                }
                if self.is_broadcast_like(b.0, pb) {
                    return Ok(self.f.axis(a.0, pa).clone());
                }
                self.check_extents(op, (a.0, pa), (b.0, pb), BROADCAST_HINT)?;
                Ok(self.f.axis(a.0, pa).clone())
            }
            (Some(pa), None) => Ok(self.f.axis(a.0, pa).clone()),
            (None, Some(pb)) => Ok(self.f.axis(b.0, pb).clone()),
            (None, None) => Err(Error::Invalid(format!("{op}: no operand covers an axis"))),
        }
    }

    fn check_extents(
        &mut self,
        op: &str,
        a: (TensorId, usize),
        b: (TensorId, usize),
        hint: &str,
    ) -> Result<()> {
        let (ea, eb) = (self.f.axis(a.0, a.1).extent, self.f.axis(b.0, b.1).extent);
        if ea == eb {
            self.note_equal(ea, eb);
            return Ok(());
        }
        let side = |(t, p): (TensorId, usize), e: ScalarId| {
            Box::new(AxisRef {
                tensor: self.f.tensor_name(t),
                axis: self.vis_index(t, p),
                extent: format!("{:#}", self.f.display_scalar(e)),
            })
        };
        Err(Error::ExtentMismatch {
            op: op.to_string(),
            lhs: side(a, ea),
            rhs: side(b, eb),
            hint: hint.to_string(),
            culprit: Culprit::Call,
        })
    }

    fn same_dtype(&self, op: &str, a: TensorId, b: TensorId) -> Result<()> {
        let (da, db) = (self.dtype(a), self.dtype(b));
        if da != db {
            let side = |t: TensorId, d| {
                Box::new(DTypeRef {
                    tensor: self.f.tensor_name(t),
                    dtype: self.dtype_name(d),
                })
            };
            return Err(Error::DTypeMismatch {
                op: op.to_string(),
                lhs: side(a, da),
                rhs: side(b, db),
                culprit: Culprit::Call,
            });
        }
        Ok(())
    }

    fn rank_error(
        &self,
        op: &str,
        t: TensorId,
        expected: &str,
        actual: usize,
        arg: usize,
    ) -> Error {
        Error::Rank {
            op: op.into(),
            tensor: self.f.tensor_name(t),
            expected: expected.into(),
            actual,
            culprit: Culprit::Arg(arg),
        }
    }

    /// Contractions over a DIDx axis are rejected; `ks` are (operand, contracted axis).
    fn reject_sharded_contraction(&self, op: &str, ks: &[(TensorId, usize)]) -> Result<()> {
        for (i, &(t, p)) in ks.iter().enumerate() {
            if self.f.axis(t, p).parallel == ParallelType::DIDx {
                return Err(Error::Parallelization {
                    tensor: self.f.tensor_name(t),
                    axis: Some(self.vis_index(t, p)),
                    reason: format!(
                        "{op} contracts this DIDx-sharded axis; make the partial sums explicit: \
                         give the operands a leading batch axis sharded on DIDx, then `sum` it"
                    ),
                    culprit: Some(Culprit::Arg(i)),
                });
            }
        }
        Ok(())
    }

    /// The position of the serial axis a view (`select`, `slice`, `split`) works on.
    fn view_axis(&self, op: &str, x: TensorId, axis: usize) -> Result<usize> {
        let pos = self.visible_pos(x, axis, op, Culprit::Arg(1))?;
        let p = self.f.axis(x, pos).parallel;
        if p != ParallelType::Serial {
            return Err(Error::Parallelization {
                tensor: self.f.tensor_name(x),
                axis: Some(axis),
                reason: format!(
                    "{op} works on serial axes, and this one is {p} (a {p} axis is a whole \
                     logical axis); reshard it first (`let y: Tensor<..> = x;` with the axis \
                     serial)"
                ),
                culprit: Some(Culprit::Arg(1)),
            });
        }
        Ok(pos)
    }

    fn vis_index(&self, t: TensorId, pos: usize) -> usize {
        self.f
            .visible_axes(t)
            .iter()
            .position(|&q| q == pos)
            .unwrap_or(pos)
    }
}

/// The reduction axis a contraction over `d` leaves in its result.
fn reduction_of(d: &IterDomain) -> IterDomain {
    IterDomain {
        extent: d.extent,
        parallel: ParallelType::Serial,
        kind: IterKind::Reduction,
    }
}
