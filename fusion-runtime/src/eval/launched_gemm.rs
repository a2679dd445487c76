//! The state of a fused AllGather+GEMM between its launch and its join, which the
//! evaluator keeps per GEMM (`gathered_gemm` runs the nodes).

use fusion_compiler::hir::GatheredGemm;
use fusion_compiler::ir::EpilogueAux;

use crate::streams::StreamHandle;
use crate::tensor::Tensor;

/// A gathered GEMM between its launch and its join.
pub(crate) struct Launched {
    pub(super) node: GatheredGemm,
    /// The stream it was launched on.
    pub(super) stream: StreamHandle,
    /// Whether the device runs it as one kernel (else it runs at the join).
    pub(super) on_device: bool,
    pub(super) gathered: Tensor,
    pub(super) own: Tensor,
    pub(super) b: Tensor,
    pub(super) output: Tensor,
    /// The epilogue's bias `[N]`, where it has one.
    pub(super) bias: Option<Tensor>,
    /// A gated product's second weight.
    pub(super) up: Option<Tensor>,
    /// The epilogue's auxiliary matrix, laid out as `output`, and what it does with it.
    pub(super) aux: Option<(Tensor, EpilogueAux)>,
    /// Per block and row range (`block * pieces + piece`): said ready (this rank's own
    /// block counts as ready).
    pub(super) ready: Vec<bool>,
}
