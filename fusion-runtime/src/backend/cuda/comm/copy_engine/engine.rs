//! A rank's copy-engine endpoint ([`CopyEngine`]): it numbers its transfers in program
//! order (per pair of ranks, and per call for the device flags), says which peers it
//! reaches and whether its calls can be captured, and keeps the receive buffers peers
//! write into from one call to the next. Running a group of transfers is `group`'s job.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use fusion_compiler::hir::CopyStreams;

use super::registry::{CopyRegistry, Event, Transfer};
use crate::backend::cuda::comm::ipc::IpcState;
use crate::backend::cuda::comm::landing::KeptBuffers;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::libs::driver_err;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Where a rank stands in its calls.
#[derive(Default)]
pub(super) struct CallState {
    /// Calls started (reruns excluded).
    calls: u64,
    /// This call's identity.
    pub(super) identity: Option<u64>,
    /// Transfers of this call so far, per (source, destination).
    indices: HashMap<(usize, usize), usize>,
    /// Which copy streams this call's copies run on (see `copy_stream_after`).
    pub(super) copy_streams: CopyStreams,
}

/// A rank's copy-engine endpoint.
pub(crate) struct CopyEngine {
    pub(super) rank: usize,
    pub(super) device: Arc<CudaDevice>,
    pub(super) registry: Arc<CopyRegistry>,
    /// Peers in other processes of this host reached over CUDA IPC, keyed by their rank
    /// in the launched world; `ipc_ranks[r]` is that rank of this world's rank `r` (a
    /// sub-world's ranks are numbered from 0).
    pub(super) ipc: Option<Arc<Mutex<IpcState>>>,
    pub(super) ipc_ranks: Arc<Vec<usize>>,
    sequences: Mutex<HashMap<(usize, usize), u64>>,
    /// The call in progress.
    pub(super) call: Mutex<CallState>,
    /// Receive buffers kept from one call to the next.
    pub(super) landing: Arc<KeptBuffers>,
    /// An event (of this rank) after the last inbound copy of a one-receive group: the
    /// next such copy starts after it, so a P2P pipeline's chunks arrive one at a time in
    /// the order the loop uses them instead of sharing the link and landing together.
    pub(super) last_inbound: Mutex<Option<Event>>,
}

impl CopyEngine {
    /// Rank `rank`'s endpoint on `device`, meeting its peers in `registry` (and over CUDA
    /// IPC through `ipc`, whose peers are keyed by their rank in the launched world,
    /// `ipc_ranks`).
    pub(crate) fn new(
        rank: usize,
        device: Arc<CudaDevice>,
        registry: Arc<CopyRegistry>,
        ipc: Option<Arc<Mutex<IpcState>>>,
        ipc_ranks: Arc<Vec<usize>>,
    ) -> Self {
        CopyEngine {
            rank,
            device: device.clone(),
            registry,
            ipc,
            ipc_ranks,
            sequences: Mutex::new(HashMap::new()),
            call: Mutex::new(CallState::default()),
            landing: Arc::new(KeptBuffers::new(device.clone())),
            last_inbound: Mutex::new(None),
        }
    }

    /// A call starts: transfers are numbered from 0 again, receive buffers are kept under
    /// `call.identity`, and copies run on the copy streams `call.copy_streams` names.
    pub(crate) fn begin_call(&self, call: &crate::comm::CallStart) {
        let mut state = self.call.lock().unwrap_or_else(PoisonError::into_inner);
        if !call.rerun {
            state.calls += 1;
        }
        state.identity = call.identity;
        state.copy_streams = call.copy_streams;
        state.indices.clear();
        drop(state);
        self.landing.lock().begin(call.identity);
        // Inbound order is kept within a call; an event of the last call (perhaps recorded
        // in a capture) is not waited for.
        self.forget_last_inbound();
        if let Some(w) = &self.registry.waits {
            w.begin_call(self.rank, call.identity);
        }
    }

    /// This rank's kept receive buffers (see `landing`), where it keeps them: with device
    /// flags and no peer over CUDA IPC (whose buffers are posted at every call anyway).
    pub(crate) fn kept_receives(&self) -> Option<Arc<KeptBuffers>> {
        self.keeps_receives().then(|| self.landing.clone())
    }

    /// Whether this rank keeps its receive buffers (see [`Self::kept_receives`]).
    pub(super) fn keeps_receives(&self) -> bool {
        self.registry.signals.is_some() && !self.has_ipc_peers()
    }

    /// The next kept receive buffer of this call; `None` when this rank keeps none (see
    /// [`Self::kept_receives`]) or the call has no identity.
    pub(crate) fn landing_buffer(
        &self,
        stream: crate::device::StreamHandle,
        dtype: fusion_compiler::DType,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        if !self.keeps_receives() {
            return Ok(None);
        }
        crate::comm::KeptReceives::take(&*self.landing, stream, dtype, shape)
    }

    /// Whether this rank's copy-engine transfers can be captured in a graph.
    pub(crate) fn capture_support(&self) -> std::result::Result<(), String> {
        if self.has_ipc_peers() {
            return Err("transfers over CUDA IPC hand off through the host".into());
        }
        if self.registry.shares_gpus {
            // A device-side wait for a peer on the same GPU can deadlock (see
            // `comm::signals`), so these ranks hand off through events and the host.
            return Err(
                "ranks of this world share a GPU: their copy-engine hand-offs go through \
                 events and the host, which a graph cannot hold"
                    .into(),
            );
        }
        if self.registry.signals.is_none() {
            return Err(
                "the device flags could not be set up (no stream memory operations)".into(),
            );
        }
        Ok(())
    }

    /// A driver error of this rank's transfer, met while doing `what`.
    pub(super) fn driver_err(&self, what: &str, e: cudarc::driver::DriverError) -> Error {
        driver_err(&format!("rank {}: {what}", self.rank), e)
    }

    /// A communication error of this rank.
    pub(super) fn err(&self, reason: String) -> Error {
        Error::Communication {
            rank: self.rank,
            reason,
        }
    }

    /// A transfer of `buf` with `peer` (sending when `sending`), numbered in program order;
    /// `label` says what it is in the program (for the error of a wait for it that times
    /// out, on the host or on the device).
    pub(crate) fn transfer(
        &self,
        stream: crate::device::StreamHandle,
        peer: usize,
        buf: &Tensor,
        sending: bool,
        label: Option<Arc<str>>,
    ) -> Result<Transfer> {
        if !buf.is_contiguous() || buf.device_ptr().is_none() {
            return Err(self.err(format!(
                "copy-engine transfers need contiguous device buffers, got {:?} with strides {:?}",
                buf.shape(),
                buf.strides()
            )));
        }
        let (src, dst) = if sending {
            (self.rank, peer)
        } else {
            (peer, self.rank)
        };
        let mut seqs = self
            .sequences
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let seq = seqs.entry((src, dst)).or_insert(0);
        *seq += 1;
        let key = (src, dst, *seq - 1);
        drop(seqs);
        let mut call = self.call.lock().unwrap_or_else(PoisonError::into_inner);
        let n = call.indices.entry((src, dst)).or_insert(0);
        *n += 1;
        Ok(Transfer {
            key,
            stream,
            buf: buf.clone(),
            sending,
            index: *n - 1,
            call: call.calls,
            label,
        })
    }

    /// The world failed: every device-side hand-off wait of this process's ranks is let
    /// through (see `SignalBoard::release_all`), so no device stays blocked on a flag a
    /// failed rank will never set, and closing the devices cannot hang on it.
    pub(crate) fn release_device_waits(&self) {
        if let Some(board) = &self.registry.signals {
            board.release_all();
        }
    }

    /// Whether some peer is reached over CUDA IPC.
    pub(crate) fn has_ipc_peers(&self) -> bool {
        self.ipc.as_ref().is_some_and(|s| {
            !s.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .peers
                .is_empty()
        })
    }

    /// Whether this engine reaches `peer` (a rank of another process) over CUDA IPC.
    pub(crate) fn reaches_over_ipc(&self, peer: usize) -> bool {
        let Some(&global) = self.ipc_ranks.get(peer) else {
            return false;
        };
        self.ipc.as_ref().is_some_and(|s| {
            s.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .peers
                .contains_key(&global)
        })
    }

    /// Whether `peer` is a GPU of this process reached through the shared registry (one
    /// this rank's GPU has peer access to).
    pub(crate) fn reaches_in_process(&self, peer: usize) -> bool {
        self.registry.contexts.contains_key(&peer) && !self.lacks_peer_access(peer)
    }

    /// Whether `peer` is a GPU of this process without peer access to this rank's GPU.
    pub(crate) fn lacks_peer_access(&self, peer: usize) -> bool {
        let pair = (self.rank.min(peer), self.rank.max(peer));
        self.registry.no_peer_access.contains(&pair)
    }
}

impl Drop for CopyEngine {
    /// Hands the last inbound copy's event back to the pool, which destroys it with the
    /// registry at the end of the run (kept here, it would outlive both: one event per
    /// rank and `World::run`).
    fn drop(&mut self) {
        self.forget_last_inbound();
    }
}
