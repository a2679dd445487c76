//! Ranks in other processes (and on other hosts): a TCP rendezvous hosted by rank 0's
//! process, through which every rank bootstraps (exchanging what the world needs to know of
//! each rank) and then meets the others, as the CPU backend's in-process fabric does
//! between threads. This is the CPU communicator between processes (the role gloo plays for
//! PyTorch) and the host-side channel of multi-process GPU worlds (NCCL ids, IPC handles,
//! failure notification).
//!
//! Every connection to the hub first proves knowledge of the world's job token, when it
//! has one (`auth`: a challenge-response over fresh nonces); the hub's door (`gate`)
//! refuses, logs and counts the others, and the world forms as if they had not come.

mod auth;
mod client;
mod gate;
mod hub;
pub(crate) mod wire;

pub use auth::JobToken;
pub use client::{join, Hello, RemoteFabric, Watch};
pub use hub::Hub;

#[cfg(test)]
mod tests;
