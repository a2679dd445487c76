//! `StreamParallelType`: turns expressions with a Stream axis into host for-loops.
//!
//! Consecutive top-level expressions whose Stream axes map onto each other share one loop;
//! any other expression in between closes it. For each loop (seeds 000-002):
//!
//! ```text
//! Allocate every output of the loop's expressions
//! GetCurrentStream into S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams)); Synchronize S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams))
//!        slice inputs and outputs along the stream axis (AliasSelect), run the body
//!        SetCurrentStream(S); Synchronize Stream(i % numberOfStreams)
//! ```
//!
//! Two resharding patterns become P2P pipelines inside the loop:
//! - a `set` turning a DIDx axis into the Stream axis (an allgather, seed 001): the
//!   device's own chunk is a local copy (or, when only the loop reads the gathered stream
//!   buffer, the local shard itself), every other chunk a coalesced receive + send;
//! - a sum over the DIDx axis whose output is sharded along the loop's Stream axis (a
//!   reduce-scatter): each iteration sends the partial result chunk to the device that
//!   owns it and receives that device's partial for this one; a local sum follows the loop.
//!
//! With [`P2pSchedule::Ring`] an allgather's iteration `i` gathers the chunk of device
//! `rank - i`, so the local chunk comes first; a reduce-scatter's iteration `i` computes
//! the partial of device `rank + i + 1`, so the local chunk comes last. Either way every
//! send meets its receive in the same iteration.
//!
//! With `compute_first_streams` (the default), a loop whose local compute precedes its
//! communication runs that compute on the caller's stream `S`, in order, and only the
//! communication on the pool stream, which waits for `S`; a join loop after it makes `S`
//! wait for every pool stream.
//! With stream buffers on, intermediates produced and consumed inside one loop get
//! `numberOfStreams` slots instead of the full extent.
//!
//! Submodules: `views` (per-iteration slices and derived buffers), `exchange` (the
//! coalesced send/receive and the allgather step), `direct` and `ring` (the two
//! reduce-scatter pipelines), `subchunk` (row ranges of a block).

mod direct;
mod exchange;
mod gather_scatter;
mod ring;
mod subchunk;
mod views;

use std::collections::{HashMap, HashSet};

use direct::{
    emit_reduce_scatter_step, reduce_scatter_slots, slot_axis, sum_slots, ReduceScatterStep,
    RoundSum,
};
use exchange::{coalesced_exchange, emit_allgather_step, require_world_mesh};
use subchunk::{RowSlicing, SubChunkPlan};
pub(crate) use views::slice_tensor;
use views::{derived_tensor, with_axis_extent, Slicer};

use super::{Pass, PassContext};
use crate::error::{Error, Result};
use crate::hir::{for_each_node, CommBackend, ForLoop, HostProgram, Node, StreamDef, StreamId};
use crate::ir::{
    axis_map, Expr, Fusion, IterDomainId, IterKind, NamedScalar, Op, ParallelType, ScalarId,
    ScalarOp, TensorId,
};
use crate::options::{P2pSchedule, ReduceScatterPipeline};
use crate::resharding::{classify, MeshContext, Resharding};

/// The stream-lowering pass.
pub struct StreamParallelType;

enum Item {
    Node(Node),
    Loop(LoopGroup),
}

impl Pass for StreamParallelType {
    fn name(&self) -> &'static str {
        "StreamParallelType"
    }

    fn run(&self, p: &mut HostProgram, ctx: &PassContext) -> Result<()> {
        let body = std::mem::take(&mut p.body);
        let mut items = group_loops(p, body)?;
        fold_reduce_scatters(p, &mut items)?;
        let internal = if ctx.options.stream_buffers {
            loop_internal_tensors(p, &items)
        } else {
            HashSet::new()
        };
        let mut out = Vec::new();
        for item in items {
            match item {
                Item::Node(n) => out.push(n),
                Item::Loop(g) => out.extend(g.emit(p, ctx, &internal)?),
            }
        }
        p.body = out;
        Ok(())
    }
}

fn group_loops(p: &HostProgram, body: Vec<Node>) -> Result<Vec<Item>> {
    let mut items: Vec<Item> = Vec::new();
    for node in body {
        let stream = match &node {
            Node::Compute(e) => p.ir.find_parallel_axis(e.output, ParallelType::Stream),
            _ => None,
        };
        let Some(s) = stream else {
            // A view that does not read the open loop's results (e.g. a weight broadcast
            // for the loop's next matmul) moves before that loop instead of closing it.
            if let (Node::Compute(e), Some(Item::Loop(g))) = (&node, items.last()) {
                if e.op.is_view() && e.inputs.iter().all(|t| !g.produced.contains_key(t)) {
                    let at = items.len() - 1;
                    items.insert(at, Item::Node(node));
                    continue;
                }
            }
            items.push(Item::Node(node));
            continue;
        };
        let Node::Compute(e) = node else {
            unreachable!("stream axes come from compute nodes")
        };
        if let Some(Item::Loop(g)) = items.last_mut() {
            if g.accepts(&p.ir, &e, s)? {
                g.push(e, s);
                continue;
            }
        }
        let mut g = LoopGroup::new(&p.ir, &e, s)?;
        g.push(e, s);
        items.push(Item::Loop(g));
    }
    Ok(items)
}

/// A reduce-scatter folded into the loop that produces its input.
struct ReduceScatterFold {
    expr: Expr,
    /// Position of the reduced DIDx axis in the input.
    didx: usize,
    /// Position of the output's DIDx axis (the one the loop's Stream axis becomes).
    out_didx: usize,
}

/// Folds `sum` over DIDx right after a loop, sharding the loop's Stream axis, into it.
fn fold_reduce_scatters(p: &HostProgram, items: &mut Vec<Item>) -> Result<()> {
    let mut i = 0;
    while i + 1 < items.len() {
        let fold = match (&items[i], &items[i + 1]) {
            (Item::Loop(g), Item::Node(Node::Compute(e))) => reduce_scatter_pattern(p, g, e)?,
            _ => None,
        };
        if let Some(f) = fold {
            items.remove(i + 1);
            if let Item::Loop(g) = &mut items[i] {
                g.reduce_scatter = Some(f);
            }
        }
        i += 1;
    }
    Ok(())
}

fn reduce_scatter_pattern(
    p: &HostProgram,
    g: &LoopGroup,
    e: &Expr,
) -> Result<Option<ReduceScatterFold>> {
    let Op::Reduction { axes, .. } = &e.op else {
        return Ok(None);
    };
    let x = e.inputs[0];
    let (Some(&s), [a]) = (g.produced.get(&x), axes.as_slice()) else {
        return Ok(None);
    };
    let f = &p.ir;
    let didx = f.visible_axes(x)[*a];
    let world: Vec<usize> = (0..p.world_size).collect();
    if f.axis(x, didx).parallel != ParallelType::DIDx
        || p.mesh_of(x) != world
        || p.mesh_of(e.output) != world
    {
        return Ok(None);
    }
    let map = axis_map(f, e);
    let Some(out_didx) = f.find_parallel_axis(e.output, ParallelType::DIDx) else {
        return Ok(None);
    };
    if map.producer_axis(0, out_didx) != Some(s)
        || f.find_parallel_axis(e.output, ParallelType::Stream)
            .is_some()
    {
        return Ok(None);
    }
    Ok(Some(ReduceScatterFold {
        expr: e.clone(),
        didx,
        out_didx,
    }))
}

/// Tensors a loop produces and only that loop uses (not outputs or aliases).
fn loop_internal_tensors(p: &HostProgram, items: &[Item]) -> HashSet<TensorId> {
    let mut used_by: HashMap<TensorId, HashSet<usize>> = HashMap::new();
    for (k, item) in items.iter().enumerate() {
        let mut touch = |t: TensorId| {
            used_by.entry(t).or_default().insert(k);
        };
        match item {
            Item::Node(n) => for_each_node(std::slice::from_ref(n), &mut |m| {
                m.tensors().into_iter().for_each(&mut touch)
            }),
            Item::Loop(g) => {
                for (e, _) in &g.exprs {
                    e.inputs.iter().copied().for_each(&mut touch);
                }
                if let Some(rs) = &g.reduce_scatter {
                    touch(rs.expr.inputs[0]);
                }
            }
        }
    }
    let pinned: HashSet<TensorId> = p
        .outputs
        .iter()
        .copied()
        .chain(p.aliases.iter().flat_map(|&(o, i)| [o, i]))
        .collect();
    let mut internal = HashSet::new();
    for (k, item) in items.iter().enumerate() {
        if let Item::Loop(g) = item {
            for (e, _) in &g.exprs {
                let t = e.output;
                let users = used_by.get(&t);
                if !pinned.contains(&t) && users.is_none_or(|u| u.iter().all(|&x| x == k)) {
                    internal.insert(t);
                }
            }
        }
    }
    internal
}

/// Expressions that will share one stream loop.
struct LoopGroup {
    axis: IterDomainId,
    extent: ScalarId,
    exprs: Vec<(Expr, usize)>,
    /// Tensors produced in the loop -> position of their Stream axis.
    produced: HashMap<TensorId, usize>,
    reduce_scatter: Option<ReduceScatterFold>,
}

impl LoopGroup {
    fn new(f: &Fusion, e: &Expr, s: usize) -> Result<Self> {
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
        })
    }

    fn push(&mut self, e: Expr, s: usize) {
        self.produced.insert(e.output, s);
        self.exprs.push((e, s));
    }

    /// True when `e` (with Stream axis `s`) continues this loop.
    fn accepts(&self, f: &Fusion, e: &Expr, s: usize) -> Result<bool> {
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

    /// How many leading exprs are local compute, when communication follows them in the
    /// loop (0 otherwise: nothing to run ahead of the communication).
    fn compute_prefix_len(&self, p: &HostProgram, ctx: MeshContext) -> Result<usize> {
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
    fn allocate_outputs(
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

    fn emit(
        self,
        p: &mut HostProgram,
        ctx: &PassContext,
        internal: &HashSet<TensorId>,
    ) -> Result<Vec<Node>> {
        let mesh_ctx = MeshContext {
            world_size: Some(p.world_size),
        };
        let mut has_allgather = false;
        for (e, _) in &self.exprs {
            has_allgather |= matches!(
                classify(&p.ir, e, mesh_ctx)?,
                Resharding::DidxToStream { .. }
            );
        }
        if has_allgather && self.reduce_scatter.is_some() {
            if let Some(reason) = gather_scatter::unsupported(p, &self, ctx, internal)? {
                return Err(stream_error(
                    &p.ir,
                    self.exprs[0].0.output,
                    self.exprs[0].1,
                    &format!(
                        "this stream loop gathers (P2P allgather) and reduce-scatters, but \
                         {reason}"
                    ),
                ));
            }
            if ctx.options.reduce_scatter_pipeline == ReduceScatterPipeline::Direct {
                tracing::debug!(
                    "a loop that also gathers reduce-scatters in a ring: the direct pipeline's \
                     sum after the loop would leave work after the last GEMM"
                );
            }
            return gather_scatter::emit(self, p, ctx, internal);
        }
        let (pipeline, subchunks) = ctx.options.reduce_scatter_plan(p.world_size);
        if let Some(rs) = &self.reduce_scatter {
            let o = &ctx.options;
            if pipeline == ReduceScatterPipeline::Ring {
                if o.compute_first_streams
                    && self.compute_prefix_len(p, mesh_ctx)? == self.exprs.len()
                    && ring::applies(p, &self, rs)
                {
                    return ring::emit(self, p, ctx, internal, subchunks);
                }
                tracing::debug!(
                    "reduce-scatter pipeline of `{}` runs direct: the ring needs \
                     compute-first streams and a matmul as the loop's last expression",
                    p.ir.tensor_name(rs.expr.output)
                );
            }
        }
        let plan = match &self.reduce_scatter {
            Some(rs) => {
                let c = subchunks;
                let plan = SubChunkPlan::new(&p.ir, &self.exprs, rs, c);
                if plan.is_none() && c > 1 {
                    tracing::debug!(
                        "reduce-scatter pipeline of `{}` runs unsplit: its row axis cannot \
                         be split into {c} contiguous ranges",
                        p.ir.tensor_name(rs.expr.output)
                    );
                }
                plan
            }
            None => None,
        };
        let index = p.ir.loop_index("StreamIdx");
        let n = p.ir.named(NamedScalar::NumberOfStreams);
        let pool_index = p.ir.binary(ScalarOp::Mod, index, n);
        // Sub-chunked: D * c iterations, round `i / D`, ring step `i % D`.
        let (loop_axis, stop, step, rows) = match &plan {
            None => (self.axis, self.extent, index, None),
            Some(plan) => {
                let c = p.ir.constant(plan.count as i64);
                let stop = p.ir.binary(ScalarOp::Mul, self.extent, c);
                let mut dom = p.ir.iter_domain(self.axis).clone();
                dom.extent = stop;
                let axis = p.ir.add_iter_domain(dom);
                let step = p.ir.binary(ScalarOp::Mod, index, self.extent);
                let sub = p.ir.binary(ScalarOp::Div, index, self.extent);
                let rows = RowSlicing {
                    rows: plan.rows.clone(),
                    sub,
                    count: c,
                };
                (axis, stop, step, Some(rows))
            }
        };
        let sched = Schedule::new(
            p,
            ctx.options.p2p_schedule,
            step,
            self.extent,
            has_allgather,
            self.reduce_scatter.is_some(),
        );
        let original = p.new_stream(StreamDef::Captured);
        let worker = p.new_stream(StreamDef::Pool(pool_index));
        let zero = p.ir.constant(0);

        // Buffers: full size, or `numberOfStreams` slots for loop-internal intermediates.
        let (mut nodes, small) = self.allocate_outputs(p, internal, rows.as_ref(), None);
        let rs_buffers = match &self.reduce_scatter {
            Some(rs) => {
                let slots = reduce_scatter_slots(&mut p.ir, rs, self.extent);
                nodes.push(Node::Allocate { tensor: slots });
                nodes.push(Node::Allocate {
                    tensor: rs.expr.output,
                });
                Some(slots)
            }
            None => None,
        };
        // With sub-chunks each round sums its rows into this device's block of the output.
        let out_block = match (&self.reduce_scatter, &rows) {
            (Some(rs), Some(_)) => Some(select_block(p, rs, zero, &mut nodes)),
            _ => None,
        };
        nodes.push(Node::GetCurrentStream { stream: original });
        nodes.push(fork_loop(index, loop_axis, zero, stop, original, worker));
        // Compute-first: the leading local exprs run on the caller's stream, in order; the
        // pool stream takes over at the first communication (the folded reduce-scatter
        // included). The slot a prefix writes was last read by the communication of
        // iteration `i - numberOfStreams`, on this same pool stream: wait for it first.
        // (Full-size buffers are never reused, and need no wait.)
        let prefix = if ctx.options.compute_first_streams {
            self.compute_prefix_len(p, mesh_ctx)?
        } else {
            0
        };
        let prefix_reuses_slots = self.exprs[..prefix]
            .iter()
            .any(|(e, _)| small.contains_key(&e.output));
        let mut body = vec![Node::SetCurrentStream {
            stream: if prefix > 0 { original } else { worker },
        }];
        if prefix_reuses_slots {
            body.push(Node::Synchronize { stream: worker });
        }
        let mut slicer = Slicer {
            chunk: sched.chunk,
            pool_index,
            zero,
            small,
            rows,
            cache: HashMap::new(),
        };
        let backend = ctx.options.p2p_backend;
        for (k, (e, s)) in self.exprs.iter().enumerate() {
            if prefix > 0 && k == prefix {
                body.push(Node::SetCurrentStream { stream: worker });
                body.push(Node::Synchronize { stream: original });
            }
            emit_body_expr(p, &mut slicer, &sched, e, *s, backend, &mut body)?;
        }
        if let (Some(rs), Some(slots)) = (&self.reduce_scatter, rs_buffers) {
            if prefix == self.exprs.len() {
                body.push(Node::SetCurrentStream { stream: worker });
                body.push(Node::Synchronize { stream: original });
            }
            let round = match (&plan, out_block) {
                (Some(plan), Some(block)) => Some(RoundSum {
                    index,
                    extent: self.extent,
                    block,
                    out_rows: plan.out_rows,
                }),
                _ => None,
            };
            let step = ReduceScatterStep { rs, slots, round };
            emit_reduce_scatter_step(p, &mut slicer, &sched, &step, backend, &mut body)?;
        }
        body.push(Node::SetCurrentStream { stream: original });
        if prefix == 0 {
            body.push(Node::Synchronize { stream: worker });
        }
        nodes.push(Node::ForLoop(ForLoop {
            index,
            axis: loop_axis,
            start: zero,
            stop,
            body,
        }));
        if prefix > 0 {
            nodes.push(join_loop(index, loop_axis, zero, stop, worker));
        }
        if let (Some(rs), Some(slots), None) = (&self.reduce_scatter, rs_buffers, &plan) {
            // The partials of this device's chunk, one per source, summed locally.
            let view = select_block(p, rs, zero, &mut nodes);
            let red_axis = slot_axis(&p.ir, view);
            nodes.push(sum_slots(rs, slots, view, red_axis));
        }
        Ok(nodes)
    }
}

/// `FOR i: SetCurrentStream(worker); Synchronize(original)`: every pool stream starts
/// after what the caller's stream has queued.
fn fork_loop(
    index: ScalarId,
    axis: IterDomainId,
    zero: ScalarId,
    stop: ScalarId,
    original: StreamId,
    worker: StreamId,
) -> Node {
    Node::ForLoop(ForLoop {
        index,
        axis,
        start: zero,
        stop,
        body: vec![
            Node::SetCurrentStream { stream: worker },
            Node::Synchronize { stream: original },
        ],
    })
}

/// `FOR i: Synchronize(worker)` on the caller's stream: it waits for every pool stream.
fn join_loop(
    index: ScalarId,
    axis: IterDomainId,
    zero: ScalarId,
    stop: ScalarId,
    worker: StreamId,
) -> Node {
    Node::ForLoop(ForLoop {
        index,
        axis,
        start: zero,
        stop,
        body: vec![Node::Synchronize { stream: worker }],
    })
}

/// Binds (at the program's top level, into `nodes`) this device's block of a folded
/// reduce-scatter's output: the output without its DIDx axis.
fn select_block(
    p: &mut HostProgram,
    rs: &ReduceScatterFold,
    zero: ScalarId,
    nodes: &mut Vec<Node>,
) -> TensorId {
    let out = rs.expr.output;
    let view = slice_tensor(&mut p.ir, out, rs.out_didx);
    nodes.push(Node::AliasSelect {
        input: out,
        output: view,
        axis: rs.out_didx,
        index: zero,
    });
    view
}

/// Which chunk an iteration handles and which peers it talks to.
struct Schedule {
    /// The chunk index (along the stream axis) of iteration `i`.
    chunk: ScalarId,
    /// Peer that iteration `i` receives from / sends to.
    recv_peer: ScalarId,
    send_peer: ScalarId,
    rank: ScalarId,
}

impl Schedule {
    fn new(
        p: &mut HostProgram,
        kind: P2pSchedule,
        index: ScalarId,
        extent: ScalarId,
        allgather: bool,
        reduce_scatter: bool,
    ) -> Self {
        let rank = p.ir.named(NamedScalar::Rank);
        let ring = reduce_scatter || (allgather && kind == P2pSchedule::Ring);
        if !ring {
            return Schedule {
                chunk: index,
                recv_peer: index,
                send_peer: index,
                rank,
            };
        }
        let f = &mut p.ir;
        let r_plus_i = f.binary(ScalarOp::Add, rank, index);
        let r_plus_d = f.binary(ScalarOp::Add, rank, extent);
        if reduce_scatter {
            // Iteration i computes the partial chunk of device (rank + i + 1) % D and sends
            // it there; it receives device (rank + D - 1 - i) % D's partial of this device's
            // chunk. The local chunk comes last, so no transfer is left after the compute.
            let one = f.constant(1);
            let r_plus_i_plus_1 = f.binary(ScalarOp::Add, r_plus_i, one);
            let to = f.binary(ScalarOp::Mod, r_plus_i_plus_1, extent);
            let r_plus_d_minus_1 = f.binary(ScalarOp::Sub, r_plus_d, one);
            let r_plus_d_minus_1_minus_i = f.binary(ScalarOp::Sub, r_plus_d_minus_1, index);
            let from = f.binary(ScalarOp::Mod, r_plus_d_minus_1_minus_i, extent);
            Schedule {
                chunk: to,
                recv_peer: from,
                send_peer: to,
                rank,
            }
        } else {
            // Iteration i gathers the chunk of device down = (rank + D - i) % D from it, and
            // sends this device's chunk to up = (rank + i) % D, which gathers it now.
            let up = f.binary(ScalarOp::Mod, r_plus_i, extent);
            let r_plus_d_minus_i = f.binary(ScalarOp::Sub, r_plus_d, index);
            let down = f.binary(ScalarOp::Mod, r_plus_d_minus_i, extent);
            Schedule {
                chunk: down,
                recv_peer: down,
                send_peer: up,
                rank,
            }
        }
    }
}

fn emit_body_expr(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    sched: &Schedule,
    e: &Expr,
    s: usize,
    backend: CommBackend,
    body: &mut Vec<Node>,
) -> Result<()> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    if let Resharding::DidxToStream { in_axis, .. } = classify(&p.ir, e, ctx)? {
        return emit_allgather_step(p, slicer, sched, e, s, in_axis, backend, body);
    }
    let map = axis_map(&p.ir, e);
    let mut inputs = Vec::with_capacity(e.inputs.len());
    let mut removed = vec![None; e.inputs.len()];
    for (i, &t) in e.inputs.iter().enumerate() {
        match map.producer_axis(i, s) {
            None => inputs.push(t),
            Some(q) => {
                if p.ir.axis(t, q).parallel == ParallelType::DIDx && p.mesh_of(t).len() > 1 {
                    return Err(stream_error(
                        &p.ir,
                        t,
                        q,
                        "a DIDx axis feeds a Stream axis outside a `set`; reshard it first",
                    ));
                }
                removed[i] = Some(q);
                inputs.push(slicer.slice(p, t, q, body));
            }
        }
    }
    let op = op_without_stream_axis(&p.ir, e, s, &removed)?;
    let output = slicer.slice(p, e.output, s, body);
    body.push(Node::Compute(Expr { op, inputs, output }));
    Ok(())
}

/// The op computing one stream slice: axis arguments shift past the removed axis.
fn op_without_stream_axis(f: &Fusion, e: &Expr, s: usize, removed: &[Option<usize>]) -> Result<Op> {
    let vis_index = |t: TensorId, pos: usize| f.visible_axes(t).iter().position(|&q| q == pos);
    Ok(match &e.op {
        Op::Reduction { op, axes } => {
            let qv = removed[0]
                .and_then(|q| vis_index(e.inputs[0], q))
                .expect("a reduction maps every axis");
            Op::Reduction {
                op: *op,
                axes: axes
                    .iter()
                    .map(|&a| if a > qv { a - 1 } else { a })
                    .collect(),
            }
        }
        Op::Broadcast { flags } => {
            let mut flags = flags.clone();
            flags.remove(s);
            Op::Broadcast { flags }
        }
        Op::Matmul => {
            let (ra, rb) = (
                f.visible_axes(e.inputs[0]).len(),
                f.visible_axes(e.inputs[1]).len(),
            );
            let nb =
                f.tensor(e.output).axes.len() - 1 - usize::from(ra >= 2) - usize::from(rb >= 2);
            let streams_m = ra >= 2 && s == nb;
            let streams_n = rb >= 2 && s == nb + usize::from(ra >= 2);
            if (streams_m && rb > 2) || (streams_n && rb != 2) {
                return Err(stream_error(
                    f,
                    e.output,
                    s,
                    "streaming a matmul's M or N axis needs an unbatched B operand; stream a \
                     batch axis instead",
                ));
            }
            Op::Matmul
        }
        Op::Linear => {
            let nb = f.visible_axes(e.inputs[0]).len() - 1;
            if s >= nb {
                return Err(stream_error(
                    f,
                    e.output,
                    s,
                    "linear can only be streamed over a batch axis of its input",
                ));
            }
            Op::Linear
        }
        Op::Select { .. } | Op::Slice { .. } | Op::Split { .. } => {
            return Err(stream_error(
                f,
                e.output,
                s,
                "views cannot be Stream-parallel; stream the op that consumes them",
            ))
        }
        other => other.clone(),
    })
}

fn stream_error(f: &Fusion, t: TensorId, pos: usize, reason: &str) -> Error {
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
