//! `StreamParallelType`: turns expressions with a Stream axis into host for-loops.
//!
//! Consecutive top-level expressions whose Stream axes map onto each other share one loop;
//! any other expression in between closes it. For each loop (seeds 000-002):
//!
//! ```text
//! Allocate every output of the loop's expressions (full size)
//! GetCurrentStream into S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams)); Synchronize S
//! FOR i: SetCurrentStream(Stream(i % numberOfStreams))
//!        slice inputs and outputs along the stream axis (AliasSelect), run the body
//!        SetCurrentStream(S); Synchronize Stream(i % numberOfStreams)
//! ```
//!
//! A `set` turning a DIDx axis into the Stream axis becomes the P2P pipeline of seed 001:
//! `IF i == rank` a local copy, `ELSE` a coalesced receive from and send to device `i`.

use std::collections::HashMap;

use super::{Pass, PassContext};
use crate::error::{Error, Result};
use crate::hir::{CommBackend, ForLoop, HostProgram, Node, P2PDirection, StreamDef, P2P};
use crate::ir::{
    axis_map, Expr, Fusion, IterDomainId, IterKind, MemoryType, NamedScalar, Op, ParallelType,
    ScalarId, ScalarOp, TensorId, TensorView,
};
use crate::lower::{classify, MeshContext, Resharding};

/// The stream-lowering pass.
pub struct StreamParallelType;

impl Pass for StreamParallelType {
    fn name(&self) -> &'static str {
        "StreamParallelType"
    }

    fn run(&self, p: &mut HostProgram, ctx: &PassContext) -> Result<()> {
        let backend = ctx.options.p2p_backend;
        let body = std::mem::take(&mut p.body);
        let mut out = Vec::with_capacity(body.len());
        let mut group: Option<LoopGroup> = None;
        for node in body {
            let stream = match &node {
                Node::Compute(e) => p.ir.find_parallel_axis(e.output, ParallelType::Stream),
                _ => None,
            };
            let Some(s) = stream else {
                if let Some(g) = group.take() {
                    out.extend(g.emit(p, backend)?);
                }
                out.push(node);
                continue;
            };
            let Node::Compute(e) = node else {
                unreachable!("stream axes come from compute nodes")
            };
            match group.as_mut() {
                Some(g) if g.accepts(&p.ir, &e, s)? => g.push(&p.ir, e, s),
                _ => {
                    if let Some(g) = group.take() {
                        out.extend(g.emit(p, backend)?);
                    }
                    let mut g = LoopGroup::new(&p.ir, &e, s)?;
                    g.push(&p.ir, e, s);
                    group = Some(g);
                }
            }
        }
        if let Some(g) = group.take() {
            out.extend(g.emit(p, backend)?);
        }
        p.body = out;
        Ok(())
    }
}

/// Expressions that will share one stream loop.
struct LoopGroup {
    axis: IterDomainId,
    extent: ScalarId,
    exprs: Vec<(Expr, usize)>,
    /// Tensors produced in the loop -> position of their Stream axis.
    produced: HashMap<TensorId, usize>,
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
        })
    }

    fn push(&mut self, _f: &Fusion, e: Expr, s: usize) {
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

    fn emit(self, p: &mut HostProgram, backend: CommBackend) -> Result<Vec<Node>> {
        let mut nodes: Vec<Node> = self
            .exprs
            .iter()
            .map(|(e, _)| Node::Allocate { tensor: e.output })
            .collect();
        let original = p.new_stream(StreamDef::Captured);
        let index = p.ir.loop_index("StreamIdx");
        let n = p.ir.named(NamedScalar::NumberOfStreams);
        let pool_index = p.ir.binary(ScalarOp::Mod, index, n);
        let worker = p.new_stream(StreamDef::Pool(pool_index));
        let zero = p.ir.constant(0);
        nodes.push(Node::GetCurrentStream { stream: original });
        nodes.push(Node::ForLoop(ForLoop {
            index,
            axis: self.axis,
            start: zero,
            stop: self.extent,
            body: vec![
                Node::SetCurrentStream { stream: worker },
                Node::Synchronize { stream: original },
            ],
        }));
        let mut body = vec![Node::SetCurrentStream { stream: worker }];
        let mut slicer = Slicer {
            index,
            zero,
            cache: HashMap::new(),
        };
        for (e, s) in &self.exprs {
            emit_body_expr(p, &mut slicer, e, *s, backend, &mut body)?;
        }
        body.push(Node::SetCurrentStream { stream: original });
        body.push(Node::Synchronize { stream: worker });
        nodes.push(Node::ForLoop(ForLoop {
            index,
            axis: self.axis,
            start: zero,
            stop: self.extent,
            body,
        }));
        Ok(nodes)
    }
}

/// Creates (once per tensor and axis) the stream slice of a tensor.
struct Slicer {
    index: ScalarId,
    zero: ScalarId,
    cache: HashMap<(TensorId, usize), TensorId>,
}

impl Slicer {
    fn slice(
        &mut self,
        p: &mut HostProgram,
        t: TensorId,
        pos: usize,
        body: &mut Vec<Node>,
    ) -> TensorId {
        if let Some(&s) = self.cache.get(&(t, pos)) {
            return s;
        }
        let d = p.ir.axis(t, pos);
        let index = if d.kind == IterKind::Broadcast || p.ir.const_value(d.extent) == Some(1) {
            self.zero
        } else {
            self.index
        };
        let s = slice_tensor(&mut p.ir, t, pos);
        body.push(Node::AliasSelect {
            input: t,
            output: s,
            axis: pos,
            index,
        });
        self.cache.insert((t, pos), s);
        s
    }
}

/// A new tensor: `t` without axis `pos`, as a view (`_l_` in dumps).
pub(crate) fn slice_tensor(f: &mut Fusion, t: TensorId, pos: usize) -> TensorId {
    let src = f.tensor(t).clone();
    let axes = src
        .axes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != pos)
        .map(|(_, &d)| {
            let dom = f.iter_domain(d).clone();
            f.add_iter_domain(dom)
        })
        .collect();
    f.add_tensor(TensorView {
        name: None,
        dtype: src.dtype,
        axes,
        mesh: src.mesh,
        memory: MemoryType::Local,
    })
}

fn emit_body_expr(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    e: &Expr,
    s: usize,
    backend: CommBackend,
    body: &mut Vec<Node>,
) -> Result<()> {
    let ctx = MeshContext {
        world_size: Some(p.world_size),
    };
    if let Resharding::DidxToStream { in_axis, .. } = classify(&p.ir, e, ctx)? {
        return emit_p2p_pipeline(p, slicer, e, s, in_axis, backend, body);
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

/// Seed 001: `IF i == rank` copy the local shard, `ELSE` coalesced recv from / send to `i`.
fn emit_p2p_pipeline(
    p: &mut HostProgram,
    slicer: &mut Slicer,
    e: &Expr,
    s: usize,
    in_axis: usize,
    backend: CommBackend,
    body: &mut Vec<Node>,
) -> Result<()> {
    let x = e.inputs[0];
    let mesh = p.mesh_of(x);
    if mesh != (0..p.world_size).collect::<Vec<_>>() {
        return Err(stream_error(
            &p.ir,
            x,
            in_axis,
            "the DIDx→Stream P2P pipeline needs the tensor on every device of the world, in order",
        ));
    }
    let out_slice = slicer.slice(p, e.output, s, body);
    let rank = p.ir.named(NamedScalar::Rank);
    let cond = p.ir.binary(ScalarOp::Eq, slicer.index, rank);
    let local = slice_tensor(&mut p.ir, x, in_axis);
    let then_body = vec![
        Node::AliasSelect {
            input: x,
            output: local,
            axis: in_axis,
            index: slicer.zero,
        },
        Node::Compute(Expr {
            op: Op::Set,
            inputs: vec![local],
            output: out_slice,
        }),
    ];
    let recv = p.new_comm_id();
    let send = p.new_comm_id();
    let group = p.new_comm_id();
    let else_body = vec![
        Node::StartCoalescing,
        Node::P2P(P2P {
            id: recv,
            direction: P2PDirection::Recv,
            buffer: out_slice,
            peer: slicer.index,
            backend,
        }),
        Node::P2P(P2P {
            id: send,
            direction: P2PDirection::Send,
            buffer: x,
            peer: slicer.index,
            backend,
        }),
        Node::EndCoalescing { id: group },
        Node::Wait { comm: group },
    ];
    body.push(Node::IfThenElse {
        cond,
        then_body,
        else_body,
    });
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
