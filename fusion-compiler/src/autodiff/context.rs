//! The state of one derivation: the forward fusion, the builder writing the backward,
//! and the tables between them (forward value -> its recomputation or saved input,
//! forward value -> its gradient so far).

use std::collections::HashMap;

use crate::builder::FusionBuilder;
use crate::ir::{Fusion, ScalarId, TensorId};

/// One derivation in progress. Rules, recomputation and accumulation are `impl` blocks
/// on it in their own modules.
pub(super) struct Ctx<'f> {
    /// The forward fusion.
    pub f: &'f Fusion,
    /// The backward being written.
    pub b: FusionBuilder,
    /// Forward tensor -> the backward tensor holding the same value (an input of the
    /// backward, or its recomputation).
    pub primal: HashMap<TensorId, TensorId>,
    /// Forward extent -> the same extent in the backward's arena.
    pub scalars: HashMap<ScalarId, ScalarId>,
    /// Forward tensor -> the sum of the gradient contributions found so far, in a shape
    /// that broadcasts to the tensor's (see `accumulate`).
    pub grads: HashMap<TensorId, TensorId>,
    /// Forward tensor -> its recomputation with the last two axes swapped (a GEMM
    /// adjoint's transposed operand).
    pub transposed: HashMap<TensorId, TensorId>,
    /// Which forward inputs the backward read (the first pass finds them).
    pub used_inputs: Vec<bool>,
    /// Whether the backward takes the forward's GEMM and reduction results as inputs
    /// (the saving form) instead of recomputing them.
    pub saving: bool,
    /// The forward values the backward takes as saved inputs, in the order it asked for
    /// them (the first pass of the saving form finds them).
    pub saved: Vec<TensorId>,
}

impl<'f> Ctx<'f> {
    /// A derivation of `f` with an empty backward.
    pub fn new(f: &'f Fusion) -> Self {
        Ctx {
            f,
            b: FusionBuilder::new(),
            primal: HashMap::new(),
            scalars: HashMap::new(),
            grads: HashMap::new(),
            transposed: HashMap::new(),
            used_inputs: vec![false; f.inputs().len()],
            saving: false,
            saved: Vec::new(),
        }
    }

    /// The forward tensor's name with a `d_` in front (`d_x`), for gradients.
    pub fn grad_name(&self, t: TensorId) -> String {
        format!("d_{}", self.f.tensor_name(t))
    }
}
