//! Copy-engine transfers between GPUs: peer-to-peer memcpys, which run on the copy engines
//! and leave every SM to the GEMMs. Between the GPUs of this process the two sides of a
//! transfer meet in a registry shared by the rank threads; with a GPU of another process
//! on this host they go through CUDA IPC (`comm::ipc`, push mode), in the same three phases
//! of a group: the receiver posts its buffer, the sender copies into it (push) on a copy
//! stream per peer, and the receiver's stream waits until the copy is done. No host thread
//! ever waits for device work, only for its peers' posts.
//!
//! One job per file:
//! - `registry`: where the two sides of a transfer meet (by source, destination and
//!   sequence number per pair), the transfers and their rendezvous slots, the pooled
//!   events, the kept receive buffers senders have learnt;
//! - `engine`: a rank's endpoint, [`CopyEngine`]: numbering transfers, which peers it
//!   reaches, whether its calls can be captured, its kept receive buffers;
//! - `group`: running a group of transfers (post, copy, finish) on each transfer's route;
//! - `flag_hand_off`: the hand-off through device flags (`comm::signals`);
//! - `event_hand_off`: the hand-off through events and the registry's rendezvous;
//! - `stream_order`: events, the copy stream per peer, single receives landing in order.
//!
//! Peer access between the GPUs (contexts, memory pools) is set up by `comm::peer_access`.

mod engine;
mod event_hand_off;
mod flag_hand_off;
mod group;
mod registry;
mod stream_order;
#[cfg(test)]
mod tests;

pub(crate) use engine::CopyEngine;
pub(crate) use registry::{CopyRegistry, Transfer};
