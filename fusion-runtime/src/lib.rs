//! `fusion-runtime`: runs host programs lowered by `fusion-core`.
//!
//! Tensors, the host-IR evaluator, device backends (CPU threads; CUDA), communicators
//! (in-process; NCCL; copy engine) and worlds of ranks.

pub mod backend;
pub mod comm;
mod error;
pub mod tensor;

pub use error::{Error, Result};
pub use tensor::{ShardTag, Tensor};
