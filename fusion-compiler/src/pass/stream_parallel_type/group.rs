//! The expressions one stream loop hosts ([`LoopGroup`]), its gathers, the reduce-scatter
//! folded into it, when a later loop may join it, and the error every step of the pass
//! reports a Stream axis it cannot lower with.

use std::collections::{HashMap, HashSet};

use super::permute_views;
use super::views::{with_axis_extent, PermuteViews, RowSlicing};
use crate::error::{Error, Result};
use crate::hir::{HostProgram, Node};
use crate::ir::{axis_map, Expr, Fusion, IterDomainId, IterKind, NamedScalar, ScalarId, TensorId};
use crate::resharding::{classify, MeshContext, Resharding};

/// One item of the pass's program: a node outside the loops, or a loop.
pub(super) enum Item {
    Node(Node),
    Loop(LoopGroup),
}

/// A reduce-scatter folded into the loop that produces its input.
#[derive(Clone)]
pub(super) struct ReduceScatterFold {
    pub(super) expr: Expr,
    /// Position of the reduced DIDx axis in the input.
    pub(super) didx: usize,
    /// Position of the output's DIDx axis (the one the loop's Stream axis becomes).
    pub(super) out_didx: usize,
}

/// One gathered input of a loop: `out = set(input)` turns `input`'s DIDx axis `in_axis`
/// into the Stream axis `s` of `out`.
pub(super) struct Gather {
    pub(super) input: TensorId,
    pub(super) in_axis: usize,
    pub(super) out: TensorId,
    pub(super) s: usize,
}

/// Expressions that will share one stream loop.
#[derive(Clone)]
pub(super) struct LoopGroup {
    pub(super) axis: IterDomainId,
    pub(super) extent: ScalarId,
    pub(super) exprs: Vec<(Expr, usize)>,
    /// Tensors produced in the loop -> position of their Stream axis.
    pub(super) produced: HashMap<TensorId, usize>,
    pub(super) reduce_scatter: Option<ReduceScatterFold>,
    /// Sums over the Stream axis folded into the loop (`accumulate`): each reads a GEMM
    /// result of the loop, which is added onto the sum chunk by chunk instead of stored.
    pub(super) accumulate: Vec<Expr>,
    /// The Stream-parallel permute views the loop's expressions read (`permute_views`).
    pub(super) views: PermuteViews,
}

impl LoopGroup {
    pub(super) fn new(f: &Fusion, e: &Expr, s: usize) -> Result<Self> {
        let d = f.axis(e.output, s);
        if d.kind == IterKind::Broadcast {
            return Err(stream_error(
                f,
                e.output,
                s,
                "a broadcast axis cannot be Stream-parallel",
            ));
        }
        Ok(LoopGroup {
            axis: f.tensor(e.output).axes[s],
            extent: d.extent,
            exprs: Vec::new(),
            produced: HashMap::new(),
            reduce_scatter: None,
            accumulate: Vec::new(),
            views: PermuteViews::new(),
        })
    }

    pub(super) fn push(&mut self, e: Expr, s: usize) {
        self.produced.insert(e.output, s);
        self.exprs.push((e, s));
    }

    /// True when `e` (with Stream axis `s`) continues this loop.
    pub(super) fn accepts(&self, f: &Fusion, e: &Expr, s: usize) -> Result<bool> {
        let map = axis_map(f, e);
        let mut linked = false;
        for (i, t) in e.inputs.iter().enumerate() {
            let Some(&ps) = self.produced.get(t) else {
                continue;
            };
            if map.producer_axis(i, s) != Some(ps) {
                return Err(stream_error(
                    f,
                    e.output,
                    s,
                    &format!(
                        "its Stream axis does not come from the Stream axis {ps} of `{}`, \
                         which the same stream loop produces; the loop cannot host `{}`",
                        f.tensor_name(*t),
                        e.op.name()
                    ),
                ));
            }
            linked = true;
        }
        Ok(linked && f.axis(e.output, s).extent == self.extent)
    }

    /// True when loop `next`, which follows this one, may run in it after this loop's
    /// expressions: both iterate a Stream axis of the same extent, this loop
    /// reduce-scatters nothing (its sum would come after `next`'s expressions), and `next`
    /// reads this loop's results only chunk by chunk: no sum this loop accumulates, no
    /// result along another axis than its Stream axis, no permute view of a result.
    pub(super) fn may_absorb(&self, f: &Fusion, next: &LoopGroup) -> bool {
        if self.extent != next.extent || self.reduce_scatter.is_some() {
            return false;
        }
        let sums: HashSet<TensorId> = self.accumulate.iter().map(|a| a.output).collect();
        next.exprs.iter().all(|(e, s)| {
            let map = axis_map(f, e);
            e.inputs.iter().enumerate().all(|(i, t)| {
                let whole_view = next.views.contains_key(t)
                    && !self.produced.contains_key(t)
                    && self
                        .produced
                        .contains_key(&permute_views::source(&next.views, *t));
                let chunked = match self.produced.get(t) {
                    Some(&ps) => map.producer_axis(i, *s) == Some(ps),
                    None => true,
                };
                chunked && !whole_view && !sums.contains(t)
            })
        })
    }

    /// Appends loop `next` (which [`LoopGroup::may_absorb`]) to this one.
    pub(super) fn absorb(&mut self, next: LoopGroup) {
        self.produced.extend(next.produced);
        self.exprs.extend(next.exprs);
        self.reduce_scatter = next.reduce_scatter;
        self.accumulate.extend(next.accumulate);
        self.views.extend(next.views);
    }

    /// True when the loop's chunks must stay whole (no row ranges): its GEMMs accumulate
    /// over the chunks, or read permuted views, whose rows are not the loop's rows.
    pub(super) fn whole_chunks(&self) -> bool {
        !self.accumulate.is_empty() || !self.views.is_empty()
    }

    /// The loop's gathers (its `set`s from a DIDx axis to the Stream axis).
    pub(super) fn gathers(&self, p: &HostProgram) -> Result<Vec<Gather>> {
        let ctx = MeshContext {
            world_size: Some(p.world_size),
        };
        let mut out = Vec::new();
        for (e, s) in &self.exprs {
            if let Resharding::DidxToStream { in_axis, .. } = classify(&p.ir, e, ctx)? {
                out.push(Gather {
                    input: e.inputs[0],
                    in_axis,
                    out: e.output,
                    s: *s,
                });
            }
        }
        Ok(out)
    }

    /// How many leading exprs are local compute, when communication follows them in the
    /// loop (0 otherwise: nothing to run ahead of the communication).
    pub(super) fn compute_prefix_len(&self, p: &HostProgram, ctx: MeshContext) -> Result<usize> {
        let mut prefix = 0;
        for (e, _) in &self.exprs {
            if !matches!(classify(&p.ir, e, ctx)?, Resharding::Local) {
                break;
            }
            prefix += 1;
        }
        let communicates = prefix < self.exprs.len() || self.reduce_scatter.is_some();
        Ok(if communicates { prefix } else { 0 })
    }

    /// `Allocate` for every output of the loop's expressions (except `skip`): full size,
    /// or `numberOfStreams` slots (of one row range each, when sub-chunked) for
    /// loop-internal intermediates, which the returned map sends to their slot buffer.
    pub(super) fn allocate_outputs(
        &self,
        p: &mut HostProgram,
        internal: &HashSet<TensorId>,
        rows: Option<&RowSlicing>,
        skip: Option<TensorId>,
    ) -> (Vec<Node>, HashMap<TensorId, TensorId>) {
        let n = p.ir.named(NamedScalar::NumberOfStreams);
        let mut nodes = Vec::new();
        let mut small = HashMap::new();
        for (e, s) in &self.exprs {
            if Some(e.output) == skip {
                continue;
            }
            // An accumulated GEMM result is never stored: its sum is.
            if let Some(sum) = self.accumulate.iter().find(|a| a.inputs[0] == e.output) {
                nodes.push(Node::Allocate { tensor: sum.output });
                continue;
            }
            let t = if internal.contains(&e.output) {
                let mut resized = vec![(*s, n)];
                if let Some(r) = rows {
                    if let Some(&q) = r.rows.get(&e.output) {
                        let extent = p.ir.axis(e.output, q).extent;
                        resized.push((q, r.slot_extent(&mut p.ir, extent)));
                    }
                }
                let b = with_axis_extent(&mut p.ir, e.output, &resized);
                small.insert(e.output, b);
                b
            } else {
                e.output
            };
            nodes.push(Node::Allocate { tensor: t });
        }
        (nodes, small)
    }
}

/// The pass's error for axis `pos` of `t`.
pub(super) fn stream_error(f: &Fusion, t: TensorId, pos: usize, reason: &str) -> Error {
    Error::StreamLowering {
        tensor: f.tensor_name(t),
        axis: f
            .visible_axes(t)
            .iter()
            .position(|&q| q == pos)
            .or(Some(pos)),
        reason: reason.to_string(),
    }
}
