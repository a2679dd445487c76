//! The builder API: creates inputs and ops with shape inference and checks.
//!
//! The `fusion!` macro expands into calls of this API; it is also the way to build a fusion
//! by hand. Each op infers its output's axes, propagates DIDx sharding from the inputs,
//! and returns an error naming the tensor and axis when the operands do not fit together.

use std::collections::HashSet;

use crate::error::{AxisRef, Error, Result};
use crate::ir::{
    axis_map, BinaryOp, DeviceMesh, Expr, Fusion, IterDomain, IterKind, Op, ParallelType, ReduceOp,
    ScalarId, ScalarOp, TensorId, UnaryOp,
};
use crate::DType;

/// One declared axis: an extent and how it is parallelized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Axis {
    /// The extent: a symbol, a constant or an expression of them.
    pub extent: ScalarId,
    /// How the axis is distributed.
    pub parallel: ParallelType,
}

impl Axis {
    /// A serial axis.
    pub fn serial(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::Serial,
        }
    }

    /// An axis sharded over the mesh (`extent` is the mesh size).
    pub fn didx(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::DIDx,
        }
    }

    /// A stream-parallel axis.
    pub fn stream(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::Stream,
        }
    }
}

/// Builds a [`Fusion`] op by op.
#[derive(Debug, Default)]
pub struct FusionBuilder {
    f: Fusion,
    declared: HashSet<TensorId>,
}

impl FusionBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// The fusion built so far (for inspection).
    pub fn fusion(&self) -> &Fusion {
        &self.f
    }

    /// The named dimension symbol `name`.
    pub fn symbol(&mut self, name: &str) -> ScalarId {
        self.f.symbol(name)
    }

    /// A fresh anonymous dimension symbol (`iN`).
    pub fn anonymous(&mut self) -> ScalarId {
        self.f.fresh_symbol()
    }

    /// A literal extent.
    pub fn constant(&mut self, v: i64) -> ScalarId {
        self.f.constant(v)
    }

    /// `a * b`, `a / b`, ... on extents.
    pub fn scalar_op(&mut self, op: ScalarOp, a: ScalarId, b: ScalarId) -> ScalarId {
        self.f.binary(op, a, b)
    }

    /// A new input on every device of the world.
    pub fn input(&mut self, name: &str, dtype: DType, axes: &[Axis]) -> Result<TensorId> {
        self.input_on(name, dtype, axes, DeviceMesh::World)
    }

    /// A new input living on `mesh`.
    pub fn input_on(
        &mut self,
        name: &str,
        dtype: DType,
        axes: &[Axis],
        mesh: DeviceMesh,
    ) -> Result<TensorId> {
        let domains = axes
            .iter()
            .map(|a| IterDomain {
                extent: a.extent,
                parallel: a.parallel,
                kind: IterKind::Iteration,
            })
            .collect();
        let t = self
            .f
            .new_tensor(Some(name.to_string()), dtype, domains, mesh);
        self.check_annotations(t)?;
        if let Some(ax) = self.f.find_parallel_axis(t, ParallelType::Stream) {
            return Err(Error::Parallelization {
                tensor: name.to_string(),
                axis: Some(ax),
                reason: "inputs cannot be Stream-parallel: a Stream axis is produced chunk by \
                         chunk inside the fusion; declare the input axis serial and put \
                         `@ Stream` on the result"
                    .into(),
            });
        }
        self.f.add_input(t);
        self.declared.insert(t);
        Ok(t)
    }

    /// Gives a tensor a name for error messages (the DSL passes `let` names).
    pub fn name(&mut self, t: TensorId, name: &str) {
        self.f.tensor_mut(t).name = Some(name.to_string());
    }

    /// Places a tensor on an explicit mesh.
    pub fn set_mesh(&mut self, t: TensorId, mesh: DeviceMesh) {
        self.f.tensor_mut(t).mesh = mesh;
    }

    /// Sets the parallel type of a visible axis.
    pub fn parallelize(&mut self, t: TensorId, axis: usize, p: ParallelType) -> Result<()> {
        let pos = self.visible_pos(t, axis, "parallelize")?;
        if self.f.is_input(t) && p == ParallelType::Stream {
            return Err(Error::Parallelization {
                tensor: self.f.tensor_name(t),
                axis: Some(axis),
                reason: "inputs cannot be Stream-parallel".into(),
            });
        }
        let d = self.f.tensor(t).axes[pos];
        self.f.iter_domain_mut(d).parallel = p;
        self.check_annotations(t)
    }

    /// Checks a declared type (`let x: Tensor<dtype, [axes]> = ...`) against the inferred
    /// one and applies its parallel types. Re-declaring an input, an output or an already
    /// declared tensor inserts a `set`, so earlier uses keep their layout; the returned id
    /// is the tensor that carries the declared type.
    pub fn declare(&mut self, t: TensorId, dtype: DType, axes: &[Axis]) -> Result<TensorId> {
        let name = self.f.tensor_name(t);
        let actual = self.f.tensor(t).dtype;
        if actual != dtype {
            return Err(Error::DTypeMismatch {
                op: "declared type".into(),
                lhs: name.clone(),
                lhs_dtype: actual.name(),
                rhs: "declaration".into(),
                rhs_dtype: dtype.name(),
            });
        }
        let vis = self.f.visible_axes(t);
        if vis.len() != axes.len() {
            return Err(Error::Rank {
                op: "declared type".into(),
                tensor: name,
                expected: axes.len().to_string(),
                actual: vis.len(),
            });
        }
        for (i, (&pos, a)) in vis.iter().zip(axes).enumerate() {
            let ext = self.f.axis(t, pos).extent;
            if ext != a.extent {
                return Err(Error::ExtentMismatch {
                    op: "declared type".into(),
                    lhs: Box::new(AxisRef {
                        tensor: name,
                        axis: i,
                        extent: self.f.display_scalar(ext).to_string(),
                    }),
                    rhs: Box::new(AxisRef {
                        tensor: "declaration".into(),
                        axis: i,
                        extent: self.f.display_scalar(a.extent).to_string(),
                    }),
                });
            }
        }
        let target = if self.declared.contains(&t) || self.f.is_output(t) {
            let s = self.set(t)?;
            if let Some(n) = self.f.tensor(t).name.clone() {
                self.name(s, &n);
            }
            s
        } else {
            t
        };
        let vis = self.f.visible_axes(target);
        for (&pos, a) in vis.iter().zip(axes) {
            let d = self.f.tensor(target).axes[pos];
            self.f.iter_domain_mut(d).parallel = a.parallel;
        }
        self.check_annotations(target)?;
        self.declared.insert(target);
        if target == t {
            self.stream_producers(target);
        }
        Ok(target)
    }

    /// Applies `t`'s Stream axis to the intermediates an elementwise `t` is computed from,
    /// so that `let a: Tensor<.., [d @ Stream, ..]> = gelu(matmul(x, w))` streams the
    /// matmul in the same loop instead of computing it whole first. This is also what
    /// settles a matmul that takes DIDx axes from both operands: the annotation names the
    /// one that becomes the Stream axis (gathered chunk by chunk). Only intermediates that
    /// this chain alone uses, that no annotation fixed, and that a matmul, linear or
    /// elementwise op (not a `set`) computes are changed; elementwise ones pass it on.
    fn stream_producers(&mut self, t: TensorId) {
        let Some(id) = self.f.definition(t) else {
            return;
        };
        let e = self.f.expr(id).clone();
        let elementwise = matches!(e.op, Op::Unary(_) | Op::Binary(_) | Op::Cast);
        let Some(s) = self.f.find_parallel_axis(t, ParallelType::Stream) else {
            return;
        };
        if !elementwise {
            return;
        }
        let map = axis_map(&self.f, &e);
        for (i, &u) in e.inputs.iter().enumerate() {
            let Some(q) = map.producer_axis(i, s) else {
                continue;
            };
            let streams = self.f.definition(u).is_some_and(|d| {
                matches!(
                    self.f.expr(d).op,
                    Op::Matmul | Op::Linear | Op::Unary(_) | Op::Binary(_) | Op::Cast
                )
            });
            if !streams
                || self.declared.contains(&u)
                || self.f.is_output(u)
                || self.f.uses(u) != [id]
                || self.is_broadcast_like(u, q)
                || self.f.find_parallel_axis(u, ParallelType::Stream).is_some()
            {
                continue;
            }
            let d = self.f.tensor(u).axes[q];
            self.f.iter_domain_mut(d).parallel = ParallelType::Stream;
            self.stream_producers(u);
        }
    }

    /// Marks a tensor as the next output (an input is copied first).
    pub fn output(&mut self, t: TensorId) -> Result<TensorId> {
        let t = if self.f.is_input(t) || self.f.is_output(t) {
            self.set(t)?
        } else {
            t
        };
        self.f.add_output(t);
        self.declared.insert(t);
        Ok(t)
    }

    /// Declares that output `out` is written in place into input `input`'s buffer.
    pub fn alias_output_to_input(&mut self, out: TensorId, input: TensorId) -> Result<()> {
        if !self.f.is_output(out) || !self.f.is_input(input) {
            return Err(Error::Invalid(format!(
                "alias_output_to_input: `{}` must be an output and `{}` an input",
                self.f.tensor_name(out),
                self.f.tensor_name(input)
            )));
        }
        let (a, b) = (self.f.tensor(out), self.f.tensor(input));
        let same_layout = a.dtype == b.dtype
            && self.f.visible_axes(out).len() == self.f.visible_axes(input).len()
            && self
                .f
                .visible_axes(out)
                .iter()
                .zip(self.f.visible_axes(input))
                .all(|(&p, q)| {
                    let (x, y) = (self.f.axis(out, p), self.f.axis(input, q));
                    x.extent == y.extent
                        && (x.parallel == ParallelType::DIDx) == (y.parallel == ParallelType::DIDx)
                });
        if !same_layout {
            return Err(Error::Invalid(format!(
                "alias_output_to_input: `{}` and `{}` differ in dtype, extents or sharding",
                self.f.tensor_name(out),
                self.f.tensor_name(input)
            )));
        }
        self.f.alias_output_to_input(out, input);
        Ok(())
    }

    /// Finishes the fusion after whole-fusion checks (DESIGN.md section 3).
    pub fn build(self) -> Result<Fusion> {
        let f = self.f;
        if f.outputs().is_empty() {
            return Err(Error::Invalid("a fusion needs at least one output".into()));
        }
        validate(&f)?;
        Ok(f)
    }

    // ----- ops -----

    /// A copy; a resharding when the result is annotated differently.
    pub fn set(&mut self, x: TensorId) -> Result<TensorId> {
        let dtype = self.f.tensor(x).dtype;
        self.pointwise(Op::Set, &[x], dtype)
    }

    /// An elementwise function of one operand.
    pub fn unary(&mut self, op: UnaryOp, x: TensorId) -> Result<TensorId> {
        let dtype = self.f.tensor(x).dtype;
        self.pointwise(Op::Unary(op), &[x], dtype)
    }

    /// Converts to `dtype`.
    pub fn cast(&mut self, x: TensorId, dtype: DType) -> Result<TensorId> {
        self.pointwise(Op::Cast, &[x], dtype)
    }

    /// An elementwise function of two operands, broadcasting size-1 and broadcast axes and
    /// right-aligning operands of lower rank.
    pub fn binary(&mut self, op: BinaryOp, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.same_dtype(op.name(), a, b)?;
        let dtype = self.f.tensor(a).dtype;
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
        let vis = self.f.visible_axes(x);
        let mut sorted = axes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != axes.len() || axes.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: reduction axes {axes:?} of `{}` must be distinct and non-empty",
                op.name(),
                self.f.tensor_name(x)
            )));
        }
        for &a in axes {
            self.visible_pos(x, a, op.name())?;
            if self.f.axis(x, vis[a]).parallel == ParallelType::Stream {
                return Err(Error::Parallelization {
                    tensor: self.f.tensor_name(x),
                    axis: Some(a),
                    reason: format!(
                        "{} over a Stream axis cannot be pipelined; reduce another axis",
                        op.name()
                    ),
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
        let dtype = self.f.tensor(x).dtype;
        let mesh = self.f.tensor(x).mesh.clone();
        let out = self.f.new_tensor(None, dtype, domains, mesh);
        self.f.add_expr(Expr {
            op: Op::Reduction {
                op,
                axes: axes.to_vec(),
            },
            inputs: vec![x],
            output: out,
        });
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
            return Err(Error::Rank {
                op: "broadcast".into(),
                tensor: self.f.tensor_name(x),
                expected: format!("{kept} (the number of false flags)"),
                actual: vis.len(),
            });
        }
        let one = self.f.constant(1);
        let mut next = vis.iter();
        let domains = flags
            .iter()
            .map(|&is_new| {
                if is_new {
                    IterDomain {
                        extent: one,
                        parallel: ParallelType::Serial,
                        kind: IterKind::Broadcast,
                    }
                } else {
                    let &p = next.next().expect("counted above");
                    self.f.axis(x, p).clone()
                }
            })
            .collect();
        let out = self.new_like(x, None, domains);
        self.f.add_expr(Expr {
            op: Op::Broadcast {
                flags: flags.to_vec(),
            },
            inputs: vec![x],
            output: out,
        });
        self.clear_stream(out);
        Ok(out)
    }

    /// Matrix product with torch semantics: 1-D operands are promoted, batch axes
    /// broadcast; the result ends with the contracted axis as a reduction axis.
    pub fn matmul(&mut self, a: TensorId, b: TensorId) -> Result<TensorId> {
        self.same_dtype("matmul", a, b)?;
        let (va, vb) = (self.f.visible_axes(a), self.f.visible_axes(b));
        for (t, v) in [(a, &va), (b, &vb)] {
            if v.is_empty() {
                return Err(Error::Rank {
                    op: "matmul".into(),
                    tensor: self.f.tensor_name(t),
                    expected: "at least 1".into(),
                    actual: 0,
                });
            }
        }
        let a_k = *va.last().expect("non-empty");
        let b_k = if vb.len() >= 2 {
            vb[vb.len() - 2]
        } else {
            vb[0]
        };
        self.check_extents("matmul", (a, a_k), (b, b_k))?;
        let a_batch = if va.len() >= 2 {
            &va[..va.len() - 2]
        } else {
            &va[..0]
        };
        let b_batch = if vb.len() >= 2 {
            &vb[..vb.len() - 2]
        } else {
            &vb[..0]
        };
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
        domains.push(IterDomain {
            extent: self.f.axis(a, a_k).extent,
            parallel: ParallelType::Serial,
            kind: IterKind::Reduction,
        });
        self.reject_sharded_contraction("matmul", &[(a, a_k), (b, b_k)])?;
        let out = self.new_like(a, None, domains);
        self.f.add_expr(Expr {
            op: Op::Matmul,
            inputs: vec![a, b],
            output: out,
        });
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    /// `x @ w^T + bias`: x `[.., K]`, w `[N, K]`, bias `[N]`.
    pub fn linear(&mut self, x: TensorId, w: TensorId, bias: Option<TensorId>) -> Result<TensorId> {
        self.same_dtype("linear", x, w)?;
        let (vx, vw) = (self.f.visible_axes(x), self.f.visible_axes(w));
        if vx.is_empty() {
            return Err(Error::Rank {
                op: "linear".into(),
                tensor: self.f.tensor_name(x),
                expected: "at least 1".into(),
                actual: 0,
            });
        }
        if vw.len() != 2 {
            return Err(Error::Rank {
                op: "linear".into(),
                tensor: self.f.tensor_name(w),
                expected: "2 ([N, K])".into(),
                actual: vw.len(),
            });
        }
        let x_k = *vx.last().expect("non-empty");
        self.check_extents("linear", (x, x_k), (w, vw[1]))?;
        let mut inputs = vec![x, w];
        if let Some(bias) = bias {
            self.same_dtype("linear", x, bias)?;
            let vbias = self.f.visible_axes(bias);
            if vbias.len() != 1 {
                return Err(Error::Rank {
                    op: "linear".into(),
                    tensor: self.f.tensor_name(bias),
                    expected: "1 ([N])".into(),
                    actual: vbias.len(),
                });
            }
            self.check_extents("linear", (bias, vbias[0]), (w, vw[0]))?;
            inputs.push(bias);
        }
        let mut domains: Vec<IterDomain> = vx[..vx.len() - 1]
            .iter()
            .map(|&p| self.f.axis(x, p).clone())
            .collect();
        domains.push(self.f.axis(w, vw[0]).clone());
        domains.push(IterDomain {
            extent: self.f.axis(x, x_k).extent,
            parallel: ParallelType::Serial,
            kind: IterKind::Reduction,
        });
        self.reject_sharded_contraction("linear", &[(x, x_k), (w, vw[1])])?;
        let out = self.new_like(x, None, domains);
        self.f.add_expr(Expr {
            op: Op::Linear,
            inputs,
            output: out,
        });
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    /// Picks index `index` of visible axis `axis`, removing the axis.
    pub fn select(&mut self, x: TensorId, axis: usize, index: ScalarId) -> Result<TensorId> {
        let pos = self.visible_pos(x, axis, "select")?;
        self.reject_parallel_view("select", x, axis, pos)?;
        if let (Some(i), Some(n)) = (
            self.f.const_value(index),
            self.f.const_value(self.f.axis(x, pos).extent),
        ) {
            if i < 0 || i >= n {
                return Err(Error::AxisOutOfRange {
                    op: format!("select index {i}"),
                    tensor: self.f.tensor_name(x),
                    axis: axis as i64,
                    rank: n as usize,
                });
            }
        }
        let domains = self
            .f
            .visible_axes(x)
            .into_iter()
            .filter(|&p| p != pos)
            .map(|p| self.f.axis(x, p).clone())
            .collect();
        let out = self.new_like(x, None, domains);
        self.f.add_expr(Expr {
            op: Op::Select { axis, index },
            inputs: vec![x],
            output: out,
        });
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
        let pos = self.visible_pos(x, axis, "slice")?;
        self.reject_parallel_view("slice", x, axis, pos)?;
        let ext = self.f.axis(x, pos).extent;
        if let (Some(s), Some(e)) = (self.f.const_value(start), self.f.const_value(stop)) {
            let n = self.f.const_value(ext);
            if s < 0 || e < s || n.is_some_and(|n| e > n) {
                return Err(Error::Invalid(format!(
                    "slice: range {s}..{e} does not fit axis {axis} of `{}` (extent {})",
                    self.f.tensor_name(x),
                    self.f.display_scalar(ext)
                )));
            }
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
        self.f.add_expr(Expr {
            op: Op::Slice { axis, start, stop },
            inputs: vec![x],
            output: out,
        });
        self.clear_stream(out);
        Ok(out)
    }

    /// Splits visible axis `axis` of extent `n` into `[outer, n / outer]`.
    pub fn split(&mut self, x: TensorId, axis: usize, outer: ScalarId) -> Result<TensorId> {
        let pos = self.visible_pos(x, axis, "split")?;
        let src = self.f.axis(x, pos).clone();
        if src.parallel != ParallelType::Serial {
            return Err(Error::Parallelization {
                tensor: self.f.tensor_name(x),
                axis: Some(axis),
                reason: format!(
                    "a {} axis must be a whole logical axis and cannot be split",
                    src.parallel
                ),
            });
        }
        if let (Some(n), Some(o)) = (self.f.const_value(src.extent), self.f.const_value(outer)) {
            if o <= 0 || n % o != 0 {
                return Err(Error::Invalid(format!(
                    "split: axis {axis} of `{}` has extent {n}, not divisible by {o}",
                    self.f.tensor_name(x)
                )));
            }
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
        self.f.add_expr(Expr {
            op: Op::Split { axis, outer },
            inputs: vec![x],
            output: out,
        });
        self.clear_stream(out);
        Ok(out)
    }

    // ----- helpers -----

    fn pointwise(&mut self, op: Op, inputs: &[TensorId], dtype: DType) -> Result<TensorId> {
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
        self.f.add_expr(Expr {
            op,
            inputs: inputs.to_vec(),
            output: out,
        });
        self.propagate_didx(out);
        self.clear_stream(out);
        Ok(out)
    }

    fn new_like(
        &mut self,
        like: TensorId,
        dtype: Option<DType>,
        domains: Vec<IterDomain>,
    ) -> TensorId {
        let t = self.f.tensor(like);
        let dtype = dtype.unwrap_or(t.dtype);
        let mesh = t.mesh.clone();
        self.f.new_tensor(None, dtype, domains, mesh)
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

    fn is_broadcast_like(&self, t: TensorId, pos: usize) -> bool {
        let d = self.f.axis(t, pos);
        d.kind == IterKind::Broadcast || self.f.const_value(d.extent) == Some(1)
    }

    /// The output axis of two operand axes that must match or broadcast.
    fn broadcast_axis(
        &self,
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
                self.check_extents(op, (a.0, pa), (b.0, pb))?;
                Ok(self.f.axis(a.0, pa).clone())
            }
            (Some(pa), None) => Ok(self.f.axis(a.0, pa).clone()),
            (None, Some(pb)) => Ok(self.f.axis(b.0, pb).clone()),
            (None, None) => Err(Error::Invalid(format!("{op}: no operand covers an axis"))),
        }
    }

    fn check_extents(&self, op: &str, a: (TensorId, usize), b: (TensorId, usize)) -> Result<()> {
        let (ea, eb) = (self.f.axis(a.0, a.1).extent, self.f.axis(b.0, b.1).extent);
        if ea == eb {
            return Ok(());
        }
        let vis_index = |t: TensorId, p: usize| {
            self.f
                .visible_axes(t)
                .iter()
                .position(|&q| q == p)
                .unwrap_or(p)
        };
        Err(Error::ExtentMismatch {
            op: op.to_string(),
            lhs: Box::new(AxisRef {
                tensor: self.f.tensor_name(a.0),
                axis: vis_index(a.0, a.1),
                extent: self.f.display_scalar(ea).to_string(),
            }),
            rhs: Box::new(AxisRef {
                tensor: self.f.tensor_name(b.0),
                axis: vis_index(b.0, b.1),
                extent: self.f.display_scalar(eb).to_string(),
            }),
        })
    }

    fn same_dtype(&self, op: &str, a: TensorId, b: TensorId) -> Result<()> {
        let (da, db) = (self.f.tensor(a).dtype, self.f.tensor(b).dtype);
        if da != db {
            return Err(Error::DTypeMismatch {
                op: op.to_string(),
                lhs: self.f.tensor_name(a),
                lhs_dtype: da.name(),
                rhs: self.f.tensor_name(b),
                rhs_dtype: db.name(),
            });
        }
        Ok(())
    }

    fn reject_sharded_contraction(&self, op: &str, ks: &[(TensorId, usize)]) -> Result<()> {
        for &(t, p) in ks {
            if self.f.axis(t, p).parallel == ParallelType::DIDx {
                let axis = self.f.visible_axes(t).iter().position(|&q| q == p);
                return Err(Error::Parallelization {
                    tensor: self.f.tensor_name(t),
                    axis,
                    reason: format!(
                        "{op} contracts this DIDx-sharded axis; make the partial sums explicit: \
                         give the operands a leading batch axis sharded on DIDx, then `sum` it"
                    ),
                });
            }
        }
        Ok(())
    }

    fn reject_parallel_view(&self, op: &str, x: TensorId, axis: usize, pos: usize) -> Result<()> {
        let p = self.f.axis(x, pos).parallel;
        if p != ParallelType::Serial {
            return Err(Error::Parallelization {
                tensor: self.f.tensor_name(x),
                axis: Some(axis),
                reason: format!("{op} of a {p} axis is not supported; reshard it first"),
            });
        }
        Ok(())
    }

    fn visible_pos(&self, t: TensorId, axis: usize, op: &str) -> Result<usize> {
        let vis = self.f.visible_axes(t);
        vis.get(axis).copied().ok_or_else(|| Error::AxisOutOfRange {
            op: op.to_string(),
            tensor: self.f.tensor_name(t),
            axis: axis as i64,
            rank: vis.len(),
        })
    }

    fn check_annotations(&self, t: TensorId) -> Result<()> {
        check_tensor_annotations(&self.f, t)
    }
}

/// At most one DIDx and one Stream axis; no parallel reduction axes.
fn check_tensor_annotations(f: &Fusion, t: TensorId) -> Result<()> {
    for p in [ParallelType::DIDx, ParallelType::Stream] {
        let axes: Vec<usize> = f
            .visible_axes(t)
            .iter()
            .enumerate()
            .filter(|(_, &q)| f.axis(t, q).parallel == p)
            .map(|(i, _)| i)
            .collect();
        if axes.len() > 1 {
            let hint = match f.definition(t) {
                Some(e) if p == ParallelType::DIDx && !f.is_input(t) => format!(
                    "; `{}` takes DIDx axes from two operands: annotate its result, or the \
                     elementwise op computed from it, with one of them as the Stream axis \
                     (that operand is then gathered chunk by chunk)",
                    f.expr(e).op.name()
                ),
                _ => String::new(),
            };
            return Err(Error::Parallelization {
                tensor: f.tensor_name(t),
                axis: Some(axes[1]),
                reason: format!(
                    "axes {axes:?} are all {p}; a tensor has at most one {p} axis (1-D mesh){hint}"
                ),
            });
        }
    }
    Ok(())
}

/// Whole-fusion checks: annotations, one DIDx extent per mesh, whole Stream axes.
pub fn validate(f: &Fusion) -> Result<()> {
    let mut world_didx: Option<(TensorId, usize, ScalarId)> = None;
    for i in 0..f.tensor_count() {
        let t = TensorId(i as u32);
        check_tensor_annotations(f, t)?;
        if f.is_input(t) {
            if let Some(ax) = f.find_parallel_axis(t, ParallelType::Stream) {
                return Err(Error::Parallelization {
                    tensor: f.tensor_name(t),
                    axis: Some(ax),
                    reason: "inputs cannot be Stream-parallel".into(),
                });
            }
        }
        for (vi, p) in f.visible_axes(t).into_iter().enumerate() {
            let d = f.axis(t, p);
            if d.parallel != ParallelType::DIDx {
                continue;
            }
            match &f.tensor(t).mesh {
                DeviceMesh::World => match world_didx {
                    None => world_didx = Some((t, vi, d.extent)),
                    Some((t0, a0, e0)) if e0 != d.extent => {
                        return Err(Error::Parallelization {
                            tensor: f.tensor_name(t),
                            axis: Some(vi),
                            reason: format!(
                                "DIDx extent {} differs from `{}` axis {a0}'s DIDx extent {}; \
                                 every DIDx axis spans the same mesh, so use one symbol",
                                f.display_scalar(d.extent),
                                f.tensor_name(t0),
                                f.display_scalar(e0)
                            ),
                        })
                    }
                    Some(_) => {}
                },
                DeviceMesh::Devices(devs) => {
                    if let Some(n) = f.const_value(d.extent) {
                        if n as usize != devs.len() {
                            return Err(Error::Parallelization {
                                tensor: f.tensor_name(t),
                                axis: Some(vi),
                                reason: format!(
                                    "DIDx extent {n} differs from the size of its mesh {}",
                                    f.tensor(t).mesh
                                ),
                            });
                        }
                    }
                }
            }
        }
    }
    for e in f.exprs() {
        if let Op::Split { axis, .. } = e.op {
            let out = e.output;
            let vis = f.visible_axes(out);
            for p in [vis[axis], vis[axis + 1]] {
                if f.axis(out, p).parallel == ParallelType::Stream {
                    return Err(Error::Parallelization {
                        tensor: f.tensor_name(out),
                        axis: vis.iter().position(|&q| q == p),
                        reason: "a Stream axis must be a whole logical axis, but this one comes \
                                 from a split; split the input instead and stream its outer axis"
                            .into(),
                    });
                }
            }
            let src = e.inputs[0];
            let src_axis = f.visible_axes(src)[axis];
            if f.axis(src, src_axis).parallel == ParallelType::Stream {
                return Err(Error::Parallelization {
                    tensor: f.tensor_name(src),
                    axis: Some(axis),
                    reason: "a Stream axis must be a whole logical axis, but `split` splits it"
                        .into(),
                });
            }
        }
        if e.op.is_view() {
            let out = e.output;
            if let Some(ax) = f.find_parallel_axis(out, ParallelType::Stream) {
                return Err(Error::Parallelization {
                    tensor: f.tensor_name(out),
                    axis: Some(ax),
                    reason: format!(
                        "the result of `{}` is a view and cannot be Stream-parallel; \
                         stream the op that consumes it",
                        e.op.name()
                    ),
                });
            }
        }
    }
    Ok(())
}
