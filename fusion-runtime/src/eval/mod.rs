//! The host-IR interpreter: runs a [`HostProgram`] for one rank.
//!
//! Binds inputs (and preallocated outputs), evaluates scalars (extents, loop indices, the
//! rank, the stream count), and walks the nodes: allocations, stream switches and waits,
//! views, communications, and compute lowered to backend [`Kernel`](crate::device::Kernel)s.

mod bind;
mod compute;
pub mod race;

use std::collections::HashMap;
use std::time::Instant;

use fusion_compiler::hir::{
    for_each_node, CommId, Communication, HostProgram, Node, NodeKind, P2PDirection, StreamDef,
    COMPUTE_STREAMS, P2P,
};
use fusion_compiler::ir::{IterKind, NamedScalar, ParallelType, Scalar, ScalarId, TensorId};

pub use bind::{bind_dtypes, bind_inputs, check_didx_extents, mesh_devices, SymbolBindings};
pub use race::{RaceCheck, RaceError};

use race::RaceChecker;

use crate::comm::{is_peer_copy, Communicator};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::streams::{StreamHandle, StreamLayout};
use crate::tensor::Tensor;

/// What one call did: allocations and memory high-water mark (bytes of buffers the call
/// allocated and had not yet released).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Buffers the call allocated.
    pub allocations: usize,
    /// Their bytes, in all.
    pub allocated_bytes: usize,
    /// The most bytes of them alive at once.
    pub peak_live_bytes: usize,
    /// Nodes run, loops and branches included, every iteration counted.
    pub nodes_executed: usize,
    /// Host time per kind of leaf node (not loops or branches), indexed by
    /// `NodeKind as usize`: where the interpreter's time goes (see [`Self::host_profile`]).
    pub host_by_kind: [HostTime; NodeKind::ALL.len()],
    /// A replayed call: the host time from the call's start to its graph launch (finding
    /// the program, allocating the outputs, matching the addresses), count 1.
    pub replay_setup: HostTime,
    /// A replayed call: the host time of its one graph launch (count 1), so that a call's
    /// host time splits into the setup, the launch and what follows.
    pub graph_launch: HostTime,
    /// A replayed call: the nodes of the graph it launched.
    pub graph_nodes: usize,
}

/// Host time spent on one kind of host-IR node during a call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostTime {
    /// How many nodes of the kind ran.
    pub count: u32,
    /// Their host time, in all.
    pub nanos: u64,
}

impl ExecStats {
    /// The node kinds that ran, with their host time, most expensive first.
    pub fn host_profile(&self) -> Vec<(NodeKind, HostTime)> {
        let mut v: Vec<(NodeKind, HostTime)> = NodeKind::ALL
            .iter()
            .zip(self.host_by_kind)
            .filter(|(_, h)| h.count > 0)
            .map(|(&k, h)| (k, h))
            .collect();
        v.sort_by_key(|h| std::cmp::Reverse(h.1.nanos));
        v
    }
}

/// Everything a call needs besides the program.
pub struct CallContext<'a> {
    /// The calling rank's device.
    pub device: &'a dyn Device,
    /// The calling rank's communicator.
    pub comm: &'a dyn Communicator,
    /// The calling rank.
    pub rank: usize,
    /// The size of the worker stream pool (`numberOfStreams`).
    pub number_of_streams: usize,
    /// Record a timeline of communications and kernels (synchronizes at the end).
    pub trace: bool,
    /// Allocate the buffers peers copy into with [`Device::allocate_shared`] (a launched
    /// world whose peers in other processes write into them).
    pub shared_receives: bool,
    /// The program's buffers that peers copy into and that it allocates itself
    /// ([`PeerCopyReceives::internal`]): asked of the communicator's kept receive buffers
    /// ([`crate::comm::Capabilities::kept_receives`]) first,
    /// so they are the same memory at every call.
    pub kept_receives: Option<&'a std::collections::HashSet<TensorId>>,
    /// Also record a host-side span for every node the call executes ([`HostSpan`]).
    pub trace_nodes: bool,
    /// Check the program's stream order ([`race`]): a race fails the call.
    pub race_check: bool,
}

/// One interval of a traced call, in milliseconds from the call's start on this device.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// What ran: `Allgather`, `P2P group`, `Matmul`, ...
    pub name: String,
    /// Whether it moved data between devices (versus computing).
    pub communication: bool,
    /// The stream it ran on.
    pub stream: StreamHandle,
    /// The stream-loop index it belonged to, if any.
    pub chunk: Option<i64>,
    /// When it started.
    pub start_ms: f64,
    /// When it ended.
    pub end_ms: f64,
    /// The node that issued it (its pre-order index in the program), when the call
    /// traced its nodes.
    pub node: Option<usize>,
}

/// The host side of one executed node of a traced call: when the rank's thread ran it,
/// in milliseconds from the call's start on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct HostSpan {
    /// The node's pre-order index in the program (`for_each_node` order), so every
    /// execution of a loop body's node has the same id.
    pub node: usize,
    /// The node's kind.
    pub kind: NodeKind,
    /// The stream current when the node started.
    pub stream: StreamHandle,
    /// The stream-loop index it ran in, if any.
    pub chunk: Option<i64>,
    /// When the thread started it.
    pub start_ms: f64,
    /// When the thread finished it.
    pub end_ms: f64,
}

struct PendingEvent {
    name: String,
    communication: bool,
    stream: StreamHandle,
    chunk: Option<i64>,
    start: usize,
    end: usize,
    node: Option<usize>,
}

/// What one call returns: outputs, statistics, and the timelines when traced.
pub struct Execution {
    /// The outputs, in order (placeholders where this rank holds none).
    pub outputs: Vec<Tensor>,
    /// What the call did.
    pub stats: ExecStats,
    /// The device intervals, when traced.
    pub trace: Option<Vec<TraceEvent>>,
    /// One span per executed node, when `CallContext::trace_nodes` is set.
    pub host_trace: Option<Vec<HostSpan>>,
    /// The happens-before order of the call's accesses, when race checking.
    pub race: Option<RaceCheck>,
}

/// Every node of `program` with its pre-order index (the ids of [`HostSpan::node`]).
pub fn node_ids(program: &HostProgram) -> HashMap<*const Node, usize> {
    let mut ids = HashMap::new();
    for_each_node(&program.body, &mut |n| {
        let next = ids.len();
        ids.insert(n as *const Node, next);
    });
    ids
}

/// Runs `program` on one rank with the symbol values bound from the inputs
/// ([`bind_inputs`]). `outputs`, when given, are written in place.
pub fn execute(
    program: &HostProgram,
    ctx: &CallContext<'_>,
    symbols: &SymbolBindings,
    inputs: &[&Tensor],
    outputs: Option<&[&Tensor]>,
) -> Result<Execution> {
    if ctx.number_of_streams == 0 {
        return Err(Error::World("number_of_streams must be at least 1".into()));
    }
    if inputs.len() != program.inputs.len() {
        return Err(Error::Arity {
            what: "inputs".into(),
            expected: program.inputs.len(),
            actual: inputs.len(),
        });
    }
    ctx.device.ensure_streams(ctx.streams().workers())?;
    let mut ev = Evaluator::new(program, ctx, symbols);
    if ctx.race_check {
        ev.race = Some(RaceChecker::new(program, ctx.rank, ctx.streams()));
    }
    if ctx.trace_nodes {
        ev.node_ids = Some(node_ids(program));
    }
    if ctx.trace || ctx.trace_nodes {
        ctx.device.clear_markers();
        ev.origin = Some(ctx.device.record_marker(0)?);
    }
    for (&tid, t) in program.inputs.iter().zip(inputs) {
        let t = if ev.in_mesh[tid.index()] && !ctx.device.is_resident(t) {
            ctx.device.upload(t)?
        } else {
            (*t).clone()
        };
        ev.tensors[tid.index()] = Some(t);
    }
    if let Some(outs) = outputs {
        ev.bind_outputs(outs)?;
    }
    for &(out, input) in &program.aliases {
        if ev.in_mesh[out.index()] {
            if ev.tensors[out.index()].is_some() {
                return Err(Error::bad_tensor(
                    program.ir.tensor_name(out),
                    None,
                    "is written in place into an input; do not also pass it preallocated",
                ));
            }
            ev.tensors[out.index()] = ev.tensors[input.index()].clone();
        }
    }
    if let Some(rc) = ev.race.as_mut() {
        // Name the caller's buffers after the program's inputs and outputs.
        for &t in program.inputs.iter().chain(&program.outputs) {
            if let Some(x) = &ev.tensors[t.index()] {
                rc.caller(t, x);
            }
        }
    }
    ev.run_nodes(&program.body)?;
    let mut result = Vec::with_capacity(program.outputs.len());
    for &t in &program.outputs {
        if ev.in_mesh[t.index()] {
            let v = ev.tensors[t.index()].clone().ok_or_else(|| {
                Error::Internal(format!(
                    "output {} was never produced",
                    program.ir.tensor_name(t)
                ))
            })?;
            result.push(v);
        } else {
            result.push(Tensor::placeholder(program.ir.tensor(t).dtype));
        }
    }
    let race = match ev.race.take() {
        Some(checker) => Some(checker.finish(&result).map_err(Error::Race)?),
        None => None,
    };
    let trace = match ev.origin {
        Some(origin) => {
            let mut events = Vec::with_capacity(ev.pending.len());
            for p in &ev.pending {
                events.push(TraceEvent {
                    name: p.name.clone(),
                    communication: p.communication,
                    stream: p.stream,
                    chunk: p.chunk,
                    start_ms: ctx.device.marker_elapsed_ms(origin, p.start)?,
                    end_ms: ctx.device.marker_elapsed_ms(origin, p.end)?,
                    node: p.node,
                });
            }
            ctx.device.clear_markers();
            Some(events)
        }
        None => None,
    };
    let host_trace = ev.node_ids.is_some().then_some(ev.host_spans);
    Ok(Execution {
        outputs: result,
        stats: ev.stats,
        trace,
        host_trace,
        race,
    })
}

/// Interpreter state for one call on one rank.
pub(crate) struct Evaluator<'a> {
    pub(crate) p: &'a HostProgram,
    pub(crate) ctx: &'a CallContext<'a>,
    pub(crate) tensors: Vec<Option<Tensor>>,
    owned_bytes: Vec<usize>,
    pub(crate) in_mesh: Vec<bool>,
    leaves: Vec<Option<i64>>,
    streams: Vec<Option<StreamHandle>>,
    pub(crate) current: StreamHandle,
    comm_streams: HashMap<CommId, StreamHandle>,
    pub(crate) stats: ExecStats,
    live_bytes: usize,
    origin: Option<usize>,
    pending: Vec<PendingEvent>,
    group_start: Option<usize>,
    chunk: Option<i64>,
    /// Tensors whose buffers peers copy into (see [`received_by_peer_copies`]).
    shared: std::collections::HashSet<TensorId>,
    /// When tracing nodes: every node's id, the node running now, and the spans so far.
    node_ids: Option<HashMap<*const Node, usize>>,
    node: Option<usize>,
    host_origin: Instant,
    host_spans: Vec<HostSpan>,
    /// The stream-order checker, when the call asks for it.
    pub(crate) race: Option<RaceChecker<'a>>,
    /// Whether every node gets a `tracing` span (and an NVTX range): something listens.
    node_scopes: bool,
}

/// The values of a program's leaf scalars for a call: the dimension symbols, the rank and
/// the stream count.
fn bound_leaves(
    p: &HostProgram,
    symbols: &SymbolBindings,
    rank: usize,
    number_of_streams: usize,
) -> Vec<Option<i64>> {
    (0..p.ir.scalar_count())
        .map(|i| {
            let s = ScalarId::from_index(i);
            match p.ir.scalar_node(s) {
                Scalar::Symbol(_) => symbols.get(s),
                Scalar::Named(NamedScalar::Rank) => Some(rank as i64),
                Scalar::Named(NamedScalar::NumberOfStreams) => Some(number_of_streams as i64),
                _ => None,
            }
        })
        .collect()
}

/// The shape a rank stores for `t` (DIDx and broadcast axes have extent 1), with `eval`
/// giving the values of extents.
fn local_shape_of(
    p: &HostProgram,
    t: TensorId,
    eval: &dyn Fn(ScalarId) -> Result<i64>,
) -> Result<Vec<usize>> {
    let f = &p.ir;
    f.visible_axes(t)
        .into_iter()
        .map(|pos| {
            let d = f.axis(t, pos);
            if d.parallel == ParallelType::DIDx || d.kind == IterKind::Broadcast {
                return Ok(1);
            }
            let v = eval(d.extent)?;
            usize::try_from(v).map_err(|_| {
                Error::bad_tensor(f.tensor_name(t), Some(pos), format!("negative extent {v}"))
            })
        })
        .collect()
}

/// An output's dtype and the shape one rank stores.
pub type OutputLayout = (fusion_compiler::DType, Vec<usize>);

/// The dtype and shape of each output of `program` on `rank`, or `None` where the rank
/// holds no part of it (a sub-mesh): what preallocated outputs must look like.
pub fn output_layouts(
    p: &HostProgram,
    symbols: &SymbolBindings,
    rank: usize,
    number_of_streams: usize,
) -> Result<Vec<Option<OutputLayout>>> {
    let leaves = bound_leaves(p, symbols, rank, number_of_streams);
    let eval = |s: ScalarId| -> Result<i64> {
        p.ir.evaluate(s, &|leaf| leaves[leaf.index()])
            .ok_or_else(|| {
                Error::Internal(format!(
                    "cannot evaluate {} on rank {rank}",
                    p.ir.display_scalar(s)
                ))
            })
    };
    p.outputs
        .iter()
        .map(|&t| {
            if !mesh_devices(&p.ir, t, p.world_size).contains(&rank) {
                return Ok(None);
            }
            Ok(Some((p.ir.tensor(t).dtype, local_shape_of(p, t, &eval)?)))
        })
        .collect()
}

/// A program's receive buffers of peer copies (the tensors owning the memory a peer
/// copies into, [`crate::comm::is_peer_copy`]), split by who owns them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerCopyReceives {
    /// Allocated by the program itself: they can be kept from one call to the next.
    pub internal: std::collections::HashSet<TensorId>,
    /// Inputs or outputs (or the memory behind an output), which the caller owns and may
    /// move between calls.
    pub external: Vec<TensorId>,
}

impl PeerCopyReceives {
    /// Whether the program's peer copies land in memory of its own only.
    pub fn all_internal(&self) -> bool {
        self.external.is_empty()
    }
}

/// [`PeerCopyReceives`] of `p`.
pub fn peer_copy_receives(p: &HostProgram) -> PeerCopyReceives {
    let roots = received_by_peer_copies(p);
    if roots.is_empty() {
        return PeerCopyReceives::default();
    }
    let parents = view_parents(p);
    let mut owned_by_caller = std::collections::HashSet::new();
    let mut stack: Vec<TensorId> = p.inputs.iter().chain(&p.outputs).copied().collect();
    while let Some(t) = stack.pop() {
        if owned_by_caller.insert(t) {
            if let Some(ps) = parents.get(&t) {
                stack.extend(ps.iter().copied());
            }
        }
    }
    let mut external: Vec<TensorId> = roots
        .iter()
        .copied()
        .filter(|t| owned_by_caller.contains(t))
        .collect();
    external.sort_by_key(|t| t.index());
    let internal = roots
        .into_iter()
        .filter(|t| !owned_by_caller.contains(t))
        .collect();
    PeerCopyReceives { internal, external }
}

/// Every view's parents (a view may be defined in both branches of an `IfThenElse`).
fn view_parents(p: &HostProgram) -> HashMap<TensorId, Vec<TensorId>> {
    let mut parents: HashMap<TensorId, Vec<TensorId>> = HashMap::new();
    for_each_node(&p.body, &mut |n| match n {
        Node::AliasSelect { input, output, .. } => {
            parents.entry(*output).or_default().push(*input);
        }
        Node::Compute(e) if e.op.is_view() => {
            if let Some(&i) = e.inputs.first() {
                parents.entry(e.output).or_default().push(i);
            }
        }
        _ => {}
    });
    parents
}

/// The tensors a program allocates whose memory a peer copies into: the allocations behind
/// the receive buffers of peer-copy P2P transfers and the outputs of peer-copy collectives,
/// following views back to the tensor that owns the memory. Views are followed as they are
/// defined where the transfer runs (a view defined in both branches of an `IfThenElse`
/// over different tensors leads, at a receive inside one branch, to that branch's tensor).
pub fn received_by_peer_copies(p: &HostProgram) -> std::collections::HashSet<TensorId> {
    let mut defs = HashMap::new();
    let mut roots = std::collections::HashSet::new();
    received_in(&p.body, &mut defs, &mut roots);
    roots
}

/// Walks `nodes` with the view definitions `defs` in effect, adding the roots behind every
/// peer-copy receive to `roots`.
fn received_in(
    nodes: &[Node],
    defs: &mut HashMap<TensorId, Vec<TensorId>>,
    roots: &mut std::collections::HashSet<TensorId>,
) {
    for n in nodes {
        match n {
            Node::AliasSelect { input, output, .. } => {
                defs.insert(*output, vec![*input]);
            }
            Node::Compute(e) if e.op.is_view() => {
                if let Some(&i) = e.inputs.first() {
                    defs.insert(e.output, vec![i]);
                }
            }
            Node::P2P(x) if x.direction == P2PDirection::Recv && is_peer_copy(x.transport) => {
                roots.extend(roots_of(x.buffer, defs));
            }
            Node::Communication(c) if is_peer_copy(c.transport) => {
                roots.extend(roots_of(c.output, defs));
            }
            Node::ForLoop(l) => {
                // Twice: a view defined late in the body reaches the next iteration.
                received_in(&l.body, defs, roots);
                received_in(&l.body, defs, roots);
            }
            Node::IfThenElse {
                then_body,
                else_body,
                ..
            } => {
                let mut other = defs.clone();
                received_in(then_body, defs, roots);
                received_in(else_body, &mut other, roots);
                for (t, ps) in other {
                    let mine = defs.entry(t).or_default();
                    for q in ps {
                        if !mine.contains(&q) {
                            mine.push(q);
                        }
                    }
                }
            }
            _ => {}
        }
    }
}

/// The tensors owning the memory of `t` under the view definitions `defs`.
fn roots_of(t: TensorId, defs: &HashMap<TensorId, Vec<TensorId>>) -> Vec<TensorId> {
    let mut out = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![t];
    while let Some(t) = stack.pop() {
        if !seen.insert(t) {
            continue;
        }
        match defs.get(&t) {
            Some(ps) => stack.extend(ps.iter().copied()),
            None => out.push(t),
        }
    }
    out
}

impl CallContext<'_> {
    /// How the call numbers its streams: the main stream, `number_of_streams` pool streams,
    /// then the compute streams.
    pub fn streams(&self) -> StreamLayout {
        StreamLayout::new(self.number_of_streams)
    }
}

impl<'a> Evaluator<'a> {
    fn new(p: &'a HostProgram, ctx: &'a CallContext<'a>, symbols: &SymbolBindings) -> Self {
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

    fn bind_outputs(&mut self, outs: &[&Tensor]) -> Result<()> {
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

    fn stream_of(&self, s: fusion_compiler::hir::StreamId) -> Result<StreamHandle> {
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
    fn wait_for(&mut self, waitee: StreamHandle) -> Result<()> {
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

    fn run_nodes(&mut self, nodes: &'a [Node]) -> Result<()> {
        for n in nodes {
            self.run_node(n)?;
        }
        Ok(())
    }

    fn run_node(&mut self, n: &'a Node) -> Result<()> {
        self.stats.nodes_executed += 1;
        if let Some(rc) = self.race.as_mut() {
            rc.at(n);
        }
        let id = match &self.node_ids {
            Some(ids) => ids.get(&(n as *const Node)).copied(),
            None => None,
        };
        let _scope = self
            .node_scopes
            .then(|| crate::observe::NodeScope::enter(n, id));
        if id.is_some() {
            return self.run_node_traced(n, id);
        }
        if matches!(n, Node::ForLoop(_) | Node::IfThenElse { .. }) {
            return self.run_node_untimed(n);
        }
        let start = Instant::now();
        let r = self.run_node_untimed(n);
        self.count_host_time(n, start.elapsed().as_nanos() as u64);
        r
    }

    fn count_host_time(&mut self, n: &Node, nanos: u64) {
        let h = &mut self.stats.host_by_kind[n.kind() as usize];
        h.count += 1;
        h.nanos += nanos;
    }

    /// Runs a node and records its host span (loops and branches span their bodies).
    fn run_node_traced(&mut self, n: &'a Node, id: Option<usize>) -> Result<()> {
        let (outer, chunk, stream) = (self.node, self.chunk, self.current);
        self.node = id;
        let start = Instant::now();
        let r = self.run_node_untimed(n);
        let end = Instant::now();
        self.node = outer;
        if !matches!(n, Node::ForLoop(_) | Node::IfThenElse { .. }) {
            self.count_host_time(n, (end - start).as_nanos() as u64);
        }
        let origin = self.host_origin;
        let ms = |t: Instant| (t - origin).as_secs_f64() * 1e3;
        if let Some(node) = id {
            self.host_spans.push(HostSpan {
                node,
                kind: n.kind(),
                stream,
                chunk,
                start_ms: ms(start),
                end_ms: ms(end),
            });
        }
        r
    }

    fn run_node_untimed(&mut self, n: &'a Node) -> Result<()> {
        match n {
            Node::Allocate { tensor } => {
                if self.in_mesh[tensor.index()] {
                    self.get_or_allocate(*tensor)?;
                }
            }
            Node::Deallocate { tensor } => {
                if let Some(rc) = self.race.as_mut() {
                    rc.deallocated(*tensor);
                }
                self.tensors[tensor.index()] = None;
                self.live_bytes -= std::mem::take(&mut self.owned_bytes[tensor.index()]);
            }
            Node::ForLoop(l) => {
                let (start, stop) = (self.eval(l.start)?, self.eval(l.stop)?);
                for i in start..stop {
                    self.leaves[l.index.index()] = Some(i);
                    self.chunk = Some(i);
                    if let Some(rc) = self.race.as_mut() {
                        rc.iteration(l.index, Some(i));
                    }
                    self.run_nodes(&l.body)?;
                }
                if let Some(rc) = self.race.as_mut() {
                    rc.iteration(l.index, None);
                }
                self.leaves[l.index.index()] = None;
                self.chunk = None;
            }
            Node::IfThenElse {
                cond,
                then_body,
                else_body,
            } => {
                if self.eval(*cond)? != 0 {
                    self.run_nodes(then_body)?;
                } else {
                    self.run_nodes(else_body)?;
                }
            }
            Node::GetCurrentStream { stream } => {
                self.streams[stream.index()] = Some(self.current);
            }
            Node::SetCurrentStream { stream } => {
                self.current = self.stream_of(*stream)?;
            }
            Node::Synchronize { stream } => {
                let s = self.stream_of(*stream)?;
                self.wait_for(s)?;
            }
            Node::AliasSelect {
                input,
                output,
                axis,
                index,
            } => {
                if self.in_mesh[input.index()] {
                    let stored = self.stored_axis(*input, *axis)?;
                    let i = self.eval(*index)?;
                    let v = self.get(*input)?.select(stored, i as usize)?;
                    self.tensors[output.index()] = Some(v);
                }
            }
            Node::Communication(c) => self.communication(c)?,
            Node::P2P(x) => self.p2p(x)?,
            Node::StartCoalescing => {
                self.group_start = self.mark()?;
                self.ctx.comm.group_start()?;
                if let Some(rc) = self.race.as_mut() {
                    rc.group_start();
                }
            }
            Node::EndCoalescing { id } => {
                self.ctx.comm.group_end()?;
                if let Some(rc) = self.race.as_mut() {
                    rc.group_end();
                }
                let start = self.group_start.take();
                self.traced(start, "P2P group", true)?;
                self.comm_streams.insert(*id, self.current);
            }
            Node::Wait { comm } => {
                if let Some(&s) = self.comm_streams.get(comm) {
                    self.wait_for(s)?;
                }
            }
            Node::Compute(e) => {
                let start = if e.op.is_view() { None } else { self.mark()? };
                self.compute(e)?;
                if !e.op.is_view() && self.in_mesh[e.output.index()] {
                    self.record_access(&e.inputs, &[e.output])?;
                }
                if start.is_some() {
                    self.traced(start, &e.op.name(), false)?;
                }
            }
            Node::Launch {
                segment,
                inputs: _,
                outputs,
            } => {
                let start = self.mark()?;
                self.launch(*segment, outputs)?;
                self.traced(start, "fused kernel", false)?;
            }
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

    fn communication(&mut self, c: &Communication) -> Result<()> {
        let rank = self.ctx.rank;
        if !c.team.contains(&rank) {
            return Ok(());
        }
        let input = if self.in_mesh[c.input.index()] {
            Some(self.get(c.input)?.clone())
        } else {
            None
        };
        let output = if self.in_mesh[c.output.index()] {
            Some(self.get_or_allocate(c.output)?)
        } else {
            None
        };
        let start = self.mark()?;
        self.ctx
            .comm
            .collective(self.current, c, input.as_ref(), output.as_ref())?;
        if let Some(rc) = self.race.as_mut() {
            let reads: Vec<_> = input.iter().map(|t| (c.input, t)).collect();
            let writes: Vec<_> = output.iter().map(|t| (c.output, t)).collect();
            rc.access(self.current, &reads, &writes);
        }
        self.traced(start, c.kind.name(), true)?;
        self.comm_streams.insert(c.id, self.current);
        Ok(())
    }

    fn p2p(&mut self, x: &P2P) -> Result<()> {
        let peer = self.eval(x.peer)?;
        if peer < 0 || peer as usize >= self.p.world_size {
            return Err(Error::Communication {
                rank: self.ctx.rank,
                reason: format!(
                    "P2P peer {peer} is outside the world of {}",
                    self.p.world_size
                ),
            });
        }
        let peer = peer as usize;
        let in_group = self.group_start.is_some();
        let start = if in_group { None } else { self.mark()? };
        let describe = || {
            let (what, to) = match x.direction {
                P2PDirection::Send => ("send", "to"),
                P2PDirection::Recv => ("receive", "from"),
            };
            let mut s = format!(
                "the P2P {what} of `{}` {to} rank {peer}",
                self.p.ir.tensor_name(x.buffer)
            );
            if let Some(i) = self.chunk {
                s.push_str(&format!(" in stream-loop iteration {i}"));
            }
            s
        };
        self.ctx.comm.describe_next_transfer(&describe);
        match x.direction {
            P2PDirection::Send => {
                let buf = self.get(x.buffer)?.clone();
                self.ctx.comm.send(self.current, peer, &buf, x.transport)?;
                if let Some(rc) = self.race.as_mut() {
                    rc.transfer(self.current, x.buffer, &buf, false);
                }
            }
            P2PDirection::Recv => {
                let buf = self.get_or_allocate(x.buffer)?;
                self.ctx.comm.recv(self.current, peer, &buf, x.transport)?;
                if let Some(rc) = self.race.as_mut() {
                    rc.transfer(self.current, x.buffer, &buf, true);
                }
            }
        }
        let name = match x.direction {
            P2PDirection::Send => "send",
            P2PDirection::Recv => "recv",
        };
        self.traced(start, name, true)?;
        self.comm_streams.insert(x.id, self.current);
        Ok(())
    }
}
