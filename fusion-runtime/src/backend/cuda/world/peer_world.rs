//! A world's peer memory: every rank's workspace mapped into every other rank, decided
//! and built at the world's first run, and agreed on by every rank (a program puts
//! collectives on peer memory only if every rank can run them).
//!
//! A rank of this process uses the workspace its IPC side made at bootstrap (launched
//! worlds, published to the other processes there) or one made here; a rank of another
//! process is reached through the workspace its IPC connection mapped. Worlds whose ranks
//! share a GPU, lack peer access between some pair, span more than
//! [`PEER_MEMORY_MAX_RANKS`] ranks, or are a sub-world, have none.

use std::sync::{Arc, Mutex, PoisonError};

use fusion_compiler::lower::PEER_MEMORY_MAX_RANKS;

use super::each::on_each;
use crate::backend::cuda::comm::ipc::IpcState;
use crate::backend::cuda::comm::peer_memory::{PeerMemory, Workspace};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::comm::local::LocalCommunicator;
use crate::comm::{Block, Communicator};
use crate::device::DeviceLifecycle;
use crate::error::Result;

/// What a world needs to know to build its peer memory.
pub(super) struct PeerWorldSpec<'a> {
    pub size: usize,
    pub local: &'a [(usize, Arc<CudaDevice>)],
    pub ipc: &'a [Option<Arc<Mutex<IpcState>>>],
    pub ipc_ranks: &'a [usize],
    pub health: &'a Arc<WorldHealth>,
    /// Whether the world may have peer memory at all (every pair has peer copies, the
    /// ranks have GPUs of their own, the world is not a sub-world).
    pub eligible: bool,
}

/// The world's peer memory once decided: one handle per local rank, or none.
#[derive(Default)]
pub(super) struct PeerWorld {
    decided: Option<Option<Vec<Arc<PeerMemory>>>>,
    /// Workspaces made here (ranks without an IPC side), by local rank index.
    own: Vec<(usize, Workspace)>,
}

impl PeerWorld {
    /// Each local rank's handle (all `None` where the world has no peer memory), built at
    /// the first call: every rank tells the others whether it could map them all.
    pub(super) fn handles(
        this: &Mutex<PeerWorld>,
        spec: &PeerWorldSpec<'_>,
        hosts: &[Arc<LocalCommunicator>],
    ) -> Result<Vec<Option<Arc<PeerMemory>>>> {
        let mut guard = this.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.decided.is_none() {
            let built = if spec.eligible {
                guard.build(spec).unwrap_or_else(|e| {
                    tracing::warn!("no peer memory in this world: {e}");
                    None
                })
            } else {
                None
            };
            let mine = if built.is_some() { 1.0 } else { 0.0 };
            let votes = on_each(hosts.iter().collect(), |h| {
                h.host_allgather(Block {
                    shape: vec![1],
                    data: vec![mine],
                })
            })?;
            let everyone = votes
                .iter()
                .all(|v| v.iter().all(|b| b.data.first() == Some(&1.0)));
            guard.decided = Some(built.filter(|_| everyone));
        }
        Ok(match guard.decided.as_ref().and_then(Option::as_ref) {
            Some(h) => h.iter().cloned().map(Some).collect(),
            None => vec![None; spec.local.len()],
        })
    }

    /// Zeroes the flags of every local rank's workspace, made here or by its IPC side (the
    /// world starts over after a failure; no device of the world runs).
    pub(super) fn reset_flags(this: &Mutex<PeerWorld>, spec: &PeerWorldSpec<'_>) -> Result<()> {
        let guard = this.lock().unwrap_or_else(PoisonError::into_inner);
        for (j, (_, device)) in spec.local.iter().enumerate() {
            device.bind_thread()?;
            let ipc = spec.ipc[j]
                .as_ref()
                .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner));
            let own = guard.own.iter().find(|(k, _)| *k == j).map(|(_, w)| w);
            match (
                own,
                ipc.as_ref().and_then(|st| st.device.workspace.as_ref()),
            ) {
                (Some(w), _) | (None, Some(w)) => w.reset_flags()?,
                (None, None) => {}
            }
        }
        Ok(())
    }

    /// Every local rank's handle, or `None` where some rank of this process cannot reach
    /// some rank's workspace.
    fn build(&mut self, spec: &PeerWorldSpec<'_>) -> Result<Option<Vec<Arc<PeerMemory>>>> {
        if !(2..=PEER_MEMORY_MAX_RANKS).contains(&spec.size) {
            return Ok(None);
        }
        let ordinals: Vec<usize> = spec.local.iter().map(|(_, d)| d.shared().ordinal).collect();
        let mut own_va = Vec::new();
        for (j, (_, device)) in spec.local.iter().enumerate() {
            let from_ipc = spec.ipc[j].as_ref().and_then(|s| {
                let st = s.lock().unwrap_or_else(PoisonError::into_inner);
                st.device.workspace.as_ref().map(|w| w.va)
            });
            if let Some(va) = from_ipc {
                own_va.push(va);
                continue;
            }
            device.bind_thread()?;
            let others: Vec<usize> = ordinals
                .iter()
                .copied()
                .filter(|&o| o != ordinals[j])
                .collect();
            let w = Workspace::create(ordinals[j], &others)?;
            own_va.push(w.va);
            self.own.push((j, w));
        }
        let mut handles = Vec::new();
        for (i, (rank, device)) in spec.local.iter().enumerate() {
            let mut vas = Vec::with_capacity(spec.size);
            for p in 0..spec.size {
                if let Some(j) = spec.local.iter().position(|(q, _)| *q == p) {
                    vas.push(own_va[j]);
                    continue;
                }
                let Some(state) = spec.ipc[i].as_ref() else {
                    return Ok(None);
                };
                let st = state.lock().unwrap_or_else(PoisonError::into_inner);
                let mapped = st
                    .peers
                    .get(&spec.ipc_ranks[p])
                    .and_then(|peer| peer.workspace.as_ref());
                let Some(m) = mapped else {
                    return Ok(None);
                };
                vas.push(m.va);
            }
            device.bind_thread()?;
            let direct = spec.local.len() == spec.size;
            handles.push(Arc::new(PeerMemory::new(
                *rank,
                &vas,
                direct,
                spec.health.clone(),
            )?));
        }
        Ok(Some(handles))
    }
}
