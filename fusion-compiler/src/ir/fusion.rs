//! [`Fusion`]: the arena of one tensor program and the queries and rewrites on it.

use std::collections::HashMap;

use super::domain::{IterDomain, IterDomainId, ParallelType};
use super::linear::{self, Linear};
use super::mesh::DeviceMesh;
use super::op::{Expr, ExprId};
use super::scalar::{NamedScalar, Scalar, ScalarDisplay, ScalarId, ScalarOp};
use super::tensor::{MemoryType, TensorId, TensorView};

/// A tensor program: the arena plus its inputs and outputs, in topological expression order.
#[derive(Clone, Debug, Default)]
pub struct Fusion {
    scalars: Vec<Scalar>,
    scalar_index: HashMap<Scalar, ScalarId>,
    /// The first sum, difference, multiple or exact quotient interned with each linear form
    /// (`m + n` and `n + m` are one extent, printed as first written).
    linear_index: HashMap<Linear, ScalarId>,
    iter_domains: Vec<IterDomain>,
    tensors: Vec<TensorView>,
    definitions: Vec<Option<ExprId>>,
    exprs: Vec<Expr>,
    inputs: Vec<TensorId>,
    outputs: Vec<TensorId>,
    aliases: Vec<(TensorId, TensorId)>,
    next_anonymous: u32,
    next_loop: u32,
}

impl Fusion {
    /// An empty fusion.
    pub fn new() -> Self {
        Self::default()
    }

    // ----- scalars -----

    /// Interns a scalar node, folding constant arithmetic and trivial identities, and
    /// combining like terms where that simplifies it (`2 * f - f` is `f`, `2 * f / 2` is
    /// `f`; other extents keep their written form).
    pub fn scalar(&mut self, s: Scalar) -> ScalarId {
        let s = match s {
            Scalar::Binary(op, a, b) => match self.fold(op, a, b) {
                Folded::Value(v) => Scalar::Const(v),
                Folded::Same(id) => return id,
                Folded::Keep => match linear::simplified(&self.scalars, op, a, b) {
                    Some(form) => return self.intern_linear(&form),
                    None => Scalar::Binary(op, a, b),
                },
            },
            other => other,
        };
        let linear = matches!(
            s,
            Scalar::Binary(
                ScalarOp::Add | ScalarOp::Sub | ScalarOp::Mul | ScalarOp::Div,
                ..
            )
        );
        let id = self.intern(s);
        if !linear {
            return id;
        }
        // An expression of an extent already written another way is that extent.
        let form = linear::linear_form(&self.scalars, id);
        if form.single_atom() == Some(id) {
            return id;
        }
        *self.linear_index.entry(form).or_insert(id)
    }

    /// Interns `s` as it is (no folding).
    fn intern(&mut self, s: Scalar) -> ScalarId {
        if let Some(&id) = self.scalar_index.get(&s) {
            return id;
        }
        let id = ScalarId(self.scalars.len() as u32);
        self.scalars.push(s.clone());
        self.scalar_index.insert(s, id);
        id
    }

    /// A linear form as one expression: its atoms in id order (`k * atom`, added or
    /// subtracted), then its constant; a form of one atom is the atom itself.
    fn intern_linear(&mut self, form: &Linear) -> ScalarId {
        if let Some(atom) = form.single_atom() {
            return atom;
        }
        let mut acc: Option<ScalarId> = None;
        for (&atom, &k) in &form.terms {
            let mag = k.abs();
            let term = if mag == 1 {
                atom
            } else {
                let c = self.intern(Scalar::Const(mag));
                self.intern(Scalar::Binary(ScalarOp::Mul, c, atom))
            };
            acc = Some(match acc {
                None if k > 0 => term,
                None => {
                    let c = self.intern(Scalar::Const(k));
                    self.intern(Scalar::Binary(ScalarOp::Mul, c, atom))
                }
                Some(x) => {
                    let op = if k > 0 { ScalarOp::Add } else { ScalarOp::Sub };
                    self.intern(Scalar::Binary(op, x, term))
                }
            });
        }
        let k = form.constant;
        match acc {
            None => self.intern(Scalar::Const(k)),
            Some(x) if k == 0 => x,
            Some(x) => {
                let op = if k > 0 { ScalarOp::Add } else { ScalarOp::Sub };
                let c = self.intern(Scalar::Const(k.abs()));
                self.intern(Scalar::Binary(op, x, c))
            }
        }
    }

    fn fold(&self, op: ScalarOp, a: ScalarId, b: ScalarId) -> Folded {
        let (ca, cb) = (self.const_value(a), self.const_value(b));
        if let (Some(x), Some(y)) = (ca, cb) {
            if let Some(v) = op.apply(x, y) {
                return Folded::Value(v);
            }
        }
        match (op, ca, cb) {
            (ScalarOp::Mul, Some(1), _) => Folded::Same(b),
            (ScalarOp::Mul | ScalarOp::Div, _, Some(1)) => Folded::Same(a),
            (ScalarOp::Add, Some(0), _) => Folded::Same(b),
            (ScalarOp::Add | ScalarOp::Sub, _, Some(0)) => Folded::Same(a),
            (ScalarOp::Div, _, _) if a == b => Folded::Value(1),
            (ScalarOp::Eq, _, _) if a == b => Folded::Value(1),
            _ => Folded::Keep,
        }
    }

    /// A literal scalar.
    pub fn constant(&mut self, v: i64) -> ScalarId {
        self.scalar(Scalar::Const(v))
    }

    /// The named dimension symbol `name` (the same id for the same name).
    pub fn symbol(&mut self, name: &str) -> ScalarId {
        self.scalar(Scalar::Symbol(name.to_string()))
    }

    /// A fresh anonymous dimension symbol, printed `iN`.
    pub fn fresh_symbol(&mut self) -> ScalarId {
        loop {
            let name = format!("i{}", self.next_anonymous);
            self.next_anonymous += 1;
            if !self
                .scalar_index
                .contains_key(&Scalar::Symbol(name.clone()))
            {
                return self.symbol(&name);
            }
        }
    }

    /// A runtime-bound scalar.
    pub fn named(&mut self, n: NamedScalar) -> ScalarId {
        self.scalar(Scalar::Named(n))
    }

    /// A new for-loop index, printed as `name`.
    pub fn loop_index(&mut self, name: &str) -> ScalarId {
        let serial = self.next_loop;
        self.next_loop += 1;
        self.scalar(Scalar::LoopIndex {
            name: name.to_string(),
            serial,
        })
    }

    /// `a op b`, folded where possible.
    pub fn binary(&mut self, op: ScalarOp, a: ScalarId, b: ScalarId) -> ScalarId {
        self.scalar(Scalar::Binary(op, a, b))
    }

    /// The node behind a scalar id.
    pub fn scalar_node(&self, id: ScalarId) -> &Scalar {
        &self.scalars[id.index()]
    }

    /// Number of scalars in the arena.
    pub fn scalar_count(&self) -> usize {
        self.scalars.len()
    }

    /// The value of a literal, else `None`.
    pub fn const_value(&self, id: ScalarId) -> Option<i64> {
        match self.scalars[id.index()] {
            Scalar::Const(v) => Some(v),
            _ => None,
        }
    }

    /// Evaluates a scalar; `leaf` supplies symbols, named scalars and loop indices.
    /// `None` when a leaf is unbound or the arithmetic fails (division by zero, overflow).
    pub fn evaluate(&self, id: ScalarId, leaf: &dyn Fn(ScalarId) -> Option<i64>) -> Option<i64> {
        match &self.scalars[id.index()] {
            Scalar::Const(v) => Some(*v),
            Scalar::Binary(op, a, b) => {
                let x = self.evaluate(*a, leaf)?;
                let y = self.evaluate(*b, leaf)?;
                op.apply(x, y)
            }
            _ => leaf(id),
        }
    }

    /// Display adaptor for a scalar (`( i0 * i2 )`).
    pub fn display_scalar(&self, id: ScalarId) -> ScalarDisplay<'_> {
        ScalarDisplay {
            scalars: &self.scalars,
            id,
        }
    }

    // ----- iteration domains -----

    /// Adds an iteration domain.
    pub fn add_iter_domain(&mut self, d: IterDomain) -> IterDomainId {
        let id = IterDomainId(self.iter_domains.len() as u32);
        self.iter_domains.push(d);
        id
    }

    /// The iteration domain behind an id.
    pub fn iter_domain(&self, id: IterDomainId) -> &IterDomain {
        &self.iter_domains[id.index()]
    }

    /// Mutable access to an iteration domain.
    pub fn iter_domain_mut(&mut self, id: IterDomainId) -> &mut IterDomain {
        &mut self.iter_domains[id.index()]
    }

    // ----- tensors -----

    /// Adds a tensor (not yet an input, output or expression result).
    pub fn add_tensor(&mut self, t: TensorView) -> TensorId {
        let id = TensorId(self.tensors.len() as u32);
        self.tensors.push(t);
        self.definitions.push(None);
        id
    }

    /// Adds a tensor whose axes are given as iteration domains.
    pub fn new_tensor(
        &mut self,
        name: Option<String>,
        dtype: crate::dtype::DType,
        axes: Vec<IterDomain>,
        mesh: DeviceMesh,
    ) -> TensorId {
        let axes = axes.into_iter().map(|d| self.add_iter_domain(d)).collect();
        self.add_tensor(TensorView {
            name,
            dtype,
            axes,
            mesh,
            memory: MemoryType::Global,
        })
    }

    /// The tensor behind an id.
    pub fn tensor(&self, id: TensorId) -> &TensorView {
        &self.tensors[id.index()]
    }

    /// Mutable access to a tensor.
    pub fn tensor_mut(&mut self, id: TensorId) -> &mut TensorView {
        &mut self.tensors[id.index()]
    }

    /// Number of tensors in the arena.
    pub fn tensor_count(&self) -> usize {
        self.tensors.len()
    }

    /// The user's name for a tensor, else `TN`.
    pub fn tensor_name(&self, id: TensorId) -> String {
        match &self.tensors[id.index()].name {
            Some(n) => n.clone(),
            None => format!("T{}", id.index()),
        }
    }

    /// Positions (in `axes`) of the axes a tensor stores: all but reduction axes.
    pub fn visible_axes(&self, id: TensorId) -> Vec<usize> {
        self.tensors[id.index()]
            .axes
            .iter()
            .enumerate()
            .filter(|(_, &d)| !self.iter_domain(d).is_reduction())
            .map(|(i, _)| i)
            .collect()
    }

    /// The iteration domain of axis `pos` (an index into `axes`).
    pub fn axis(&self, id: TensorId, pos: usize) -> &IterDomain {
        self.iter_domain(self.tensors[id.index()].axes[pos])
    }

    /// Position (in `axes`) of the first axis with the given parallel type.
    pub fn find_parallel_axis(&self, id: TensorId, p: ParallelType) -> Option<usize> {
        self.tensors[id.index()]
            .axes
            .iter()
            .position(|&d| self.iter_domain(d).parallel == p)
    }

    /// True when the tensor has a DIDx axis.
    pub fn is_sharded(&self, id: TensorId) -> bool {
        self.find_parallel_axis(id, ParallelType::DIDx).is_some()
    }

    /// A copy of `src`'s visible axes as fresh iteration domains (same extents, kinds and
    /// parallel types), as a new tensor on the same mesh.
    pub fn clone_visible(&mut self, src: TensorId, dtype: crate::dtype::DType) -> TensorId {
        let axes: Vec<IterDomain> = self
            .visible_axes(src)
            .into_iter()
            .map(|p| self.axis(src, p).clone())
            .collect();
        let mesh = self.tensor(src).mesh.clone();
        self.new_tensor(None, dtype, axes, mesh)
    }

    // ----- expressions -----

    /// Appends an expression and records it as its output's definition.
    pub fn add_expr(&mut self, e: Expr) -> ExprId {
        let id = ExprId(self.exprs.len() as u32);
        self.definitions[e.output.index()] = Some(id);
        self.exprs.push(e);
        id
    }

    /// The expression behind an id.
    pub fn expr(&self, id: ExprId) -> &Expr {
        &self.exprs[id.index()]
    }

    /// All expressions in creation (topological) order.
    pub fn exprs(&self) -> &[Expr] {
        &self.exprs
    }

    /// Mutable access to an expression (lowering rewires inputs and outputs).
    pub fn expr_mut(&mut self, id: ExprId) -> &mut Expr {
        &mut self.exprs[id.index()]
    }

    /// Records `e` as the definition of `t` (after rewiring an expression's output).
    pub fn set_definition(&mut self, t: TensorId, e: ExprId) {
        self.definitions[t.index()] = Some(e);
    }

    /// Ids of all expressions in creation order.
    pub fn expr_ids(&self) -> impl Iterator<Item = ExprId> {
        (0..self.exprs.len() as u32).map(ExprId)
    }

    /// The expression that defines a tensor, if any.
    pub fn definition(&self, t: TensorId) -> Option<ExprId> {
        self.definitions[t.index()]
    }

    /// Expressions that read a tensor.
    pub fn uses(&self, t: TensorId) -> Vec<ExprId> {
        self.expr_ids()
            .filter(|&e| self.expr(e).inputs.contains(&t))
            .collect()
    }

    // ----- inputs, outputs, aliases -----

    /// Marks a tensor as the next input.
    pub fn add_input(&mut self, t: TensorId) {
        self.inputs.push(t);
    }

    /// Marks a tensor as the next output.
    pub fn add_output(&mut self, t: TensorId) {
        self.outputs.push(t);
    }

    /// Inputs in call order.
    pub fn inputs(&self) -> &[TensorId] {
        &self.inputs
    }

    /// Outputs in return order.
    pub fn outputs(&self) -> &[TensorId] {
        &self.outputs
    }

    /// Declares that `output` is written into `input`'s buffer (an in-place update).
    pub fn alias_output_to_input(&mut self, output: TensorId, input: TensorId) {
        self.aliases.push((output, input));
    }

    /// `(output, input)` pairs declared with [`Fusion::alias_output_to_input`].
    pub fn aliases(&self) -> &[(TensorId, TensorId)] {
        &self.aliases
    }

    /// True if `t` is an input of the fusion.
    pub fn is_input(&self, t: TensorId) -> bool {
        self.inputs.contains(&t)
    }

    /// True if `t` is an output of the fusion.
    pub fn is_output(&self, t: TensorId) -> bool {
        self.outputs.contains(&t)
    }

    /// Replaces every `DeviceMesh::World` with the explicit list for `world_size` devices.
    pub fn resolve_meshes(&mut self, world_size: usize) {
        for t in &mut self.tensors {
            if t.mesh == DeviceMesh::World {
                t.mesh = DeviceMesh::Devices((0..world_size).collect());
            }
        }
    }
}

enum Folded {
    Value(i64),
    Same(ScalarId),
    Keep,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_are_interned_and_folded() {
        let mut f = Fusion::new();
        let m = f.symbol("m");
        assert_eq!(m, f.symbol("m"));
        let one = f.constant(1);
        assert_eq!(f.binary(ScalarOp::Mul, m, one), m);
        let two = f.constant(2);
        let three = f.constant(3);
        let six = f.binary(ScalarOp::Mul, two, three);
        assert_eq!(f.const_value(six), Some(6));
        let mk = f.binary(ScalarOp::Mul, m, two);
        assert_eq!(f.display_scalar(mk).to_string(), "( m * 2 )");
        let v = f.evaluate(mk, &|id| (id == m).then_some(21));
        assert_eq!(v, Some(42));
        let a = f.fresh_symbol();
        let b = f.fresh_symbol();
        assert_ne!(a, b);
    }

    #[test]
    fn division_by_zero_is_not_folded() {
        let mut f = Fusion::new();
        let z = f.constant(0);
        let x = f.constant(5);
        let d = f.binary(ScalarOp::Div, x, z);
        assert_eq!(f.const_value(d), None);
        assert_eq!(f.evaluate(d, &|_| None), None);
    }
}
