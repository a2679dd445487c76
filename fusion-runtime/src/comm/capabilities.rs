//! What a communicator can do, decided when it is made: the one question the executor,
//! the evaluator and replay ask it ([`Capabilities`]), instead of naming its transports.
//!
//! A host program's transfers say which transport carries them (`Transport` on every
//! P2P node and collective). Transfers over a *peer copy* transport (copy engines) are
//! written by the sender's device straight into the receiver's buffer: such a buffer must
//! be memory the peer can reach, it can be kept from one call to the next, and whether a
//! call with such transfers can be recorded as a device graph depends on how the
//! communicator hands them off. Which transport a program's transfers name is decided
//! once per world too: lowering asks [`Capabilities::lowering`], so the program (and its
//! dump) says what will run, and the communicator carries out what the program says.

use std::borrow::Cow;
use std::sync::Arc;

use fusion_compiler::hir::Transport;
use fusion_compiler::lower::{LowerOptions, PeerMemoryCollectives};
use fusion_compiler::DType;

use crate::error::Result;
use crate::streams::StreamHandle;
use crate::tensor::Tensor;

/// Whether transfers over `transport` are peer copies: the sender's device writes into the
/// receiver's buffer (copy engines), rather than a library staging the data.
pub fn is_peer_copy(transport: Transport) -> bool {
    transport == Transport::CopyEngine
}

/// Which pairs of a world's ranks can copy into each other's memory, decided when the
/// world is made (from where its ranks live and what their GPUs reach).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerCopies {
    /// Transports are simulated (the CPU backend): a program runs as it was lowered,
    /// whatever transport its transfers name.
    Simulated,
    /// Every pair of ranks: transfers lowered as peer copies run as peer copies.
    EveryPair,
    /// Not every pair (GPUs without peer access to each other, ranks on other hosts,
    /// processes without CUDA IPC): the world's transfers and collectives go through NCCL,
    /// so that every rank runs the same program.
    NotEveryPair,
}

/// Receive buffers a communicator keeps from one call of a program to the next (the
/// `n`-th buffer peers write into in a call is the same memory at every call of the same
/// call identity, [`crate::comm::CallStart::identity`]), so that after the first call the
/// sender knows where to copy without asking.
pub trait KeptReceives: Send + Sync {
    /// The next kept receive buffer of this call, allocated on `stream` the first time;
    /// `None` when the call keeps none (the caller then allocates).
    fn take(&self, stream: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Option<Tensor>>;
}

/// What a communicator can do beyond its operations, fixed for its life.
#[derive(Clone)]
pub struct Capabilities {
    /// Which pairs of ranks have peer copies: what lowering may put in a program
    /// ([`Capabilities::lowering`]).
    pub peer_copies: PeerCopies,
    /// Whether collectives of the whole world can run as kernels over peer memory
    /// (`Transport::PeerMemory`): every rank's workspace is mapped into every other's.
    /// Simulated on the CPU backend.
    pub peer_memory: bool,
    /// Whether a peer-memory Allreduce of a GEMM's product can run as one kernel with the
    /// GEMM (`Communicator::gemm_allreduce`, `Node::GemmAllreduce`). The CPU backend runs
    /// the node as the GEMM, then the Allreduce.
    pub gemm_allreduce: bool,
    /// Whether a call with peer copies can be recorded as a device graph (`Err`: why not,
    /// e.g. the hand-off goes through the host).
    pub capture: std::result::Result<(), String>,
    /// Buffers that peers copy into must come from `Device::allocate_shared`: peers in
    /// other processes map them.
    pub shared_receives: bool,
    /// Receive buffers kept from call to call, where the communicator keeps them.
    pub kept_receives: Option<Arc<dyn KeptReceives>>,
    /// How this rank reaches each peer, one line per peer (for dumps; empty where there is
    /// nothing to choose, as on the CPU backend).
    pub transports: Vec<String>,
}

impl std::fmt::Debug for Capabilities {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capabilities")
            .field("peer_copies", &self.peer_copies)
            .field("peer_memory", &self.peer_memory)
            .field("gemm_allreduce", &self.gemm_allreduce)
            .field("capture", &self.capture)
            .field("shared_receives", &self.shared_receives)
            .field("kept_receives", &self.kept_receives.is_some())
            .field("transports", &self.transports)
            .finish()
    }
}

impl Capabilities {
    /// A communicator whose transports are simulated (the CPU backend's): no graphs, no
    /// kept buffers.
    pub fn simulated() -> Self {
        Capabilities {
            peer_copies: PeerCopies::Simulated,
            peer_memory: true,
            gemm_allreduce: true,
            capture: Err("this communicator has no copy engines".into()),
            shared_receives: false,
            kept_receives: None,
            transports: Vec::new(),
        }
    }

    /// `requested` with the transports this world has: where not every pair of ranks has
    /// peer copies, P2P transfers and collectives asked of the copy engines go through
    /// NCCL instead, and where the ranks' memory is not mapped into each other, no
    /// collective runs over peer memory (the same for every rank, so that every rank
    /// lowers the same program). Borrowed when nothing changes.
    pub fn lowering<'a>(&self, requested: &'a LowerOptions) -> Cow<'a, LowerOptions> {
        let asked = requested.transports;
        let wants_copies = is_peer_copy(asked.p2p) || is_peer_copy(asked.collectives);
        let drop_copies = self.peer_copies == PeerCopies::NotEveryPair && wants_copies;
        let drop_peer_memory =
            !self.peer_memory && asked.peer_memory != PeerMemoryCollectives::Never;
        let drop_gemm_allreduce = !self.gemm_allreduce && asked.gemm_allreduce;
        if !drop_copies && !drop_peer_memory && !drop_gemm_allreduce {
            return Cow::Borrowed(requested);
        }
        let mut lower = requested.clone();
        if drop_copies {
            for transport in [&mut lower.transports.p2p, &mut lower.transports.collectives] {
                if is_peer_copy(*transport) {
                    *transport = Transport::Nccl;
                }
            }
        }
        if drop_peer_memory {
            lower.transports.peer_memory = PeerMemoryCollectives::Never;
        }
        if drop_gemm_allreduce {
            lower.transports.gemm_allreduce = false;
        }
        Cow::Owned(lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowering_keeps_copy_engines_only_where_every_pair_has_them() {
        let mut asked = LowerOptions::default();
        asked.transports.collectives = Transport::CopyEngine;
        assert_eq!(asked.transports.p2p, Transport::CopyEngine);
        let with = |peer_copies| Capabilities {
            peer_copies,
            ..Capabilities::simulated()
        };
        for kept in [PeerCopies::Simulated, PeerCopies::EveryPair] {
            assert!(matches!(with(kept).lowering(&asked), Cow::Borrowed(_)));
        }
        let lowered = with(PeerCopies::NotEveryPair).lowering(&asked).into_owned();
        assert_eq!(lowered.transports.p2p, Transport::Nccl);
        assert_eq!(lowered.transports.collectives, Transport::Nccl);
        assert_eq!(
            LowerOptions {
                transports: asked.transports,
                ..lowered
            },
            asked,
            "nothing else changes"
        );
        let nccl = LowerOptions::plain();
        assert!(matches!(
            with(PeerCopies::NotEveryPair).lowering(&nccl),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn lowering_drops_peer_memory_where_the_world_has_none() {
        let asked = LowerOptions::default();
        assert_eq!(asked.transports.peer_memory, PeerMemoryCollectives::Auto);
        let without = Capabilities {
            peer_memory: false,
            ..Capabilities::simulated()
        };
        let lowered = without.lowering(&asked).into_owned();
        assert_eq!(lowered.transports.peer_memory, PeerMemoryCollectives::Never);
        assert_eq!(lowered.transports.p2p, asked.transports.p2p);
        assert!(matches!(
            Capabilities::simulated().lowering(&asked),
            Cow::Borrowed(_)
        ));
        assert!(matches!(
            without.lowering(&LowerOptions::plain()),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn lowering_keeps_gemm_and_allreduce_apart_where_no_kernel_runs_them_together() {
        let asked = LowerOptions::default();
        assert!(asked.transports.gemm_allreduce);
        let without = Capabilities {
            gemm_allreduce: false,
            ..Capabilities::simulated()
        };
        let lowered = without.lowering(&asked).into_owned();
        assert!(!lowered.transports.gemm_allreduce);
        assert_eq!(lowered.transports.peer_memory, asked.transports.peer_memory);
    }
}
