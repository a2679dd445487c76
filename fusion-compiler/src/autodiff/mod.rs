//! Reverse-mode differentiation of a fusion: from a forward [`Fusion`] and which of its
//! outputs get gradients and which inputs want them, the backward fusion computing the
//! input gradients.
//!
//! The backward is an ordinary fusion over logical tensors: a gradient has its primal's
//! layout (DIDx axis, mesh, and where the forward had one its Stream axis), so the
//! lowering inserts the communication a change of sharding needs, as it does for any
//! fusion. The duality of the collectives follows from the adjoint rules: a broadcast's
//! adjoint is a sum (over the DIDx axis of a column-parallel weight, a ReduceScatter or
//! AllReduce), a sum's adjoint a broadcast (its batched GEMM gathers, as the forward's
//! AllGather did), and a resharding `set` is differentiated as a `set` back.
//!
//! **Saved or recomputed**: a fusion's backward comes in two forms. The *recomputing*
//! form ([`backward`]) saves nothing: it takes the forward inputs it reads again
//! ([`Backward::inputs`] lists which) and recomputes inside itself every forward value an
//! adjoint reads (a GEMM output before its activation, the gathered rows a weight
//! gradient needs), each once (memoized); the forward stays the fusion it was (no extra
//! outputs, nothing kept alive between the calls), the price is the recomputed GEMMs and
//! gathers. The *saving* form ([`saving`], what training uses by default) pairs a forward
//! that also returns the GEMM and reduction results the backward reads, in the layout the
//! forward computed them (saving costs no communication), with a backward that takes them
//! as inputs ([`BackwardInput::Saved`]): no GEMM is computed twice. Pointwise values are
//! recomputed from the saved ones, and gathered operands are gathered again (saved, they
//! would hold every device's rows on each device). docs/DECISIONS.md, "Training", says
//! why.

mod accumulate;
mod context;
mod error;
mod gemm;
mod replay;
mod rules;
mod saving;
#[cfg(test)]
mod tests;

use crate::ir::{Fusion, TensorId};
use context::Ctx;

pub use error::{AutodiffError, Result};
pub use saving::{saving, Saving};

/// Which gradients to derive: the forward outputs that receive a gradient (inputs of the
/// backward) and the forward inputs whose gradients the backward returns; indices in the
/// forward's output and input order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradSpec {
    pub outputs: Vec<usize>,
    pub inputs: Vec<usize>,
}

impl GradSpec {
    /// Every output gets a gradient and every input wants one.
    pub fn all(f: &Fusion) -> Self {
        GradSpec {
            outputs: (0..f.outputs().len()).collect(),
            inputs: (0..f.inputs().len()).collect(),
        }
    }
}

/// What one input of a backward fusion is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardInput {
    /// Forward input `i`, passed again (the backward recomputes what it needs from it).
    Primal(usize),
    /// Saved value `k` of the saving form: the output [`Saving::saved`]`[k]` of its
    /// forward.
    Saved(usize),
    /// The gradient of forward output `i` (its shape, dtype and sharding).
    OutputGrad(usize),
}

/// A derived backward fusion and what its inputs and outputs are.
#[derive(Clone, Debug)]
pub struct Backward {
    pub fusion: Fusion,
    /// The backward's inputs in call order: the forward inputs it reads (in forward
    /// order), the saved values (the saving form's, in order), then the output gradients
    /// (in [`GradSpec::outputs`] order).
    pub inputs: Vec<BackwardInput>,
    /// For each backward output, the forward input whose gradient it is
    /// ([`GradSpec::inputs`] order).
    pub outputs: Vec<usize>,
}

/// Derives the recomputing backward of `f` for `spec`. An op without an adjoint on the
/// way from a wanted input to a differentiated output is an
/// [`AutodiffError::NotDifferentiable`] naming it.
pub fn backward(f: &Fusion, spec: &GradSpec) -> Result<Backward> {
    Ok(derive_twice(f, spec, false)?.0)
}

/// The backward of `f` for `spec`, recomputing or (`saving`) taking the forward's GEMM
/// and reduction results as inputs, and the forward values it takes (in forward order).
fn derive_twice(f: &Fusion, spec: &GradSpec, saving: bool) -> Result<(Backward, Vec<TensorId>)> {
    check_spec(f, spec)?;
    // The first derivation finds the forward inputs the backward reads, and the values it
    // takes saved; the second takes only those, in order.
    let every = vec![true; f.inputs().len()];
    let first = derive(f, spec, &every, saving.then_some(&[]))?;
    let (used, mut saved) = (first.used_inputs, first.saved);
    saved.sort();
    let ctx = derive(f, spec, &used, saving.then_some(&saved))?;
    if ctx.saved != saved {
        return Err(AutodiffError::Request(format!(
            "the backward's saved values changed between its two derivations ({saved:?}, \
             then {:?})",
            ctx.saved
        )));
    }
    let inputs = (0..f.inputs().len())
        .filter(|&i| used[i])
        .map(BackwardInput::Primal)
        .chain((0..saved.len()).map(BackwardInput::Saved))
        .chain(spec.outputs.iter().map(|&o| BackwardInput::OutputGrad(o)))
        .collect();
    let backward = Backward {
        fusion: ctx.b.build()?,
        inputs,
        outputs: spec.inputs.clone(),
    };
    Ok((backward, saved))
}

fn check_spec(f: &Fusion, spec: &GradSpec) -> Result<()> {
    let bad = |what: &str, i: usize, n: usize| {
        Err(error::AutodiffError::Request(format!(
            "the fusion has {n} {what}s, so {what} {i} does not exist"
        )))
    };
    if let Some(&o) = spec.outputs.iter().find(|&&o| o >= f.outputs().len()) {
        return bad("output", o, f.outputs().len());
    }
    if let Some(&i) = spec.inputs.iter().find(|&&i| i >= f.inputs().len()) {
        return bad("input", i, f.inputs().len());
    }
    Ok(())
}

/// One derivation, taking the forward inputs `keep` marks as its first inputs, then with
/// `saved` (the saving form) those forward values, then the output gradients. A saving
/// derivation takes any further GEMM or reduction result it reads as an input too.
fn derive<'f>(
    f: &'f Fusion,
    spec: &GradSpec,
    keep: &[bool],
    saved: Option<&[TensorId]>,
) -> Result<Ctx<'f>> {
    let mut c = Ctx::new(f);
    for (_, &t) in f.inputs().iter().enumerate().filter(|(i, _)| keep[*i]) {
        let axes = c.layout(t);
        let tv = f.tensor(t);
        let p = (c.b).input_on(&f.tensor_name(t), tv.dtype, &axes, tv.mesh.clone())?;
        c.primal.insert(t, p);
    }
    c.saving = saved.is_some();
    for &t in saved.unwrap_or_default() {
        c.saved_input(t)?;
    }
    for &o in &spec.outputs {
        let t = f.outputs()[o];
        let axes = c.input_layout(t);
        let tv = f.tensor(t);
        let g = (c.b).input_on(&c.grad_name(t), tv.dtype, &axes, tv.mesh.clone())?;
        c.add_grad(t, g)?;
    }
    let active = active(f, spec);
    // A wanted input's gradient is complete once its first reader's adjoint ran. It is
    // settled after the adjoint that follows (that of the reader's other operand's
    // producer), so that a sum this adjoint makes over a GEMM's expanded axes (the
    // ReduceScatter of a column-parallel layer's input gradient) comes right after the
    // GEMM: a stream loop pipelines a GEMM with the reduction that follows it directly.
    let first_use: Vec<Option<usize>> = (f.inputs().iter())
        .map(|&t| f.exprs().iter().position(|e| e.inputs.contains(&t)))
        .collect();
    let mut grads = vec![None; f.inputs().len()];
    let mut pending: Vec<usize> = Vec::new();
    for id in f.expr_ids().collect::<Vec<_>>().into_iter().rev() {
        let out = f.expr(id).output;
        // A broadcast's adjoint sums its gradient as it comes (see `broadcast_adjoint`).
        let raw = matches!(f.expr(id).op, crate::ir::Op::Broadcast { .. });
        if active[out.index()] {
            let g = match raw {
                true => c.grads.get(&out).copied(),
                false => c.settle(out)?.map(|(g, _)| g),
            };
            if let Some(g) = g {
                c.adjoint(id, g, &active)?;
            }
        }
        for i in pending.drain(..) {
            grads[i] = Some(input_grad(&mut c, i)?);
        }
        pending.extend(
            spec.inputs
                .iter()
                .filter(|&&i| first_use[i] == Some(id.index())),
        );
    }
    for &i in &spec.inputs {
        let g = match grads[i] {
            Some(g) => g,
            None => input_grad(&mut c, i)?,
        };
        let out = c.b.output(g)?;
        let name = c.grad_name(f.inputs()[i]);
        c.b.name(out, &name);
    }
    Ok(c)
}

/// The settled gradient of forward input `i`, which must have the input's shape.
fn input_grad(c: &mut Ctx, i: usize) -> Result<TensorId> {
    let t = c.f.inputs()[i];
    match c.settle(t)? {
        Some((g, true)) => Ok(g),
        Some((_, false)) => Err(AutodiffError::Request(format!(
            "the gradient of `{}` is constant along an axis the input has in full (the \
             input is summed over it), and the IR has no op to expand it",
            c.f.tensor_name(t)
        ))),
        None => Err(AutodiffError::Request(format!(
            "no differentiated output depends on `{}`; leave it out of the inputs that want \
             gradients",
            c.f.tensor_name(t)
        ))),
    }
}

/// Tensors on a path from a wanted input to a differentiated output (indexed by tensor).
fn active(f: &Fusion, spec: &GradSpec) -> Vec<bool> {
    let n = f.tensor_count();
    let mut from_input = vec![false; n];
    for &i in &spec.inputs {
        from_input[f.inputs()[i].index()] = true;
    }
    for e in f.exprs() {
        if e.inputs.iter().any(|t| from_input[t.index()]) {
            from_input[e.output.index()] = true;
        }
    }
    let mut to_output = vec![false; n];
    for &o in &spec.outputs {
        to_output[f.outputs()[o].index()] = true;
    }
    for e in f.exprs().iter().rev() {
        if to_output[e.output.index()] {
            for t in &e.inputs {
                to_output[t.index()] = true;
            }
        }
    }
    (0..n)
        .map(|i| from_input[i] && to_output[i])
        .collect::<Vec<_>>()
}
