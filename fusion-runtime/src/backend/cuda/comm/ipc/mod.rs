//! Copy-engine transfers between GPUs of different processes on one host, through CUDA
//! IPC: the one-process-per-GPU layout keeps the copy-engine pipelines.
//!
//! - **Memory.** Receive buffers come from the device's shared arena
//!   (`backend::cuda::memory::shared_arena`): chunks exported as POSIX file descriptors,
//!   which a sender duplicates with `pidfd_getfd` and maps the first time a transfer lands
//!   in one, then keeps mapped, so a transfer makes no driver call but the copy and its
//!   events. A buffer outside the arena (e.g. a caller's preallocated output) still works:
//!   the devices of such worlds allocate from a memory pool that can be exported, imported
//!   once by each peer; the receiver exports the buffer (`cuMemPoolExportPointer`), the
//!   sender imports it, copies, and frees its import on the same stream right after the
//!   copy, which the receiver's stream waits for before it can free the buffer itself (the
//!   order CUDA requires of imported pool memory). That costs a mapping per transfer.
//! - **Events.** Interprocess events, created once per rank and opened once per peer; an
//!   event is recorded again only once the peer has enqueued its wait on the last record.
//! - **Hand-off.** Every rank owns an inbox in shared memory (`/dev/shm`), one ring of
//!   fixed-size messages per sender; a sender writes into the receiver's ring and the
//!   receiver reads with acquire loads, spinning briefly before it sleeps. Only the sender
//!   copies (push): the receiver's buffer is the one that must be shared.
//!
//! Setup happens per rank ([`IpcDevice::prepare`] before the bootstrap, whose infos carry
//! the pool descriptor and inbox name; [`IpcPeer::connect`] after). A pair uses IPC only if
//! both sides connected; otherwise it falls back to NCCL and the world's transports say so.
//!
//! One job per file:
//! - `device`: this rank's own side ([`IpcDevice`]: exportable pool, inbox, events) and
//!   what it publishes at bootstrap ([`IpcInfo`]);
//! - `peer`: the connection with one peer rank ([`IpcPeer`]) and its messages;
//! - `import`: reaching the peer's memory (descriptors, pool, arena chunks);
//! - `inbox`: the shared-memory rings the messages travel through, and the host wait;
//! - `transfer`: one transfer's post, copy and finish over that connection.

mod device;
mod import;
mod inbox;
mod peer;
mod transfer;

use std::collections::HashMap;

use crate::backend::cuda::libs::cu_check as check;
use crate::error::Error;
pub(crate) use device::{IpcDevice, IpcInfo};
pub(crate) use peer::IpcPeer;

/// A rank's CUDA IPC state: its own exportable side and its peers in other processes.
pub(crate) struct IpcState {
    pub device: IpcDevice,
    pub peers: HashMap<usize, IpcPeer>,
}

impl IpcState {
    /// Forgets every hand-off in flight with every peer, for a world that recovers (no
    /// rank sends, no device runs): see [`IpcPeer::forget_in_flight`].
    pub(crate) fn forget_in_flight(&mut self) {
        for peer in self.peers.values_mut() {
            peer.forget_in_flight(&mut self.device);
        }
    }
}

/// (source rank, destination rank, sequence number of the pair).
pub(crate) type Key = (usize, usize, u64);

/// An error of CUDA IPC, met while doing `what`.
fn ipc_err(what: &str, reason: impl std::fmt::Display) -> Error {
    Error::Backend {
        backend: "cuda ipc",
        reason: format!("{what}: {reason}"),
    }
}
