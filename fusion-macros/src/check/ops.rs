//! Shape inference per op, mirroring `fusion_core::builder::FusionBuilder` rule for rule
//! (axis order, broadcasting, DIDx propagation, Stream clearing, the tensors each op
//! creates), so that the generated builder calls produce exactly the checked fusion.
//! Annotations live in [`super::annotate`].

use super::annotate::Fact;
use super::dims::DimId;
use super::model::{Ax, Binary, DType, Ex, Kind, Model, Op, Par, Reduce, Tid, Unary};
use crate::parse::DimOp;
use crate::span::SpanRange;

type Result<T> = std::result::Result<T, syn::Error>;

impl Model {
    /// A copy; a resharding when the result is annotated differently.
    pub fn set(&mut self, x: Tid, span: SpanRange) -> Result<Tid> {
        let dtype = self.tv(x).dtype;
        self.pointwise(Op::Set, &[x], dtype, span)
    }

    /// An elementwise function.
    pub fn unary(&mut self, u: Unary, x: Tid, span: SpanRange) -> Result<Tid> {
        let dtype = self.tv(x).dtype;
        self.pointwise(Op::Unary(u), &[x], dtype, span)
    }

    /// A dtype conversion.
    pub fn cast(&mut self, x: Tid, dtype: DType, span: SpanRange) -> Result<Tid> {
        self.pointwise(Op::Cast(dtype), &[x], dtype, span)
    }

    /// An elementwise function of two operands with broadcasting.
    pub fn binary(&mut self, op: Binary, a: Tid, b: Tid, span: SpanRange) -> Result<Tid> {
        self.same_dtype(op.name(), a, b, span)?;
        let dtype = self.tv(a).dtype;
        self.pointwise(Op::Binary(op), &[a, b], dtype, span)
    }

    /// `sum`/`max` over visible axes.
    pub fn reduce(
        &mut self,
        op: Reduce,
        x: Tid,
        axes: &[(usize, SpanRange)],
        span: SpanRange,
    ) -> Result<Tid> {
        let name = Op::Reduce { op, axes: vec![] }.name();
        let vis = self.visible(x);
        for (i, &(a, s)) in axes.iter().enumerate() {
            if axes[..i].iter().any(|&(b, _)| b == a) {
                return Err(s.error(format!(
                    "{name}: axis {a} is listed twice; list each reduced axis once"
                )));
            }
            if a >= vis.len() {
                return Err(s.error(out_of_range(name, a, &self.what(x), vis.len())));
            }
            if self.axis(x, vis[a]).par == Par::Stream {
                return Err(s.error(format!(
                    "{name}: axis {a} of {} is Stream-parallel, and a reduction over a Stream \
                     axis cannot be pipelined; reduce another axis",
                    self.what(x)
                )));
            }
        }
        let idx: Vec<usize> = axes.iter().map(|a| a.0).collect();
        let axes_out = vis
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let src = self.axis(x, p).clone();
                if idx.contains(&i) {
                    Ax {
                        extent: src.extent,
                        par: Par::Serial,
                        kind: Kind::Red,
                        origin: None,
                    }
                } else {
                    src
                }
            })
            .collect();
        let (dtype, mesh) = (self.tv(x).dtype, self.tv(x).mesh.clone());
        let out = self.new_tensor(dtype, axes_out, mesh, span, name);
        self.push_expr(Op::Reduce { op, axes: idx }, vec![x], out, span);
        self.clear_stream(out);
        Ok(out)
    }

    /// Inserts broadcast axes where `flags` is true.
    pub fn broadcast(
        &mut self,
        x: Tid,
        flags: &[bool],
        flags_span: SpanRange,
        span: SpanRange,
    ) -> Result<Tid> {
        let vis = self.visible(x);
        let kept = flags.iter().filter(|&&b| !b).count();
        if kept != vis.len() {
            return Err(flags_span.error(format!(
                "broadcast: {} has rank {}, but these flags keep {kept} axes; give one `false` \
                 per axis of the input and a `true` per new axis",
                self.what(x),
                vis.len()
            )));
        }
        let one = self.dims.constant(1);
        let mut next = vis.iter();
        let mut axes = Vec::new();
        for &is_new in flags {
            if is_new {
                axes.push(Ax {
                    extent: one,
                    par: Par::Serial,
                    kind: Kind::Bcast,
                    origin: None,
                });
            } else {
                let &p = next.next().expect("counted above");
                axes.push(self.axis(x, p).clone());
            }
        }
        let out = self.new_like(x, None, axes, span, "broadcast");
        self.push_expr(
            Op::Broadcast {
                flags: flags.to_vec(),
            },
            vec![x],
            out,
            span,
        );
        self.clear_stream(out);
        Ok(out)
    }

    /// Batched matrix product (torch semantics).
    pub fn matmul(&mut self, a: Tid, b: Tid, span: SpanRange) -> Result<Tid> {
        self.same_dtype("matmul", a, b, span)?;
        let (va, vb) = (self.visible(a), self.visible(b));
        for (t, v) in [(a, &va), (b, &vb)] {
            if v.is_empty() {
                return Err(span.error(format!(
                    "matmul: {} has rank 0; matmul needs operands of rank 1 or more",
                    self.what(t)
                )));
            }
        }
        let a_k = *va.last().expect("non-empty");
        let b_k = if vb.len() >= 2 {
            vb[vb.len() - 2]
        } else {
            vb[0]
        };
        let (ea, eb) = (self.axis(a, a_k).extent, self.axis(b, b_k).extent);
        if ea != eb {
            return Err(span.error(format!(
                "matmul: the contracted axes differ: axis {} of {} has extent `{}` but axis {} \
                 of {} has extent `{}`; the last axis of the left operand must equal the \
                 second-to-last axis of the right one (`[.., m, k] x [.., k, n]`)",
                self.vis_index(a, a_k),
                self.what(a),
                self.dims.show(ea),
                self.vis_index(b, b_k),
                self.what(b),
                self.dims.show(eb)
            )));
        }
        self.note_equal(ea, eb, span);
        let a_batch: Vec<usize> = if va.len() >= 2 {
            va[..va.len() - 2].to_vec()
        } else {
            vec![]
        };
        let b_batch: Vec<usize> = if vb.len() >= 2 {
            vb[..vb.len() - 2].to_vec()
        } else {
            vec![]
        };
        let nb = a_batch.len().max(b_batch.len());
        let mut axes = Vec::new();
        for j in 0..nb {
            let pa = (j + a_batch.len() >= nb).then(|| a_batch[j + a_batch.len() - nb]);
            let pb = (j + b_batch.len() >= nb).then(|| b_batch[j + b_batch.len() - nb]);
            axes.push(self.broadcast_axis("matmul", (a, pa), (b, pb), span)?);
        }
        if va.len() >= 2 {
            axes.push(self.axis(a, va[va.len() - 2]).clone());
        }
        if vb.len() >= 2 {
            axes.push(self.axis(b, vb[vb.len() - 1]).clone());
        }
        axes.push(Ax {
            extent: ea,
            par: Par::Serial,
            kind: Kind::Red,
            origin: None,
        });
        self.reject_sharded_contraction("matmul", &[(a, a_k), (b, b_k)], span)?;
        let out = self.new_like(a, None, axes, span, "matmul");
        let e = self.push_expr(Op::Matmul, vec![a, b], out, span);
        self.propagate_didx(e);
        self.clear_stream(out);
        Ok(out)
    }

    /// `x @ w^T (+ bias)`.
    pub fn linear(&mut self, x: Tid, w: Tid, bias: Option<Tid>, span: SpanRange) -> Result<Tid> {
        self.same_dtype("linear", x, w, span)?;
        let (vx, vw) = (self.visible(x), self.visible(w));
        if vx.is_empty() {
            return Err(span.error(format!(
                "linear: {} has rank 0; the input needs at least one axis (`[.., k]`)",
                self.what(x)
            )));
        }
        if vw.len() != 2 {
            return Err(span.error(format!(
                "linear: the weight {} has rank {}; it must be `[n, k]` (rank 2)",
                self.what(w),
                vw.len()
            )));
        }
        let x_k = *vx.last().expect("non-empty");
        self.check_extents(
            "linear",
            (x, x_k),
            (w, vw[1]),
            span,
            "; the last axis of the input must equal the last axis of the weight \
             (`[.., k]` and `[n, k]`)",
        )?;
        let mut inputs = vec![x, w];
        if let Some(bias) = bias {
            self.same_dtype("linear", x, bias, span)?;
            let vb = self.visible(bias);
            if vb.len() != 1 {
                return Err(span.error(format!(
                    "linear: the bias {} has rank {}; it must be `[n]` (rank 1)",
                    self.what(bias),
                    vb.len()
                )));
            }
            self.check_extents(
                "linear",
                (bias, vb[0]),
                (w, vw[0]),
                span,
                "; the bias must have the weight's first extent (`[n]` for `[n, k]`)",
            )?;
            inputs.push(bias);
        }
        let mut axes: Vec<Ax> = vx[..vx.len() - 1]
            .iter()
            .map(|&p| self.axis(x, p).clone())
            .collect();
        axes.push(self.axis(w, vw[0]).clone());
        axes.push(Ax {
            extent: self.axis(x, x_k).extent,
            par: Par::Serial,
            kind: Kind::Red,
            origin: None,
        });
        self.reject_sharded_contraction("linear", &[(x, x_k), (w, vw[1])], span)?;
        let out = self.new_like(x, None, axes, span, "linear");
        let e = self.push_expr(Op::Linear, inputs, out, span);
        self.propagate_didx(e);
        self.clear_stream(out);
        Ok(out)
    }

    /// Picks one index of an axis.
    pub fn select(
        &mut self,
        x: Tid,
        axis: (usize, SpanRange),
        index: (DimId, SpanRange),
        span: SpanRange,
    ) -> Result<Tid> {
        let pos = self.visible_pos(x, axis, "select")?;
        self.reject_parallel_view("select", x, axis, pos)?;
        let ext = self.axis(x, pos).extent;
        if let (Some(i), Some(n)) = (self.dims.value(index.0), self.dims.value(ext)) {
            if i < 0 || i >= n {
                return Err(index.1.error(format!(
                    "select: index {i} is out of range for axis {} of {} (extent {n}); use \
                     0..{n}",
                    axis.0,
                    self.what(x)
                )));
            }
            self.facts.push((Fact::Lt(i, n), index.1));
        }
        let axes = self
            .visible(x)
            .into_iter()
            .filter(|&p| p != pos)
            .map(|p| self.axis(x, p).clone())
            .collect();
        let out = self.new_like(x, None, axes, span, "select");
        self.push_expr(
            Op::Select {
                axis: axis.0,
                index: index.0,
            },
            vec![x],
            out,
            span,
        );
        self.clear_stream(out);
        Ok(out)
    }

    /// Keeps `start..stop` of an axis.
    pub fn slice(
        &mut self,
        x: Tid,
        axis: (usize, SpanRange),
        start: (DimId, SpanRange),
        stop: (DimId, SpanRange),
        span: SpanRange,
    ) -> Result<Tid> {
        let pos = self.visible_pos(x, axis, "slice")?;
        self.reject_parallel_view("slice", x, axis, pos)?;
        let ext = self.axis(x, pos).extent;
        if let (Some(s), Some(e)) = (self.dims.value(start.0), self.dims.value(stop.0)) {
            let n = self.dims.value(ext);
            if s < 0 || e < s || n.is_some_and(|n| e > n) {
                return Err(start.1.to(stop.1).error(format!(
                    "slice: the range {s}..{e} does not fit axis {} of {} (extent `{}`); use \
                     0 <= start <= stop <= extent",
                    axis.0,
                    self.what(x),
                    self.dims.show(ext)
                )));
            }
            self.facts.push((Fact::Le(s, e), start.1.to(stop.1)));
            if let Some(n) = n {
                self.facts.push((Fact::Le(e, n), stop.1));
            }
        }
        let len = self.dims.binary(DimOp::Sub, stop.0, start.0);
        let axes = self
            .visible(x)
            .into_iter()
            .map(|p| {
                let mut a = self.axis(x, p).clone();
                if p == pos {
                    a.extent = len;
                }
                a
            })
            .collect();
        let out = self.new_like(x, None, axes, span, "slice");
        self.push_expr(
            Op::Slice {
                axis: axis.0,
                start: start.0,
                stop: stop.0,
            },
            vec![x],
            out,
            span,
        );
        self.clear_stream(out);
        Ok(out)
    }

    /// Splits an axis of extent `n` into `[outer, n / outer]`.
    pub fn split(
        &mut self,
        x: Tid,
        axis: (usize, SpanRange),
        outer: (DimId, SpanRange),
        span: SpanRange,
    ) -> Result<Tid> {
        let pos = self.visible_pos(x, axis, "split")?;
        let src = self.axis(x, pos).clone();
        if src.par != Par::Serial {
            return Err(axis.1.error(format!(
                "split: axis {} of {} is {}, and a {} axis must be a whole logical axis; split \
                 a serial axis",
                axis.0,
                self.what(x),
                src.par.name(),
                src.par.name()
            )));
        }
        if let (Some(n), Some(o)) = (self.dims.value(src.extent), self.dims.value(outer.0)) {
            if o <= 0 || n % o != 0 {
                return Err(outer.1.error(format!(
                    "split: axis {} of {} has extent {n}, which is not divisible by {o}; the \
                     outer extent must divide it",
                    axis.0,
                    self.what(x)
                )));
            }
            self.facts.push((Fact::Divides { n, by: o }, outer.1));
        }
        let inner = self.dims.binary(DimOp::Div, src.extent, outer.0);
        let mut axes = Vec::new();
        for p in self.visible(x) {
            if p == pos {
                axes.push(Ax::new(outer.0));
                axes.push(Ax::new(inner));
            } else {
                axes.push(self.axis(x, p).clone());
            }
        }
        let out = self.new_like(x, None, axes, span, "split");
        self.push_expr(
            Op::Split {
                axis: axis.0,
                outer: outer.0,
            },
            vec![x],
            out,
            span,
        );
        self.clear_stream(out);
        Ok(out)
    }

    // ----- helpers -----

    fn push_expr(&mut self, op: Op, inputs: Vec<Tid>, output: Tid, span: SpanRange) -> usize {
        self.exprs.push(Ex {
            op,
            inputs,
            output,
            span,
        });
        self.exprs.len() - 1
    }

    fn pointwise(&mut self, op: Op, inputs: &[Tid], dtype: DType, span: SpanRange) -> Result<Tid> {
        let name = op.name();
        let ranks: Vec<usize> = inputs.iter().map(|&t| self.visible(t).len()).collect();
        let out_rank = *ranks.iter().max().expect("at least one input");
        let mut axes = Vec::with_capacity(out_rank);
        for j in 0..out_rank {
            let mut acc: Option<(Tid, usize)> = None;
            for (&t, &r) in inputs.iter().zip(&ranks) {
                if j + r < out_rank {
                    continue;
                }
                let p = self.visible(t)[j + r - out_rank];
                acc = Some(match acc {
                    None => (t, p),
                    Some(prev) => {
                        self.broadcast_axis(name, (prev.0, Some(prev.1)), (t, Some(p)), span)?;
                        if self.is_broadcast_like(prev.0, prev.1) {
                            (t, p)
                        } else {
                            prev
                        }
                    }
                });
            }
            let (t, p) = acc.expect("some input covers every output axis");
            let mut a = self.axis(t, p).clone();
            if a.kind == Kind::Red {
                a.kind = Kind::Iter;
            }
            axes.push(a);
        }
        let out = self.new_like(inputs[0], Some(dtype), axes, span, name);
        let e = self.push_expr(op, inputs.to_vec(), out, span);
        self.propagate_didx(e);
        self.clear_stream(out);
        Ok(out)
    }

    fn new_like(
        &mut self,
        like: Tid,
        dtype: Option<DType>,
        axes: Vec<Ax>,
        span: SpanRange,
        made_by: &'static str,
    ) -> Tid {
        let dtype = dtype.unwrap_or(self.tv(like).dtype);
        let mesh = self.tv(like).mesh.clone();
        self.new_tensor(dtype, axes, mesh, span, made_by)
    }

    fn clear_stream(&mut self, t: Tid) {
        for a in &mut self.tv_mut(t).axes {
            if a.par == Par::Stream {
                a.par = Par::Serial;
            }
        }
    }

    fn propagate_didx(&mut self, e: usize) {
        let ex = self.exprs[e].clone();
        let map = self.axis_map(&ex);
        for j in 0..self.tv(ex.output).axes.len() {
            if self.axis(ex.output, j).kind == Kind::Red {
                self.tv_mut(ex.output).axes[j].par = Par::Serial;
                continue;
            }
            let sharded = ex
                .inputs
                .iter()
                .zip(&map)
                .any(|(&t, m)| m[j].is_some_and(|p| self.axis(t, p).par == Par::DIDx));
            let a = &mut self.tv_mut(ex.output).axes[j];
            if sharded {
                a.par = Par::DIDx;
            } else if a.par == Par::DIDx {
                a.par = Par::Serial;
            }
        }
    }

    fn broadcast_axis(
        &mut self,
        op: &str,
        a: (Tid, Option<usize>),
        b: (Tid, Option<usize>),
        span: SpanRange,
    ) -> Result<Ax> {
        match (a.1, b.1) {
            (Some(pa), Some(pb)) => {
                if self.is_broadcast_like(a.0, pa) {
                    return Ok(self.axis(b.0, pb).clone());
                }
                if self.is_broadcast_like(b.0, pb) {
                    return Ok(self.axis(a.0, pa).clone());
                }
                self.check_extents(
                    op,
                    (a.0, pa),
                    (b.0, pb),
                    span,
                    "; elementwise operands must have equal extents on each axis (aligned from \
                     the right), or extent 1 to broadcast",
                )?;
                Ok(self.axis(a.0, pa).clone())
            }
            (Some(pa), None) => Ok(self.axis(a.0, pa).clone()),
            (None, Some(pb)) => Ok(self.axis(b.0, pb).clone()),
            (None, None) => Err(span.error(format!("{op}: no operand covers an axis"))),
        }
    }

    fn check_extents(
        &mut self,
        op: &str,
        a: (Tid, usize),
        b: (Tid, usize),
        span: SpanRange,
        hint: &str,
    ) -> Result<()> {
        let (ea, eb) = (self.axis(a.0, a.1).extent, self.axis(b.0, b.1).extent);
        if ea == eb {
            self.note_equal(ea, eb, span);
            return Ok(());
        }
        Err(span.error(format!(
            "{op}: axis {} of {} has extent `{}` but axis {} of {} has extent `{}`{hint}",
            self.vis_index(a.0, a.1),
            self.what(a.0),
            self.dims.show(ea),
            self.vis_index(b.0, b.1),
            self.what(b.0),
            self.dims.show(eb)
        )))
    }

    /// Records a literal equality for the generated `static_assertions`.
    pub(super) fn note_equal(&mut self, a: DimId, b: DimId, span: SpanRange) {
        if let (Some(x), Some(y)) = (self.dims.value(a), self.dims.value(b)) {
            self.facts.push((Fact::Eq(x, y), span));
        }
    }

    fn same_dtype(&self, op: &str, a: Tid, b: Tid, span: SpanRange) -> Result<()> {
        let (da, db) = (self.tv(a).dtype, self.tv(b).dtype);
        if da != db {
            return Err(span.error(format!(
                "{op}: {} is `{}` but {} is `{}`; convert one with `cast(x, {})`",
                self.what(a),
                self.dtype_name(da),
                self.what(b),
                self.dtype_name(db),
                self.dtype_name(da)
            )));
        }
        Ok(())
    }

    fn reject_sharded_contraction(
        &self,
        op: &str,
        ks: &[(Tid, usize)],
        span: SpanRange,
    ) -> Result<()> {
        for &(t, p) in ks {
            if self.axis(t, p).par == Par::DIDx {
                return Err(span.error(format!(
                    "{op} contracts axis {} of {}, which is DIDx-sharded; make the partial \
                     sums explicit: give the operands a leading batch axis sharded on DIDx, \
                     then `sum` it",
                    self.vis_index(t, p),
                    self.what(t)
                )));
            }
        }
        Ok(())
    }

    fn reject_parallel_view(
        &self,
        op: &str,
        x: Tid,
        axis: (usize, SpanRange),
        pos: usize,
    ) -> Result<()> {
        let p = self.axis(x, pos).par;
        if p != Par::Serial {
            return Err(axis.1.error(format!(
                "{op}: axis {} of {} is {}; {op} works on serial axes, so reshard it first \
                 (`let y: Tensor<..> = x;` with the axis serial)",
                axis.0,
                self.what(x),
                p.name()
            )));
        }
        Ok(())
    }

    fn visible_pos(&self, t: Tid, axis: (usize, SpanRange), op: &str) -> Result<usize> {
        let vis = self.visible(t);
        vis.get(axis.0).copied().ok_or_else(|| {
            axis.1
                .error(out_of_range(op, axis.0, &self.what(t), vis.len()))
        })
    }
}

fn out_of_range(op: &str, axis: usize, what: &str, rank: usize) -> String {
    if rank == 0 {
        return format!("{op}: axis {axis} is out of range: {what} has rank 0 (no axes)");
    }
    format!(
        "{op}: axis {axis} is out of range for {what} of rank {rank}; use an axis in 0..={}",
        rank - 1
    )
}
