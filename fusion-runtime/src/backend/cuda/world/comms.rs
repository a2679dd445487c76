//! The communicators of a CUDA world: made once per world from its long-lived NCCL
//! state, copy-engine registry and IPC connections, and for its sub-worlds.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::each::on_each;
use super::peer_world::{PeerWorld, PeerWorldSpec};
use super::routes::Routes;
use crate::backend::cuda::comm::communicator::CudaCommunicator;
use crate::backend::cuda::comm::copy_engine::{CopyEngine, CopyRegistry};
use crate::backend::cuda::comm::ipc::IpcState;
use crate::backend::cuda::comm::nccl::{
    id_bytes, id_from_bytes, init_rank, init_world, unique_id, NcclRankState,
};
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::comm::local::LocalCommunicator;
use crate::comm::{Block, Communicator, PeerCopies};
use crate::device::DeviceLifecycle;
use crate::error::{Error, Result};
use crate::world::RunComms;

/// How the world communicators of a [`CudaComms`] come about.
pub(super) enum NcclSource {
    /// `ncclCommInitAll` over these device ordinals (every rank in this process); made
    /// again after an abort.
    All(Vec<usize>),
    /// Joined once at construction (ranks in other processes too); an abort ends them.
    Fixed,
    /// None: several ranks share a GPU, which NCCL does not allow (the reason).
    Unavailable(String),
}

/// Builds each run's communicators over a world's long-lived NCCL and copy-engine state.
pub(super) struct CudaComms {
    /// Ranks in this (sub-)world.
    size: usize,
    /// This process's ranks: (rank in this world, device).
    local: Vec<(usize, Arc<CudaDevice>)>,
    nccl: Mutex<Option<Vec<Arc<NcclRankState>>>>,
    source: NcclSource,
    health: Arc<WorldHealth>,
    /// Per local rank: its CUDA IPC state (launched worlds with peers in other processes).
    ipc: Vec<Option<Arc<Mutex<IpcState>>>>,
    /// Rank in the launched world of each rank of this world.
    ipc_ranks: Arc<Vec<usize>>,
    /// Pairs of this world's ranks (lower first) in this process whose GPUs have no peer
    /// access to each other: their transfers go through NCCL.
    no_peer_access: Vec<(usize, usize)>,
    /// How every pair of the launched world's ranks reaches the other (this world's ranks
    /// are `ipc_ranks` there), decided when the world was made.
    routes: Arc<Routes>,
    /// Whether this world may map its ranks' memory into each other (not a sub-world).
    whole_world: bool,
    /// The world's peer memory, decided at its first run.
    peer_world: Mutex<PeerWorld>,
}

impl CudaComms {
    /// The communicators' maker for a world of `size` ranks whose ranks in this process
    /// are `local`, with NCCL from `source` (`nccl`: made already), `ipc` state per local
    /// rank, its ranks' numbers in the launched world (`ipc_ranks`), the pairs of its GPUs
    /// without peer access, and every pair's route (by launched-world rank).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        size: usize,
        local: Vec<(usize, Arc<CudaDevice>)>,
        nccl: Option<Vec<Arc<NcclRankState>>>,
        source: NcclSource,
        health: Arc<WorldHealth>,
        ipc: Vec<Option<Arc<Mutex<IpcState>>>>,
        ipc_ranks: Vec<usize>,
        no_peer_access: Vec<(usize, usize)>,
        routes: Arc<Routes>,
    ) -> CudaComms {
        CudaComms {
            size,
            local,
            nccl: Mutex::new(nccl),
            source,
            health,
            ipc,
            ipc_ranks: Arc::new(ipc_ranks),
            no_peer_access,
            routes,
            whole_world: true,
            peer_world: Mutex::new(PeerWorld::default()),
        }
    }

    /// What building the world's peer memory needs to know.
    fn peer_world_spec(&self) -> PeerWorldSpec<'_> {
        let mut ordinals: Vec<usize> = self.local.iter().map(|(_, d)| d.shared().ordinal).collect();
        ordinals.sort_unstable();
        ordinals.dedup();
        PeerWorldSpec {
            size: self.size,
            local: &self.local,
            ipc: &self.ipc,
            ipc_ranks: &self.ipc_ranks,
            health: &self.health,
            eligible: self.whole_world
                && ordinals.len() == self.local.len()
                && !matches!(self.source, NcclSource::Unavailable(_))
                && self.peer_copies() == PeerCopies::EveryPair,
        }
    }

    /// Which pairs of this world's ranks have copy engines.
    fn peer_copies(&self) -> PeerCopies {
        self.routes.peer_copies(&self.ipc_ranks)
    }

    /// A copy-engine registry over this process's ranks.
    fn registry(&self) -> CopyRegistry {
        CopyRegistry::new(
            self.local
                .iter()
                .map(|(r, d)| (*r, d.shared().ctx.cu_ctx()))
                .collect(),
            self.health.clone(),
        )
        .without_peer_access(&self.no_peer_access)
    }

    /// The NCCL state of every local rank, (re)made when missing or aborted (in-process
    /// worlds only; a launched world's communicators cannot be rebuilt alone).
    pub(super) fn ensure_nccl(&self) -> Result<Vec<Arc<NcclRankState>>> {
        let mut guard = self.nccl.lock().unwrap_or_else(PoisonError::into_inner);
        let stale = match guard.as_ref() {
            None => true,
            Some(s) => s.iter().any(|r| r.is_aborted()),
        };
        if let NcclSource::Unavailable(why) = &self.source {
            let states = guard.get_or_insert_with(|| {
                self.local
                    .iter()
                    .map(|_| Arc::new(NcclRankState::unavailable(why.clone())))
                    .collect()
            });
            return Ok(states.clone());
        }
        if stale {
            let NcclSource::All(ordinals) = &self.source else {
                return Err(Error::World(
                    "the world's NCCL communicators were aborted after a failure; a launched \
                     world cannot run again"
                        .into(),
                ));
            };
            if let Some(old) = guard.take() {
                for r in &old {
                    r.abort_all();
                }
            }
            let comms = init_world(ordinals)?;
            *guard = Some(
                comms
                    .into_iter()
                    .map(|c| Arc::new(NcclRankState::new(c)))
                    .collect(),
            );
        }
        Ok(guard.as_ref().expect("just ensured").clone())
    }
}

impl CudaComms {
    /// One communicator per local rank over the world's NCCL state (made again where it
    /// was aborted), a fresh copy-engine registry and the world's peer memory.
    fn make_communicators(
        &self,
        hosts: &[Arc<LocalCommunicator>],
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>> {
        self.health.set_timeout(timeout);
        let states = self.ensure_nccl()?;
        let copies = Arc::new(self.registry());
        let peer_copies = self.peer_copies();
        let peer_memory = PeerWorld::handles(&self.peer_world, &self.peer_world_spec(), hosts)?;
        Ok(self
            .local
            .iter()
            .enumerate()
            .map(|(i, (r, device))| {
                let engine = CopyEngine::new(
                    *r,
                    device.clone(),
                    copies.clone(),
                    self.ipc[i].clone(),
                    self.ipc_ranks.clone(),
                );
                Arc::new(CudaCommunicator::new(
                    *r,
                    self.size,
                    device.clone(),
                    states[i].clone(),
                    hosts[i].clone(),
                    self.health.clone(),
                    engine,
                    peer_copies,
                    self.routes.lines(&self.ipc_ranks, *r),
                    peer_memory[i].clone(),
                )) as Arc<dyn Communicator>
            })
            .collect())
    }

    /// The world's NCCL communicators joined again after a recovery: rank 0 makes a new
    /// unique id and every rank joins with it, each from its own thread (in one process
    /// too: measured faster than `ncclCommInitAll` from one thread).
    fn rejoin_nccl(&self, hosts: &[Arc<LocalCommunicator>]) -> Result<()> {
        if matches!(self.source, NcclSource::Unavailable(_)) {
            return Ok(());
        }
        let mut guard = self.nccl.lock().unwrap_or_else(PoisonError::into_inner);
        // Waits for an abort still in progress (a failure notice's thread) to return.
        for r in guard.iter().flatten() {
            r.abort_all();
        }
        let comms = join_nccl(
            self.local.iter().zip(hosts).collect(),
            self.size,
            "nccl world id after a recovery",
        )?;
        // Into the same states: the failure watch of a launched world holds them too.
        match guard.as_ref() {
            Some(states) => {
                for (state, comm) in states.iter().zip(comms) {
                    state.install(comm);
                }
            }
            None => {
                *guard = Some(
                    comms
                        .into_iter()
                        .map(|c| Arc::new(NcclRankState::new(c)))
                        .collect(),
                )
            }
        }
        Ok(())
    }
}

/// A rank of this process: its rank in the world and its device.
type LocalRank = (usize, Arc<CudaDevice>);

/// Joins a new NCCL communicator of `size` ranks on each local `(rank, device)` with its
/// host endpoint: the group's rank 0 makes the unique id and shares it (as `label`)
/// through the host endpoints.
fn join_nccl(
    members: Vec<(&LocalRank, &Arc<LocalCommunicator>)>,
    size: usize,
    label: &str,
) -> Result<Vec<crate::backend::cuda::comm::nccl::RawComm>> {
    let all: Vec<usize> = (0..size).collect();
    on_each(members, |((r, device), host)| {
        device.bind_thread()?;
        let mine = if *r == 0 {
            id_bytes(&unique_id()?)
        } else {
            Vec::new()
        };
        let ids = host.share_bytes(label, &all, &mine)?;
        init_rank(device, id_from_bytes(&ids[0])?, size, *r)
    })
}

impl RunComms for CudaComms {
    fn for_run(
        &self,
        hosts: &[Arc<LocalCommunicator>],
        timeout: Duration,
    ) -> Result<Vec<Arc<dyn Communicator>>> {
        self.make_communicators(hosts, timeout)
    }

    fn rebuild(
        &self,
        hosts: &[Arc<LocalCommunicator>],
        timeout: Duration,
    ) -> Result<Option<Vec<Arc<dyn Communicator>>>> {
        // Every device of the world is idle (each rank drained it before the last
        // barrier): the flags peers write into start at zero again, the CUDA IPC
        // hand-offs forget what was in flight, the health its failure.
        PeerWorld::reset_flags(&self.peer_world, &self.peer_world_spec())?;
        for ipc in self.ipc.iter().flatten() {
            ipc.lock()
                .unwrap_or_else(PoisonError::into_inner)
                .forget_in_flight();
        }
        self.health.reset();
        self.rejoin_nccl(hosts)?;
        self.make_communicators(hosts, timeout).map(Some)
    }

    fn subset(
        &self,
        local: &[usize],
        hosts: &[Arc<LocalCommunicator>],
        sub_size: usize,
    ) -> Result<Box<dyn RunComms>> {
        if let NcclSource::Unavailable(why) = &self.source {
            return Err(Error::World(format!(
                "sub-worlds need NCCL communicators, and this world has none: {why}"
            )));
        }
        let members: Vec<(usize, Arc<CudaDevice>)> = local
            .iter()
            .zip(hosts)
            .map(|(&i, h)| (h.membership().rank, self.local[i].1.clone()))
            .collect();
        let states = join_nccl(
            members.iter().zip(hosts).collect(),
            sub_size,
            "nccl sub-world id",
        )?;
        let states: Vec<Arc<NcclRankState>> = states
            .into_iter()
            .map(|c| Arc::new(NcclRankState::new(c)))
            .collect();
        // Ranks of the sub-world in the launched world, known to every member through
        // the host (each gives its own).
        let mut ipc_ranks = vec![usize::MAX; sub_size];
        let gathered = on_each(local.iter().zip(hosts).collect(), |(&i, host)| {
            let global = self.ipc_ranks[self.local[i].0];
            host.host_allgather(Block {
                shape: vec![1],
                data: vec![global as f32],
            })
        })?;
        if let Some(first) = gathered.into_iter().next() {
            for (r, b) in first.into_iter().enumerate() {
                ipc_ranks[r] = b.data[0] as usize;
            }
        }
        // The pairs without peer access, in the group's ranks.
        let sub_rank = |world_rank: usize| {
            local
                .iter()
                .zip(hosts)
                .find(|(&i, _)| self.local[i].0 == world_rank)
                .map(|(_, h)| h.membership().rank)
        };
        let no_peer_access = self
            .no_peer_access
            .iter()
            .filter_map(|&(a, b)| Some((sub_rank(a)?, sub_rank(b)?)))
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        let mut sub = CudaComms::new(
            sub_size,
            members,
            Some(states),
            NcclSource::Fixed,
            self.health.clone(),
            local.iter().map(|&i| self.ipc[i].clone()).collect(),
            ipc_ranks,
            no_peer_access,
            self.routes.clone(),
        );
        sub.whole_world = false;
        Ok(Box::new(sub))
    }

    fn transports(&self) -> Vec<String> {
        self.local
            .iter()
            .flat_map(|(r, _)| self.routes.lines(&self.ipc_ranks, *r))
            .collect()
    }
}
