//! CUDA backend: GPUs through cudarc (driver, cuBLAS, NVRTC), loaded at run time so that
//! machines without CUDA build and test everything else.
//!
//! One [`CudaDevice`] per GPU, driven by one rank thread; kernels for elementwise ops,
//! reductions and copies are generated, compiled with NVRTC once per process and cached;
//! matmul and linear go to cuBLASLt (cached plans, epilogues in the GEMM) or cuBLAS, with
//! f32 accumulation, or to the runtime's persistent Hopper GEMM where a call asks for it.
//!
//! Everything CUDA-only lives here, one folder per concern: `memory/` (buffers, the free
//! list, capture arenas, memory shared with other processes, the caller's buffers),
//! `gemm/` (cuBLASLt, cuBLAS, the persistent Hopper GEMM), `kernels/` (generated
//! elementwise and reduction kernels), `comm/` (the CUDA communicator: NCCL, copy-engine
//! transfers, CUDA IPC) and `world/` (CUDA worlds: devices, communicators and transports
//! per pair of ranks).

mod allocation;
mod caller_capture;
mod caller_stream;
pub(crate) mod comm;
mod device;
mod device_gemm;
mod discrepancy;
mod gemm;
mod graph;
pub(crate) mod health;
mod kernels;
mod libs;
pub(crate) mod memory;
mod stream;
mod user_buffers;
pub(crate) mod world;

pub use device::CudaDevice;
pub use libs::{check_libraries, device_count, driver_present};
pub use user_buffers::CudaElement;
pub use world::{
    cuda_world, cuda_world_sharing_gpus, cuda_world_without_peer_access,
    launched_world_sharing_gpus, GraphAllocations, OnStream,
};

pub use health::a_device_is_stuck;
