//! The CUDA communicator: NCCL for collectives and NCCL P2P, copy-engine transfers between
//! the GPUs of a process (device flags, events) and over CUDA IPC between processes of a
//! host, and the watchdog that bounds device-side waits.

pub(crate) mod communicator;
pub(crate) mod copy_engine;
mod device_waits;
pub(crate) mod ipc;
mod landing;
pub(crate) mod nccl;
pub(crate) mod nccl_graphs;
pub(crate) mod peer_access;
pub(crate) mod signals;
