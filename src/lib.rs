//! `fusion`: multi-GPU tensor programs as compile-time checked fusions.
//!
//! A fusion is a small tensor program whose axes carry sharding (`DIDx`) and stream
//! (`Stream`) annotations. It is lowered, at its first call, to a host program that loops
//! over CUDA streams, allocates buffers and issues NCCL collectives and P2P transfers, so
//! that communication hides behind computation. The same program runs on simulated CPU
//! devices, which is how everything is tested without a GPU.
//!
//! This crate re-exports [`fusion_core`] (IR, builder, lowering, passes) and
//! [`fusion_runtime`] (tensors, evaluator, backends, worlds); most users only need the
//! [`prelude`].

pub use fusion_core as core;
pub use fusion_runtime as runtime;

pub use fusion_core::builder::{Axis, FusionBuilder};
pub use fusion_core::ir::ParallelType;
pub use fusion_core::DType;
pub use fusion_runtime::{
    concat, BackendKind, Error, ExecOptions, FusionExecutor, Rank, Result, RunReport, Tensor, World,
};

/// The names most programs use.
pub mod prelude {
    pub use crate::{
        concat, Axis, BackendKind, DType, Error, ExecOptions, FusionBuilder, FusionExecutor,
        ParallelType, Rank, Result, Tensor, World,
    };
}

/// Paths used by code the `fusion!` macro generates. Not a public API.
#[doc(hidden)]
pub mod __private {
    pub use fusion_core;
    pub use fusion_runtime;
    pub use static_assertions;
}
