//! Gradient accumulation and layout.
//!
//! A contribution to a forward tensor's gradient may come in a shape that only
//! *broadcasts* to the tensor's: the adjoint of an elementwise op or a batched matmul has
//! the result's (expanded) shape, and the adjoint of a sum is a broadcast (extent 1 where
//! the tensor has the reduced extent). Contributions are added as they come (broadcasting),
//! and the sum is *settled* when the tensor's own adjoint runs: summed over the axes that
//! were expanded (a sum over a DIDx axis is where the backward's AllReduce or
//! ReduceScatter comes from) and declared with the tensor's layout, so the lowering inserts
//! the communication a change of sharding needs.

use super::context::Ctx;
use super::error::{AutodiffError, Result};
use crate::builder::Axis;
use crate::ir::{IterKind, ParallelType, TensorId};

impl Ctx<'_> {
    /// Adds a contribution to the gradient of forward tensor `t`.
    pub fn add_grad(&mut self, t: TensorId, contribution: TensorId) -> Result<()> {
        let sum = match self.grads.get(&t) {
            Some(&g) => self.b.add(g, contribution)?,
            None => contribution,
        };
        self.grads.insert(t, sum);
        Ok(())
    }

    /// True when axis `i` (visible) of backward tensor `t` is an extent-1 or broadcast axis.
    pub fn broadcast_like(&self, t: TensorId, i: usize) -> bool {
        let f = self.b.fusion();
        let d = f.axis(t, f.visible_axes(t)[i]);
        d.kind == IterKind::Broadcast || f.const_value(d.extent) == Some(1)
    }

    /// True when visible axis `i` of forward tensor `t` is an extent-1 or broadcast axis.
    pub fn forward_broadcast_like(&self, t: TensorId, i: usize) -> bool {
        let d = self.f.axis(t, self.f.visible_axes(t)[i]);
        d.kind == IterKind::Broadcast || self.f.const_value(d.extent) == Some(1)
    }

    /// The gradient of forward tensor `t` (`None` when nothing reached it), summed over the
    /// axes its contributions expanded and with `t`'s rank. When it has `t`'s shape (not
    /// only one broadcasting to it) it also has `t`'s layout; `exact` then tells so.
    pub fn settle(&mut self, t: TensorId) -> Result<Option<(TensorId, bool)>> {
        let Some(g) = self.grads.get(&t).copied() else {
            return Ok(None);
        };
        let rt = self.f.visible_axes(t).len();
        let rg = self.b.fusion().visible_axes(g).len();
        let lead = rg.saturating_sub(rt);
        let missing = rt.saturating_sub(rg);
        let mut summed: Vec<usize> = (0..lead).collect();
        let mut refill = vec![false; rt];
        for (k, flag) in refill.iter_mut().enumerate().skip(missing) {
            let j = k - missing + lead;
            if self.forward_broadcast_like(t, k) && !self.broadcast_like(g, j) {
                summed.push(j);
                *flag = true;
            }
        }
        let mut s = g;
        if !summed.is_empty() {
            s = self.b.sum(s, &summed)?;
        }
        for flag in refill.iter_mut().take(missing) {
            *flag = true;
        }
        if refill.iter().any(|&r| r) {
            s = self.b.broadcast(s, &refill)?;
        }
        let exact = (0..rt)
            .all(|k| !self.broadcast_like(s, k) || self.forward_broadcast_like(t, k) || refill[k]);
        if exact {
            s = self.relayout(s, t)?;
        }
        self.grads.insert(t, s);
        Ok(Some((s, exact)))
    }

    /// Declares backward tensor `s` (of forward tensor `t`'s shape) with `t`'s layout: its
    /// DIDx axis and mesh, and its Stream axis, or else the one `s` already has.
    fn relayout(&mut self, s: TensorId, t: TensorId) -> Result<TensorId> {
        let forward = self.layout(t);
        let bf = self.b.fusion();
        let current: Vec<ParallelType> = (bf.visible_axes(s).into_iter())
            .map(|p| bf.axis(s, p).parallel)
            .collect();
        let forward_stream = forward.iter().any(|a| a.parallel == ParallelType::Stream);
        // A gradient that is an input of the backward (an output's, passed on as it is)
        // keeps its serial axes: a Stream axis alone is no reason for a copy.
        let input = bf.is_input(s);
        let pars: Vec<ParallelType> = (forward.iter().zip(&current))
            .map(|(a, &c)| match (a.parallel, c) {
                (ParallelType::Serial, ParallelType::Stream) if !forward_stream => c,
                (ParallelType::Stream, _) if input => ParallelType::Serial,
                (p, _) => p,
            })
            .collect();
        let mesh = self.f.tensor(t).mesh.clone();
        self.declare_pars(s, &pars, mesh)
    }

    /// Declares backward tensor `s` with its own extents and the parallel types `pars`
    /// (serial on broadcast axes). A Stream axis the builder refuses there (a sum's or a
    /// view's result) is dropped rather than failing the derivation.
    pub fn declare_pars(
        &mut self,
        s: TensorId,
        pars: &[ParallelType],
        mesh: crate::ir::DeviceMesh,
    ) -> Result<TensorId> {
        let bf = self.b.fusion();
        let extents: Vec<_> = (bf.visible_axes(s).into_iter())
            .map(|p| bf.axis(s, p).extent)
            .collect();
        let dtype = bf.tensor(s).dtype;
        let axes = |stream: bool| -> Vec<Axis> {
            (extents.iter().zip(pars).enumerate())
                .map(|(i, (&extent, &p))| Axis {
                    extent,
                    parallel: match p {
                        _ if self.broadcast_like(s, i) => ParallelType::Serial,
                        ParallelType::Stream if !stream => ParallelType::Serial,
                        p => p,
                    },
                })
                .collect()
        };
        let (with, without) = (axes(true), axes(false));
        match self.b.declare_on(s, dtype, &with, mesh.clone()) {
            Ok(t) => Ok(t),
            Err(_) if with != without => Ok(self.b.declare_on(s, dtype, &without, mesh)?),
            Err(e) => Err(AutodiffError::Build(e)),
        }
    }
}
