//! What the evaluator needs from a device: the [`Device`] trait, below every backend.
//!
//! A [`Device`] allocates tensors, owns a pool of streams, orders streams against each
//! other with events, and runs a small set of [`Kernel`]s. The evaluator lowers every
//! compute node of a host program to these kernels, so a backend implements only them.
//! The backends themselves (`backend::cpu`, `backend::cuda`) sit above the worlds that
//! hold their devices; the evaluator, the worlds and the communicators know devices only
//! through this trait.

use fusion_compiler::ir::{EpilogueAux, ReduceOp, UnaryOp};
use fusion_compiler::DType;

use crate::error::Result;
pub use crate::fused_programs::{PointwiseInstr, PointwiseProgram, RowInstr, RowPass, RowProgram};
pub use crate::streams::StreamHandle;
use crate::tensor::Tensor;

/// Which kind of backend a device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Simulated devices: threads of this process, host memory.
    Cpu,
    /// NVIDIA GPUs through CUDA.
    Cuda,
}

impl BackendKind {
    /// Whether devices of this backend record calls as graphs to replay (`crate::replay`).
    pub fn records_graphs(self) -> bool {
        self == BackendKind::Cuda
    }

    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// The caller's stream of a call (`Rank::on`): a CUDA stream handle, and for the per-thread
/// default stream, whose handle means another stream on each thread, the calling thread.
/// It keeps the caller's stream object alive (a cudarc `CudaStream`) for as long as the
/// device may still order work after it (buffers handed out on it, kept outputs, the join
/// the device's streams owe it). Equal when the stream is.
#[derive(Clone)]
pub struct CallerStream {
    /// The raw `CUstream`.
    pub(crate) raw: usize,
    /// The thread whose per-thread default stream it is (`None` for every other stream).
    pub(crate) thread: Option<std::thread::ThreadId>,
    /// The stream's owner, kept alive (never read: holding it is the point; `None` for
    /// streams that are never destroyed).
    pub(crate) _keep: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

impl std::fmt::Debug for CallerStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CallerStream({:#x}, {:?})", self.raw, self.thread)
    }
}

impl PartialEq for CallerStream {
    fn eq(&self, other: &Self) -> bool {
        (self.raw, self.thread) == (other.raw, other.thread)
    }
}

impl Eq for CallerStream {}

/// Which engine runs a device's GEMMs ([`Kernel::Gemm`]), chosen per call
/// (`ExecOptions::gemm`). A choice among CUDA GEMMs: the CPU backend has one and ignores it.
/// With either engine, a product multiplied by an activation's derivative at an auxiliary
/// matrix ([`Kernel::GemmAux`], a backward's `dY W^T * act'(H)`) runs on the persistent
/// kernel where it applies (Hopper, bf16/f16): faster than cuBLASLt's fused form.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GemmEngine {
    /// cuBLASLt from cached plans, else cuBLAS (the default).
    #[default]
    Cublas,
    /// The runtime's persistent GEMM for Hopper GPUs (compute capability 9.0) where it
    /// applies: bf16 or f16 operands and output of one dtype, row-major or transposed
    /// operands, no bias or epilogue other than an activation's derivative, accumulation
    /// in place or from an addend; cuBLAS(Lt) for every other GEMM.
    Persistent,
}

/// Memory of one device, for soak runs and reports (bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// The device's memory.
    pub total: usize,
    /// In use on the device by every process (`total - free` of `cuMemGetInfo`).
    pub used: usize,
    /// Allocated from this process's stream-ordered pool and not freed.
    pub pool_used: usize,
    /// Held by the pool (freed memory stays reserved for reuse).
    pub pool_reserved: usize,
}

/// The operations a backend executes on a stream.
#[derive(Clone, Copy, Debug)]
pub enum Kernel<'a> {
    /// `dst = src` elementwise (same shape; dtypes may differ).
    Copy {
        /// What is read.
        src: &'a Tensor,
        /// What is written.
        dst: &'a Tensor,
    },
    /// A fused elementwise program.
    Pointwise(&'a PointwiseProgram),
    /// Elementwise ops and reductions over each row of the iteration shape, fused.
    Rows(&'a RowProgram),
    /// `dst` = `src` reduced over `axes` (dst's shape is src's without those axes).
    Reduce {
        /// Sum or max.
        op: ReduceOp,
        /// What is reduced.
        src: &'a Tensor,
        /// The result.
        dst: &'a Tensor,
        /// The axes of `src` reduced away.
        axes: &'a [usize],
    },
    /// Batched `dst = epilogue(a @ b (+ bias))`: a `[B.., M, K]`, b `[B.., K, N]`, dst
    /// `[B.., M, N]`, bias `[N]`; all of one rank >= 2, batch axes already broadcast
    /// (stride 0), any strides. Accumulates in f32; the bias and then the `epilogue`
    /// functions apply to the f32 result, which is rounded once, to `dst`'s dtype (which
    /// may differ from the operands'). With `accumulate`, `dst = dst + a @ b` (no bias, no
    /// epilogue): the GEMM epilogue adds what `dst` holds, so a running sum needs no
    /// separate kernel; with an `addend` as well, `dst = addend + a @ b` (out of place: a
    /// sum that arrived in one buffer is finished into another).
    Gemm {
        /// The left operand, `[B.., M, K]`.
        a: &'a Tensor,
        /// The right operand, `[B.., K, N]`.
        b: &'a Tensor,
        /// Added to every row, `[N]`.
        bias: Option<&'a Tensor>,
        /// `dst = dst + a @ b`.
        accumulate: bool,
        /// With `accumulate`: what is added, when it is not `dst` itself (`[B.., M, N]`,
        /// `dst`'s dtype; the same view as `dst`, or memory apart from it).
        addend: Option<&'a Tensor>,
        /// Elementwise ops applied to the product before it is stored (in f32, rounded
        /// once): a fused epilogue.
        epilogue: &'a [UnaryOp],
        /// The result, `[B.., M, N]`.
        dst: &'a Tensor,
    },
    /// [`Kernel::Gemm`] without accumulation, with an auxiliary matrix `aux` of `dst`'s
    /// shape (any strides and dtype): with [`EpilogueAux::PreActivation`] the f32 result
    /// after the bias is also stored into `aux` (rounded once, to its dtype) before the
    /// `epilogue` functions apply; with [`EpilogueAux::Derivative`] the result after them
    /// is multiplied by that op at `aux`'s values (cuBLASLt's `GELU_AUX` and `DGELU`).
    GemmAux {
        /// The left operand, `[B.., M, K]`.
        a: &'a Tensor,
        /// The right operand, `[B.., K, N]`.
        b: &'a Tensor,
        /// Added to every row, `[N]`.
        bias: Option<&'a Tensor>,
        /// Elementwise ops applied to the product before it is stored.
        epilogue: &'a [UnaryOp],
        /// The auxiliary matrix, `[B.., M, N]`.
        aux: &'a Tensor,
        /// Whether `aux` is written (the pre-activation) or read (a derivative's input).
        mode: EpilogueAux,
        /// The result, `[B.., M, N]`.
        dst: &'a Tensor,
    },
}

/// The operands of a [`Kernel::Gemm`] or [`Kernel::GemmAux`], as one struct for the
/// backends (the fields as there; `aux` with its mode).
#[derive(Clone, Copy)]
pub(crate) struct GemmOperands<'a> {
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    pub accumulate: bool,
    /// With `accumulate`: what is added when it is not `dst`.
    pub addend: Option<&'a Tensor>,
    pub epilogue: &'a [UnaryOp],
    pub aux: Option<(&'a Tensor, EpilogueAux)>,
    pub dst: &'a Tensor,
}

impl<'a> Kernel<'a> {
    /// The GEMM's operands; `None` for a kernel that is not a GEMM.
    pub(crate) fn gemm_operands(self) -> Option<GemmOperands<'a>> {
        match self {
            Kernel::Gemm {
                a,
                b,
                bias,
                accumulate,
                addend,
                epilogue,
                dst,
            } => Some(GemmOperands {
                a,
                b,
                bias,
                accumulate,
                addend,
                epilogue,
                aux: None,
                dst,
            }),
            Kernel::GemmAux {
                a,
                b,
                bias,
                epilogue,
                aux,
                mode,
                dst,
            } => Some(GemmOperands {
                a,
                b,
                bias,
                accumulate: false,
                addend: None,
                epilogue,
                aux: Some((aux, mode)),
                dst,
            }),
            _ => None,
        }
    }
}

/// What an accumulating [`Kernel::Gemm`] adds: `addend`, else `dst` itself; `None` when it
/// does not accumulate. An `addend` without `accumulate`, or of another shape or dtype than
/// `dst`, is an error.
pub(crate) fn gemm_addend<'a>(
    accumulate: bool,
    addend: Option<&'a Tensor>,
    dst: &'a Tensor,
) -> Result<Option<&'a Tensor>> {
    let Some(c) = addend else {
        return Ok(accumulate.then_some(dst));
    };
    let reason = if !accumulate {
        "gemm: an addend needs accumulate".to_string()
    } else if c.shape() != dst.shape() || c.dtype() != dst.dtype() {
        format!(
            "gemm: the addend {} {:?} must have dst's dtype and shape, {} {:?}",
            c.dtype(),
            c.shape(),
            dst.dtype(),
            dst.shape()
        )
    } else {
        return Ok(Some(c));
    };
    Err(crate::error::Error::Backend {
        backend: "gemm",
        reason,
    })
}

/// How far one tensor is from another ([`Device::discrepancy`]): two sums over their
/// elements, in f64, from which the relative Frobenius error follows. A device computes
/// them where the tensors live, so only the two sums reach the host (plan tuning compares
/// every candidate's outputs with the reference candidate's this way).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Discrepancy {
    /// `sum((got - want)^2)`: NaN or infinite when an element of either is not finite.
    pub squared_error: f64,
    /// `sum(want^2)`.
    pub squared_reference: f64,
}

impl Discrepancy {
    /// `‖got − want‖ / ‖want‖` (`‖got − want‖` where `want` is all zeros), infinite where an
    /// element is not finite: what [`Tensor::rel_error`] gives for the same tensors.
    pub fn relative(&self) -> f64 {
        let (err, reference) = (self.squared_error, self.squared_reference);
        if !err.is_finite() || !reference.is_finite() {
            f64::INFINITY
        } else if reference == 0.0 {
            err.sqrt()
        } else {
            (err / reference).sqrt()
        }
    }

    /// The sums for host tensors `got` and `want` of one shape (any dtypes and strides),
    /// element by element in row-major order: the CPU backend's, and a device's for
    /// tensors that are not its own.
    pub fn of_host(got: &Tensor, want: &Tensor) -> Result<Discrepancy> {
        check_same_shape(got, want)?;
        let (a, b) = (got.to_f32_vec()?, want.to_f32_vec()?);
        let mut sums = Discrepancy::default();
        for (&x, &y) in a.iter().zip(&b) {
            let (x, y) = (f64::from(x), f64::from(y));
            sums.squared_error += (x - y) * (x - y);
            sums.squared_reference += y * y;
        }
        Ok(sums)
    }

    /// The sums of two parts of one comparison added (a device's per-block partial sums).
    pub fn plus(self, other: Discrepancy) -> Discrepancy {
        Discrepancy {
            squared_error: self.squared_error + other.squared_error,
            squared_reference: self.squared_reference + other.squared_reference,
        }
    }
}

/// An error unless `got` and `want` have one shape (what [`Device::discrepancy`] compares).
pub(crate) fn check_same_shape(got: &Tensor, want: &Tensor) -> Result<()> {
    if got.shape() == want.shape() {
        return Ok(());
    }
    Err(crate::error::Error::Tensor(format!(
        "discrepancy: shapes {:?} and {:?} differ",
        got.shape(),
        want.shape()
    )))
}

/// Bytes of a capture arena for `count` buffers of `bytes` in all (alignment included).
pub fn capture_arena_bytes(bytes: usize, count: usize) -> usize {
    bytes + count * CAPTURE_ARENA_ALIGN
}

/// Alignment of the buffers of a capture arena (the stream-ordered allocator's).
pub const CAPTURE_ARENA_ALIGN: usize = 256;

/// Buffers a device handed out, whoever asked: the evaluator for a program's tensors, a
/// kernel for its scratch, a transport for its staging ([`CallerCapture::handed_out`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HandedOut {
    /// How many buffers.
    pub buffers: usize,
    /// Their bytes, in all.
    pub bytes: usize,
}

impl HandedOut {
    /// What was handed out between the reading `earlier` and this one (of one device).
    pub fn since(self, earlier: HandedOut) -> HandedOut {
        HandedOut {
            buffers: self.buffers.wrapping_sub(earlier.buffers),
            bytes: self.bytes.wrapping_sub(earlier.bytes),
        }
    }
}

/// A call recorded on a device that can be replayed with one launch (a CUDA graph).
pub trait DeviceGraph: Send + Sync {
    /// Launches the recorded work on the device's main stream, or on the caller's stream
    /// `on` (see [`DeviceLifecycle::begin_replay`]).
    fn launch(&self, on: Option<&CallerStream>) -> Result<()>;
    /// Number of operations recorded.
    fn nodes(&self) -> usize;
    /// Writes the graph's topology to `path` (the driver's dot format), for
    /// `ExecOptions::graph_dot_dir`.
    fn write_dot(&self, path: &std::path::Path) -> Result<()>;
    /// Device memory the graph keeps for itself while it lives (its capture arena, or the
    /// buffers its capture allocated as its own), which bounds how many graphs a program
    /// keeps.
    fn retained_bytes(&self) -> usize {
        0
    }
}

/// The answer of a backend without streams to a call on a caller's stream.
fn no_caller_streams(kind: BackendKind, on: Option<&CallerStream>) -> Result<()> {
    match on {
        None => Ok(()),
        Some(_) => Err(crate::error::Error::Backend {
            backend: kind.name(),
            reason: "this backend has no streams: call it without a CUDA stream".into(),
        }),
    }
}

/// A device as the evaluator sees it: what every backend implements. Methods are called by
/// one call of the rank at a time (from whichever thread holds the rank's call). What a
/// device with streams shared with its caller and graphs to replay does around a call is
/// the optional [`DeviceLifecycle`] ([`Device::lifecycle`]).
pub trait Device: Send + Sync {
    /// The backend kind.
    fn kind(&self) -> BackendKind;
    /// The device ordinal (the rank on a local world).
    fn ordinal(&self) -> usize;
    /// Makes sure the worker pool has at least `n` streams.
    fn ensure_streams(&self, n: usize) -> Result<()>;
    /// A new uninitialized contiguous tensor, ordered on `stream`.
    fn allocate(&self, stream: StreamHandle, dtype: DType, shape: &[usize]) -> Result<Tensor>;
    /// `waiter` waits for the work enqueued so far on `waitee` (no host blocking).
    fn stream_wait(&self, waiter: StreamHandle, waitee: StreamHandle) -> Result<()>;
    /// Enqueues `kernel` on `stream`.
    fn execute(&self, stream: StreamHandle, kernel: Kernel<'_>) -> Result<()>;
    /// Copies a host tensor to this device (a no-op clone on the CPU backend).
    fn upload(&self, t: &Tensor) -> Result<Tensor>;
    /// Copies a tensor of this device to the host (waits for it).
    fn download(&self, t: &Tensor) -> Result<Tensor>;
    /// Blocks the host until all streams are idle.
    fn synchronize(&self) -> Result<()>;
    /// Records a timing marker on `stream` (for traces); returns its id.
    fn record_marker(&self, stream: StreamHandle) -> Result<usize>;
    /// Records a timing marker on the stream that a call given the caller's stream `on`
    /// ends on: `on`, or the main stream. Markers around back-to-back calls time them on
    /// the device (plan tuning); on the CPU backend, which runs each kernel as it is
    /// enqueued, a marker is the host's time.
    fn record_call_marker(&self, on: Option<&CallerStream>) -> Result<usize> {
        no_caller_streams(self.kind(), on)?;
        self.record_marker(0)
    }
    /// Milliseconds from marker `start` to marker `end` (waits for both).
    fn marker_elapsed_ms(&self, start: usize, end: usize) -> Result<f64>;
    /// Forgets every marker (call after reading a trace).
    fn clear_markers(&self);
    /// The [`Discrepancy`] of `got` from `want`, tensors of this device of one shape (any
    /// dtypes and strides), summed where they live: only the two sums come back to the
    /// host. Waits for the device (the tensors' producers on the main stream come first).
    fn discrepancy(&self, got: &Tensor, want: &Tensor) -> Result<Discrepancy>;
    /// Fills every later allocation with NaN bytes (`on`), so outputs a program forgets to
    /// write show up in tests ([`crate::World::poison_allocations`]).
    fn set_poison(&self, on: bool);
    /// Runs the GEMMs enqueued from now on with `engine` (each call sets its own, from its
    /// options). A device with one GEMM ignores it (the default).
    fn set_gemm_engine(&self, engine: GemmEngine) {
        let _ = engine;
    }
    /// The device's memory in use, where the backend can tell (`None` where its memory is
    /// the process's).
    fn memory(&self) -> Result<Option<DeviceMemory>>;
    /// This device as `Any`, for the API of one backend (the CUDA backend's
    /// `Rank::cuda_context` and tensors over cudarc buffers find their device this way).
    fn as_any(&self) -> &dyn std::any::Any;
    /// True when `t` lives where this device's kernels can read it.
    fn is_resident(&self, t: &Tensor) -> bool;
    /// What the device does around a call, where its streams are shared with the caller and
    /// calls can be recorded as graphs (CUDA); `None` for a device that runs each kernel as
    /// it is enqueued (the CPU). Callers use the methods of `dyn Device` of the same names,
    /// which answer for devices without it.
    fn lifecycle(&self) -> Option<&dyn DeviceLifecycle> {
        None
    }
    /// What the device is, for keys of measurements that hold only on the same hardware
    /// (the plan file): the GPU's name, or the backend's.
    fn model(&self) -> String {
        self.kind().name().to_string()
    }
    /// Whether programs for this device may hold fused AllGather+GEMMs
    /// (`LowerOptions::pipelines.gathered_gemm`) when its calls run their GEMMs on
    /// `engine`: where it runs them as one kernel, or computes them at their join (the CPU
    /// backend, so that every test checks the fused programs). No by default.
    fn runs_gathered_gemm(&self, engine: GemmEngine) -> bool {
        let _ = engine;
        false
    }
    /// Launches `call` on `stream` as one kernel where the device has one for it
    /// (`Ok(true)`); `Ok(false)`: the evaluator runs the GEMM at its join (the default).
    fn launch_gathered_gemm(
        &self,
        stream: StreamHandle,
        call: &GatheredGemmCall<'_>,
    ) -> Result<bool> {
        let _ = (stream, call);
        Ok(false)
    }
    /// Whether programs for this device may hold fused GEMM + ReduceScatters
    /// (`LowerOptions::pipelines.scattered_gemm`): where the device runs them as one kernel
    /// (given a world whose ranks reach each other's memory), or runs the GEMM, then the
    /// ReduceScatter (the CPU backend, so that every test checks the fused programs). No by
    /// default.
    fn runs_scattered_gemm(&self) -> bool {
        false
    }
    /// Launches `call` on `stream` as one kernel that adds each tile of the product into
    /// its owner's output over `links` (`Ok(true)`); `Ok(false)` where the device has no
    /// such kernel or the call does not fit it (the evaluator runs the GEMM, then the
    /// ReduceScatter).
    fn launch_scattered_gemm(
        &self,
        stream: StreamHandle,
        call: &ScatteredGemmCall<'_>,
        links: &ScatterLinks,
    ) -> Result<bool> {
        let _ = (stream, call, links);
        Ok(false)
    }
    /// On `stream`: ready word `word` (`block * pieces + piece`, see
    /// [`GatheredGemmCall::pieces`]) of the gathered GEMM `id` this device launched: those
    /// rows have landed (the kernel may read them from now on).
    fn gathered_rows_ready(&self, stream: StreamHandle, id: usize, word: usize) -> Result<()> {
        let _ = (stream, id, word);
        Err(crate::error::Error::Internal(
            "rows ready for a gathered GEMM the device did not launch".into(),
        ))
    }
}

/// A fused AllGather+GEMM (`Node::GatheredGemmLaunch`) as a device launches it:
/// `output = gathered @ b`, axis 0 of `gathered` and `output` one block per rank, this
/// rank's block of rows read from `own` (its block of `gathered` is never written).
#[derive(Clone, Copy, Debug)]
pub struct GatheredGemmCall<'a> {
    /// Its id in the program (the device keeps its ready words per id).
    pub id: usize,
    /// `[world, .., rows, K]`: the peers' blocks land here while the GEMM runs.
    pub gathered: &'a Tensor,
    /// `[.., rows, K]`: this rank's rows.
    pub own: &'a Tensor,
    /// `[.., K, N]`, the same for every block.
    pub b: &'a Tensor,
    /// `[world, .., rows, N]`.
    pub output: &'a Tensor,
    /// This rank (its block is `own`).
    pub rank: usize,
    /// The ranks, one block each.
    pub world: usize,
    /// Row ranges per block, each with its own ready word (1: whole blocks).
    pub pieces: usize,
    /// `[N]`: added to every row of the product, in f32 before the activation.
    pub bias: Option<&'a Tensor>,
    /// Applied after the bias, in f32, before the product's one rounding.
    pub activation: Option<UnaryOp>,
    /// `[.., K, N]` like `b`: the product is gated, `activation(rows @ b) * (rows @ up)`
    /// (the gated MLP's gate and up weights; no bias).
    pub up: Option<&'a Tensor>,
    /// `[world, .., rows, N]` like `output`: the epilogue's auxiliary matrix, written with
    /// the pre-activation ([`EpilogueAux::PreActivation`]) or read for a derivative that
    /// multiplies the result ([`EpilogueAux::Derivative`]). Not with `up`.
    pub aux: Option<(&'a Tensor, EpilogueAux)>,
}

/// A fused GEMM + ReduceScatter (`Node::GemmReduceScatter`) as a device launches it:
/// rank `rank` of `world` computes its partial product `a @ b` (`[m, k] @ [k, n]`) and the
/// sum over ranks of rows `[rank m / world, (rank + 1) m / world)` lands in `output`.
#[derive(Clone, Copy, Debug)]
pub struct ScatteredGemmCall<'a> {
    /// `[m, k]`: this rank's columns of A.
    pub a: &'a Tensor,
    /// `[k, n]`: this rank's rows of B.
    pub b: &'a Tensor,
    /// `[m / world, n]`: this rank's rows of the sum.
    pub output: &'a Tensor,
    /// This rank.
    pub rank: usize,
    /// The ranks, one row block each.
    pub world: usize,
}

/// Where the ranks of a world meet for a fused GEMM + ReduceScatter: device addresses,
/// as mapped on this rank, of every rank's words in its peer-memory workspace (a world
/// whose ranks reach each other's memory hands them out:
/// [`crate::comm::Communicator::scatter_links`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScatterLinks {
    /// Per rank: its output-address slot (u64 address, u32 epoch).
    pub slots: [u64; SCATTER_MAX_RANKS],
    /// Per rank: its u32 `ready` counters, one per source rank.
    pub ready: [u64; SCATTER_MAX_RANKS],
    /// Per rank: its u32 `done` counters, one per source rank.
    pub done: [u64; SCATTER_MAX_RANKS],
    /// This rank's u32 count of calls so far.
    pub calls: u64,
    /// This rank's u32 count of a call's blocks past their last wait.
    pub arrived: u64,
}

/// The most ranks a fused GEMM + ReduceScatter spans (`MAXR` of the kernel).
pub const SCATTER_MAX_RANKS: usize = 8;

/// The call life cycle of a device with streams (CUDA): the thread that drives it, memory
/// other processes write into, the caller's stream at both ends of a walk or a replay,
/// outputs handed out on that stream, and recording a call as a graph.
pub trait DeviceLifecycle: Send + Sync {
    /// Prepares the calling thread to drive this device (makes its CUDA context current).
    fn bind_thread(&self) -> Result<()>;
    /// Like [`Device::allocate`], for a buffer that devices of other processes write into
    /// (a copy-engine receive buffer): on GPUs of a launched world it comes from memory
    /// that peers map once.
    fn allocate_shared(
        &self,
        stream: StreamHandle,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor>;
    /// A call that walks its program (eagerly, or capturing it) starts: with the caller's
    /// stream `on`, the main stream waits for the work enqueued there so far. Without one,
    /// the main stream is ordered after earlier calls' replays on callers' streams.
    fn begin_walk(&self, on: Option<&CallerStream>) -> Result<()>;
    /// The walk of [`DeviceLifecycle::begin_walk`] is done: the caller's stream `on` waits
    /// for the main stream, so the caller's next work sees the outputs.
    fn end_walk(&self, on: Option<&CallerStream>) -> Result<()>;
    /// A replayed call is about to launch its graph (on the caller's stream `on`, or the
    /// main stream): the launch stream is ordered after the device's earlier work it has
    /// not waited for yet (nothing to do when the previous call ran on the same stream).
    fn begin_replay(&self, on: Option<&CallerStream>) -> Result<()>;
    /// The graph was launched on `on`: later work of the device on its own streams (frees,
    /// walks, downloads) is ordered after it.
    fn end_replay(&self, on: Option<&CallerStream>) -> Result<()>;
    /// A call on the caller's stream `on` hands out `outputs`: buffers of them that the
    /// device frees later first wait for that stream, where the caller's work may still
    /// read them.
    fn hand_out(&self, outputs: &[Tensor], on: Option<&CallerStream>);
    /// Starts recording the calling thread's work on the main stream instead of running
    /// it (see `crate::replay`). With `arena_bytes` above 0, the buffers the recorded
    /// work allocates come from memory of that size set aside for the graph, so that the
    /// graph holds no allocation nodes (cheaper launches).
    fn begin_capture(&self, arena_bytes: usize) -> Result<()>;
    /// Ends the recording that [`DeviceLifecycle::begin_capture`] started and returns the
    /// graph.
    fn end_capture(&self) -> Result<Box<dyn DeviceGraph>>;
    /// Recording calls into a graph the caller is capturing on its own stream, where the
    /// device can ([`CallerCapture`]); `None` (the default) refuses such calls.
    fn caller_capture(&self) -> Option<&dyn CallerCapture> {
        None
    }
}

/// Recording a call into a graph the caller is capturing on its stream (`Rank::on` with a
/// stream in capture): the call's program is captured on the device's streams as a graph
/// of its own, which is added to the caller's capture and lives as long as the caller's
/// graph.
pub trait CallerCapture: Send + Sync {
    /// Whether `on` is being captured into a graph of the caller's now.
    fn capturing(&self, on: &CallerStream) -> bool;
    /// Lets the calling thread use the device's own streams (allocate, capture, wait)
    /// while the caller's capture goes on (`true`, before a recording), or gives the
    /// caller's capture its own rules back (`false`, after it). A caller capturing in
    /// global or thread-local mode forbids those calls on its thread otherwise.
    fn relax_capture(&self, relaxed: bool) -> Result<()>;
    /// Starts recording the calling thread's work on the device's streams for the capture
    /// on `on`; the buffers the recorded work allocates come from `arena_bytes` set aside
    /// now (the caller's graph must hold no allocation of its own).
    fn begin_recording(&self, on: &CallerStream, arena_bytes: usize) -> Result<()>;
    /// Ends the recording of [`CallerCapture::begin_recording`]. With `keep`, adds it to the
    /// capture on `on` (after the work captured there so far; the caller's next work there
    /// comes after it) and keeps `keep`, and the memory the recording uses, alive as long
    /// as the caller's graph; returns the number of nodes added. Without `keep` (the walk
    /// failed), the recording is thrown away.
    fn end_recording(&self, on: &CallerStream, keep: Option<&[Tensor]>) -> Result<usize>;
    /// Every buffer the device handed out so far, a running total: [`Device::allocate`]'s
    /// and what its kernels and transports allocate for themselves, on any stream. What an
    /// eager call adds to it is what a recording of the same call takes from its arena
    /// (the evaluator's own count misses the buffers the backend allocates).
    fn handed_out(&self) -> HandedOut;
}

/// The life cycle's steps for any device: a device without [`DeviceLifecycle`] needs no
/// thread binding, allocates shared buffers as ordinary ones, has nothing to order around
/// a call (and refuses a caller's stream), and cannot record graphs.
impl dyn Device + '_ {
    /// [`DeviceLifecycle::bind_thread`], or nothing.
    pub fn bind_thread(&self) -> Result<()> {
        self.lifecycle().map_or(Ok(()), |l| l.bind_thread())
    }

    /// [`DeviceLifecycle::allocate_shared`], or [`Device::allocate`].
    pub fn allocate_shared(
        &self,
        stream: StreamHandle,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Tensor> {
        match self.lifecycle() {
            Some(l) => l.allocate_shared(stream, dtype, shape),
            None => self.allocate(stream, dtype, shape),
        }
    }

    /// [`DeviceLifecycle::begin_walk`], or a refusal of a caller's stream.
    pub fn begin_walk(&self, on: Option<&CallerStream>) -> Result<()> {
        match self.lifecycle() {
            Some(l) => l.begin_walk(on),
            None => no_caller_streams(self.kind(), on),
        }
    }

    /// [`DeviceLifecycle::end_walk`], or a refusal of a caller's stream.
    pub fn end_walk(&self, on: Option<&CallerStream>) -> Result<()> {
        match self.lifecycle() {
            Some(l) => l.end_walk(on),
            None => no_caller_streams(self.kind(), on),
        }
    }

    /// [`DeviceLifecycle::begin_replay`], or a refusal of a caller's stream.
    pub fn begin_replay(&self, on: Option<&CallerStream>) -> Result<()> {
        match self.lifecycle() {
            Some(l) => l.begin_replay(on),
            None => no_caller_streams(self.kind(), on),
        }
    }

    /// [`DeviceLifecycle::end_replay`], or a refusal of a caller's stream.
    pub fn end_replay(&self, on: Option<&CallerStream>) -> Result<()> {
        match self.lifecycle() {
            Some(l) => l.end_replay(on),
            None => no_caller_streams(self.kind(), on),
        }
    }

    /// [`DeviceLifecycle::caller_capture`], or `None`.
    pub fn caller_capture(&self) -> Option<&dyn CallerCapture> {
        self.lifecycle().and_then(|l| l.caller_capture())
    }

    /// [`DeviceLifecycle::hand_out`], or nothing.
    pub fn hand_out(&self, outputs: &[Tensor], on: Option<&CallerStream>) {
        if let Some(l) = self.lifecycle() {
            l.hand_out(outputs, on);
        }
    }

    /// [`DeviceLifecycle::begin_capture`], or an error: this backend records no graphs.
    pub fn begin_capture(&self, arena_bytes: usize) -> Result<()> {
        match self.lifecycle() {
            Some(l) => l.begin_capture(arena_bytes),
            None => Err(self.no_graphs()),
        }
    }

    /// [`DeviceLifecycle::end_capture`], or an error: this backend records no graphs.
    pub fn end_capture(&self) -> Result<Box<dyn DeviceGraph>> {
        match self.lifecycle() {
            Some(l) => l.end_capture(),
            None => Err(self.no_graphs()),
        }
    }

    fn no_graphs(&self) -> crate::error::Error {
        crate::error::Error::Backend {
            backend: self.kind().name(),
            reason: "this backend cannot record graphs".into(),
        }
    }
}
