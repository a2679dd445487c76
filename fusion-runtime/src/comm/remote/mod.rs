//! Ranks in other processes (and on other hosts): a TCP rendezvous hosted by rank 0's
//! process, through which every rank bootstraps (exchanging what the world needs to know of
//! each rank) and then meets the others, as the CPU backend's in-process fabric does
//! between threads. This is the CPU communicator between processes (the role gloo plays for
//! PyTorch) and the host-side channel of multi-process GPU worlds (NCCL ids, IPC handles,
//! failure notification).

mod client;
mod hub;
pub(crate) mod wire;

pub use client::{join, Hello, RemoteFabric, Watch};
pub use hub::Hub;
