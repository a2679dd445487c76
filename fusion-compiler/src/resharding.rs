//! Classifies how an expression redistributes data.
//!
//! | op | producer / consumer sharding | communication |
//! | --- | --- | --- |
//! | set | p sharded on DIDx, c not (same mesh) | Allgather (Gather if meshes differ) |
//! | set | c sharded, p not | Scatter |
//! | set | neither, different meshes | Broadcast |
//! | set | both sharded, same axis, different meshes | SendRecv |
//! | set | p's DIDx axis becomes c's Stream axis | a P2P pipeline (stream lowering) |
//! | sum/max | reduced axis sharded, c not sharded | Allreduce (Reduce if meshes differ) |
//! | sum/max | reduced axis sharded, c sharded on another axis | ReduceScatter |
//!
//! `Set` and `Reduction` are the only expressions that may change distribution; lowering
//! first rewrites every other op so that its inputs already match its output
//! (`insert_reshardings` in [`crate::lower`]). This module decides, for one expression, whether it is
//! local, which communications implement it, or why it cannot be lowered.

use crate::error::{Error, Result};
use crate::hir::CommunicationKind;
use crate::ir::{
    axis_map, AxisMap, DeviceMesh, Expr, Fusion, IterKind, Op, ParallelType, ReduceOp, TensorId,
};

/// One communication a resharding needs; the conversion pass turns it into a node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommSpec {
    pub kind: CommunicationKind,
    pub team: Vec<usize>,
    pub mesh: Vec<usize>,
    pub root: Option<usize>,
    pub reduce_op: Option<ReduceOp>,
    pub in_sharded_axis: Option<usize>,
    pub in_scatter_axis: Option<usize>,
    pub out_sharded_axis: Option<usize>,
    pub receiver: Option<usize>,
}

/// How an expression relates its inputs' distribution to its output's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resharding {
    /// Every device computes its part from data it holds.
    Local,
    /// These communications implement the expression (`Set`/`Reduction` only).
    Communications(Vec<CommSpec>),
    /// A `Set` turning a DIDx axis into a Stream axis: the P2P pipeline of seed 001.
    /// Positions index the tensors' `axes`.
    DidxToStream { in_axis: usize, out_axis: usize },
    /// A reduction mixing local and cross-device work; lowering splits it first.
    SplitReduction,
    /// A compute op whose listed inputs must be resharded (a `set` inserted) first.
    ReshardInputs(Vec<usize>),
}

/// Context for classification: the world size, once known (meshes resolved).
#[derive(Clone, Copy, Debug)]
pub struct MeshContext {
    pub world_size: Option<usize>,
}

impl MeshContext {
    fn devices(&self, mesh: &DeviceMesh) -> Option<Vec<usize>> {
        match (mesh, self.world_size) {
            (DeviceMesh::Devices(d), _) => Some(d.clone()),
            (DeviceMesh::World, Some(n)) => Some((0..n).collect()),
            (DeviceMesh::World, None) => None,
        }
    }

    /// Whether two meshes are the same; `None` when that depends on the world size.
    fn same_mesh(&self, a: &DeviceMesh, b: &DeviceMesh) -> Option<bool> {
        match (self.devices(a), self.devices(b)) {
            (Some(x), Some(y)) => Some(x == y),
            _ => (a == b).then_some(true),
        }
    }

    /// [`MeshContext::same_mesh`], or the error that the world size is needed to lower
    /// expression `e`.
    fn same_mesh_of(&self, f: &Fusion, e: &Expr) -> Result<bool> {
        let (a, b) = (&f.tensor(e.inputs[0]).mesh, &f.tensor(e.output).mesh);
        self.same_mesh(a, b).ok_or_else(|| Error::Resharding {
            expr: describe(f, e),
            reason: format!("the world size is needed to compare the meshes {a} and {b}"),
        })
    }

    fn size(&self, mesh: &DeviceMesh) -> Option<usize> {
        self.devices(mesh).map(|d| d.len())
    }
}

/// Position of the tensor's DIDx axis if it is effectively sharded (mesh of 2+ devices).
fn sharded_axis(f: &Fusion, ctx: MeshContext, t: TensorId) -> Option<usize> {
    let p = f.find_parallel_axis(t, ParallelType::DIDx)?;
    match ctx.size(&f.tensor(t).mesh) {
        Some(1) => None,
        _ => Some(p),
    }
}

/// Index of axis position `pos` among the tensor's stored (visible) axes.
pub(crate) fn stored_index(f: &Fusion, t: TensorId, pos: usize) -> usize {
    f.visible_axes(t)
        .iter()
        .position(|&q| q == pos)
        .expect("axis is stored")
}

/// Describes an expression for error messages: `set(a)`, `matmul(x, w)`.
pub(crate) fn describe(f: &Fusion, e: &Expr) -> String {
    let ins: Vec<String> = e.inputs.iter().map(|&t| f.tensor_name(t)).collect();
    format!("{}({})", e.op.name(), ins.join(", "))
}

/// Classifies expression `e` of fusion `f`.
pub fn classify(f: &Fusion, e: &Expr, ctx: MeshContext) -> Result<Resharding> {
    match &e.op {
        Op::Set => classify_set(f, e, ctx),
        Op::Reduction { op, axes } => classify_reduction(f, e, *op, axes, ctx),
        _ => Ok(match inconsistent_inputs(f, e, ctx) {
            v if v.is_empty() => Resharding::Local,
            v => Resharding::ReshardInputs(v),
        }),
    }
}

/// Whether fusion `f` may communicate in a world of `world_size` ranks: some expression
/// is not local (or cannot be classified). A fusion for which this is false lowers to a
/// program without communication.
pub fn may_communicate(f: &Fusion, world_size: usize) -> bool {
    let ctx = MeshContext {
        world_size: Some(world_size),
    };
    world_size > 1
        && f.exprs()
            .iter()
            .any(|e| !matches!(classify(f, e, ctx), Ok(Resharding::Local)))
}

/// Inputs of `e` not distributed like its output (axis for axis, and mesh).
pub fn inconsistent_inputs(f: &Fusion, e: &Expr, ctx: MeshContext) -> Vec<usize> {
    let map = axis_map(f, e);
    let out = e.output;
    let out_mesh = &f.tensor(out).mesh;
    let c = sharded_axis(f, ctx, out);
    let out_stream = f.find_parallel_axis(out, ParallelType::Stream);
    let mut bad = Vec::new();
    for (i, &t) in e.inputs.iter().enumerate() {
        let p = sharded_axis(f, ctx, t);
        let ok_mesh = ctx.same_mesh(&f.tensor(t).mesh, out_mesh) == Some(true);
        let consistent = match (p, c) {
            (None, None) => true,
            (Some(p), Some(c)) => map.producer_axis(i, c) == Some(p),
            (Some(_), None) => false,
            (None, Some(c)) => match map.producer_axis(i, c) {
                None => true,
                Some(q) => {
                    let d = f.axis(t, q);
                    d.kind == IterKind::Broadcast || f.const_value(d.extent) == Some(1)
                }
            },
        };
        // An input's DIDx axis feeding the output's Stream axis needs the P2P pipeline,
        // which only a `set` expresses.
        let feeds_stream =
            matches!((p, out_stream), (Some(p), Some(s)) if map.producer_axis(i, s) == Some(p));
        if !consistent || !ok_mesh || feeds_stream {
            bad.push(i);
        }
    }
    bad
}

fn classify_set(f: &Fusion, e: &Expr, ctx: MeshContext) -> Result<Resharding> {
    let set = SetParts::new(f, e, ctx)?;
    if let Some(pipeline) = set.didx_to_stream()? {
        return Ok(pipeline);
    }
    match (set.p, set.c) {
        (None, None) if set.same => Ok(Resharding::Local),
        (None, None) => set.broadcast(),
        (Some(p), None) => set.gather(p),
        (None, Some(c)) => set.scatter(c),
        (Some(p), Some(c)) => set.send_recv(p, c),
    }
}

/// A `set` being classified: its input `x`, output `y`, their sharded axes (`p`, `c`) and
/// meshes, and whether the meshes are the same.
struct SetParts<'a> {
    f: &'a Fusion,
    e: &'a Expr,
    ctx: MeshContext,
    x: TensorId,
    y: TensorId,
    map: AxisMap,
    p: Option<usize>,
    c: Option<usize>,
    same: bool,
}

impl<'a> SetParts<'a> {
    fn new(f: &'a Fusion, e: &'a Expr, ctx: MeshContext) -> Result<Self> {
        let (x, y) = (e.inputs[0], e.output);
        Ok(SetParts {
            f,
            e,
            ctx,
            x,
            y,
            map: axis_map(f, e),
            p: sharded_axis(f, ctx, x),
            c: sharded_axis(f, ctx, y),
            same: ctx.same_mesh_of(f, e)?,
        })
    }

    fn in_mesh(&self) -> &DeviceMesh {
        &self.f.tensor(self.x).mesh
    }

    fn out_mesh(&self) -> &DeviceMesh {
        &self.f.tensor(self.y).mesh
    }

    fn error(&self, reason: String) -> Error {
        Error::Resharding {
            expr: describe(self.f, self.e),
            reason,
        }
    }

    fn devices(&self, m: &DeviceMesh) -> Result<Vec<usize>> {
        self.ctx.devices(m).ok_or_else(|| {
            self.error("the world size is needed to lower a resharding between meshes".into())
        })
    }

    /// The P2P pipeline, when the input's DIDx axis becomes the output's Stream axis.
    fn didx_to_stream(&self) -> Result<Option<Resharding>> {
        let (f, x) = (self.f, self.x);
        let (Some(p), Some(s)) = (self.p, f.find_parallel_axis(self.y, ParallelType::Stream))
        else {
            return Ok(None);
        };
        if self.map.producer_axis(0, s) != Some(p) {
            return Ok(None);
        }
        if !self.same {
            return Err(self.error(format!(
                "turning the DIDx axis of `{}` into a Stream axis (the P2P pipeline) needs \
                 both on the same mesh, but they live on {} and {}",
                f.tensor_name(x),
                self.in_mesh(),
                self.out_mesh()
            )));
        }
        if self.c.is_some() {
            return Err(self.error(
                "the DIDx→Stream pipeline cannot also shard the result along another axis \
                 (two shardings would change at once); copy in two steps"
                    .into(),
            ));
        }
        Ok(Some(Resharding::DidxToStream {
            in_axis: p,
            out_axis: s,
        }))
    }

    /// A communication of `kind` from the input mesh's first device to every device of
    /// the output's mesh.
    fn rooted_at_first_source(&self, kind: CommunicationKind) -> Result<CommSpec> {
        let (src, dst) = (
            self.devices(self.in_mesh())?,
            self.devices(self.out_mesh())?,
        );
        let root = src[0];
        Ok(CommSpec {
            team: with_root(&dst, root),
            mesh: dst,
            root: Some(root),
            ..CommSpec::of(kind)
        })
    }

    /// Unsharded to unsharded between meshes: a broadcast from the input's first device.
    fn broadcast(&self) -> Result<Resharding> {
        let spec = self.rooted_at_first_source(CommunicationKind::Broadcast)?;
        Ok(Resharding::Communications(vec![spec]))
    }

    /// Sharded (axis `p`) to unsharded: an allgather on one mesh, else a gather to every
    /// device of the output's mesh.
    fn gather(&self, p: usize) -> Result<Resharding> {
        let (f, x, y) = (self.f, self.x, self.y);
        let src = self.devices(self.in_mesh())?;
        let in_axis = stored_index(f, x, p);
        let out_axis = self
            .map
            .consumer_axes(0, p)
            .first()
            .map(|&j| stored_index(f, y, j));
        if self.same {
            return Ok(Resharding::Communications(vec![CommSpec {
                team: src.clone(),
                mesh: src,
                in_sharded_axis: Some(in_axis),
                out_sharded_axis: out_axis,
                ..CommSpec::of(CommunicationKind::Allgather)
            }]));
        }
        let dst = self.devices(self.out_mesh())?;
        Ok(Resharding::Communications(
            dst.iter()
                .map(|&root| CommSpec {
                    team: with_root(&src, root),
                    mesh: src.clone(),
                    root: Some(root),
                    in_sharded_axis: Some(in_axis),
                    out_sharded_axis: out_axis,
                    ..CommSpec::of(CommunicationKind::Gather)
                })
                .collect(),
        ))
    }

    /// Unsharded to sharded (axis `c`): a scatter from the input's first device.
    fn scatter(&self, c: usize) -> Result<Resharding> {
        let q = self.map.producer_axis(0, c).ok_or_else(|| {
            self.error("the output's DIDx axis does not come from the input".into())
        })?;
        let spec = self.rooted_at_first_source(CommunicationKind::Scatter)?;
        Ok(Resharding::Communications(vec![CommSpec {
            in_scatter_axis: Some(stored_index(self.f, self.x, q)),
            out_sharded_axis: Some(stored_index(self.f, self.y, c)),
            ..spec
        }]))
    }

    /// Sharded (axis `p`) to sharded (axis `c`): local on one mesh, else a send/receive
    /// per shard between meshes of one size.
    fn send_recv(&self, p: usize, c: usize) -> Result<Resharding> {
        let (f, x, y) = (self.f, self.x, self.y);
        if self.map.producer_axis(0, c) != Some(p) {
            return Err(self.error(format!(
                "two shardings change at once: `{}` is sharded on axis {} but the result on \
                 axis {} (an all-to-all); reshard through an unsharded tensor: first copy to \
                 a tensor with no DIDx axis (`let full: Tensor<..> = x;`), then shard the \
                 other axis",
                f.tensor_name(x),
                stored_index(f, x, p),
                stored_index(f, y, c)
            )));
        }
        if self.same {
            return Ok(Resharding::Local);
        }
        let (src, dst) = (
            self.devices(self.in_mesh())?,
            self.devices(self.out_mesh())?,
        );
        if src.len() != dst.len() {
            return Err(self.error(format!(
                "`{}` is sharded over {} devices but the result over {}; a sharded-to-sharded \
                 copy needs meshes of one size",
                f.tensor_name(x),
                src.len(),
                dst.len()
            )));
        }
        Ok(Resharding::Communications(
            src.iter()
                .zip(&dst)
                .map(|(&s, &r)| CommSpec {
                    team: vec![s, r],
                    mesh: vec![s],
                    root: Some(s),
                    receiver: Some(r),
                    in_sharded_axis: Some(stored_index(f, x, p)),
                    out_sharded_axis: Some(stored_index(f, y, c)),
                    ..CommSpec::of(CommunicationKind::SendRecv)
                })
                .collect(),
        ))
    }
}

impl CommSpec {
    /// A communication of `kind` with every other field empty.
    fn of(kind: CommunicationKind) -> Self {
        CommSpec {
            kind,
            team: vec![],
            mesh: vec![],
            root: None,
            reduce_op: None,
            in_sharded_axis: None,
            in_scatter_axis: None,
            out_sharded_axis: None,
            receiver: None,
        }
    }
}

fn classify_reduction(
    f: &Fusion,
    e: &Expr,
    op: ReduceOp,
    axes: &[usize],
    ctx: MeshContext,
) -> Result<Resharding> {
    let (x, y) = (e.inputs[0], e.output);
    let vis = f.visible_axes(x);
    let p = sharded_axis(f, ctx, x);
    let reduces_sharded = p.is_some_and(|p| axes.iter().any(|&a| vis[a] == p));
    if !reduces_sharded {
        return Ok(if inconsistent_inputs(f, e, ctx).is_empty() {
            Resharding::Local
        } else {
            Resharding::SplitReduction
        });
    }
    if axes.len() > 1 {
        return Ok(Resharding::SplitReduction);
    }
    let p = p.expect("reduces_sharded");
    let (in_mesh, out_mesh) = (&f.tensor(x).mesh, &f.tensor(y).mesh);
    let same = ctx.same_mesh_of(f, e)?;
    let src = ctx.devices(in_mesh).ok_or_else(|| Error::Resharding {
        expr: describe(f, e),
        reason: "the world size is needed to lower this reduction".into(),
    })?;
    let base = CommSpec {
        kind: CommunicationKind::Allreduce,
        team: src.clone(),
        mesh: src.clone(),
        root: None,
        reduce_op: Some(op),
        in_sharded_axis: Some(stored_index(f, x, p)),
        in_scatter_axis: None,
        out_sharded_axis: None,
        receiver: None,
    };
    match sharded_axis(f, ctx, y) {
        Some(c) => {
            if !same {
                return Err(Error::Resharding {
                    expr: describe(f, e),
                    reason: "a ReduceScatter needs input and output on the same mesh; reduce \
                             on the input's mesh, then copy to the other mesh (a `set`, or a \
                             `let` annotated with that mesh)"
                        .into(),
                });
            }
            let map = axis_map(f, e);
            let q = map.producer_axis(0, c).expect("reduction maps every axis");
            Ok(Resharding::Communications(vec![CommSpec {
                kind: CommunicationKind::ReduceScatter,
                in_scatter_axis: Some(stored_index(f, x, q)),
                out_sharded_axis: Some(stored_index(f, y, c)),
                ..base
            }]))
        }
        None if same => Ok(Resharding::Communications(vec![base])),
        None => {
            let dst = ctx.devices(out_mesh).ok_or_else(|| Error::Resharding {
                expr: describe(f, e),
                reason: "the world size is needed to lower this reduction".into(),
            })?;
            Ok(Resharding::Communications(
                dst.iter()
                    .map(|&root| CommSpec {
                        kind: CommunicationKind::Reduce,
                        team: with_root(&src, root),
                        root: Some(root),
                        ..base.clone()
                    })
                    .collect(),
            ))
        }
    }
}

fn with_root(mesh: &[usize], root: usize) -> Vec<usize> {
    let mut team = mesh.to_vec();
    if !team.contains(&root) {
        team.push(root);
    }
    team
}
