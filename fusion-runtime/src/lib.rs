//! `fusion-runtime`: runs host programs lowered by `fusion-compiler`.
//!
//! Tensors, the host-IR evaluator, device backends (CPU threads; CUDA), communicators
//! (in-process; NCCL; copy engine) and worlds of ranks.

#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

pub mod backend;
pub mod comm;
pub mod config;
pub mod counters;
mod device;
mod error;
pub mod eval;
pub mod executor;
mod fused_programs;
mod observe;
mod program_facts;
mod ranked;
pub mod replay;
pub mod streams;
pub mod tensor;
pub mod trace;
pub mod world;

#[cfg(feature = "cuda")]
pub use backend::cuda::CudaElement;
#[cfg(feature = "cuda")]
pub use backend::cuda::{GraphAllocations, OnStream};
pub use backend::{BackendKind, GemmEngine};
/// The cudarc version the runtime is built with: `CudaSlice`, `CudaView`, `CudaContext`,
/// `CudaStream` of this crate are what [`Rank::from_cuda_slice`], [`Rank::with_cuda_view`]
/// and [`Rank::on`] take.
#[cfg(feature = "cuda")]
pub use cudarc;
#[cfg(feature = "cuda")]
pub use error::NcclFailure;
pub use error::{Error, Result};
pub use executor::{
    CandidateReport, ExecOptions, FusionExecutor, PlanMode, PlanReport, PlanSource, RunReport,
    TuningPhases,
};
pub use ranked::{Ranked, Tensor1, Tensor2, Tensor3, Tensor4, Tensor5, Tensor6};
pub use tensor::{ShardTag, Tensor};
pub use world::{concat, CallTarget, Rank, World};
