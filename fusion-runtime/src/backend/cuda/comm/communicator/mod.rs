//! The CUDA communicator (one thread per GPU of this process; the world may span
//! processes and hosts): NCCL for collectives and NCCL P2P, the copy engines for the
//! transfers a program lowers onto them.
//!
//! Every call enqueues on the stream the host program chose. The world communicator comes
//! from `ncclCommInitAll` (every rank in this process) or `ncclCommInitRank` with the
//! unique id rank 0 shared at bootstrap; a team that is not the whole world gets its own
//! communicator the first time it is used, from a unique id its first member makes and
//! shares with the others through the host-side endpoints. A transfer runs on the
//! transport its node names: the world decided when it was made whether its pairs have
//! copy engines (`world::routes`), and the executor lowered the program accordingly.
//! NCCL needs contiguous buffers laid out block by block, so views that are not get a
//! staging buffer and a copy kernel on the same stream. Scatter and Gather, which NCCL
//! lacks, are grouped sends and receives.
//!
//! One job per file:
//! - here: the communicator, its coalescing group, and which transport runs a collective
//!   ([`CudaCommunicator::run_collective`], by the node's `Transport`);
//! - `trait_impl`: the [`Communicator`](crate::comm::Communicator) implementation;
//! - `teams`: the NCCL communicator of a team;
//! - `buffers`: buffers as the transports need them (contiguous, staged, squeezed);
//! - `nccl_ops`: the collectives and transfers on NCCL, one helper for stage -> call ->
//!   copy back;
//! - `nccl_grouped`: Scatter and Gather, which NCCL lacks, as grouped sends and receives;
//! - `copy_engine_ops`: Allgather and ReduceScatter over the copy engines;
//! - `peer_memory_ops`: Allreduce, Allgather and ReduceScatter over peer memory.

mod buffers;
mod copy_engine_ops;
mod nccl_grouped;
mod nccl_ops;
mod peer_memory_ops;
mod teams;
mod trait_impl;

use std::sync::{Arc, Mutex, PoisonError};

use cudarc::nccl::result as nccl;
use fusion_compiler::hir::{Communication, CommunicationKind, Transport};

use super::copy_engine::{CopyEngine, Transfer};
use super::nccl::{nccl_err, NcclRankState};
use super::nccl_graphs::GraphFence;
use super::peer_memory::PeerMemory;
use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::comm::local::LocalCommunicator;
use crate::comm::{is_peer_copy, Capabilities, KeptReceives, PeerCopies};
use crate::device::StreamHandle;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// One rank's endpoint in a CUDA world: NCCL for collectives and NCCL P2P, the copy
/// engines for transfers the program lowers onto them.
pub struct CudaCommunicator {
    /// This rank, in its (sub-)world.
    rank: usize,
    /// Ranks in the (sub-)world.
    world_size: usize,
    /// This rank's GPU.
    device: Arc<CudaDevice>,
    /// This rank's NCCL communicators (the world's and its teams'), kept across runs.
    state: Arc<NcclRankState>,
    /// The host-side endpoints: team ids, exchanges, aborts.
    host: Arc<LocalCommunicator>,
    /// The world's health, which every wait checks.
    health: Arc<WorldHealth>,
    /// This rank's copy-engine endpoint.
    copy_engine: CopyEngine,
    /// This rank's handle on the world's peer memory, where every rank maps every other's.
    peer_memory: Option<Arc<PeerMemory>>,
    /// The coalescing group in progress, if any.
    group: Mutex<Option<Group>>,
    /// See [`Communicator::instance`][instance].
    ///
    /// [instance]: crate::comm::Communicator::instance
    instance: u64,
    /// The last graph launch, which NCCL calls outside graphs wait for.
    graph_fence: GraphFence,
    /// A one-element device tensor per (dtype, reduction) holding its identity, uploaded at
    /// the first (walked) call that needs it, so that a captured call uploads nothing.
    identities: Mutex<
        std::collections::HashMap<(fusion_compiler::DType, fusion_compiler::ir::ReduceOp), Tensor>,
    >,
    /// What the next send or receive is in the program (see
    /// [`Communicator::describe_next_transfer`][describe]); taken by that send or receive.
    ///
    /// [describe]: crate::comm::Communicator::describe_next_transfer
    next_label: Mutex<Option<Arc<str>>>,
    /// What this communicator can do (see [`Communicator::capabilities`][capabilities]).
    ///
    /// [capabilities]: crate::comm::Communicator::capabilities
    capabilities: Capabilities,
}

/// One collective as the program calls it: the stream it is enqueued on, its node, and
/// this rank's buffers.
#[derive(Clone, Copy)]
struct Collective<'a> {
    s: StreamHandle,
    c: &'a Communication,
    input: Option<&'a Tensor>,
    output: Option<&'a Tensor>,
}

/// Work that must happen after a group's transfers are issued.
#[derive(Default)]
struct Group {
    /// (stream, staging buffer, destination view): copies after receives.
    after: Vec<(StreamHandle, Tensor, Tensor)>,
    /// Buffers that must stay alive until the group is issued.
    keep: Vec<Tensor>,
    /// Copy-engine transfers, issued at the group's end.
    copies: Vec<Transfer>,
}

impl CudaCommunicator {
    /// Rank `rank`'s communicator over its NCCL state, host endpoints and copy engine;
    /// `peer_copies` and `transports` are what the world decided for its pairs.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        rank: usize,
        world_size: usize,
        device: Arc<CudaDevice>,
        state: Arc<NcclRankState>,
        host: Arc<LocalCommunicator>,
        health: Arc<WorldHealth>,
        copy_engine: CopyEngine,
        peer_copies: PeerCopies,
        transports: Vec<String>,
        peer_memory: Option<Arc<PeerMemory>>,
    ) -> Self {
        crate::counters::communicators_created(1);
        let kept = copy_engine.kept_receives();
        let capabilities = Capabilities {
            peer_copies,
            peer_memory: peer_memory.is_some(),
            // The GEMM with the Allreduce in its epilogue runs over peer memory.
            gemm_allreduce: peer_memory.is_some(),
            capture: copy_engine.capture_support(),
            shared_receives: copy_engine.has_ipc_peers(),
            kept_receives: kept.map(|k| k as Arc<dyn KeptReceives>),
            transports,
        };
        CudaCommunicator {
            rank,
            world_size,
            device,
            state,
            host,
            health,
            copy_engine,
            peer_memory,
            group: Mutex::new(None),
            instance: crate::comm::next_instance(),
            graph_fence: GraphFence::new(),
            identities: Mutex::new(std::collections::HashMap::new()),
            next_label: Mutex::new(None),
            capabilities,
        }
    }

    /// Runs a collective on the transport its node names: over peer memory or, for
    /// Allgather and ReduceScatter, the copy engines where the node says so; every other
    /// collective on NCCL.
    fn run_collective(&self, call: &Collective<'_>) -> Result<()> {
        if call.c.transport == Transport::PeerMemory {
            return self.peer_memory_collective(call);
        }
        if is_peer_copy(call.c.transport)
            && matches!(
                call.c.kind,
                CommunicationKind::Allgather | CommunicationKind::ReduceScatter
            )
        {
            return self.copy_engine_collective(call);
        }
        self.nccl_collective(call)
    }

    /// A send (`sending`) or receive on the transport its P2P node names: the copy engines
    /// or NCCL.
    fn point_to_point(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
        sending: bool,
    ) -> Result<()> {
        if is_peer_copy(transport) {
            return self.copy_transfer(stream, peer, buf, sending);
        }
        self.forget_label();
        if sending {
            self.nccl_send(stream, peer, buf)
        } else {
            self.nccl_recv(stream, peer, buf)
        }
    }

    /// A copy-engine transfer: deferred to the group's end, or issued now.
    fn copy_transfer(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        sending: bool,
    ) -> Result<()> {
        if peer == self.rank || peer >= self.world_size {
            return Err(self.err(format!("copy-engine transfer with rank {peer}: not a peer")));
        }
        if !self.by_copy_engine(peer) {
            return Err(self.err(format!(
                "the program asks for a copy-engine transfer with rank {peer}, which this \
                 world reaches through NCCL (its transports: {}); run it through the \
                 executor, which lowers onto the world's transports, or lower with \
                 LowerOptions::transports.p2p = Nccl",
                self.capabilities.transports.join("; ")
            )));
        }
        let label = self
            .next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let t = self
            .copy_engine
            .transfer(stream, peer, buf, sending, label)?;
        let mut group = self.group.lock().unwrap_or_else(PoisonError::into_inner);
        match group.as_mut() {
            Some(g) => {
                g.copies.push(t);
                Ok(())
            }
            None => {
                drop(group);
                self.copy_engine.run_group(&[t])
            }
        }
    }

    /// Drops the description of a send or receive that NCCL carries (it is for copy-engine
    /// transfers only; a later collective's transfers must not take it).
    fn forget_label(&self) {
        self.next_label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
    }

    /// Whether the copy engines reach `peer` (a GPU of this process, or of another process
    /// of this host over CUDA IPC).
    fn by_copy_engine(&self, peer: usize) -> bool {
        self.copy_engine.reaches_in_process(peer) || self.copy_engine.reaches_over_ipc(peer)
    }

    fn err(&self, reason: String) -> Error {
        Error::Communication {
            rank: self.rank,
            reason,
        }
    }

    fn nccl_err(&self, what: &str, e: nccl::NcclError) -> Error {
        nccl_err(&format!("rank {}: {what}", self.rank), e)
    }
}
