//! Whole-fusion rules (DESIGN.md section 3): one DIDx extent per mesh, whole Stream axes,
//! and reshardings that lowering can turn into communications. They mirror
//! `fusion_core::builder::validate` and `fusion_core::lower::resharding::classify` with the
//! world size unknown: only what is certain to fail is rejected here; the rest is checked
//! again when the fusion is lowered at its first call.

use super::dims::DimId;
use super::model::{Mesh, Model, Op, Par, Tid};
use crate::span::{Errors, SpanRange};

impl Model {
    /// The builder's `validate`, with spans.
    pub fn validate(&self, errors: &mut Errors) {
        let mut world_didx: Option<(Tid, usize, DimId)> = None;
        for i in 0..self.tensors.len() {
            let t = Tid(i);
            if let Err(e) = self.check_annotations(t) {
                errors.push(e);
            }
            for p in self.visible(t) {
                let a = self.axis(t, p);
                if a.par != Par::DIDx {
                    continue;
                }
                let span = a.origin.unwrap_or(self.tv(t).span);
                let vi = self.vis_index(t, p);
                match &self.tv(t).mesh {
                    Mesh::World => match world_didx {
                        None => world_didx = Some((t, vi, a.extent)),
                        Some((t0, a0, e0)) if e0 != a.extent => errors.push(span.error(format!(
                            "DIDx extent `{}` differs from `{}`, the DIDx extent of axis {a0} of \
                             {}; every DIDx axis spans the same device mesh, so use one symbol \
                             for it: `{} @ DIDx`",
                            self.dims.show(a.extent),
                            self.dims.show(e0),
                            self.what(t0),
                            self.dims.show(e0)
                        ))),
                        Some(_) => {}
                    },
                    Mesh::Devices(devs) => {
                        if let Some(n) = self.dims.value(a.extent) {
                            if n as usize != devs.len() {
                                errors.push(span.error(format!(
                                    "DIDx extent {n} differs from the size of the mesh {devs:?} \
                                     ({} devices); a DIDx axis has one index per device of \
                                     its mesh",
                                    devs.len()
                                )));
                            }
                        }
                    }
                }
            }
        }
        for e in &self.exprs {
            if let Op::Split { axis, .. } = e.op {
                let vis = self.visible(e.output);
                let from_split = [vis[axis], vis[axis + 1]]
                    .into_iter()
                    .map(|p| self.axis(e.output, p))
                    .find(|a| a.par == Par::Stream);
                if let Some(a) = from_split {
                    errors.push(a.origin.unwrap_or(e.span).error(
                        "a Stream axis must be a whole logical axis, but this one comes from a \
                         `split`; split the input instead and stream its outer axis",
                    ));
                    continue;
                }
            }
            if e.op.is_view() {
                if let Some(p) = self.find_par(e.output, Par::Stream) {
                    let a = self.axis(e.output, p);
                    errors.push(a.origin.unwrap_or(e.span).error(format!(
                        "the result of `{}` is a view and cannot be Stream-parallel; stream the \
                         op that consumes it",
                        e.op.name()
                    )));
                }
            }
        }
    }

    /// Reshardings that lowering certainly rejects (rule 4), on expressions an output needs.
    pub fn check_lowerable(&self, errors: &mut Errors) {
        let live = self.live_exprs();
        for (i, e) in self.exprs.iter().enumerate() {
            if !live[i] {
                continue;
            }
            let result = match &e.op {
                Op::Set => self.check_set(e.inputs[0], e.output, e.span),
                Op::Reduce { axes, .. } => self.check_reduction(i, axes, e.span),
                _ => self.check_compute(i),
            };
            if let Err(err) = result {
                errors.push(err);
            }
        }
    }

    fn live_exprs(&self) -> Vec<bool> {
        let mut live = vec![false; self.exprs.len()];
        let mut stack: Vec<Tid> = self.outputs.clone();
        let mut seen = vec![false; self.tensors.len()];
        while let Some(t) = stack.pop() {
            if std::mem::replace(&mut seen[t.0], true) {
                continue;
            }
            if let Some(i) = self.exprs.iter().rposition(|e| e.output == t) {
                live[i] = true;
                stack.extend(self.exprs[i].inputs.iter().copied());
            }
        }
        live
    }

    /// The DIDx axis position, if the tensor is effectively sharded (not on one device).
    fn sharded(&self, t: Tid) -> Option<usize> {
        let p = self.find_par(t, Par::DIDx)?;
        match &self.tv(t).mesh {
            Mesh::Devices(d) if d.len() == 1 => None,
            _ => Some(p),
        }
    }

    /// Whether two meshes are the same; `None` when it depends on the world size.
    fn same_mesh(a: &Mesh, b: &Mesh) -> Option<bool> {
        match (a, b) {
            (Mesh::World, Mesh::World) => Some(true),
            (Mesh::Devices(x), Mesh::Devices(y)) => Some(x == y),
            _ => None,
        }
    }

    /// A `set` from `x`'s layout to `y`'s (`map` gives y's axis -> x's axis).
    fn check_set(&self, x: Tid, y: Tid, span: SpanRange) -> syn::Result<()> {
        let map = |j: usize| self.visible(x).get(j).copied();
        let (p, c) = (self.sharded(x), self.sharded(y));
        let same = Self::same_mesh(&self.tv(x).mesh, &self.tv(y).mesh);
        if let (Some(p), Some(s)) = (p, self.find_par(y, Par::Stream)) {
            if map(s) == Some(p) {
                if same == Some(false) {
                    return Err(span.error(format!(
                        "cannot lower this resharding: turning the DIDx axis of {} into a \
                         Stream axis (the P2P pipeline) needs both on the same mesh, but they \
                         live on {} and {}",
                        self.what(x),
                        self.tv(x).mesh.show(),
                        self.tv(y).mesh.show()
                    )));
                }
                return Ok(());
            }
        }
        if let (Some(p), Some(c)) = (p, c) {
            if map(c) != Some(p) {
                return Err(span.error(format!(
                    "cannot lower this resharding: two shardings change at once, {} is sharded \
                     on axis {} but the result on axis {} (an all-to-all); reshard through an \
                     unsharded tensor: first `let full: Tensor<..> = x;` with no DIDx axis, \
                     then shard the other axis",
                    self.what(x),
                    self.vis_index(x, p),
                    self.vis_index(y, c)
                )));
            }
            if let (Mesh::Devices(a), Mesh::Devices(b)) = (&self.tv(x).mesh, &self.tv(y).mesh) {
                if a.len() != b.len() {
                    return Err(span.error(format!(
                        "cannot lower this resharding: {} is sharded over {} devices but the \
                         result over {}; a sharded-to-sharded copy needs meshes of one size",
                        self.what(x),
                        a.len(),
                        b.len()
                    )));
                }
            }
        }
        Ok(())
    }

    fn check_reduction(&self, i: usize, axes: &[usize], span: SpanRange) -> syn::Result<()> {
        let e = &self.exprs[i];
        let (x, y) = (e.inputs[0], e.output);
        let vis = self.visible(x);
        let p = self.sharded(x);
        let reduces_sharded = p.is_some_and(|p| axes.iter().any(|&a| vis[a] == p));
        let c = self.sharded(y);
        if reduces_sharded {
            if c.is_some() && Self::same_mesh(&self.tv(x).mesh, &self.tv(y).mesh) == Some(false) {
                return Err(span.error(
                    "cannot lower this reduction: a ReduceScatter needs its input and result on \
                     the same mesh; reduce on the input's mesh, then copy with a `let` \
                     annotated with the other mesh",
                ));
            }
            return Ok(());
        }
        if let (Some(p), Some(c)) = (p, c) {
            // The output axis that keeps the input's sharded axis.
            let map = self.axis_map(e);
            let kept = (0..self.tv(y).axes.len()).find(|&j| map[0][j] == Some(p));
            if kept != Some(c) {
                return Err(span.error(format!(
                    "cannot lower this reduction: {} is sharded on axis {} but the result on \
                     axis {}, so two shardings would change at once; reduce first, then \
                     reshard the result with an annotated `let`",
                    self.what(x),
                    self.vis_index(x, p),
                    self.vis_index(y, c)
                )));
            }
        }
        Ok(())
    }

    /// A compute op whose inputs are laid out unlike its result gets a resharding `set` of
    /// each such input when lowered; check that set.
    fn check_compute(&self, i: usize) -> syn::Result<()> {
        let e = &self.exprs[i];
        let map = self.axis_map(e);
        let out = e.output;
        let c = self.sharded(out);
        let out_stream = self.find_par(out, Par::Stream);
        for (k, &x) in e.inputs.iter().enumerate() {
            let p = self.sharded(x);
            let want_didx = c
                .and_then(|c| map[k][c])
                .filter(|&q| !self.is_broadcast_like(x, q));
            let want_stream = out_stream
                .and_then(|s| map[k][s])
                .filter(|&q| !self.is_broadcast_like(x, q));
            if let (Some(p), Some(q)) = (p, want_didx) {
                if p != q && want_stream != Some(p) {
                    return Err(e.span.error(format!(
                        "cannot lower `{}`: its input {} is sharded on axis {} but the result \
                         needs it sharded on axis {}, so two shardings would change at once; \
                         reshard the input through an unsharded tensor first",
                        e.op.name(),
                        self.what(x),
                        self.vis_index(x, p),
                        self.vis_index(x, q)
                    )));
                }
            }
            if let (Some(p), Some(s)) = (p, want_stream) {
                if p == s && Self::same_mesh(&self.tv(x).mesh, &self.tv(out).mesh) == Some(false) {
                    return Err(e.span.error(format!(
                        "cannot lower `{}`: turning the DIDx axis of {} into the result's \
                         Stream axis needs both on the same mesh",
                        e.op.name(),
                        self.what(x)
                    )));
                }
            }
        }
        Ok(())
    }
}
