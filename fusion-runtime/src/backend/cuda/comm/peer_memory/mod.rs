//! Collectives over peer memory (`Transport::PeerMemory`): Allreduce (one-shot and
//! two-shot), Allgather and ReduceScatter as one kernel per rank over workspaces that
//! every rank of the world maps into its address space once, when the world is made.
//!
//! A call is one launch on the program's stream, with no host work: a rank writes its part
//! straight into every peer's workspace, raises one flag per peer and block, waits for
//! the peers' flags, and finishes from its own workspace (`source.cu` says how calls
//! never overwrite what a peer still reads). In a world of one process, where every rank
//! reaches all of every other's memory, a large Allreduce skips the workspaces: each rank
//! reads its part from the ranks' own inputs and stores the sum into their own outputs
//! (`peer_allreduce_direct`). So a call can be captured in a CUDA graph, and a
//! replayed decode step pays a few microseconds per collective where NCCL pays ~20.
//! Sums accumulate in f32 in rank order, so every rank gets the same bits.
//!
//! Flag waits are bounded like every device-side wait: the kernels read the GPU's clock
//! while they wait, and one that outlasts the world's timeout records itself in pinned
//! host memory ([`status::WaitStatus`]) and ends; the world's health turns that into a
//! `Timeout` naming the rank, the peer and the collective. A world that fails sets a
//! release word the waits poll, so no kernel outlives the failure.
//!
//! The same workspaces carry a decode-size GEMM whose epilogue does the Allreduce of its
//! product (`Node::GemmAllreduce`): each block's finished tile goes to every rank, which
//! sums the ranks' tiles ([`PeerMemory::launch_gemm`]).
//!
//! One job per file:
//! - `source.cu`: the collectives' kernels;
//! - `gemm_allreduce.cu`: the GEMM with the Allreduce in its epilogue (appended to
//!   `source.cu`, bf16 and f16);
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
use crate::device::{ScatterLinks, SCATTER_MAX_RANKS};
use crate::error::{Error, Result};
pub(crate) use status::WaitStatus;
pub(crate) use workspace::{MappedWorkspace, Workspace, DATA_OFFSET};

/// The kernels, for every element type.
const SOURCE: &str = include_str!("source.cu");

/// The GEMM with the Allreduce in its epilogue (bf16 and f16), appended to [`SOURCE`].
const GEMM_SOURCE: &str = include_str!("gemm_allreduce.cu");

/// Bytes of one shared-memory stage of the fused GEMM's ring (64 x 64 of W, 64 of K of
/// 16 rows of X per 16-row tile) and stages in the ring (`gemm_allreduce.cu`).
const GEMM_STAGE_BYTES: u32 = 64 * 64 * 2;
const GEMM_X_STAGE_BYTES_PER_TILE: u32 = 16 * 64 * 2;
const GEMM_STAGES: u32 = 8;

/// Byte of a workspace where the fused GEMM + ReduceScatter's words start (past the
/// flags, counters and buffer packets of `source.cu`, which end at byte 40960; zeroed with
/// them by `Workspace::reset_flags`): the output-address slot (16 bytes), at 64 the u32
/// `ready` counters and at 128 the `done` counters (one per source rank), at 192 the
/// count of calls and at 196 of a call's blocks done.
const SCATTER_AT: u64 = 40960;

/// The most blocks of a peer-memory kernel (`GMAX` of `source.cu`).
const MAX_GRID: usize = 128;

/// Blocks for a kernel that pushes `bytes` to its peers: one per 32 KB, at least 8 (the
/// flag round trips of small messages run in parallel), at most [`MAX_GRID`].
fn grid_for(bytes: usize) -> u32 {
    bytes.div_ceil(32 << 10).clamp(8, MAX_GRID) as u32
}

/// Threads per block.
const BLOCK: u32 = 512;

/// Threads per block of the flagged Allreduce on more than 2 ranks up to 32 KB, with 4
/// times [`grid_for`]'s blocks: on 4 H100s 4.39 / 4.53 / 4.64 / 4.80 us at 4 / 8 / 16 / 32
/// KB, where 512-thread blocks took 4.66 / 4.93 / 5.11 / 5.31 (one per 32 KB to 16 KB, 4
/// times that at 32 KB) and 256-thread ones 4.52 / 4.67 / 4.76 / 4.97; at 64 KB 256
/// threads are fastest (5.93 against 6.26 and 6.54), [`FLAGGED_WIDE_BLOCK`]
/// (`bench/results/2026-11-27-0805-allreduce-blocks-candle-phases-h100x4/`).
const FLAGGED_SMALL_BLOCK: u32 = 128;
/// See [`FLAGGED_SMALL_BLOCK`].
const FLAGGED_WIDE_BLOCK: u32 = 256;

/// Largest Allreduce (bytes) whose data travels with its flags (`peer_allreduce_ll_at_once`:
/// no flag round trip, twice the bytes on the links) on more than 2 ranks: on 4 H100s
/// 4.7-5.5 us up to 32 KB and 6.5 at 64 KB, where the one-shot kernel took 6.6-7.0
/// (docs/DECISIONS.md, "Small collectives over peer memory").
const FLAGGED_LIMIT: usize = 64 << 10;

/// Largest Allreduce (bytes) that runs one-shot (every rank reads `world_size` copies) on
/// more than 2 ranks, with 4 times [`grid_for`]'s blocks: on 4 H100s 7.3 us at 128 KB,
/// level with the two-shot flagged kernel (7.4).
const ONE_SHOT_LIMIT: usize = 128 << 10;

/// Largest Allreduce (bytes) that runs in two shots with the data beside its flags
/// (`peer_allreduce_ll_two_shot`, 4 times [`grid_for`]'s blocks) on more than 2 ranks: on
/// 4 H100s 8.7 / 10.6 / 15.6 us at 256 KB / 512 KB / 1 MB, where the one-shot kernel took
/// 9.5 / 13.3 / 20.9 and the two-shot one through the flag meetings 13.2 / 14.2 / 17.6; at
/// 2 MB level with the latter (24.7 against 24.8), which is faster from 4 MB (36.4
/// against 43.7).
const LL_TWO_SHOT_LIMIT: usize = 1 << 20;

/// On 4 ranks of one process, the Allreduce straight between the ranks' buffers
/// (`peer_allreduce_direct`) from 512 KB to 16 MB: on 4 H100s 10.1 / 12.2 / 16.9 / 26.3 /
/// 89.2 us at 512 KB / 1 / 2 / 4 / 16 MB, where the flagged two-shot kernel took 10.5 /
/// 15.4 / 24.6 us to 2 MB, the two-shot one through the workspaces 36.5 at 4 MB and 98.1
/// at 16 MB, and PyTorch's two-shot 14.8 / 30.2 / 93.4 at 1 / 4 / 16 MB; at 256 KB the
/// flagged two-shot kernel is faster (8.8 against 9.3), at 64 MB the workspaces' (332.5
/// against 344.2). Other world sizes were not measured with it and keep the workspaces.
const DIRECT_RANGE: std::ops::RangeInclusive<usize> = (512 << 10)..=(16 << 20);

/// On 2 ranks (measured there, 2x H100): the flagged kernel up to 256 KB, the one-shot
/// kernel up to 4 MB (2 MB where the ranks reach each other's buffers), each with 4 times
/// [`grid_for`]'s blocks from 64 KB (4.4 against 4.8 us at 64 KB, 5.8 against 9.2 at 256
/// KB, 9.5 against 11.2 at 1 MB); larger messages two-shot, straight between the ranks'
/// buffers where they reach each other's memory (19.2 against the one-shot kernel's 20.4
/// us at 4 MB, 57.8 at 16 MB, 210.8 against 240 at 64 MB), else through the workspaces.
const TWO_RANKS_FLAGGED_LIMIT: usize = 256 << 10;
/// Largest two-rank Allreduce (bytes) that runs one-shot (see above).
const TWO_RANKS_ONE_SHOT_LIMIT: usize = 4 << 20;
/// The same where the ranks reach each other's buffers (see above).
const TWO_RANKS_ONE_SHOT_LIMIT_DIRECT: usize = 2 << 20;

/// Bytes of a half that the flag-meeting kernels use (the rest is the flagged kernel's).
const USABLE_BYTES: usize = PEER_MEMORY_REGION_BYTES - PEER_MEMORY_FLAGGED_BYTES;

/// How an Allreduce runs: its kernel, its blocks and their threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AllreducePlan {
    pub kernel: &'static str,
    pub grid: u32,
    pub block: u32,
}

/// The kernel and blocks of an Allreduce of `bytes` on `world_size` ranks; `direct`: the
/// ranks reach each other's buffers (one process), so a two-shot Allreduce needs no
/// workspace (`peer_allreduce_direct`).
pub(crate) fn allreduce_plan(bytes: usize, world_size: usize, direct: bool) -> AllreducePlan {
    let flagged = world_size * bytes.div_ceil(8) * 16 <= PEER_MEMORY_FLAGGED_BYTES;
    // Two areas of `world_size` parts of the message's 8-byte packets, 16 bytes each.
    let flagged_two_shot =
        2 * world_size * bytes.div_ceil(8).div_ceil(world_size) * 16 <= PEER_MEMORY_FLAGGED_BYTES;
    let one_shot = world_size * bytes.div_ceil(16) * 16 <= USABLE_BYTES;
    let plan = |kernel, grid| AllreducePlan {
        kernel,
        grid,
        block: BLOCK,
    };
    let wide = (grid_for(bytes) * 4).min(MAX_GRID as u32);
    if world_size == 2 {
        return if bytes <= TWO_RANKS_FLAGGED_LIMIT && flagged {
            plan(
                "peer_allreduce_ll",
                if bytes < 64 << 10 {
                    grid_for(bytes)
                } else {
                    wide
                },
            )
        } else if bytes
            <= if direct {
                TWO_RANKS_ONE_SHOT_LIMIT_DIRECT
            } else {
                TWO_RANKS_ONE_SHOT_LIMIT
            }
            && one_shot
        {
            plan("peer_allreduce_one_shot", wide)
        } else if direct {
            plan("peer_allreduce_direct", grid_for(bytes))
        } else {
            plan("peer_allreduce_two_shot", grid_for(bytes))
        };
    }
    if bytes <= FLAGGED_LIMIT && flagged {
        // Many narrow blocks: each thread's flag round trips run beside more others'.
        AllreducePlan {
            kernel: "peer_allreduce_ll_at_once",
            grid: wide,
            block: if bytes <= 32 << 10 {
                FLAGGED_SMALL_BLOCK
            } else {
                FLAGGED_WIDE_BLOCK
            },
        }
    } else if bytes <= ONE_SHOT_LIMIT && one_shot {
        plan("peer_allreduce_one_shot", wide)
    } else if direct && world_size == 4 && DIRECT_RANGE.contains(&bytes) {
        plan("peer_allreduce_direct", grid_for(bytes))
    } else if bytes <= LL_TWO_SHOT_LIMIT && flagged_two_shot {
        plan("peer_allreduce_ll_two_shot", wide)
    } else {
        // Through the workspaces: where the ranks do not reach each other's buffers, above
        // 16 MB on 4 ranks (see `DIRECT_RANGE`), and on world sizes other than 2 and 4,
        // where the direct kernel was not measured.
        plan("peer_allreduce_two_shot", grid_for(bytes))
    }
}

/// The kernels' source for `dtype`.
fn source_for(dtype: DType) -> &'static str {
    static SOURCES: OnceLock<[String; 3]> = OnceLock::new();
    crate::backend::cuda::kernels::source_for_dtype(&SOURCES, SOURCE, dtype)
}

/// The parts of K the fused GEMM splits `call` into on `world` ranks (`None`: it does not
/// take it).
fn gemm_parts(call: &GemmCall, world: usize) -> Option<i64> {
    let [m, k, n] = [call.m, call.k, call.n].map(|v| v as i64);
    fusion_compiler::lower::gemm_allreduce_parts(m, k, n, call.dtype, world)
}

/// The fused GEMM's source for `dtype` (`None`: it takes bf16 and f16 only).
fn gemm_source_for(dtype: DType) -> Option<&'static str> {
    static SOURCES: OnceLock<[String; 2]> = OnceLock::new();
    let all = SOURCES.get_or_init(|| {
        ["DT_BF16", "DT_F16"].map(|d| format!("#define {d}\n{SOURCE}\n{GEMM_SOURCE}"))
    });
    match dtype {
        DType::BF16 => Some(&all[0]),
        DType::F16 => Some(&all[1]),
        DType::F32 => None,
    }
}

/// The fused GEMM's kernel for `m` rows in `parts` parts of K on `world` ranks
/// (`lower::gemm_allreduce_parts`) and its 16-row tiles: data beside its flags up to
/// `lower::gemm_allreduce_flag_beside_rows` (and always in two parts, which only flags
/// beside the data join), the flag meeting above.
fn gemm_kernel_for(m: usize, parts: i64, world: usize) -> (&'static str, u32) {
    let beside = m as i64 <= fusion_compiler::lower::gemm_allreduce_flag_beside_rows(world);
    match (m, parts) {
        (_, 2) => ("peer_gemm_allreduce_ll_m16_k2", 1),
        (0..=16, _) if beside => ("peer_gemm_allreduce_ll_m16", 1),
        (0..=16, _) => ("peer_gemm_allreduce_flag_m16", 1),
        _ => ("peer_gemm_allreduce_flag_m32", 2),
    }
}

/// One GEMM + Allreduce: `y [m, n] = r + sum over ranks of x [m, k] @ w [k, n]` (`r` 0:
/// none), row-major and contiguous, on this rank's device.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemmCall {
    pub dtype: DType,
    pub x: u64,
    pub w: u64,
    pub y: u64,
    /// A residual `[m, n]` added to the sum (the same on every rank), or 0.
    pub r: u64,
    pub m: usize,
    pub k: usize,
    pub n: usize,
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
    /// Every rank is of this process, so kernels may read and write the ranks' own
    /// buffers (peer access covers all of their memory).
    direct: bool,
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
    /// rank); its wait status is watched by `health`. `direct`: every rank is of this
    /// process, with peer access to each other's memory.
    pub(crate) fn new(
        rank: usize,
        workspaces: &[u64],
        direct: bool,
        health: Arc<WorldHealth>,
    ) -> Result<Self> {
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
            direct,
            peers: Peers(peers),
            status,
            health,
        })
    }

    /// Where the ranks meet for a fused GEMM + ReduceScatter (`gemm.cu`'s `RsArgs`): their
    /// words at [`SCATTER_AT`] of each workspace. Only in a world of one process, where
    /// the kernel reaches every rank's output.
    pub(crate) fn scatter_links(&self) -> Option<ScatterLinks> {
        if !self.direct || self.world_size > SCATTER_MAX_RANKS {
            return None;
        }
        let mut links = ScatterLinks::default();
        for (q, &ws) in self.peers.0.iter().enumerate().take(self.world_size) {
            let at = ws + SCATTER_AT;
            links.slots[q] = at;
            links.ready[q] = at + 64;
            links.done[q] = at + 128;
        }
        let mine = self.peers.0[self.rank] + SCATTER_AT;
        links.calls = mine + 192;
        links.arrived = mine + 196;
        Some(links)
    }

    /// The kernels' control words: the wait status, the world's timeout, the layout.
    fn ctl(&self) -> Ctl {
        Ctl {
            status: self.status.status_ptr(),
            release: self.status.release_ptr(),
            timeout_ns: self.health.timeout().as_nanos().min(u128::from(u64::MAX)) as u64,
            data_offset: DATA_OFFSET as u64,
            half_bytes: PEER_MEMORY_REGION_BYTES as u64,
            usable_bytes: USABLE_BYTES as u64,
        }
    }

    /// Enqueues `call` on `stream` of `device`.
    pub(crate) fn launch(
        &self,
        device: &CudaDevice,
        stream: RawStream,
        call: PeerCall,
    ) -> Result<()> {
        let bytes = match call.kind {
            CommunicationKind::Allgather => call.elements * self.world_size,
            _ => call.elements,
        } * call.dtype.size_bytes();
        let (name, grid, block) = match call.kind {
            CommunicationKind::Allreduce => {
                let p = allreduce_plan(bytes, self.world_size, self.direct);
                (p.kernel, p.grid, p.block)
            }
            CommunicationKind::Allgather => ("peer_allgather", grid_for(bytes), BLOCK),
            CommunicationKind::ReduceScatter => ("peer_reduce_scatter", grid_for(bytes), BLOCK),
            other => {
                return Err(Error::Communication {
                    rank: self.rank,
                    reason: format!("{} does not run over peer memory", other.name()),
                })
            }
        };
        let mut input = call.input;
        let mut output = call.output;
        let mut n = call.elements as u64;
        let mut peers = self.peers;
        let mut rank = self.rank as i32;
        let mut world = self.world_size as i32;
        let mut ctl = self.ctl();
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
                (grid, block),
                stream,
                &mut args,
            )
        }
    }
}

impl PeerMemory {
    /// Whether the fused GEMM takes `call` (see `lower::gemm_allreduce_fits`; the caller
    /// checks the layouts).
    pub(crate) fn takes_gemm(&self, call: &GemmCall) -> bool {
        gemm_parts(call, self.world_size)
            .is_some_and(|parts| call.n / 64 * parts as usize <= MAX_GRID)
    }

    /// Enqueues the GEMM + Allreduce `call` on `stream` of `device`: one kernel, one block
    /// per 64 output columns.
    pub(crate) fn launch_gemm(
        &self,
        device: &CudaDevice,
        stream: RawStream,
        call: GemmCall,
    ) -> Result<()> {
        let Some(source) = gemm_source_for(call.dtype) else {
            return Err(Error::Communication {
                rank: self.rank,
                reason: format!(
                    "the GEMM + Allreduce kernel takes bf16 or f16, not {}",
                    call.dtype
                ),
            });
        };
        let parts = gemm_parts(&call, self.world_size).ok_or_else(|| Error::Communication {
            rank: self.rank,
            reason: format!(
                "the GEMM + Allreduce kernel does not take {} x {} x {} (lower::gemm_allreduce_parts)",
                call.m, call.k, call.n
            ),
        })?;
        let (name, tiles) = gemm_kernel_for(call.m, parts, self.world_size);
        let shared_bytes = GEMM_STAGES * (GEMM_STAGE_BYTES + tiles * GEMM_X_STAGE_BYTES_PER_TILE);
        let shared = device.shared();
        let f = device.kernels.static_function(
            shared,
            source,
            name,
            crate::backend::cuda::kernels::KernelNeeds {
                arch: None,
                shared_bytes,
            },
        )?;
        let (mut x, mut w, mut y, mut r) = (call.x, call.w, call.y, call.r);
        let (mut m, mut k, mut n) = (call.m as u64, call.k as u64, call.n as u64);
        let mut peers = self.peers;
        let mut rank = self.rank as i32;
        let mut world = self.world_size as i32;
        let mut ctl = self.ctl();
        let mut args: [*mut c_void; 11] = [
            (&mut x as *mut u64).cast(),
            (&mut w as *mut u64).cast(),
            (&mut y as *mut u64).cast(),
            (&mut r as *mut u64).cast(),
            (&mut m as *mut u64).cast(),
            (&mut k as *mut u64).cast(),
            (&mut n as *mut u64).cast(),
            (&mut peers as *mut Peers).cast(),
            (&mut rank as *mut i32).cast(),
            (&mut world as *mut i32).cast(),
            (&mut ctl as *mut Ctl).cast(),
        ];
        let grid = (call.n / 64) as u32 * parts as u32;
        // SAFETY: the arguments match the kernel's (X, W, Y, R, M, K, N, Peers, rank, world,
        // Ctl); the buffers belong to the call, which keeps them until its stream passes
        // them; the workspaces and status words live as long as the world.
        unsafe {
            device.kernels.launch_function(
                shared,
                (f, name),
                (grid, 128, shared_bytes),
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
    fn the_fused_gemm_takes_flags_beside_the_data_up_to_the_measured_rows() {
        assert_eq!(gemm_kernel_for(1, 1, 4).0, "peer_gemm_allreduce_ll_m16");
        assert_eq!(gemm_kernel_for(8, 1, 4).0, "peer_gemm_allreduce_ll_m16");
        assert_eq!(
            gemm_kernel_for(9, 1, 4),
            ("peer_gemm_allreduce_flag_m16", 1)
        );
        assert_eq!(gemm_kernel_for(16, 1, 2).0, "peer_gemm_allreduce_ll_m16");
        assert_eq!(
            gemm_kernel_for(32, 1, 2),
            ("peer_gemm_allreduce_flag_m32", 2)
        );
        assert_eq!(
            gemm_kernel_for(8, 2, 4),
            ("peer_gemm_allreduce_ll_m16_k2", 1)
        );
        assert!(gemm_source_for(DType::F32).is_none());
        assert!(gemm_source_for(DType::BF16)
            .is_some_and(|s| s.contains("peer_gemm_allreduce_flag_m32")));
    }

    #[test]
    fn small_allreduces_run_one_shot_and_larger_ones_two_shot() {
        let kernel = |bytes, world, direct| allreduce_plan(bytes, world, direct).kernel;
        assert_eq!(kernel(32 << 10, 4, true), "peer_allreduce_ll_at_once");
        assert_eq!(kernel(64 << 10, 8, false), "peer_allreduce_ll_at_once");
        assert_eq!(kernel(128 << 10, 4, true), "peer_allreduce_one_shot");
        assert_eq!(kernel(256 << 10, 4, true), "peer_allreduce_ll_two_shot");
        assert_eq!(kernel(1 << 20, 3, true), "peer_allreduce_ll_two_shot");
        assert_eq!(kernel(1 << 20, 8, false), "peer_allreduce_ll_two_shot");
        assert_eq!(kernel((1 << 20) + 8, 4, false), "peer_allreduce_two_shot");
        assert_eq!(kernel(4 << 20, 4, false), "peer_allreduce_two_shot");
        // Four ranks of one process: straight between the buffers from 512 KB to 16 MB.
        assert_eq!(kernel(512 << 10, 4, true), "peer_allreduce_direct");
        assert_eq!(kernel(4 << 20, 4, true), "peer_allreduce_direct");
        assert_eq!(kernel(16 << 20, 4, true), "peer_allreduce_direct");
        assert_eq!(kernel(64 << 20, 4, true), "peer_allreduce_two_shot");
        assert_eq!(kernel(4 << 20, 8, true), "peer_allreduce_two_shot");
        // Two ranks: flagged to 256 KB, one-shot to 4 MB (2 MB where the ranks reach
        // each other's buffers), then two shots, straight between the buffers where the
        // ranks reach them.
        assert_eq!(kernel(256 << 10, 2, false), "peer_allreduce_ll");
        assert_eq!(kernel(512 << 10, 2, false), "peer_allreduce_one_shot");
        assert_eq!(kernel(2 << 20, 2, true), "peer_allreduce_one_shot");
        assert_eq!(kernel(4 << 20, 2, false), "peer_allreduce_one_shot");
        assert_eq!(kernel(4 << 20, 2, true), "peer_allreduce_direct");
        assert_eq!(kernel(16 << 20, 2, true), "peer_allreduce_direct");
        assert_eq!(kernel(16 << 20, 2, false), "peer_allreduce_two_shot");
    }

    #[test]
    fn two_ranks_take_four_times_the_blocks_from_64_kb() {
        assert_eq!(allreduce_plan(32 << 10, 2, true).grid, 8);
        assert_eq!(allreduce_plan(64 << 10, 2, true).grid, 32);
        assert_eq!(allreduce_plan(1 << 20, 2, true).grid, 128);
        assert_eq!(allreduce_plan(64 << 10, 4, true).grid, 32);
        assert_eq!(allreduce_plan(4 << 10, 4, true).grid, 32);
        assert_eq!(allreduce_plan(32 << 10, 4, true).grid, 32);
        assert_eq!(allreduce_plan(4 << 20, 4, false).grid, 128);
    }

    #[test]
    fn small_flagged_allreduces_on_more_than_two_ranks_take_narrow_blocks() {
        let block = |bytes, world| allreduce_plan(bytes, world, true).block;
        assert_eq!(block(4 << 10, 4), 128);
        assert_eq!(block(32 << 10, 4), 128);
        assert_eq!(block(64 << 10, 4), 256);
        assert_eq!(block(128 << 10, 4), 512);
        assert_eq!(block(32 << 10, 2), 512);
        assert_eq!(block(4 << 20, 4), 512);
    }

    #[test]
    fn grids_grow_with_the_message() {
        assert_eq!(grid_for(4 << 10), 8);
        assert_eq!(grid_for(1 << 20), 32);
        assert_eq!(grid_for(64 << 20), 128);
    }

    #[test]
    fn a_two_shot_flagged_allreduce_fits_the_flagged_area_on_any_world() {
        for world in 3..=PEER_MEMORY_MAX_RANKS {
            let packets = (LL_TWO_SHOT_LIMIT / 8).div_ceil(world);
            assert!(
                2 * world * packets * 16 <= PEER_MEMORY_FLAGGED_BYTES,
                "{world} ranks"
            );
        }
    }

    #[test]
    fn the_direct_kernels_buffer_packets_fit_before_the_data() {
        let define = |name: &str| -> usize {
            let line = SOURCE
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("source.cu defines {name}"));
            line.split_whitespace().nth(2).unwrap().parse().unwrap()
        };
        let (at, blocks, ranks) = (define("BUFFERS_AT"), define("GMAX"), define("MAXR"));
        assert_eq!(blocks, MAX_GRID);
        assert_eq!(ranks, PEER_MEMORY_MAX_RANKS);
        // The u32 flags, epoch counters and call counters end before the packets begin.
        assert!((blocks * ranks + 2 * blocks) * 4 <= at * 8);
        // Two 16-byte packets per block and sending rank.
        assert!(at * 8 + 32 * blocks * ranks <= DATA_OFFSET);
        // The fused GEMM + ReduceScatter's words come after them, before the data.
        assert!(at * 8 + 32 * blocks * ranks <= SCATTER_AT as usize);
        assert!(SCATTER_AT as usize + 200 <= DATA_OFFSET);
    }

    #[test]
    fn every_dtype_gets_its_own_source() {
        assert!(source_for(DType::BF16).starts_with("#define DT_BF16\n"));
        assert!(source_for(DType::F32).contains("peer_allreduce_two_shot"));
        assert_ne!(source_for(DType::F16), source_for(DType::BF16));
    }
}
