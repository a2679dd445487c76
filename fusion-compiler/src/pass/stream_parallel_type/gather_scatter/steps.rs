//! The steps of a gather-scatter loop: the buffers it allocates, and per unit the
//! prefetch of the next unit's rows, the compute on this unit's rows and the
//! reduce onto the running sum that arrived.

use std::collections::{HashMap, HashSet};

use super::super::after_loop;
use super::scalars::{UnitScalars, UnitStreams};
use super::sink::sink_elementwise;
use super::unit::Unit;
use crate::error::Result;
use crate::hir::{HostProgram, Node, StreamId, Transport};
use crate::ir::{axis_map, Expr, Op, ScalarId, TensorId};
use crate::pass::stream_parallel_type::exchange::coalesced_exchange;
use crate::pass::stream_parallel_type::group::{Gather, LoopGroup, ReduceScatterFold};
use crate::pass::stream_parallel_type::iteration::emit_body_expr;
use crate::pass::stream_parallel_type::permute_views::source;
use crate::pass::stream_parallel_type::ring::{
    allocate_running_sums, drop_didx, RingStep, RunningSums,
};
use crate::pass::stream_parallel_type::schedule::Schedule;
use crate::pass::stream_parallel_type::subchunk::SubChunkPlan;
use crate::pass::stream_parallel_type::views::{with_axis_extent, RowSlicing, Slicer};

/// The buffers of the loop besides the caller's.
pub(super) struct Buffers {
    /// Gathered tensor -> its two slots of received rows.
    received: HashMap<TensorId, TensorId>,
    gathered: HashSet<TensorId>,
    /// Loop-internal result -> the one slot the other chunks' units share.
    shared: HashMap<TensorId, TensorId>,
    /// Inputs of the last expression -> the buffer of this device's own chunk.
    own: HashMap<TensorId, TensorId>,
    /// The running sums.
    acc: TensorId,
    /// Gathered tensors landing whole (the weight gradients after the loop read them).
    whole: HashSet<TensorId>,
}

/// One gather-scatter loop being emitted: its group, gathers, last expression (the matmul
/// whose result is reduce-scattered), row ranges and scalars.
pub(super) struct GatherScatter<'a> {
    pub(super) g: &'a LoopGroup,
    pub(super) rs: &'a ReduceScatterFold,
    pub(super) gathers: Vec<Gather>,
    pub(super) last: Expr,
    pub(super) s_last: usize,
    pub(super) plan: Option<SubChunkPlan>,
    pub(super) u: UnitScalars,
    pub(super) transport: Transport,
    /// The expressions run once after the loop over every block instead of block by
    /// block (chosen by `after_loop` in `gather_scatter/mod.rs`); empty: none.
    pub(super) after: Vec<(Expr, usize)>,
}

impl GatherScatter<'_> {
    /// The row ranges of the unit whose rows index is `sub` (`None` unsplit).
    pub(super) fn rows_of(&self, sub: ScalarId) -> Option<RowSlicing> {
        self.plan.as_ref().map(|pl| RowSlicing {
            rows: pl.rows.clone(),
            sub,
            count: self.u.count,
        })
    }

    /// The row axis of `t` and its full extent, when the loop is split into row ranges.
    fn row_axis(&self, p: &HostProgram, t: TensorId) -> Option<(usize, ScalarId)> {
        let q = *self.plan.as_ref()?.rows.get(&t)?;
        Some((q, p.ir.axis(t, q).extent))
    }

    /// The rows of one unit of `t`, for the unit whose row ranges are `rows`.
    fn unit<'r>(&self, p: &HostProgram, rows: Option<&'r RowSlicing>, t: TensorId) -> Unit<'r> {
        Unit {
            rows,
            row: self.row_axis(p, t),
        }
    }

    /// Allocates (into `nodes`) the received rows' slots, the loop results (whole, or a
    /// shared slot and, for the last expression's inputs, an own-chunk buffer; for an
    /// accumulated GEMM result its sum), the running sums and the output.
    pub(super) fn allocate(
        &self,
        p: &mut HostProgram,
        internal: &HashSet<TensorId>,
        nodes: &mut Vec<Node>,
    ) -> Buffers {
        let (one, two) = (self.u.one, self.u.two);
        let rows = self.rows_of(self.u.sub);
        let mut received: HashMap<TensorId, TensorId> = HashMap::new();
        let read_after = after_loop::read_by(self.g, &self.after);
        let mut whole = HashSet::new();
        for gth in &self.gathers {
            if read_after.contains(&gth.out) {
                nodes.push(Node::Allocate { tensor: gth.out });
                received.insert(gth.out, gth.out);
                whole.insert(gth.out);
                continue;
            }
            let mut resized = vec![(gth.s, two)];
            if let (Some(r), Some((q, extent))) = (&rows, self.row_axis(p, gth.out)) {
                resized.push((q, r.slot_extent(&mut p.ir, extent)));
            }
            let buf = with_axis_extent(&mut p.ir, gth.out, &resized);
            nodes.push(Node::Allocate { tensor: buf });
            received.insert(gth.out, buf);
        }
        let gathered: HashSet<TensorId> = self.gathers.iter().map(|gth| gth.out).collect();
        let mut shared: HashMap<TensorId, TensorId> = HashMap::new();
        let mut own: HashMap<TensorId, TensorId> = HashMap::new();
        for (e, s) in self
            .body_exprs()
            .filter(|(e, _)| !gathered.contains(&e.output))
        {
            let t = e.output;
            // An accumulated GEMM result is never stored: its sum is.
            if let Some(sum) = self.g.accumulate.iter().find(|a| a.inputs[0] == t) {
                nodes.push(Node::Allocate { tensor: sum.output });
                continue;
            }
            if !internal.contains(&t) || read_after.contains(&t) {
                nodes.push(Node::Allocate { tensor: t });
                continue;
            }
            let mut resized = vec![(*s, one)];
            if let (Some(r), Some((q, extent))) = (&rows, self.row_axis(p, t)) {
                resized.push((q, r.slot_extent(&mut p.ir, extent)));
            }
            let slot = with_axis_extent(&mut p.ir, t, &resized);
            nodes.push(Node::Allocate { tensor: slot });
            shared.insert(t, slot);
            if self.last.inputs.contains(&t) {
                let buf = with_axis_extent(&mut p.ir, t, &[(*s, one)]);
                if let Some(name) = p.ir.tensor(t).name.clone() {
                    p.ir.tensor_mut(buf).name = Some(format!("{name}_local"));
                }
                nodes.push(Node::Allocate { tensor: buf });
                own.insert(t, buf);
            }
        }
        let acc = allocate_running_sums(p, self.rs, self.g.extent, nodes);
        Buffers {
            received,
            gathered,
            shared,
            own,
            acc,
            whole,
        }
    }

    /// Every expression of the loop but the last.
    fn body_exprs(&self) -> impl Iterator<Item = &(Expr, usize)> {
        self.g.exprs[..self.g.exprs.len() - 1].iter()
    }

    /// Step 1: the next unit's rows, on the next unit's pool stream (unless it gathers
    /// nothing): receive them into its slot, send this device's rows to the device that
    /// gathers them then.
    pub(super) fn emit_prefetch(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        streams: &UnitStreams,
        body: &mut Vec<Node>,
    ) {
        let u = &self.u;
        let next_rows = self.rows_of(u.next_sub);
        let mut prefetch = vec![
            Node::SetCurrentStream {
                stream: streams.next_worker,
            },
            Node::Synchronize {
                stream: streams.original,
            },
        ];
        for gth in &self.gathers {
            let unit = self.unit(p, next_rows.as_ref(), gth.out);
            let slots = bufs.received[&gth.out];
            let at = match bufs.whole.contains(&gth.out) {
                true => u.next_chunk,
                false => u.next_slot,
            };
            let recv = unit.bind(p, slots, gth.s, at, true, None, &mut prefetch);
            let unit = self.unit(p, next_rows.as_ref(), gth.input);
            let send = unit.bind(
                p,
                gth.input,
                gth.in_axis,
                u.zero,
                false,
                None,
                &mut prefetch,
            );
            prefetch.extend(coalesced_exchange(
                p,
                recv,
                u.next_chunk,
                send,
                u.next_up,
                self.transport,
            ));
        }
        body.push(Node::IfThenElse {
            cond: u.no_prefetch,
            then_body: Vec::new(),
            else_body: prefetch,
        });
    }

    /// Step 2 (steps 0..D-1): every expression but the last, on the unit's rows: the
    /// gathered rows (local at step 0, else the slot they arrived in), then each result's
    /// view, then the expressions the last one reads (directly or through others). The
    /// rest (a weight gradient accumulating block by block: nothing of this step reads
    /// it) come back as a branch for after step 3, so that the running sum step 3 sends
    /// crosses the link while they run; at the last step the sum has then arrived before
    /// the last GEMM needs it.
    pub(super) fn emit_compute(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        worker: StreamId,
        body: &mut Vec<Node>,
    ) -> Result<Node> {
        let u = &self.u;
        let sched = Schedule {
            chunk: u.chunk,
            recv_peer: u.chunk,
            send_peer: u.chunk,
            rank: u.rank,
        };
        let mut compute = Vec::new();
        for gth in &self.gathers {
            self.bind_gathered(p, bufs, slicer, gth, worker, &mut compute);
        }
        // Every result's view first, then the expressions, elementwise ones right before
        // their first reader: a chain of them (the gated MLP's `silu(g) * u`) then becomes
        // one kernel, and an activation right after its GEMM folds into the GEMM's
        // epilogue.
        let computed = sink_elementwise(
            self.body_exprs()
                .filter(|(e, _)| !bufs.gathered.contains(&e.output))
                .cloned()
                .collect(),
            &self.g.views,
        );
        for (e, s) in &computed {
            let t = e.output;
            if let Some(&slot) = bufs.shared.get(&t) {
                let unit = self.unit(p, slicer.rows.as_ref(), t);
                let view = match bufs.own.get(&t) {
                    Some(&buf) => unit.own_or_slot(p, (t, *s), buf, slot, u.is_own, &mut compute),
                    None => unit.bind(p, slot, *s, u.zero, true, None, &mut compute),
                };
                slicer.cache.insert((t, *s), view);
            }
        }
        let needed = self.read_by_last(&computed);
        let mut later = Vec::new();
        for (e, s) in &computed {
            if self.after.iter().any(|(a, _)| a.output == e.output) {
                continue;
            }
            let into = match needed.contains(&e.output) {
                true => &mut compute,
                false => &mut later,
            };
            emit_body_expr(p, slicer, &sched, e, *s, self.transport, into)?;
        }
        body.push(Node::IfThenElse {
            cond: u.is_final,
            then_body: Vec::new(),
            else_body: compute,
        });
        Ok(Node::IfThenElse {
            cond: u.is_final,
            then_body: Vec::new(),
            else_body: later,
        })
    }

    /// The results of `computed` that the last expression reads, directly or through
    /// other results of it (a permute view's read is a read of what it views).
    fn read_by_last(&self, computed: &[(Expr, usize)]) -> HashSet<TensorId> {
        let views = &self.g.views;
        let mut wanted: HashSet<TensorId> = (self.last.inputs.iter())
            .flat_map(|&t| [t, source(views, t)])
            .collect();
        let mut needed = HashSet::new();
        for (e, _) in computed.iter().rev() {
            if wanted.contains(&e.output) {
                needed.insert(e.output);
                wanted.extend(e.inputs.iter().flat_map(|&t| [t, source(views, t)]));
            }
        }
        needed
    }

    /// Binds the unit's rows of one gather: the local shard's rows at step 0, else (after
    /// the unit's pool stream) the slot they arrived in.
    fn bind_gathered(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        gth: &Gather,
        worker: StreamId,
        compute: &mut Vec<Node>,
    ) {
        let u = &self.u;
        let unit = self.unit(p, slicer.rows.as_ref(), gth.out);
        let view = unit.view(p, gth.out, gth.s);
        let local = self.unit(p, slicer.rows.as_ref(), gth.input);
        let mut then_body = Vec::new();
        let shard = (gth.input, gth.in_axis);
        local.bind(
            p,
            shard.0,
            shard.1,
            u.zero,
            false,
            Some(view),
            &mut then_body,
        );
        let slots = bufs.received[&gth.out];
        let whole = bufs.whole.contains(&gth.out);
        if whole {
            // The own block lands in the whole buffer too (the weight gradients after
            // the loop read every block from it).
            let own = unit.bind(p, slots, gth.s, u.chunk, false, None, &mut then_body);
            then_body.push(Node::Compute(Expr {
                op: Op::Set,
                inputs: vec![view],
                output: own,
            }));
        }
        let mut else_body = vec![Node::Synchronize { stream: worker }];
        let at = if whole { u.chunk } else { u.slot_index };
        unit.bind(p, slots, gth.s, at, true, Some(view), &mut else_body);
        compute.push(Node::IfThenElse {
            cond: u.is_own,
            then_body,
            else_body,
        });
        slicer.cache.insert((gth.out, gth.s), view);
    }

    /// Step 3 (steps 1..D): the last expression onto the running sum that arrived, and the
    /// ring step that passes the sum on (at step D into this device's output block).
    pub(super) fn emit_reduce(
        &self,
        p: &mut HostProgram,
        bufs: &Buffers,
        slicer: &mut Slicer,
        streams: &UnitStreams,
        body: &mut Vec<Node>,
    ) -> Result<()> {
        let u = &self.u;
        let mut reduce = vec![Node::Synchronize {
            stream: streams.arrived,
        }];
        let map = axis_map(&p.ir, &self.last);
        let mut operands = Vec::new();
        for (i, &t) in self.last.inputs.iter().enumerate() {
            let v = match map.producer_axis(i, self.s_last) {
                None => t,
                Some(q) => match (bufs.shared.get(&t), bufs.own.get(&t)) {
                    (Some(&slot), Some(&buf)) => {
                        let unit = self.unit(p, slicer.rows.as_ref(), t);
                        unit.own_or_slot(p, (t, q), buf, slot, u.is_final, &mut reduce)
                    }
                    // A loop result kept whole, or an input of the loop: its chunk (at
                    // step D `chunk` is this device's own).
                    _ => slicer.slice(p, t, q, &mut reduce),
                },
            };
            operands.push(drop_didx(p, v, u.zero, &mut reduce));
        }
        let sums = RunningSums {
            acc: bufs.acc,
            rs: self.rs,
            rows: slicer.rows.as_ref(),
            zero: u.zero,
        };
        // Ring step j - 1 (the last one, into the output block, at j = D).
        let ring_step = RingStep {
            step: u.sum_step,
            is_first: u.is_first_sum,
            is_last: u.is_final,
            next_step: u.step,
            from: u.from,
            to: u.to,
            worker: streams.worker,
            compute: streams.original,
        };
        ring_step.emit(p, &sums, operands, self.transport, &mut reduce)?;
        body.push(Node::IfThenElse {
            cond: u.is_own,
            then_body: Vec::new(),
            else_body: reduce,
        });
        Ok(())
    }
}
