//! Device backends: the CPU backend (simulated devices, host memory) and the CUDA backend,
//! each with the worlds it assembles, and which one a default world gets.
//!
//! The [`Device`] trait they implement lives below them (`crate::device`, re-exported
//! here), so that the worlds, communicators and the evaluator use devices without knowing
//! the backends.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod default_world;

pub use crate::device::{
    capture_arena_bytes, BackendKind, CallerCapture, CallerStream, Device, DeviceGraph,
    DeviceLifecycle, DeviceMemory, Discrepancy, GatheredGemmCall, GemmEngine, HandedOut, Kernel,
    PointwiseInstr, PointwiseProgram, RowInstr, RowPass, RowProgram, ScatterLinks,
    ScatteredGemmCall, CAPTURE_ARENA_ALIGN, SCATTER_MAX_RANKS,
};
pub use crate::streams::{StreamHandle, StreamLayout};

/// How many GPUs this process sees: 0 without a driver, without devices, or in a build
/// without the `cuda` feature.
pub fn visible_gpus() -> usize {
    #[cfg(feature = "cuda")]
    return cuda::device_count();
    #[cfg(not(feature = "cuda"))]
    0
}
