//! Recomputation: the backward re-creates each forward value an adjoint reads by
//! replaying the forward expressions that compute it (memoized), from the forward inputs
//! it takes again, with the forward's layout (DIDx, Stream and mesh) declared on every
//! replayed value, so the recomputation lowers as the forward did. In the saving form a
//! GEMM's or a reduction's result is not replayed: it is an input of the backward (the
//! forward returns it), and only the pointwise values and views after it are replayed.

use super::context::Ctx;
use super::error::{AutodiffError, Result};
use crate::builder::Axis;
use crate::ir::{Op, ParallelType, Scalar, ScalarId, TensorId};

impl Ctx<'_> {
    /// The forward extent `s` in the backward's arena.
    pub fn scalar(&mut self, s: ScalarId) -> ScalarId {
        if let Some(&t) = self.scalars.get(&s) {
            return t;
        }
        let t = match self.f.scalar_node(s).clone() {
            Scalar::Const(v) => self.b.constant(v),
            Scalar::Binary(op, x, y) => {
                let (x, y) = (self.scalar(x), self.scalar(y));
                self.b.scalar_op(op, x, y)
            }
            Scalar::Symbol(name) => self.b.symbol(&name),
            // Named scalars and loop indices appear only in lowered programs; a symbol of
            // the same printed name keeps the backward well formed.
            _ => {
                let name = self.f.display_scalar(s).to_string();
                self.b.symbol(&name)
            }
        };
        self.scalars.insert(s, t);
        t
    }

    /// The forward tensor's visible axes as declared axes of the backward (extents
    /// translated, parallel types as in the forward).
    pub fn layout(&mut self, t: TensorId) -> Vec<Axis> {
        let axes: Vec<(ScalarId, ParallelType)> = (self.f.visible_axes(t).into_iter())
            .map(|p| {
                let d = self.f.axis(t, p);
                (d.extent, d.parallel)
            })
            .collect();
        axes.into_iter()
            .map(|(e, parallel)| Axis {
                extent: self.scalar(e),
                parallel,
            })
            .collect()
    }

    /// The backward tensor holding the forward value `t`: the backward's input for a
    /// forward input, else its recomputation.
    pub fn primal(&mut self, t: TensorId) -> Result<TensorId> {
        if let Some(&p) = self.primal.get(&t) {
            if let Some(i) = self.f.inputs().iter().position(|&x| x == t) {
                self.used_inputs[i] = true;
            }
            return Ok(p);
        }
        let Some(e) = self.f.definition(t) else {
            return Err(AutodiffError::Request(format!(
                "`{}` is neither an input nor computed by the fusion",
                self.f.tensor_name(t)
            )));
        };
        let e = self.f.expr(e).clone();
        if self.saving && worth_saving(&e.op) {
            return self.saved_input(t);
        }
        let inputs = (e.inputs.iter())
            .map(|&i| self.primal(i))
            .collect::<Result<Vec<_>>>()?;
        let out = self.replay(&e.op, &inputs, t)?;
        let axes = self.layout(t);
        let mesh = self.f.tensor(t).mesh.clone();
        let dtype = self.f.tensor(t).dtype;
        let out = self.b.declare_on(out, dtype, &axes, mesh)?;
        self.b.name(out, &self.f.tensor_name(t));
        self.primal.insert(t, out);
        Ok(out)
    }

    /// The forward value `t` as the operand a weight gradient's GEMM reads. In the saving
    /// form an activation of a saved GEMM or reduction result (`gelu(x W1)`) is taken
    /// saved too, as autograd keeps a GEMM's input, rather than computed again (a GEMM
    /// epilogue can store both); everything else as [`Self::primal`] gives it. (Values of
    /// several such results, a gated MLP's `silu(g) * u`, are recomputed: the forward
    /// computes them in one fused kernel, which returning them would split.)
    pub fn operand_primal(&mut self, t: TensorId) -> Result<TensorId> {
        if self.saving && !self.primal.contains_key(&t) && self.activation_of_saved(t) {
            return self.saved_input(t);
        }
        self.primal(t)
    }

    /// Whether `t` is a unary op's result on a value the saving form saves.
    fn activation_of_saved(&self, t: TensorId) -> bool {
        let Some(e) = self.f.definition(t) else {
            return false;
        };
        let e = self.f.expr(e);
        matches!(e.op, Op::Unary(_))
            && (self.f.definition(e.inputs[0])).is_some_and(|d| worth_saving(&self.f.expr(d).op))
    }

    /// The forward value `t` as an input of the backward (the forward returns it): its
    /// layout, with a Stream axis serial (an input is whole when the call begins).
    pub fn saved_input(&mut self, t: TensorId) -> Result<TensorId> {
        let axes = self.input_layout(t);
        let tv = self.f.tensor(t);
        let (dtype, mesh) = (tv.dtype, tv.mesh.clone());
        let name = format!("saved_{}", self.f.tensor_name(t));
        let p = self.b.input_on(&name, dtype, &axes, mesh)?;
        self.primal.insert(t, p);
        self.saved.push(t);
        Ok(p)
    }

    /// The forward tensor's layout for an input of the backward: a Stream axis is serial.
    pub fn input_layout(&mut self, t: TensorId) -> Vec<Axis> {
        (self.layout(t).into_iter())
            .map(|mut a| {
                if a.parallel == ParallelType::Stream {
                    a.parallel = ParallelType::Serial;
                }
                a
            })
            .collect()
    }

    /// `op(inputs)` in the backward, computing the forward tensor `out`.
    fn replay(&mut self, op: &Op, x: &[TensorId], out: TensorId) -> Result<TensorId> {
        let b = &mut self.b;
        Ok(match op {
            Op::Set => b.set(x[0])?,
            Op::Unary(u) => b.unary(*u, x[0])?,
            Op::Binary(o) => b.binary(*o, x[0], x[1])?,
            Op::Cast => b.cast(x[0], self.f.tensor(out).dtype)?,
            Op::Reduction { op, axes } => b.reduce(*op, x[0], axes)?,
            Op::Broadcast { flags } => b.broadcast(x[0], flags)?,
            Op::Matmul => b.matmul(x[0], x[1])?,
            Op::Linear => b.linear(x[0], x[1], x.get(2).copied())?,
            Op::Permute { perm } => b.permute(x[0], perm)?,
            Op::Select { axis, index } => {
                let index = self.scalar(*index);
                self.b.select(x[0], *axis, index)?
            }
            Op::Slice { axis, start, stop } => {
                let (start, stop) = (self.scalar(*start), self.scalar(*stop));
                self.b.slice(x[0], *axis, start, stop)?
            }
            Op::Split { axis, outer } => {
                let outer = self.scalar(*outer);
                self.b.split(x[0], *axis, outer)?
            }
            Op::Gemm { .. } => {
                return Err(AutodiffError::Request(
                    "a fused GEMM is host IR; differentiate the fusion before lowering".into(),
                ))
            }
        })
    }
}

/// Whether the saving form takes the result of `op` from the forward rather than
/// recomputing it: a GEMM's (the compute a recomputation would repeat) and a reduction's
/// (a sum over a sharded axis is a collective). Pointwise values, views and reshardings
/// are recomputed from what is saved (a gathered operand saved would hold every device's
/// rows on each device), except an activation a weight gradient's GEMM reads
/// (`Ctx::operand_primal`).
fn worth_saving(op: &Op) -> bool {
    matches!(op, Op::Matmul | Op::Linear | Op::Reduction { .. })
}
