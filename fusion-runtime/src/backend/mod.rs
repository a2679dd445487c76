//! Device backends: what the evaluator needs from a device.
//!
//! A [`Device`] allocates tensors, owns a pool of streams, orders streams against each
//! other with events, and runs a small set of [`Kernel`]s. The evaluator lowers every
//! compute node of a host program to these kernels, so a backend implements only them.

pub mod cpu;
pub mod cuda;

use fusion_core::ir::{BinaryOp, ReduceOp, UnaryOp};
use fusion_core::DType;

use crate::error::Result;
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
    /// `cpu` or `cuda`.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// A stream of a device: 0 is the stream current when a call starts (the caller's);
/// `1..=n` are the worker pool.
pub type StreamHandle = usize;

/// One instruction of a [`PointwiseProgram`]. Registers `0..inputs.len()` hold the inputs;
/// instruction `i` writes register `inputs.len() + i`. Values are f32 in registers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PointwiseInstr {
    Unary(UnaryOp, usize),
    Binary(BinaryOp, usize, usize),
    /// Rounds a register to `DType` (a cast inside a fused chain).
    Round(DType, usize),
}

/// A fused elementwise computation over one iteration shape.
#[derive(Clone, Debug)]
pub struct PointwiseProgram {
    /// The iteration shape (every output's shape).
    pub shape: Vec<usize>,
    /// Input views, already broadcast to `shape` (stride 0 on broadcast axes).
    pub inputs: Vec<Tensor>,
    pub instrs: Vec<PointwiseInstr>,
    /// Output views of shape `shape`, each with the register it stores.
    pub outputs: Vec<(Tensor, usize)>,
}

impl PointwiseProgram {
    /// Evaluates the program for one element given its inputs (reference semantics).
    pub fn eval_element(&self, regs: &mut Vec<f32>) {
        for ins in &self.instrs {
            let v = match *ins {
                PointwiseInstr::Unary(op, a) => op.apply_f64(regs[a] as f64) as f32,
                PointwiseInstr::Binary(op, a, b) => {
                    op.apply_f64(regs[a] as f64, regs[b] as f64) as f32
                }
                PointwiseInstr::Round(dt, a) => crate::tensor::round_to(dt, regs[a]),
            };
            regs.push(v);
        }
    }
}

/// The operations a backend executes on a stream.
#[derive(Clone, Copy, Debug)]
pub enum Kernel<'a> {
    /// `dst = src` elementwise (same shape; dtypes may differ).
    Copy { src: &'a Tensor, dst: &'a Tensor },
    /// A fused elementwise program.
    Pointwise(&'a PointwiseProgram),
    /// `dst` = `src` reduced over `axes` (dst's shape is src's without those axes).
    Reduce {
        op: ReduceOp,
        src: &'a Tensor,
        dst: &'a Tensor,
        axes: &'a [usize],
    },
    /// Batched `dst = epilogue(a @ b (+ bias))`: a `[B.., M, K]`, b `[B.., K, N]`, dst
    /// `[B.., M, N]`, bias `[N]`; all of one rank >= 2, batch axes already broadcast
    /// (stride 0), any strides. Accumulates in f32; the bias and then the `epilogue`
    /// functions apply to the f32 result, which is rounded once, to `dst`'s dtype (which
    /// may differ from the operands'). With `accumulate`, `dst = dst + a @ b` (no bias, no
    /// epilogue): the GEMM epilogue adds what `dst` holds, so a running sum needs no
    /// separate kernel.
    Gemm {
        a: &'a Tensor,
        b: &'a Tensor,
        bias: Option<&'a Tensor>,
        accumulate: bool,
        epilogue: &'a [UnaryOp],
        dst: &'a Tensor,
    },
}

/// A device as the evaluator sees it. Methods are called from the owning rank's thread.
pub trait Device: Send + Sync {
    /// The backend kind.
    fn kind(&self) -> BackendKind;
    /// The device ordinal (the rank on a local world).
    fn ordinal(&self) -> usize;
    /// Prepares the calling thread to drive this device (e.g. makes a CUDA context
    /// current); called once per rank thread.
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }
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
    /// Milliseconds from marker `start` to marker `end` (waits for both).
    fn marker_elapsed_ms(&self, start: usize, end: usize) -> Result<f64>;
    /// Forgets every marker (call after reading a trace).
    fn clear_markers(&self);
    /// True when `t` lives where this device's kernels can read it.
    fn is_resident(&self, t: &Tensor) -> bool {
        match self.kind() {
            BackendKind::Cpu => t.is_host(),
            BackendKind::Cuda => t
                .device_buffer()
                .is_some_and(|b| b.device() == self.ordinal()),
        }
    }
}
