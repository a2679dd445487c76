//! Communicators: collectives and point-to-point transfers between the ranks of a world.
//!
//! One trait for every transport: the in-process communicator of the CPU backend (here,
//! `local/`, and over TCP between processes, `remote/`) and the CUDA communicator (NCCL
//! and copy-engine peer copies, `backend::cuda::comm`). Calls enqueue on the given stream;
//! the evaluator orders streams itself. What a communicator can do beyond its operations
//! is one question, [`Communicator::capabilities`].
//!
//! ## Shapes (per rank; axes index the tensors' stored axes)
//!
//! With `D = comm.mesh.len()`, mesh index `r` of a device, `a = in_sharded_axis`,
//! `s = in_scatter_axis`, `o = out_sharded_axis`:
//!
//! | kind | input (contributors) | output (receivers) |
//! | --- | --- | --- |
//! | Allgather | size 1 at `a` | size D at `o`: block `r` is member `r`'s input |
//! | Gather | size 1 at `a` (mesh members) | root: like Allgather |
//! | Allreduce | size 1 at `a` | input without `a`, reduced over members |
//! | Reduce | size 1 at `a` (mesh members) | root: like Allreduce |
//! | ReduceScatter | size 1 at `a`, size D at `s` | reduced, without `a`, size 1 at `o`: block `r` |
//! | Scatter | root: size D at `s` | size 1 at `o`: block `r` of root's input |
//! | Broadcast | root | a copy of root's input |
//! | SendRecv | root (the sender) | `receiver`: a copy of the sender's input |

mod capabilities;
pub mod local;
pub mod remote;

pub use capabilities::{is_peer_copy, Capabilities, KeptReceives, PeerCopies};

use fusion_compiler::hir::{Communication, CopyStreams, Transport};

use crate::device::{ScatterLinks, StreamHandle};
use crate::error::Result;
use crate::tensor::Tensor;

/// Copy-engine transfer events alive in this process (CUDA worlds; 0 elsewhere, and in a
/// build without the `cuda` feature): a soak checks that the count stays flat.
pub fn copy_engine_events_alive() -> usize {
    crate::counters::transfer_events_alive()
}

/// A tensor's values in row-major order, as f32, with its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    /// The tensor's shape.
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub data: Vec<f32>,
}

/// What a communicator is told at the start of each call of a host program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallStart {
    /// The program and the shapes of the call's inputs, hashed: the same on every rank of
    /// an SPMD call, and another value whenever the receive buffers could differ. `None`
    /// keeps nothing from one call to the next.
    pub identity: Option<u64>,
    /// The call is run again after a failed capture (nothing of the first attempt ran):
    /// the transfers are numbered from the start again, as the same call.
    pub rerun: bool,
    /// Which copy streams the call's copy-engine transfers run on (the program's
    /// [`fusion_compiler::hir::HostProgram::copy_streams`]).
    pub copy_streams: CopyStreams,
}

/// A rank's endpoint to the other ranks of its world.
pub trait Communicator: Send + Sync {
    /// This rank's index in the world.
    fn rank(&self) -> usize;
    /// Number of ranks in the world.
    fn world_size(&self) -> usize;
    /// Runs `comm` (see the module table). `input` is `None` when this rank contributes no
    /// data (e.g. a non-root of a Broadcast), `output` when it receives none. Ranks outside
    /// `comm.team` never call.
    fn collective(
        &self,
        stream: StreamHandle,
        comm: &Communication,
        input: Option<&Tensor>,
        output: Option<&Tensor>,
    ) -> Result<()>;
    /// Runs `comm`, an Allreduce of the product `operands[0] @ operands[1]`, as one kernel
    /// whose GEMM's epilogue exchanges the product's tiles (`Node::GemmAllreduce`), writing
    /// `output` (plus `residual`, shaped like it, where given: the sum rounded first).
    /// False when this communicator has no such kernel or the operands do not fit it (then
    /// the caller runs the GEMM, then [`Communicator::collective`], then the add).
    fn gemm_allreduce(
        &self,
        _stream: StreamHandle,
        _comm: &Communication,
        _operands: [&Tensor; 2],
        _residual: Option<&Tensor>,
        _output: &Tensor,
    ) -> Result<bool> {
        Ok(false)
    }
    /// Where this rank meets its peers for a fused GEMM + ReduceScatter
    /// ([`crate::device::Device::launch_scattered_gemm`]): `Some` only in a world whose
    /// ranks all run in this process, with peer access to each other's memory.
    fn scatter_links(&self) -> Option<ScatterLinks> {
        None
    }
    /// Sends `buf` to `peer` over `transport`, the one the program names (lowered onto
    /// what the world has, [`Capabilities::lowering`]; a communicator carries it out and
    /// does not pick another). In a group, the transfer may only be issued at `group_end`.
    /// Messages between a pair arrive in send order.
    fn send(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()>;
    /// Receives from `peer` into `buf` over `transport`.
    fn recv(
        &self,
        stream: StreamHandle,
        peer: usize,
        buf: &Tensor,
        transport: Transport,
    ) -> Result<()>;
    /// Starts a group: sends and receives until `group_end` are issued together.
    fn group_start(&self) -> Result<()>;
    /// Ends a group, issuing its transfers.
    fn group_end(&self) -> Result<()>;
    /// Marks the world as failed by this rank, so peers stop waiting with an error.
    fn abort(&self, reason: &str);
    /// Marks the world as failed because of rank `failed_rank` (this rank failed because
    /// of it), so every peer names the root cause rather than this rank.
    fn abort_for(&self, failed_rank: usize, reason: &str);
    /// This rank's part of recovering a failed world in place: every rank of the world
    /// calls it (each from its own thread or process, with no call in flight); when all
    /// have, the failure and everything in flight are forgotten and the communicator
    /// numbers its transfers from the start again. An error when this communicator cannot
    /// recover (the world stays failed).
    fn recover(&self) -> Result<()>;
    /// Host-side allgather of small integer vectors among all ranks of the world (call
    /// metadata such as extents); returns every rank's vector in rank order. Every rank
    /// must call it at the same point of its program.
    fn exchange(&self, values: &[i64]) -> Result<Vec<Vec<i64>>>;
    /// Host-side allgather of one block per rank (every rank calls it at the same point);
    /// returns every rank's block in rank order.
    fn host_allgather(&self, block: Block) -> Result<Vec<Block>>;
    /// What this communicator can do ([`Capabilities`]): decided when it was made, asked
    /// by the executor, the evaluator and replay instead of naming transports.
    fn capabilities(&self) -> &Capabilities;
    /// What the communicator does around a call (numbering transfers per call, graphs
    /// launched, naming the next transfer for a timeout), where it keeps state from call to
    /// call (CUDA); `None` for one that keeps none. Callers use the methods of
    /// `dyn Communicator` of the same names, which answer for communicators without it.
    fn lifecycle(&self) -> Option<&dyn CommLifecycle> {
        None
    }
}

/// The call life cycle of a communicator that numbers its transfers per call, replays
/// graphs and names the transfer a timed-out wait was for (the CUDA communicator).
pub trait CommLifecycle: Send + Sync {
    /// A call of a host program starts: transfers are numbered per call from here.
    fn begin_call(&self, call: &CallStart) -> Result<()>;
    /// A device graph of this rank was just launched on its main stream: communicators
    /// whose calls outside graphs must not overlap a running graph (NCCL without
    /// graph-mixing support) remember it.
    fn graph_launched(&self) -> Result<()>;
    /// Says what the next [`Communicator::send`] or [`Communicator::recv`] is in the
    /// program (e.g. the P2P receive of a tensor in a stream-loop iteration), so that a
    /// wait for it that times out can say so. `what` is only called when it is kept.
    fn describe_next_transfer(&self, what: &dyn Fn() -> String);
    /// A number no other communicator of this process has (graphs captured with one
    /// communicator are never replayed with another).
    fn instance(&self) -> u64;
}

/// The life cycle's steps for any communicator: one without [`CommLifecycle`] keeps nothing
/// from call to call, and its instance number is 0.
impl dyn Communicator + '_ {
    /// [`CommLifecycle::begin_call`], or nothing.
    pub fn begin_call(&self, call: &CallStart) -> Result<()> {
        self.lifecycle().map_or(Ok(()), |l| l.begin_call(call))
    }

    /// [`CommLifecycle::graph_launched`], or nothing.
    pub fn graph_launched(&self) -> Result<()> {
        self.lifecycle().map_or(Ok(()), |l| l.graph_launched())
    }

    /// [`CommLifecycle::describe_next_transfer`], or nothing.
    pub fn describe_next_transfer(&self, what: &dyn Fn() -> String) {
        if let Some(l) = self.lifecycle() {
            l.describe_next_transfer(what);
        }
    }

    /// [`CommLifecycle::instance`], or 0.
    pub fn instance(&self) -> u64 {
        self.lifecycle().map_or(0, |l| l.instance())
    }
}

/// A fresh [`CommLifecycle::instance`] number.
#[cfg(feature = "cuda")]
pub(crate) fn next_instance() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}
