//! The CUDA communicator: NCCL for collectives and NCCL P2P, copy-engine transfers between
//! the GPUs of a process (device flags, events) and over CUDA IPC between processes of a
//! host, and the watchdog that bounds device-side waits.
//!
//! # Map of the wing
//!
//! - `communicator/`: [`CudaCommunicator`](communicator::CudaCommunicator), one rank's
//!   endpoint; runs each collective and transfer on the transport its node names
//!   (`mod.rs`: `run_collective`, `point_to_point`), NCCL operations in `nccl_ops.rs`
//!   and `nccl_grouped.rs`, copy-engine collectives in `copy_engine_ops.rs`, the
//!   `Communicator` impl in `trait_impl.rs`.
//! - `nccl.rs`: NCCL itself: communicators, unique ids, data types, errors.
//! - `nccl_graphs.rs`: NCCL calls inside CUDA graphs without NCCL's graph mixing (calls
//!   outside graphs wait for the last graph launch).
//! - `copy_engine/`: copy-engine transfers between the GPUs of this process (registry,
//!   endpoint, group phases, flag and event hand-offs, stream order) and the group
//!   phases over CUDA IPC.
//! - `ipc/`: CUDA IPC with the processes of this host: exportable memory, shared-memory
//!   inboxes, interprocess events, mapping a peer's memory, one transfer's phases.
//! - `signals.rs`: the device flags of the copy-engine hand-offs, and why they are never
//!   seen stale.
//! - `device_waits.rs`: the watchdog that turns a device-side flag wait past the world's
//!   timeout into an error.
//! - `landing.rs`: receive buffers kept from one call to the next.
//! - `peer_access.rs`: peer access between this process's GPUs (contexts, memory pools).
//! - `peer_memory/`: collectives as kernels over every rank's workspace mapped into each
//!   other (`Transport::PeerMemory`): the kernels, the workspaces, the wait status.
//!
//! # Where to add a transport
//!
//! A new transport (as peer-memory collectives did) touches:
//!
//! 1. Its own module here, `comm/<transport>/`, as `copy_engine/` is: a per-rank endpoint
//!    and the state the ranks of a run share. Peer access comes from `peer_access.rs`;
//!    a peer in another process is reached through `ipc/` (`import.rs` maps its memory).
//! 2. A `Transport` variant in `fusion_compiler::hir` (its name in dumps), and the lowering
//!    options that put it on nodes (`LowerOptions::transports`: `p2p`, `collectives`).
//! 3. The dispatch in `communicator/mod.rs`: `run_collective` (collectives, by the node's
//!    `Transport` and kind) and `point_to_point` (sends and receives, by the P2P node's
//!    `Transport`) call the transport's operations, kept in their own file beside
//!    `copy_engine_ops.rs`; `CudaCommunicator::new` takes its endpoint as it takes the
//!    `CopyEngine`.
//! 4. What the communicator announces, in `CudaCommunicator::new`:
//!    `crate::comm::Capabilities` (whether graphs can hold its hand-offs, whether its
//!    receive buffers must be shared or are kept from call to call, one line per peer in
//!    `transports`), and `crate::comm::is_peer_copy` where the transport writes into
//!    peers' buffers (the evaluator and replay ask it).
//! 5. Lowering: `Capabilities::lowering` must replace the transport with one every pair of
//!    the world has (as it replaces `CopyEngine` with `Nccl` where `PeerCopies` is
//!    `NotEveryPair`), so that every rank lowers the same program.
//! 6. The world: `world/routes.rs` decides once which pairs have it, `world/comms.rs`
//!    builds the run's shared state and each rank's endpoint, `world/mod.rs` and
//!    `world/launched.rs` set it up in one process and across processes.
//! 7. The in-process CPU simulation, `crate::comm::local`: it ignores the transport
//!    (`PeerCopies::Simulated`), so programs lowered onto the new transport run there
//!    unchanged; its tests (`comm/local/tests/`) check the results on CPU.
//! 8. Tests: lowering (`fusion-compiler`, `comm/capabilities.rs`), the CPU simulation,
//!    and GPU tests marked `#[ignore]` beside the module (as `copy_engine/tests.rs`).

pub(crate) mod communicator;
pub(crate) mod copy_engine;
mod device_waits;
pub(crate) mod ipc;
mod landing;
pub(crate) mod nccl;
pub(crate) mod nccl_graphs;
pub(crate) mod peer_access;
pub(crate) mod peer_memory;
pub(crate) mod signals;
