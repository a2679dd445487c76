//! The builder API: creates inputs and ops with shape inference and checks.
//!
//! The `fusion!` macro checks a fusion at compile time by driving this builder, and its
//! expansion calls it again to build the fusion; it is also the way to build a fusion by
//! hand. Each op infers its output's axes, propagates DIDx sharding from the inputs,
//! and returns an error naming the tensor and axis (and the argument at fault, see
//! [`Culprit`]) when the operands do not fit together.
//!
//! Two things serve checkers that report every mistake at once. A builder made with
//! [`FusionBuilder::with_dtype_params`] takes dtype parameters ([`DTypeSpec::Param`]) where
//! it takes dtypes, so a fusion generic over its element types is checked once; a
//! parameter equals only itself. And after a failed call the builder stays usable: a
//! [`FusionBuilder::poisoned`] tensor stands in for the failed result with its declared
//! type, so what reads it is still checked; a builder holding one never builds.

mod ops;
mod validate;

use std::collections::{HashMap, HashSet};

use crate::dtype::{DType, DTypeSpec};
use crate::error::{Culprit, Error, Result};
use crate::ir::{
    axis_map, DeviceMesh, Expr, ExprId, Fusion, IterDomain, IterKind, Op, ParallelType, ScalarId,
    ScalarOp, TensorId,
};

pub use validate::{problems, validate, Site};

/// One declared axis: an extent and how it is parallelized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Axis {
    /// The extent: a symbol, a constant or an expression of them.
    pub extent: ScalarId,
    /// How the axis is distributed.
    pub parallel: ParallelType,
}

impl Axis {
    /// A serial axis.
    pub fn serial(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::Serial,
        }
    }

    /// An axis sharded over the mesh (`extent` is the mesh size).
    pub fn didx(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::DIDx,
        }
    }

    /// A stream-parallel axis.
    pub fn stream(extent: ScalarId) -> Self {
        Axis {
            extent,
            parallel: ParallelType::Stream,
        }
    }

    /// The iteration domain of a declared axis.
    fn domain(&self) -> IterDomain {
        IterDomain {
            extent: self.extent,
            parallel: self.parallel,
            kind: IterKind::Iteration,
        }
    }
}

/// A comparison of literal extents that a check relied on (a front end may assert it
/// again in generated code, as `fusion!` does with `static_assertions`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LiteralFact {
    /// Two literal extents found equal.
    Eq(i64, i64),
    /// `by` is positive and divides `n`.
    Divides { n: i64, by: i64 },
    /// `a < b`.
    Lt(i64, i64),
    /// `a <= b`.
    Le(i64, i64),
}

/// Builds a [`Fusion`] op by op.
#[derive(Debug, Default)]
pub struct FusionBuilder {
    f: Fusion,
    declared: HashSet<TensorId>,
    /// The names of the dtype parameters ([`FusionBuilder::with_dtype_params`]).
    dtype_params: Vec<String>,
    /// Tensors whose element type is a dtype parameter, and which one. Their dtype in
    /// the IR is a placeholder; such a builder checks but never builds.
    param_dtypes: HashMap<TensorId, usize>,
    /// Stand-ins for failed definitions and what was computed from them.
    poisoned: HashSet<TensorId>,
    facts: Vec<LiteralFact>,
}

impl FusionBuilder {
    /// An empty builder.
    pub fn new() -> Self {
        Self::default()
    }

    /// A builder that checks a fusion generic over the dtype parameters `names`
    /// (`DTypeSpec::Param(i)` is `names[i]`). It reports every error a binding of the
    /// parameters could hit, once, but [`FusionBuilder::build`] refuses: each binding
    /// builds its own fusion with concrete dtypes ([`crate::generic::GenericFusion`]).
    pub fn with_dtype_params(names: &[&str]) -> Self {
        FusionBuilder {
            dtype_params: names.iter().map(|n| n.to_string()).collect(),
            ..Self::default()
        }
    }

    /// The fusion built so far (for inspection). Tensors of a dtype parameter show a
    /// placeholder dtype; [`FusionBuilder::dtype`] has theirs.
    pub fn fusion(&self) -> &Fusion {
        &self.f
    }

    /// A tensor's element type: concrete, or a dtype parameter.
    pub fn dtype(&self, t: TensorId) -> DTypeSpec {
        match self.param_dtypes.get(&t) {
            Some(&i) => DTypeSpec::Param(i),
            None => DTypeSpec::Fixed(self.f.tensor(t).dtype),
        }
    }

    /// A dtype's name in messages: `f32`, or the parameter's name.
    pub fn dtype_name(&self, d: DTypeSpec) -> String {
        match d {
            DTypeSpec::Fixed(d) => d.name().to_string(),
            DTypeSpec::Param(i) => self.dtype_params.get(i).cloned().unwrap_or_default(),
        }
    }

    /// The literal comparisons the checks so far relied on, in order.
    pub fn literal_facts(&self) -> &[LiteralFact] {
        &self.facts
    }

    /// True for a [`FusionBuilder::poisoned`] tensor and what was computed from one.
    pub fn is_poisoned(&self, t: TensorId) -> bool {
        self.poisoned.contains(&t)
    }

    /// The named dimension symbol `name`.
    pub fn symbol(&mut self, name: &str) -> ScalarId {
        self.f.symbol(name)
    }

    /// A fresh anonymous dimension symbol (`iN`).
    pub fn anonymous(&mut self) -> ScalarId {
        self.f.fresh_symbol()
    }

    /// A literal extent.
    pub fn constant(&mut self, v: i64) -> ScalarId {
        self.f.constant(v)
    }

    /// `a * b`, `a / b`, ... on extents.
    pub fn scalar_op(&mut self, op: ScalarOp, a: ScalarId, b: ScalarId) -> ScalarId {
        self.f.binary(op, a, b)
    }

    /// A new input on every device of the world.
    pub fn input(
        &mut self,
        name: &str,
        dtype: impl Into<DTypeSpec>,
        axes: &[Axis],
    ) -> Result<TensorId> {
        self.input_on(name, dtype, axes, DeviceMesh::World)
    }

    /// A new input living on `mesh`.
    pub fn input_on(
        &mut self,
        name: &str,
        dtype: impl Into<DTypeSpec>,
        axes: &[Axis],
        mesh: DeviceMesh,
    ) -> Result<TensorId> {
        let dtype = self.declared_type(dtype.into(), &mesh)?;
        let domains = axes.iter().map(|a| a.domain()).collect();
        let t = self.new_tensor(Some(name.to_string()), dtype, domains, mesh);
        self.check_annotations(t, true)
            .map_err(|e| blame_axis(e, 2))?;
        if let Some(ax) = self.f.find_parallel_axis(t, ParallelType::Stream) {
            return Err(Error::Parallelization {
                tensor: name.to_string(),
                axis: Some(ax),
                reason: "inputs cannot be Stream-parallel: a Stream axis is produced chunk by \
                         chunk inside the fusion; declare the input axis serial and put \
                         `@ Stream` on the result instead"
                    .into(),
                culprit: Some(Culprit::Element { arg: 2, index: ax }),
            });
        }
        self.f.add_input(t);
        self.declared.insert(t);
        Ok(t)
    }

    /// A stand-in for a tensor whose definition failed, with the type it was declared
    /// with: the ops that read it are still checked, but it and everything computed from
    /// it are poisoned, and the builder no longer builds.
    pub fn poisoned(
        &mut self,
        dtype: impl Into<DTypeSpec>,
        axes: &[Axis],
        mesh: DeviceMesh,
    ) -> Result<TensorId> {
        let dtype = self.known(dtype.into())?;
        let domains = axes.iter().map(|a| a.domain()).collect();
        let t = self.new_tensor(None, dtype, domains, mesh);
        self.poisoned.insert(t);
        self.declared.insert(t);
        Ok(t)
    }

    /// Gives a tensor a name for error messages (the DSL passes `let` names).
    pub fn name(&mut self, t: TensorId, name: &str) {
        self.f.tensor_mut(t).name = Some(name.to_string());
    }

    /// Places a tensor on an explicit mesh.
    pub fn set_mesh(&mut self, t: TensorId, mesh: DeviceMesh) {
        self.f.tensor_mut(t).mesh = mesh;
    }

    /// Sets the parallel type of a visible axis.
    pub fn parallelize(&mut self, t: TensorId, axis: usize, p: ParallelType) -> Result<()> {
        let pos = self.visible_pos(t, axis, "parallelize", Culprit::Arg(1))?;
        if self.f.is_input(t) && p == ParallelType::Stream {
            return Err(Error::Parallelization {
                tensor: self.f.tensor_name(t),
                axis: Some(axis),
                reason: "inputs cannot be Stream-parallel".into(),
                culprit: Some(Culprit::Arg(1)),
            });
        }
        let d = self.f.tensor(t).axes[pos];
        self.f.iter_domain_mut(d).parallel = p;
        self.check_annotations(t, true)
            .map_err(|e| e.at(Culprit::Arg(1)))
    }

    /// Checks a declared type (`let x: Tensor<dtype, [axes]> = ...`) against the inferred
    /// one and applies its parallel types. Re-declaring an input, an output or an already
    /// declared tensor inserts a `set` (unless it already has exactly this layout), so
    /// earlier uses keep their layout; the returned id is the tensor that carries the
    /// declared type.
    pub fn declare(
        &mut self,
        t: TensorId,
        dtype: impl Into<DTypeSpec>,
        axes: &[Axis],
    ) -> Result<TensorId> {
        let mesh = self.f.tensor(t).mesh.clone();
        self.declare_on(t, dtype, axes, mesh)
    }

    /// [`FusionBuilder::declare`] with the mesh the declared tensor lives on.
    pub fn declare_on(
        &mut self,
        t: TensorId,
        dtype: impl Into<DTypeSpec>,
        axes: &[Axis],
        mesh: DeviceMesh,
    ) -> Result<TensorId> {
        let dtype = self.declared_type(dtype.into(), &mesh)?;
        let name = self.f.tensor_name(t);
        let actual = self.dtype(t);
        let declared = |reason: String, culprit| Error::Declared {
            tensor: name.clone(),
            reason,
            culprit,
        };
        if actual != dtype {
            let (want, have) = (self.dtype_name(dtype), self.dtype_name(actual));
            return Err(declared(
                format!(
                    "declared element type `{want}`, but `{name}` is `{have}`; declare `{have}` \
                     or convert with `cast(x, {want})`"
                ),
                Culprit::Arg(1),
            ));
        }
        let vis = self.f.visible_axes(t);
        if vis.len() != axes.len() {
            return Err(declared(
                format!(
                    "declared rank {}, but `{name}` has rank {}: its type is `{}`",
                    axes.len(),
                    vis.len(),
                    self.type_string(t)
                ),
                Culprit::Arg(2),
            ));
        }
        for (i, (&pos, a)) in vis.iter().zip(axes).enumerate() {
            let ext = self.f.axis(t, pos).extent;
            if ext != a.extent {
                return Err(declared(
                    format!(
                        "declared extent `{:#}` for axis {i}, but `{name}` has extent `{:#}` \
                         there (its type is `{}`)",
                        self.f.display_scalar(a.extent),
                        self.f.display_scalar(ext),
                        self.type_string(t)
                    ),
                    Culprit::Element { arg: 2, index: i },
                ));
            }
            self.note_equal(ext, a.extent);
        }
        let same_layout = self.f.tensor(t).mesh == mesh
            && vis
                .iter()
                .zip(axes)
                .all(|(&p, a)| self.f.axis(t, p).parallel == a.parallel);
        let copy = self.declared.contains(&t) || self.f.is_output(t);
        if copy && same_layout {
            return Ok(t);
        }
        let target = if copy {
            let s = self.set(t)?;
            if let Some(n) = self.f.tensor(t).name.clone() {
                self.name(s, &n);
            }
            s
        } else {
            t
        };
        let vis = self.f.visible_axes(target);
        for (&pos, a) in vis.iter().zip(axes) {
            let d = self.f.tensor(target).axes[pos];
            self.f.iter_domain_mut(d).parallel = a.parallel;
        }
        self.f.tensor_mut(target).mesh = mesh;
        self.check_annotations(target, true)
            .map_err(|e| blame_axis(e, 2))?;
        self.declared.insert(target);
        if target == t {
            self.stream_producers(target);
        }
        Ok(target)
    }

    /// Applies `t`'s Stream axis to the intermediates an elementwise `t` is computed from,
    /// so that `let a: Tensor<.., [d @ Stream, ..]> = gelu(matmul(x, w))` streams the
    /// matmul in the same loop instead of computing it whole first. This is also what
    /// settles a matmul that takes DIDx axes from both operands: the annotation names the
    /// one that becomes the Stream axis (gathered chunk by chunk). Only intermediates that
    /// this chain alone uses, that no annotation fixed, and that a matmul, linear or
    /// elementwise op (not a `set`) computes are changed; elementwise ones pass it on.
    ///
    /// A streamed matmul or linear passes it on to elementwise operands only, so that
    /// `let up: [d @ Stream, ..] = matmul(x, w1); let y: [d @ Stream, ..] =
    /// matmul(gelu(up), w2)` computes the activation chunk by chunk in the same loop (and
    /// folds it into the first GEMM's epilogue) as when the activation is annotated.
    fn stream_producers(&mut self, t: TensorId) {
        let Some(id) = self.f.definition(t) else {
            return;
        };
        let e = self.f.expr(id).clone();
        let elementwise = matches!(e.op, Op::Unary(_) | Op::Binary(_) | Op::Cast);
        let gemm = matches!(e.op, Op::Matmul | Op::Linear);
        let Some(s) = self.f.find_parallel_axis(t, ParallelType::Stream) else {
            return;
        };
        if !elementwise && !gemm {
            return;
        }
        let map = axis_map(&self.f, &e);
        for (i, &u) in e.inputs.iter().enumerate() {
            let Some(q) = map.producer_axis(i, s) else {
                continue;
            };
            let streams = self
                .f
                .definition(u)
                .is_some_and(|d| match self.f.expr(d).op {
                    Op::Unary(_) | Op::Binary(_) | Op::Cast => true,
                    Op::Matmul | Op::Linear => elementwise,
                    _ => false,
                });
            if !streams
                || self.declared.contains(&u)
                || self.f.is_output(u)
                || self.f.uses(u) != [id]
                || self.is_broadcast_like(u, q)
                || self.f.find_parallel_axis(u, ParallelType::Stream).is_some()
            {
                continue;
            }
            let d = self.f.tensor(u).axes[q];
            self.f.iter_domain_mut(d).parallel = ParallelType::Stream;
            self.stream_producers(u);
        }
    }

    /// Marks a tensor as the next output (an input is copied first).
    pub fn output(&mut self, t: TensorId) -> Result<TensorId> {
        let t = if self.f.is_input(t) || self.f.is_output(t) {
            self.set(t)?
        } else {
            t
        };
        self.f.add_output(t);
        self.declared.insert(t);
        Ok(t)
    }

    /// Declares that output `out` is written in place into input `input`'s buffer.
    pub fn alias_output_to_input(&mut self, out: TensorId, input: TensorId) -> Result<()> {
        if !self.f.is_output(out) || !self.f.is_input(input) {
            return Err(Error::Invalid(format!(
                "alias_output_to_input: `{}` must be an output and `{}` an input",
                self.f.tensor_name(out),
                self.f.tensor_name(input)
            )));
        }
        let (a, b) = (self.f.tensor(out), self.f.tensor(input));
        let same_layout = a.dtype == b.dtype
            && self.f.visible_axes(out).len() == self.f.visible_axes(input).len()
            && self
                .f
                .visible_axes(out)
                .iter()
                .zip(self.f.visible_axes(input))
                .all(|(&p, q)| {
                    let (x, y) = (self.f.axis(out, p), self.f.axis(input, q));
                    x.extent == y.extent
                        && (x.parallel == ParallelType::DIDx) == (y.parallel == ParallelType::DIDx)
                });
        if !same_layout {
            return Err(Error::Invalid(format!(
                "alias_output_to_input: `{}` and `{}` differ in dtype, extents or sharding",
                self.f.tensor_name(out),
                self.f.tensor_name(input)
            )));
        }
        self.f.alias_output_to_input(out, input);
        Ok(())
    }

    /// Finishes the fusion after whole-fusion checks (the compile-time rules of docs/DSL.md).
    pub fn build(self) -> Result<Fusion> {
        if !self.dtype_params.is_empty() {
            return Err(Error::Invalid(format!(
                "this builder checks a fusion generic over {:?}; build one fusion per binding \
                 of the dtype parameters (`fusion_compiler::generic::GenericFusion`)",
                self.dtype_params
            )));
        }
        if !self.poisoned.is_empty() {
            return Err(Error::Invalid(
                "a definition failed (a poisoned stand-in took its place); fix the earlier \
                 error"
                    .into(),
            ));
        }
        let f = self.f;
        if f.outputs().is_empty() {
            return Err(Error::Invalid("a fusion needs at least one output".into()));
        }
        validate(&f)?;
        Ok(f)
    }

    // ----- helpers shared with the ops -----

    /// Checks the dtype and mesh of a declared type (`input_on`, `declare_on`).
    fn declared_type(&self, dtype: DTypeSpec, mesh: &DeviceMesh) -> Result<DTypeSpec> {
        check_mesh(mesh)?;
        self.known(dtype)
    }

    /// Checks that a dtype parameter exists.
    fn known(&self, d: DTypeSpec) -> Result<DTypeSpec> {
        match d {
            DTypeSpec::Param(i) if i >= self.dtype_params.len() => Err(Error::Invalid(format!(
                "dtype parameter {i} does not exist; this builder has {:?}",
                self.dtype_params
            ))),
            d => Ok(d),
        }
    }

    /// Adds a tensor of a concrete dtype or a dtype parameter.
    fn new_tensor(
        &mut self,
        name: Option<String>,
        dtype: DTypeSpec,
        domains: Vec<IterDomain>,
        mesh: DeviceMesh,
    ) -> TensorId {
        let concrete = match dtype {
            DTypeSpec::Fixed(d) => d,
            DTypeSpec::Param(_) => DType::F32,
        };
        let t = self.f.new_tensor(name, concrete, domains, mesh);
        if let DTypeSpec::Param(i) = dtype {
            self.param_dtypes.insert(t, i);
        }
        t
    }

    /// Adds `output = op(inputs)`; the output of poisoned inputs is poisoned.
    fn define(&mut self, op: Op, inputs: Vec<TensorId>, output: TensorId) -> ExprId {
        if inputs.iter().any(|t| self.poisoned.contains(t)) {
            self.poisoned.insert(output);
        }
        self.f.add_expr(Expr { op, inputs, output })
    }

    /// Records a literal equality the checks relied on.
    fn note_equal(&mut self, a: ScalarId, b: ScalarId) {
        if let (Some(x), Some(y)) = (self.f.const_value(a), self.f.const_value(b)) {
            self.facts.push(LiteralFact::Eq(x, y));
        }
    }

    /// The type as the DSL writes it: `Tensor<f32, [d @ DIDx, m], mesh = [0, 1]>`.
    fn type_string(&self, t: TensorId) -> String {
        let axes: Vec<String> = self
            .f
            .visible_axes(t)
            .into_iter()
            .map(|p| {
                let a = self.f.axis(t, p);
                match a.parallel {
                    ParallelType::Serial => format!("{:#}", self.f.display_scalar(a.extent)),
                    p => format!("{:#} @ {p}", self.f.display_scalar(a.extent)),
                }
            })
            .collect();
        let mesh = match &self.f.tensor(t).mesh {
            DeviceMesh::World => String::new(),
            DeviceMesh::Devices(d) => format!(", mesh = {d:?}"),
        };
        let dtype = self.dtype_name(self.dtype(t));
        format!("Tensor<{dtype}, [{}]{mesh}>", axes.join(", "))
    }

    fn is_broadcast_like(&self, t: TensorId, pos: usize) -> bool {
        let d = self.f.axis(t, pos);
        d.kind == IterKind::Broadcast || self.f.const_value(d.extent) == Some(1)
    }

    fn visible_pos(&self, t: TensorId, axis: usize, op: &str, culprit: Culprit) -> Result<usize> {
        let vis = self.f.visible_axes(t);
        vis.get(axis).copied().ok_or_else(|| Error::AxisOutOfRange {
            op: op.to_string(),
            tensor: self.f.tensor_name(t),
            axis: axis as i64,
            rank: vis.len(),
            culprit,
        })
    }

    /// At most one DIDx and one Stream axis (`declared`: the layout comes from a
    /// declaration, so no op is to blame).
    fn check_annotations(&self, t: TensorId, declared: bool) -> Result<()> {
        validate::check_tensor_annotations(&self.f, t, declared)
    }
}

/// An explicit mesh lists distinct devices, at least one (argument 3 of `input_on` and
/// `declare_on`).
fn check_mesh(mesh: &DeviceMesh) -> Result<()> {
    let DeviceMesh::Devices(d) = mesh else {
        return Ok(());
    };
    let error = |reason: String, culprit| Error::Argument {
        op: "mesh".into(),
        reason,
        culprit,
    };
    if d.is_empty() {
        let reason = "a mesh lists at least one device; the world mesh (no `mesh`) is every \
                      device";
        return Err(error(reason.into(), Culprit::Arg(3)));
    }
    match (0..d.len()).find(|&i| d[..i].contains(&d[i])) {
        Some(i) => Err(error(
            format!(
                "device {} is listed twice; a mesh lists distinct devices",
                d[i]
            ),
            Culprit::Element { arg: 3, index: i },
        )),
        None => Ok(()),
    }
}

/// A sharding error of a declared type, blamed on the declared axis (list argument `arg`).
fn blame_axis(e: Error, arg: usize) -> Error {
    match e {
        Error::Parallelization {
            axis: Some(index), ..
        } => e.at(Culprit::Element { arg, index }),
        e => e,
    }
}

#[cfg(test)]
mod tests;
