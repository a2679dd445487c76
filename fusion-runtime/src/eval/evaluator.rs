//! The interpreter's state for one call on one rank, and what the node walk asks of it:
//! bound tensors and buffers, scalar values, streams, trace markers and the race checker.

use std::collections::HashMap;
use std::time::Instant;

use fusion_compiler::hir::{CommId, GatheredGemmId, HostProgram, Node, StreamDef, COMPUTE_STREAMS};
use fusion_compiler::ir::{ScalarId, TensorId};

use super::bind::{mesh_devices, SymbolBindings};
use super::call::{CallContext, ExecStats, HostSpan};
use super::launched_gemm::Launched;
use super::race::RaceChecker;
use super::shapes::{bound_leaves, local_shape_of};
use crate::error::{Error, Result};
use crate::program_facts::received_by_peer_copies;
use crate::streams::StreamHandle;
use crate::tensor::Tensor;

/// A traced interval whose device markers are read when the call ends.
pub(super) struct PendingEvent {
    pub(super) name: String,
    pub(super) communication: bool,
    pub(super) stream: StreamHandle,
    pub(super) chunk: Option<i64>,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) node: Option<usize>,
}

/// Interpreter state for one call on one rank.
pub(crate) struct Evaluator<'a> {
    pub(crate) p: &'a HostProgram,
    pub(crate) ctx: &'a CallContext<'a>,
    pub(crate) tensors: Vec<Option<Tensor>>,
    pub(super) owned_bytes: Vec<usize>,
    pub(crate) in_mesh: Vec<bool>,
    pub(super) leaves: Vec<Option<i64>>,
    pub(super) streams: Vec<Option<StreamHandle>>,
    pub(crate) current: StreamHandle,
    pub(super) comm_streams: HashMap<CommId, StreamHandle>,
    pub(crate) stats: ExecStats,
    pub(super) live_bytes: usize,
    pub(super) origin: Option<usize>,
    pub(super) pending: Vec<PendingEvent>,
    pub(super) group_start: Option<usize>,
    pub(super) chunk: Option<i64>,
    /// Tensors whose buffers peers copy into (see [`received_by_peer_copies`]).
    pub(super) shared: std::collections::HashSet<TensorId>,
    /// When tracing nodes: every node's id, the node running now, and the spans so far.
    pub(super) node_ids: Option<HashMap<*const Node, usize>>,
    pub(super) node: Option<usize>,
    pub(super) host_origin: Instant,
    pub(super) host_spans: Vec<HostSpan>,
    /// The stream-order checker, when the call asks for it.
    pub(crate) race: Option<RaceChecker<'a>>,
    /// Whether every node gets a `tracing` span (and an NVTX range): something listens.
    pub(super) node_scopes: bool,
    /// Gathered GEMMs launched and not yet joined.
    pub(super) gathered: HashMap<GatheredGemmId, Launched>,
}

impl<'a> Evaluator<'a> {
    pub(super) fn new(
        p: &'a HostProgram,
        ctx: &'a CallContext<'a>,
        symbols: &SymbolBindings,
    ) -> Self {
        let n = p.ir.tensor_count();
        let in_mesh = (0..n)
            .map(|i| {
                let t = TensorId::from_index(i);
                mesh_devices(&p.ir, t, p.world_size).contains(&ctx.rank)
            })
            .collect();
        let leaves = bound_leaves(p, symbols, ctx.rank, ctx.number_of_streams);
        Evaluator {
            p,
            ctx,
            tensors: vec![None; n],
            owned_bytes: vec![0; n],
            in_mesh,
            leaves,
            streams: vec![None; p.streams.len()],
            current: 0,
            comm_streams: HashMap::new(),
            stats: ExecStats::default(),
            live_bytes: 0,
            origin: None,
            pending: Vec::new(),
            group_start: None,
            chunk: None,
            shared: if ctx.shared_receives {
                received_by_peer_copies(p)
            } else {
                Default::default()
            },
            node_ids: None,
            node: None,
            host_origin: Instant::now(),
            host_spans: Vec::new(),
            race: None,
            node_scopes: crate::observe::node_scopes_wanted(),
            gathered: HashMap::new(),
        }
    }

    /// A trace marker on the current stream, when tracing.
    pub(crate) fn mark(&self) -> Result<Option<usize>> {
        match self.origin {
            Some(_) => Ok(Some(self.ctx.device.record_marker(self.current)?)),
            None => Ok(None),
        }
    }

    /// Records a traced interval that started at `start`, ending now.
    pub(crate) fn traced(
        &mut self,
        start: Option<usize>,
        name: &str,
        communication: bool,
    ) -> Result<()> {
        if let Some(start) = start {
            let end = self.ctx.device.record_marker(self.current)?;
            self.pending.push(PendingEvent {
                name: name.to_string(),
                communication,
                stream: self.current,
                chunk: self.chunk,
                start,
                end,
                node: self.node,
            });
        }
        Ok(())
    }

    /// Evaluates a scalar; an unbound symbol is an error naming it.
    pub(crate) fn eval(&self, s: ScalarId) -> Result<i64> {
        self.p
            .ir
            .evaluate(s, &|leaf| self.leaves[leaf.index()])
            .ok_or_else(|| {
                Error::Internal(format!(
                    "cannot evaluate {} on rank {} (an extent no input of this rank binds, or \
                     a division by zero)",
                    self.p.ir.display_scalar(s),
                    self.ctx.rank
                ))
            })
    }

    /// The shape this rank stores for `t`: DIDx and broadcast axes have extent 1.
    pub(crate) fn local_shape(&self, t: TensorId) -> Result<Vec<usize>> {
        local_shape_of(self.p, t, &|s| self.eval(s))
    }

    pub(super) fn bind_outputs(&mut self, outs: &[&Tensor]) -> Result<()> {
        let p = self.p;
        if outs.len() != p.outputs.len() {
            return Err(Error::Arity {
                what: "preallocated outputs".into(),
                expected: p.outputs.len(),
                actual: outs.len(),
            });
        }
        for (&tid, t) in p.outputs.iter().zip(outs) {
            if !self.in_mesh[tid.index()] {
                continue;
            }
            let name = p.ir.tensor_name(tid);
            let dtype = p.ir.tensor(tid).dtype;
            let shape = self.local_shape(tid)?;
            if t.dtype() != dtype || t.shape() != shape.as_slice() {
                return Err(Error::bad_tensor(
                    name,
                    None,
                    format!(
                        "preallocated output must be {dtype} {shape:?} on this rank, got {} {:?}",
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            if !self.ctx.device.is_resident(t) {
                return Err(Error::bad_tensor(
                    name,
                    None,
                    "preallocated output must live on this rank's device",
                ));
            }
            self.tensors[tid.index()] = Some((*t).clone());
        }
        Ok(())
    }

    /// The tensor bound to `t`, or an error if nothing bound it.
    pub(crate) fn get(&self, t: TensorId) -> Result<&Tensor> {
        self.tensors[t.index()].as_ref().ok_or_else(|| {
            Error::Internal(format!(
                "{} is used on rank {} before it is defined",
                self.p.ir.tensor_name(t),
                self.ctx.rank
            ))
        })
    }

    /// The buffer bound to `t`, allocating it (local shape) if nothing is bound yet.
    pub(crate) fn get_or_allocate(&mut self, t: TensorId) -> Result<Tensor> {
        if let Some(x) = &self.tensors[t.index()] {
            return Ok(x.clone());
        }
        let shape = self.local_shape(t)?;
        let dtype = self.p.ir.tensor(t).dtype;
        let keeper = &self.ctx.comm.capabilities().kept_receives;
        let kept = match (self.ctx.kept_receives, keeper) {
            (Some(k), Some(keeper)) if k.contains(&t) => {
                keeper.take(self.current, dtype, &shape)?
            }
            _ => None,
        };
        let x = if let Some(x) = kept {
            x
        } else if self.shared.contains(&t) {
            self.ctx
                .device
                .allocate_shared(self.current, dtype, &shape)?
        } else {
            self.ctx.device.allocate(self.current, dtype, &shape)?
        };
        if let Some(rc) = self.race.as_mut() {
            rc.allocated(self.current, t, &x);
        }
        let bytes = x.nbytes();
        self.stats.allocations += 1;
        self.stats.allocated_bytes += bytes;
        self.live_bytes += bytes;
        self.stats.peak_live_bytes = self.stats.peak_live_bytes.max(self.live_bytes);
        self.owned_bytes[t.index()] = bytes;
        self.tensors[t.index()] = Some(x.clone());
        Ok(x)
    }

    pub(super) fn stream_of(&self, s: fusion_compiler::hir::StreamId) -> Result<StreamHandle> {
        match &self.p.streams[s.index()] {
            StreamDef::Captured => self.streams[s.index()].ok_or_else(|| {
                Error::Internal(format!("Stream {} used before GetCurrentStream", s.index()))
            }),
            StreamDef::Pool(i) => {
                let v = self.eval(*i)?;
                let layout = self.ctx.streams();
                usize::try_from(v)
                    .ok()
                    .and_then(|v| layout.pool(v))
                    .ok_or_else(|| {
                        Error::Internal(format!(
                            "stream index {v} outside the pool of {}",
                            layout.pool_size()
                        ))
                    })
            }
            StreamDef::Compute(i) => {
                let v = self.eval(*i)?;
                usize::try_from(v)
                    .ok()
                    .and_then(|v| self.ctx.streams().compute(v))
                    .ok_or_else(|| {
                        Error::Internal(format!(
                            "compute stream index {v} outside the {COMPUTE_STREAMS} compute \
                             streams"
                        ))
                    })
            }
        }
    }

    /// The current stream waits for `waitee`'s work so far (event record + wait).
    pub(super) fn wait_for(&mut self, waitee: StreamHandle) -> Result<()> {
        if waitee != self.current {
            self.ctx.device.stream_wait(self.current, waitee)?;
            if let Some(rc) = self.race.as_mut() {
                rc.stream_wait(self.current, waitee);
            }
        }
        Ok(())
    }

    /// Tells the race checker, if any, that the current node read `reads` and wrote
    /// `writes` (their bound buffers) on the current stream.
    pub(crate) fn record_access(&mut self, reads: &[TensorId], writes: &[TensorId]) -> Result<()> {
        if self.race.is_none() {
            return Ok(());
        }
        let bound = |ts: &[TensorId]| -> Result<Vec<(TensorId, Tensor)>> {
            ts.iter().map(|&t| Ok((t, self.get(t)?.clone()))).collect()
        };
        let (r, w) = (bound(reads)?, bound(writes)?);
        fn refs(v: &[(TensorId, Tensor)]) -> Vec<(TensorId, &Tensor)> {
            v.iter().map(|(id, t)| (*id, t)).collect()
        }
        let (r, w) = (refs(&r), refs(&w));
        if let Some(rc) = self.race.as_mut() {
            rc.access(self.current, &r, &w);
        }
        Ok(())
    }

    /// Index among stored axes of axis position `pos` of `t`.
    pub(crate) fn stored_axis(&self, t: TensorId, pos: usize) -> Result<usize> {
        self.p
            .ir
            .visible_axes(t)
            .iter()
            .position(|&q| q == pos)
            .ok_or_else(|| {
                Error::Internal(format!(
                    "axis {pos} of {} is a reduction axis and is not stored",
                    self.p.ir.tensor_name(t)
                ))
            })
    }
}
