//! Collectives over peer memory (`Transport::PeerMemory`): Allreduce (one-shot and
//! two-shot), Allgather and ReduceScatter as one kernel per rank over workspaces that
//! every rank of the world maps into its address space once, when the world is made.
//!
//! A call is one launch on the program's stream, with no host work: a rank writes its part
//! straight into every peer's workspace, raises one flag per peer and block, waits for
//! the peers' flags, and finishes from its own workspace (`source.cu` says how calls
//! never overwrite what a peer still reads). So it can be captured in a CUDA graph, and a
//! replayed decode step pays a few microseconds per collective where NCCL pays ~20.
//! Sums accumulate in f32 in rank order, so every rank gets the same bits.
//!
//! Flag waits are bounded like every device-side wait: the kernels read the GPU's clock
//! while they wait, and one that outlasts the world's timeout records itself in pinned
//! host memory ([`status::WaitStatus`]) and ends; the world's health turns that into a
//! `Timeout` naming the rank, the peer and the collective. A world that fails sets a
//! release word the waits poll, so no kernel outlives the failure.
//!
//! One job per file:
//! - `source.cu`: the kernels;
//! - `workspace`: a rank's workspace, and a peer's mapped here;
//! - `status`: the wait status and release words;
//! - here: [`PeerMemory`], one rank's handle on the world's workspaces, and the launch.

mod status;
mod workspace;

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use fusion_compiler::hir::CommunicationKind;
use fusion_compiler::lower::{
    PEER_MEMORY_FLAGGED_BYTES, PEER_MEMORY_MAX_RANKS, PEER_MEMORY_REGION_BYTES,
};
use fusion_compiler::DType;

use crate::backend::cuda::device::CudaDevice;
use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::stream::RawStream;
use crate::error::{Error, Result};
pub(crate) use status::WaitStatus;
pub(crate) use workspace::{MappedWorkspace, Workspace, DATA_OFFSET};

/// The kernels, for every element type.
const SOURCE: &str = include_str!("source.cu");

/// The most blocks of a peer-memory kernel (`GMAX` of `source.cu`).
const MAX_GRID: usize = 128;

/// Blocks for a kernel that pushes `bytes` to its peers: one per 32 KB, at least 8 (the
/// flag round trips of small messages run in parallel), at most [`MAX_GRID`].
fn grid_for(bytes: usize) -> u32 {
    bytes.div_ceil(32 << 10).clamp(8, MAX_GRID) as u32
}

/// Threads per block.
const BLOCK: u32 = 512;

/// Largest Allreduce (bytes) whose data travels with its flags (`peer_allreduce_ll`: no
/// flag round trip, twice the bytes on the links): 4.5-5.9 us up to 64 KB on 2 H200s, 8.1
/// at 128 KB where the one-shot and NCCL are faster.
const FLAGGED_LIMIT: usize = 64 << 10;

/// Largest Allreduce (bytes) that runs one-shot (every rank reads `world_size` copies)
/// rather than two-shot (one more flag round trip): docs/DECISIONS.md, "Small
/// collectives over peer memory".
const ONE_SHOT_LIMIT: usize = 256 << 10;

/// Bytes of a half that the flag-meeting kernels use (the rest is the flagged kernel's).
const USABLE_BYTES: usize = PEER_MEMORY_REGION_BYTES - PEER_MEMORY_FLAGGED_BYTES;

/// Which kernel runs an Allreduce of `bytes` on `world_size` ranks.
pub(crate) fn allreduce_kernel(bytes: usize, world_size: usize) -> &'static str {
    let flagged = world_size * bytes.div_ceil(8) * 16 <= PEER_MEMORY_FLAGGED_BYTES;
    let one_shot = world_size * bytes.div_ceil(16) * 16 <= USABLE_BYTES;
    if bytes <= FLAGGED_LIMIT && flagged {
        "peer_allreduce_ll"
    } else if bytes <= ONE_SHOT_LIMIT && one_shot {
        "peer_allreduce_one_shot"
    } else {
        "peer_allreduce_two_shot"
    }
}

/// The kernels' source for `dtype`.
fn source_for(dtype: DType) -> &'static str {
    static SOURCES: OnceLock<[String; 3]> = OnceLock::new();
    let all = SOURCES
        .get_or_init(|| ["DT_F32", "DT_BF16", "DT_F16"].map(|d| format!("#define {d}\n{SOURCE}")));
    match dtype {
        DType::F32 => &all[0],
        DType::BF16 => &all[1],
        DType::F16 => &all[2],
    }
}

/// The kernels' `Peers`: each rank's workspace, as mapped here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Peers([u64; PEER_MEMORY_MAX_RANKS]);

/// The kernels' `Ctl`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Ctl {
    status: u64,
    release: u64,
    timeout_ns: u64,
    data_offset: u64,
    half_bytes: u64,
    usable_bytes: u64,
}

/// One rank's handle on its world's peer memory: every rank's workspace as mapped here,
/// and this rank's wait status.
#[derive(Debug)]
pub(crate) struct PeerMemory {
    rank: usize,
    world_size: usize,
    peers: Peers,
    status: Arc<WaitStatus>,
    health: Arc<WorldHealth>,
}

/// One collective's buffers: contiguous, on this rank's device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PeerCall {
    pub kind: CommunicationKind,
    pub dtype: DType,
    pub input: u64,
    pub output: u64,
    /// Elements of the output (Allreduce, ReduceScatter) or of the input (Allgather).
    pub elements: usize,
}

impl PeerMemory {
    /// Rank `rank`'s handle, given every rank's workspace address here (`workspaces`, by
    /// rank); its wait status is watched by `health`.
    pub(crate) fn new(rank: usize, workspaces: &[u64], health: Arc<WorldHealth>) -> Result<Self> {
        let world_size = workspaces.len();
        if !(2..=PEER_MEMORY_MAX_RANKS).contains(&world_size) || rank >= world_size {
            return Err(Error::World(format!(
                "peer memory spans 2 to {PEER_MEMORY_MAX_RANKS} ranks, not {world_size}"
            )));
        }
        let mut peers = [0u64; PEER_MEMORY_MAX_RANKS];
        peers[..world_size].copy_from_slice(workspaces);
        let status = Arc::new(WaitStatus::new(rank)?);
        health.watch(status.clone());
        Ok(PeerMemory {
            rank,
            world_size,
            peers: Peers(peers),
            status,
            health,
        })
    }

    /// Enqueues `call` on `stream` of `device`.
    pub(crate) fn launch(
        &self,
        device: &CudaDevice,
        stream: RawStream,
        call: PeerCall,
    ) -> Result<()> {
        let name = match call.kind {
            CommunicationKind::Allreduce => {
                allreduce_kernel(call.elements * call.dtype.size_bytes(), self.world_size)
            }
            CommunicationKind::Allgather => "peer_allgather",
            CommunicationKind::ReduceScatter => "peer_reduce_scatter",
            other => {
                return Err(Error::Communication {
                    rank: self.rank,
                    reason: format!("{} does not run over peer memory", other.name()),
                })
            }
        };
        let bytes = match call.kind {
            CommunicationKind::Allgather => call.elements * self.world_size,
            _ => call.elements,
        } * call.dtype.size_bytes();
        let grid = grid_for(bytes);
        let mut input = call.input;
        let mut output = call.output;
        let mut n = call.elements as u64;
        let mut peers = self.peers;
        let mut rank = self.rank as i32;
        let mut world = self.world_size as i32;
        let mut ctl = Ctl {
            status: self.status.status_ptr(),
            release: self.status.release_ptr(),
            timeout_ns: self.health.timeout().as_nanos().min(u128::from(u64::MAX)) as u64,
            data_offset: DATA_OFFSET as u64,
            half_bytes: PEER_MEMORY_REGION_BYTES as u64,
            usable_bytes: USABLE_BYTES as u64,
        };
        let mut args: [*mut c_void; 7] = [
            (&mut input as *mut u64).cast(),
            (&mut output as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut peers as *mut Peers).cast(),
            (&mut rank as *mut i32).cast(),
            (&mut world as *mut i32).cast(),
            (&mut ctl as *mut Ctl).cast(),
        ];
        let shared = device.shared();
        // SAFETY: the arguments match the kernels' (in, out, n, Peers, rank, world, Ctl);
        // the buffers belong to the call, which keeps them until its stream passes them;
        // the workspaces and status words live as long as the world.
        unsafe {
            device.kernels.launch_source(
                shared,
                (source_for(call.dtype), name),
                (grid, BLOCK),
                stream,
                &mut args,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_allreduces_run_one_shot_and_larger_ones_two_shot() {
        assert_eq!(allreduce_kernel(32 << 10, 4), "peer_allreduce_ll");
        assert_eq!(allreduce_kernel(64 << 10, 8), "peer_allreduce_ll");
        assert_eq!(allreduce_kernel(128 << 10, 4), "peer_allreduce_one_shot");
        assert_eq!(allreduce_kernel(4 << 20, 4), "peer_allreduce_two_shot");
        assert_eq!(allreduce_kernel(1 << 20, 2), "peer_allreduce_two_shot");
    }

    #[test]
    fn grids_grow_with_the_message() {
        assert_eq!(grid_for(4 << 10), 8);
        assert_eq!(grid_for(1 << 20), 32);
        assert_eq!(grid_for(64 << 20), 128);
    }

    #[test]
    fn every_dtype_gets_its_own_source() {
        assert!(source_for(DType::BF16).starts_with("#define DT_BF16\n"));
        assert!(source_for(DType::F32).contains("peer_allreduce_two_shot"));
        assert_ne!(source_for(DType::F16), source_for(DType::BF16));
    }
}
