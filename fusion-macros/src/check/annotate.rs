//! Annotations: inputs, `let` and return types (the builder's `input`, `declare` and
//! `output`), and the per-tensor sharding rules they must keep.

use super::dims::DimId;
use super::model::{Ax, DType, Kind, Mesh, Model, Op, Par, Tid};
use crate::span::SpanRange;

type Result<T> = std::result::Result<T, syn::Error>;

/// A literal-dim fact the generated code re-checks with `static_assertions`.
#[derive(Clone, Debug)]
pub enum Fact {
    /// Two literal extents that must be equal.
    Eq(i64, i64),
    /// `by` is positive and divides `n`.
    Divides { n: i64, by: i64 },
    /// `a < b`.
    Lt(i64, i64),
    /// `a <= b`.
    Le(i64, i64),
}

/// A checked annotation, `Tensor<dtype, [axes], mesh = ..>`, ready to apply.
#[derive(Clone, Debug)]
pub struct Declared {
    pub dtype: DType,
    pub dtype_span: SpanRange,
    pub axes: Vec<(DimId, Par, SpanRange)>,
    pub axes_span: SpanRange,
    pub mesh: Mesh,
    pub span: SpanRange,
}

impl Model {
    /// A new input (the builder's `input`/`input_on`).
    pub fn input(&mut self, name: &str, ty: &Declared) -> Result<Tid> {
        let axes = ty
            .axes
            .iter()
            .map(|&(extent, par, span)| Ax {
                extent,
                par,
                kind: Kind::Iter,
                origin: Some(span),
            })
            .collect();
        let t = self.new_tensor(ty.dtype, axes, ty.mesh.clone(), ty.span, "input");
        self.tv_mut(t).name = Some(name.to_string());
        self.inputs.push(t);
        self.declared.push(t);
        self.check_annotations(t)?;
        if let Some(&(_, _, span)) = ty.axes.iter().find(|a| a.1 == Par::Stream) {
            return Err(span.error(format!(
                "input `{name}` cannot have a Stream axis: a Stream axis is produced chunk by \
                 chunk inside the fusion; declare this axis serial and put `@ Stream` on the \
                 result instead"
            )));
        }
        Ok(t)
    }

    /// Applies an annotation (the builder's `declare`, then `set_mesh` when the mesh
    /// changes). Returns the tensor that carries it: `t` itself, or a new `set` of it when
    /// `t` is an input, an output or already annotated.
    pub fn declare(&mut self, t: Tid, ty: &Declared) -> Result<Tid> {
        let actual = self.tv(t).dtype;
        if actual != ty.dtype {
            return Err(ty.dtype_span.error(format!(
                "declared element type `{}`, but {} is `{}`; declare `{}` or convert with \
                 `cast(x, {})`",
                self.dtype_name(ty.dtype),
                self.what(t),
                self.dtype_name(actual),
                self.dtype_name(actual),
                self.dtype_name(ty.dtype)
            )));
        }
        let vis = self.visible(t);
        if vis.len() != ty.axes.len() {
            return Err(ty.axes_span.error(format!(
                "declared rank {}, but {} has rank {}: its type is `{}`",
                ty.axes.len(),
                self.what(t),
                vis.len(),
                self.show_type(t)
            )));
        }
        let mut mismatch = None;
        for (i, (&p, &(ext, _, span))) in vis.iter().zip(&ty.axes).enumerate() {
            let actual = self.axis(t, p).extent;
            if actual != ext {
                mismatch.get_or_insert_with(|| {
                    span.error(format!(
                        "declared extent `{}` for axis {i}, but {} has extent `{}` there \
                         (its type is `{}`)",
                        self.dims.show(ext),
                        self.what(t),
                        self.dims.show(actual),
                        self.show_type(t)
                    ))
                });
            } else {
                self.note_equal(actual, ext, span);
            }
        }
        if let Some(e) = mismatch {
            return Err(e);
        }
        let target = if self.declared.contains(&t) || self.is_output(t) {
            let s = self.set(t, ty.span)?;
            self.tv_mut(s).name = self.tv(t).name.clone();
            s
        } else {
            t
        };
        let vis = self.visible(target);
        for (&p, &(_, par, span)) in vis.iter().zip(&ty.axes) {
            let ax = &mut self.tv_mut(target).axes[p];
            ax.par = par;
            ax.origin = Some(span);
        }
        self.check_annotations(target)?;
        self.declared.push(target);
        if self.tv(target).mesh != ty.mesh {
            self.tv_mut(target).mesh = ty.mesh.clone();
        }
        if target == t {
            self.stream_producers(target);
        }
        Ok(target)
    }

    /// The builder's `stream_producers`: a Stream annotation on the result of an
    /// elementwise op also streams the unannotated matmul, linear or elementwise results
    /// it is computed from (those this op alone uses), and so settles a matmul result
    /// that took DIDx axes from both operands.
    fn stream_producers(&mut self, t: Tid) {
        let Some(ei) = self.exprs.iter().rposition(|e| e.output == t) else {
            return;
        };
        let e = self.exprs[ei].clone();
        if !matches!(e.op, Op::Unary(_) | Op::Binary(_) | Op::Cast(_)) {
            return;
        }
        let Some(s) = self.find_par(t, Par::Stream) else {
            return;
        };
        let map = self.axis_map(&e);
        for (i, &u) in e.inputs.iter().enumerate() {
            let Some(q) = map[i][s] else {
                continue;
            };
            let streams = self
                .exprs
                .iter()
                .rev()
                .find(|x| x.output == u)
                .is_some_and(|x| {
                    matches!(
                        x.op,
                        Op::Matmul | Op::Linear | Op::Unary(_) | Op::Binary(_) | Op::Cast(_)
                    )
                });
            let only_here = self
                .exprs
                .iter()
                .enumerate()
                .all(|(j, x)| j == ei || !x.inputs.contains(&u));
            if !streams
                || self.declared.contains(&u)
                || self.is_output(u)
                || !only_here
                || self.is_broadcast_like(u, q)
                || self.find_par(u, Par::Stream).is_some()
            {
                continue;
            }
            self.tv_mut(u).axes[q].par = Par::Stream;
            self.stream_producers(u);
        }
    }

    /// True when `t` is annotated and already has exactly this annotation's layout, so
    /// declaring it again would only add a copy.
    pub fn already_has(&self, t: Tid, ty: &Declared) -> bool {
        let vis = self.visible(t);
        self.declared.contains(&t)
            && self.tv(t).dtype == ty.dtype
            && self.tv(t).mesh == ty.mesh
            && vis.len() == ty.axes.len()
            && vis.iter().zip(&ty.axes).all(|(&p, &(e, par, _))| {
                let a = self.axis(t, p);
                a.extent == e && a.par == par
            })
    }

    /// Marks the next output (an input or an output is copied first).
    pub fn output(&mut self, t: Tid, span: SpanRange) -> Result<Tid> {
        let t = if self.is_input(t) || self.is_output(t) {
            self.set(t, span)?
        } else {
            t
        };
        self.outputs.push(t);
        self.declared.push(t);
        Ok(t)
    }

    /// At most one DIDx and one Stream axis per tensor.
    pub fn check_annotations(&self, t: Tid) -> Result<()> {
        for p in [Par::DIDx, Par::Stream] {
            let axes: Vec<usize> = self
                .visible(t)
                .into_iter()
                .filter(|&q| self.axis(t, q).par == p)
                .collect();
            if axes.len() > 1 {
                let idx: Vec<usize> = axes.iter().map(|&q| self.vis_index(t, q)).collect();
                // An op result that took DIDx axes from two operands: point at the op.
                let made = self.exprs.iter().rev().find(|e| e.output == t);
                if let (Some(e), Par::DIDx, false) = (made, p, self.declared.contains(&t)) {
                    let didx_axes = |x: Tid| {
                        self.visible(x)
                            .into_iter()
                            .filter(|&q| self.axis(x, q).par == Par::DIDx)
                            .count()
                    };
                    if e.inputs.iter().any(|&x| didx_axes(x) > 1) {
                        // Inherited from an operand, whose error says it.
                        return Ok(());
                    }
                    return Err(e.span.error(format!(
                        "axes {idx:?} of {} are all DIDx: `{}` takes DIDx axes from two \
                         operands, and a tensor has at most one DIDx axis (the device mesh is \
                         1-D); annotate the result, or the elementwise op computed from it, \
                         with one of them as the Stream axis (that operand is then gathered \
                         chunk by chunk), e.g. `let h: Tensor<.., [d @ Stream, d @ DIDx, ..]> \
                         = gelu(matmul(x, w));`",
                        self.what(t),
                        e.op.name()
                    )));
                }
                let second = self.axis(t, axes[1]);
                let span = second.origin.unwrap_or(self.tv(t).span);
                return Err(span.error(format!(
                    "axes {idx:?} of {} are all {}; a tensor has at most one {} axis (the \
                     device mesh is 1-D); keep one and make the others serial",
                    self.what(t),
                    p.name(),
                    p.name()
                )));
            }
        }
        Ok(())
    }
}
