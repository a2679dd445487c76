//! The checker's picture of a fusion: tensors with axes, meshes and expressions, laid out
//! like `fusion_core`'s arena so the checker can apply the builder's rules one for one.

use super::annotate::Fact;
use super::dims::{DimId, Dims};
use crate::span::SpanRange;

/// Index of a tensor; also the order in which the generated code creates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tid(pub usize);

/// Element types: a concrete one, or a dtype parameter of the fusion (`T: Float`), which
/// equals only itself (the call may bind it to any concrete type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// Dtype parameter number `i` of the fusion ([`Model::dtype_params`]).
    Param(usize),
}

impl DType {
    /// Every dtype's DSL name.
    pub const NAMES: [&'static str; 3] = ["f32", "bf16", "f16"];

    /// Parses a DSL name.
    pub fn from_name(s: &str) -> Option<DType> {
        match s {
            "f32" => Some(DType::F32),
            "bf16" => Some(DType::BF16),
            "f16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// How an axis is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Par {
    Serial,
    DIDx,
    Stream,
}

impl Par {
    /// The DSL name.
    pub fn name(self) -> &'static str {
        match self {
            Par::Serial => "Serial",
            Par::DIDx => "DIDx",
            Par::Stream => "Stream",
        }
    }
}

/// Iterated, reduced away (not stored), or a size-1 broadcast.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Iter,
    Red,
    Bcast,
}

/// One axis.
#[derive(Clone, Debug)]
pub struct Ax {
    pub extent: DimId,
    pub par: Par,
    pub kind: Kind,
    /// The annotation that gave this axis its parallel type, for error spans.
    pub origin: Option<SpanRange>,
}

impl Ax {
    /// A serial iteration axis.
    pub fn new(extent: DimId) -> Self {
        Ax {
            extent,
            par: Par::Serial,
            kind: Kind::Iter,
            origin: None,
        }
    }
}

/// The devices a tensor lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mesh {
    World,
    Devices(Vec<usize>),
}

impl Mesh {
    /// `[0, 1]` or `every device`.
    pub fn show(&self) -> String {
        match self {
            Mesh::World => "every device".into(),
            Mesh::Devices(d) => format!("{d:?}"),
        }
    }
}

/// Unary elementwise functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unary {
    Neg,
    Relu,
    Gelu,
    Exp,
    Tanh,
    Sigmoid,
    Abs,
    Sqrt,
    GeluTanh,
    Silu,
}

/// Binary elementwise functions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
}

impl Binary {
    /// The builder's name for messages (`add`, `maximum`).
    pub fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
            Binary::Max => "maximum",
            Binary::Min => "minimum",
        }
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    Sum,
    Max,
}

/// What an expression computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Set,
    Unary(Unary),
    Cast(DType),
    Binary(Binary),
    Reduce {
        op: Reduce,
        axes: Vec<usize>,
    },
    Broadcast {
        flags: Vec<bool>,
    },
    Matmul,
    Linear,
    Select {
        axis: usize,
        index: DimId,
    },
    Slice {
        axis: usize,
        start: DimId,
        stop: DimId,
    },
    Split {
        axis: usize,
        outer: DimId,
    },
}

impl Op {
    /// Name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Set => "set",
            Op::Unary(u) => match u {
                Unary::Neg => "neg",
                Unary::Relu => "relu",
                Unary::Gelu => "gelu",
                Unary::Exp => "exp",
                Unary::Tanh => "tanh",
                Unary::Sigmoid => "sigmoid",
                Unary::Abs => "abs",
                Unary::Sqrt => "sqrt",
                Unary::GeluTanh => "gelu_tanh",
                Unary::Silu => "silu",
            },
            Op::Cast(_) => "cast",
            Op::Binary(b) => b.name(),
            Op::Reduce {
                op: Reduce::Sum, ..
            } => "sum",
            Op::Reduce {
                op: Reduce::Max, ..
            } => "max",
            Op::Broadcast { .. } => "broadcast",
            Op::Matmul => "matmul",
            Op::Linear => "linear",
            Op::Select { .. } => "select",
            Op::Slice { .. } => "slice",
            Op::Split { .. } => "split",
        }
    }

    /// Ops whose output is a view of the input.
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Select { .. } | Op::Slice { .. } | Op::Split { .. } | Op::Broadcast { .. }
        )
    }
}

/// A tensor.
#[derive(Clone, Debug)]
pub struct Tv {
    /// The Rust name it is bound to, if any.
    pub name: Option<String>,
    pub dtype: DType,
    /// All axes, reduction axes included.
    pub axes: Vec<Ax>,
    pub mesh: Mesh,
    /// Where it is created (an op call, an annotation, a parameter).
    pub span: SpanRange,
    /// The op that created it, for messages about unnamed results.
    pub made_by: &'static str,
}

/// One expression.
#[derive(Clone, Debug)]
pub struct Ex {
    pub op: Op,
    pub inputs: Vec<Tid>,
    pub output: Tid,
    pub span: SpanRange,
}

/// The arena.
#[derive(Default)]
pub struct Model {
    pub dims: Dims,
    pub tensors: Vec<Tv>,
    pub exprs: Vec<Ex>,
    pub inputs: Vec<Tid>,
    pub outputs: Vec<Tid>,
    pub declared: Vec<Tid>,
    /// Literal-dim facts for the generated `static_assertions`.
    pub facts: Vec<(Fact, SpanRange)>,
    /// The names of the fusion's dtype parameters.
    pub dtype_params: Vec<String>,
}

impl Model {
    /// A dtype's DSL name: `f32`, `bf16`, `f16` or a parameter's name.
    pub fn dtype_name(&self, d: DType) -> String {
        match d {
            DType::F32 => "f32".into(),
            DType::BF16 => "bf16".into(),
            DType::F16 => "f16".into(),
            DType::Param(i) => self.dtype_params.get(i).cloned().unwrap_or_default(),
        }
    }

    /// The tensor behind an id.
    pub fn tv(&self, t: Tid) -> &Tv {
        &self.tensors[t.0]
    }

    /// Mutable access to a tensor.
    pub fn tv_mut(&mut self, t: Tid) -> &mut Tv {
        &mut self.tensors[t.0]
    }

    /// Adds a tensor.
    pub fn new_tensor(
        &mut self,
        dtype: DType,
        axes: Vec<Ax>,
        mesh: Mesh,
        span: SpanRange,
        made_by: &'static str,
    ) -> Tid {
        self.tensors.push(Tv {
            name: None,
            dtype,
            axes,
            mesh,
            span,
            made_by,
        });
        Tid(self.tensors.len() - 1)
    }

    /// Positions of the stored (non-reduction) axes.
    pub fn visible(&self, t: Tid) -> Vec<usize> {
        self.tv(t)
            .axes
            .iter()
            .enumerate()
            .filter(|(_, a)| a.kind != Kind::Red)
            .map(|(i, _)| i)
            .collect()
    }

    /// Axis at position `pos` (an index into all axes).
    pub fn axis(&self, t: Tid, pos: usize) -> &Ax {
        &self.tv(t).axes[pos]
    }

    /// Visible index of axis position `pos`.
    pub fn vis_index(&self, t: Tid, pos: usize) -> usize {
        self.visible(t)
            .iter()
            .position(|&q| q == pos)
            .unwrap_or(pos)
    }

    /// Position of the first axis with parallel type `p`.
    pub fn find_par(&self, t: Tid, p: Par) -> Option<usize> {
        self.tv(t).axes.iter().position(|a| a.par == p)
    }

    /// True for inputs.
    pub fn is_input(&self, t: Tid) -> bool {
        self.inputs.contains(&t)
    }

    /// True for outputs.
    pub fn is_output(&self, t: Tid) -> bool {
        self.outputs.contains(&t)
    }

    /// "`x`" for named tensors, "the `matmul` result" otherwise.
    pub fn what(&self, t: Tid) -> String {
        match &self.tv(t).name {
            Some(n) => format!("`{n}`"),
            None => format!("the `{}` result", self.tv(t).made_by),
        }
    }

    /// Extent 1 or a broadcast axis.
    pub fn is_broadcast_like(&self, t: Tid, pos: usize) -> bool {
        let a = self.axis(t, pos);
        a.kind == Kind::Bcast || self.dims.value(a.extent) == Some(1)
    }

    /// The type as DSL text: `Tensor<f32, [d @ DIDx, m]>`.
    pub fn show_type(&self, t: Tid) -> String {
        let tv = self.tv(t);
        let axes: Vec<String> = self
            .visible(t)
            .into_iter()
            .map(|p| {
                let a = &tv.axes[p];
                let e = self.dims.show(a.extent);
                match a.par {
                    Par::Serial => e,
                    p => format!("{e} @ {}", p.name()),
                }
            })
            .collect();
        let mesh = match &tv.mesh {
            Mesh::World => String::new(),
            Mesh::Devices(d) => format!(", mesh = {d:?}"),
        };
        format!(
            "Tensor<{}, [{}]{mesh}>",
            self.dtype_name(tv.dtype),
            axes.join(", ")
        )
    }

    /// For each input of `e`, the input axis (position) behind each output axis.
    pub fn axis_map(&self, e: &Ex) -> Vec<Vec<Option<usize>>> {
        let out_rank = self.tv(e.output).axes.len();
        let vis: Vec<Vec<usize>> = e.inputs.iter().map(|&t| self.visible(t)).collect();
        let mut per: Vec<Vec<Option<usize>>> = vec![vec![None; out_rank]; e.inputs.len()];
        match &e.op {
            Op::Set | Op::Unary(_) | Op::Cast(_) | Op::Reduce { .. } | Op::Slice { .. } => {
                for (j, m) in per[0].iter_mut().enumerate() {
                    *m = vis[0].get(j).copied();
                }
            }
            Op::Binary(_) => {
                for (v, m) in vis.iter().zip(per.iter_mut()) {
                    let offset = out_rank.saturating_sub(v.len());
                    for (j, slot) in m.iter_mut().enumerate().skip(offset) {
                        *slot = v.get(j - offset).copied();
                    }
                }
            }
            Op::Broadcast { flags } => {
                let mut next = 0;
                for (j, &is_new) in flags.iter().enumerate() {
                    if !is_new {
                        per[0][j] = vis[0].get(next).copied();
                        next += 1;
                    }
                }
            }
            Op::Select { axis, .. } => {
                for (j, m) in per[0].iter_mut().enumerate() {
                    let src = if j < *axis { j } else { j + 1 };
                    *m = vis[0].get(src).copied();
                }
            }
            Op::Split { axis, .. } => {
                for (j, m) in per[0].iter_mut().enumerate() {
                    let src = match j {
                        j if j <= *axis => j,
                        j if j == axis + 1 => *axis,
                        j => j - 1,
                    };
                    *m = vis[0].get(src).copied();
                }
            }
            Op::Matmul => map_matmul(&vis, out_rank, &mut per),
            Op::Linear => map_linear(&vis, out_rank, &mut per),
        }
        per
    }
}

fn map_matmul(vis: &[Vec<usize>], out_rank: usize, per: &mut [Vec<Option<usize>>]) {
    let (a, b) = (&vis[0], &vis[1]);
    let (a_batch, a_m, a_k) = if a.len() >= 2 {
        (&a[..a.len() - 2], Some(a[a.len() - 2]), a[a.len() - 1])
    } else {
        (&a[..0], None, a[0])
    };
    let (b_batch, b_k, b_n) = if b.len() >= 2 {
        (&b[..b.len() - 2], b[b.len() - 2], Some(b[b.len() - 1]))
    } else {
        (&b[..0], b[0], None)
    };
    let nb = out_rank - 1 - usize::from(a_m.is_some()) - usize::from(b_n.is_some());
    for j in 0..nb {
        if j + a_batch.len() >= nb {
            per[0][j] = Some(a_batch[j + a_batch.len() - nb]);
        }
        if j + b_batch.len() >= nb {
            per[1][j] = Some(b_batch[j + b_batch.len() - nb]);
        }
    }
    let mut j = nb;
    if let Some(m) = a_m {
        per[0][j] = Some(m);
        j += 1;
    }
    if let Some(n) = b_n {
        per[1][j] = Some(n);
        j += 1;
    }
    per[0][j] = Some(a_k);
    per[1][j] = Some(b_k);
}

fn map_linear(vis: &[Vec<usize>], out_rank: usize, per: &mut [Vec<Option<usize>>]) {
    let x = &vis[0];
    let nb = x.len() - 1;
    for (j, &p) in x[..nb].iter().enumerate() {
        per[0][j] = Some(p);
    }
    per[1][nb] = Some(vis[1][0]);
    per[0][out_rank - 1] = Some(x[nb]);
    per[1][out_rank - 1] = Some(vis[1][1]);
    if vis.len() > 2 {
        per[2][nb] = Some(vis[2][0]);
    }
}
