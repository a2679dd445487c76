//! The saving form of a backward: a forward that also returns the values the backward
//! reads and would otherwise recompute (GEMM and reduction results), and the backward
//! that takes them as inputs.
//!
//! A saved value is returned in the layout the forward computed it (its DIDx and Stream
//! axes, its mesh): returning it costs no communication, only the memory it holds until
//! the backward runs. A value the forward already returns is not returned twice.

use super::error::Result;
use super::{derive_twice, Backward, GradSpec};
use crate::ir::Fusion;

/// A fusion's saving form: [`Saving::forward`] computes the fusion's outputs and the
/// saved values, [`Saving::backward`] the input gradients from them.
#[derive(Clone, Debug)]
pub struct Saving {
    /// The fusion with the saved values it does not return already as outputs after its
    /// own (in [`Saving::saved`] order). It computes what the fusion computes, in the same
    /// layouts.
    pub forward: Fusion,
    /// For each saved value (the backward's [`super::BackwardInput::Saved`] index), the
    /// output of [`Saving::forward`] that holds it.
    pub saved: Vec<usize>,
    /// The backward; its inputs name the saved values with
    /// [`super::BackwardInput::Saved`].
    pub backward: Backward,
}

/// Derives the saving form of `f` for `spec`: the backward takes the GEMM and reduction
/// results it reads from the forward, which returns them. Fails where [`super::backward`]
/// does, naming the same op.
pub fn saving(f: &Fusion, spec: &GradSpec) -> Result<Saving> {
    let (backward, values) = derive_twice(f, spec, true)?;
    let mut forward = f.clone();
    let saved = (values.iter())
        .map(|&t| match forward.outputs().iter().position(|&o| o == t) {
            Some(o) => o,
            None => {
                forward.add_output(t);
                forward.outputs().len() - 1
            }
        })
        .collect();
    crate::builder::validate(&forward)?;
    Ok(Saving {
        forward,
        saved,
        backward,
    })
}
