//! CUDA backend: GPUs through cudarc (driver, cuBLAS, NVRTC), loaded at run time so that
//! machines without CUDA build and test everything else.
//!
//! One [`CudaDevice`] per GPU, driven by one rank thread; kernels for elementwise ops,
//! reductions and copies are generated, compiled with NVRTC once per process and cached;
//! matmul and linear go to cuBLASLt (cached plans, epilogues in the GEMM) or cuBLAS, with
//! f32 accumulation.
//!
//! Everything CUDA-only lives here, one folder per concern: `memory/` (buffers, the free
//! list, capture arenas, memory shared with other processes, the caller's buffers),
//! `gemm/` (cuBLASLt and cuBLAS), `kernels/` (generated elementwise and reduction
//! kernels), `comm/` (the CUDA communicator: NCCL, copy-engine transfers, CUDA IPC) and
//! `world/` (CUDA worlds: devices, communicators and transports per pair of ranks).

mod caller_stream;
pub(crate) mod comm;
mod device;
mod gemm;
mod graph;
pub(crate) mod health;
mod kernels;
mod libs;
pub(crate) mod memory;
pub(crate) mod world;

pub use device::CudaDevice;
pub use libs::{check_libraries, device_count, driver_present};
pub(crate) use libs::{cu_check, cu_text, device_location};
pub use memory::user_buffers::CudaElement;

pub(crate) use graph::stream_is_capturing;
pub(crate) use health::WorldHealth;
pub(crate) use memory::buffer::RawStream;

/// Set when a device closes with work that never finished (its stream waits for a peer
/// that failed, e.g. on a copy-engine flag inside a replayed graph): from then on memory
/// that such work may still touch is left to the process's end instead of being freed,
/// since freeing it would wait for the device forever.
pub(crate) static DEVICE_STUCK: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether a device of this process closed with work that never finished: its memory,
/// graphs and context were then left to the process's end (a failed world whose device
/// waits were not all released; a `tracing` warning names the device).
pub fn a_device_is_stuck() -> bool {
    DEVICE_STUCK.load(std::sync::atomic::Ordering::Acquire)
}

/// Records that a device of this process has work that will never finish (see
/// [`a_device_is_stuck`]).
pub(crate) fn mark_device_stuck() {
    DEVICE_STUCK.store(true, std::sync::atomic::Ordering::Release);
}
