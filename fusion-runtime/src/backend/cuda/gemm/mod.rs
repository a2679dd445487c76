//! Batched GEMM: cuBLASLt from cached plans with the epilogue in the GEMM (`lt`) where
//! it applies, else cuBLAS (`cublasGemmStridedBatchedEx`, f32 accumulation) and a
//! generated kernel for the epilogue. With [`GemmEngine::Persistent`], the runtime's own
//! persistent kernel for Hopper GPUs (`hopper`) runs the GEMMs it applies to first; with
//! any engine it runs the products multiplied by an activation's derivative (a backward's
//! `dH = (dY W^T) * act'(H)`) where it applies.
//!
//! Tensors are row-major strided views; cuBLAS is column-major. A row-major matrix with a
//! unit column stride is, to cuBLAS, its transpose with leading dimension = row stride;
//! one with a unit row stride is itself with leading dimension = column stride. When the
//! output has unit column stride we compute `Cᵀ = Bᵀ Aᵀ`, otherwise `C = A B`. Operands
//! with neither stride 1 are first copied to contiguous buffers. Batch axes along which B
//! does not change (a weight broadcast) merge into the rows of one GEMM
//! (`shared_weight`); otherwise the last batch axis goes to cuBLAS as the strided batch
//! and outer batch axes are looped on the host.

mod args;
mod epilogue;
mod hopper;
pub(crate) mod launch_graphs;
pub(crate) mod lt;
mod shared_weight;
mod stream_blas;
mod word_hash;

pub(crate) use args::{gemm_kernel, GemmArgs};
pub(crate) use hopper::{
    gathered_rows_ready, launch_gathered, launch_scattered, runs_gathered, runs_scattered,
    HopperGemms,
};
pub(crate) use stream_blas::StreamBlas;

use std::ffi::c_void;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use fusion_compiler::ir::EpilogueAux;
use fusion_compiler::DType;

use crate::backend::cuda::health::WorldHealth;
use crate::backend::cuda::kernels::KernelCache;
use crate::backend::cuda::libs::driver_err;
use crate::backend::cuda::memory::device_shared::DeviceShared;
use crate::backend::cuda::stream::RawStream;
use crate::device::{Device, GemmEngine, Kernel, StreamHandle};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use lt::{LtAux, LtEpilogue, LtMatrix, LtProblem};

/// A cuBLAS handle, bound to one stream of its device.
#[derive(Clone, Copy)]
pub(crate) struct BlasHandle(pub cudarc::cublas::sys::cublasHandle_t);
// SAFETY: used only from the rank thread that owns the device, one call at a time.
unsafe impl Send for BlasHandle {}

/// What a GEMM needs of its device beyond [`Device`] (which allocates and runs the copies
/// and epilogue kernels): the raw stream and cuBLAS handle of a stream, the cuBLASLt plans
/// and the context. The CUDA device implements it.
pub(crate) trait GemmDevice: Device {
    /// The raw stream behind a handle.
    fn raw_stream(&self, s: StreamHandle) -> Result<RawStream>;
    /// The cuBLAS handle bound to stream `s`.
    fn blas(&self, s: StreamHandle) -> Result<BlasHandle>;
    /// The device's cuBLASLt handle, plans and workspaces.
    fn lt(&self) -> &lt::LtPlans;
    /// What the device's buffers share with it (its context).
    fn shared(&self) -> &DeviceShared;
    /// The device's compiled kernels (the persistent GEMM loads through them).
    fn kernels(&self) -> &KernelCache;
    /// The device's state of the persistent Hopper GEMM.
    fn hopper(&self) -> &HopperGemms;
    /// The engine of the GEMMs enqueued now (`Device::set_gemm_engine`).
    fn gemm_engine(&self) -> GemmEngine;
    /// The health of the device's world (its timeout, the waits it watches).
    fn health(&self) -> &WorldHealth;
    /// The rank the device serves.
    fn rank(&self) -> usize;
}

/// How a row-major `rows x cols` matrix appears to cuBLAS.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// Unit column stride: cuBLAS sees the transpose, leading dimension `ld`.
    RowMajor { ld: i64 },
    /// Unit row stride: cuBLAS sees the matrix itself, leading dimension `ld`.
    ColMajor { ld: i64 },
}

fn layout(rows: usize, cols: usize, rs: isize, cs: isize) -> Option<Layout> {
    let (rows, cols) = (rows as i64, cols as i64);
    let (rs, cs) = (rs as i64, cs as i64);
    if cs == 1 || cols == 1 {
        let ld = if rows == 1 { cols.max(1) } else { rs };
        if ld >= cols.max(1) {
            return Some(Layout::RowMajor { ld });
        }
    }
    if rs == 1 || rows == 1 {
        let ld = if cols == 1 { rows.max(1) } else { cs };
        if ld >= rows.max(1) {
            return Some(Layout::ColMajor { ld });
        }
    }
    None
}

fn data_type(dt: DType) -> cudaDataType {
    match dt {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        DType::F16 => cudaDataType::CUDA_R_16F,
    }
}

fn err(reason: String) -> Error {
    Error::Backend {
        backend: "cuda",
        reason,
    }
}

/// The matrix layout of the last two axes, copying to a contiguous buffer if needed.
fn matrix(dev: &dyn GemmDevice, stream: StreamHandle, t: &Tensor) -> Result<(Tensor, Layout)> {
    let r = t.rank();
    let (rows, cols) = (t.shape()[r - 2], t.shape()[r - 1]);
    if let Some(l) = layout(rows, cols, t.strides()[r - 2], t.strides()[r - 1]) {
        return Ok((t.clone(), l));
    }
    let c = dev.allocate(stream, t.dtype(), t.shape())?;
    dev.execute(stream, Kernel::Copy { src: t, dst: &c })?;
    let l = layout(rows, cols, c.strides()[r - 2], c.strides()[r - 1]).expect("contiguous");
    Ok((c, l))
}

/// True when cuBLAS stores a product of `input` operands in `output` directly.
fn direct_output(input: DType, output: DType) -> bool {
    input == output || output == DType::F32
}

/// `dst = epilogue(a @ b (+ bias))`, or `dst += a @ b` with `accumulate`; see
/// [`Kernel::Gemm`] (and [`Kernel::GemmAux`] for `g.aux`). The persistent Hopper kernel
/// first where the device's engine asks for it, or the product is multiplied by an
/// activation's derivative, and it applies;
/// cuBLASLt from a cached plan with the epilogue in the GEMM where it can; else cuBLAS,
/// and for an epilogue (or output dtype) cuBLAS cannot store, the product in f32 and one
/// generated kernel for the rest (the same f32 semantics as cuBLASLt's epilogue and the
/// CPU backend).
pub(crate) fn gemm(dev: &dyn GemmDevice, stream: StreamHandle, g: GemmArgs) -> Result<()> {
    args::validate(&g)?;
    if g.dst.numel() == 0 {
        return Ok(());
    }
    if let Some(merged) = shared_weight::MergedRows::of(&g) {
        return gemm(dev, stream, merged.args(&g));
    }
    // A product times an activation's derivative runs on the persistent kernel's slope
    // entry whatever the engine (where it applies: Hopper, bf16/f16); cuBLASLt's DGELU
    // and a separate kernel were slower (docs/DECISIONS.md).
    let slope = matches!(g.aux, Some((_, EpilogueAux::Derivative(_))));
    let persistent = slope || (dev.gemm_engine() == GemmEngine::Persistent && g.aux.is_none());
    if persistent && hopper::try_gemm(dev, stream, &g)? {
        return Ok(());
    }
    if let Some(c) = g.addend.filter(|c| !same_view(c, g.dst)) {
        // Out of place: cuBLASLt reads C from the addend and writes D; where it cannot,
        // the addend is copied into dst and the GEMM accumulates there.
        if lt_gemm(dev, stream, &g, LtEpilogue::None)? {
            return Ok(());
        }
        dev.execute(stream, Kernel::Copy { src: c, dst: g.dst })?;
        return cublas_gemm(dev, stream, g.a, g.b, None, true, g.dst);
    }
    let lt_epilogue = match g.aux {
        // cuBLASLt's auxiliary matrix is taken in D's dtype, that of the operands.
        Some((x, mode)) => LtEpilogue::with_aux(g.epilogue, mode)
            .filter(|_| x.dtype() == g.dst.dtype() && g.a.dtype() == g.dst.dtype()),
        None => LtEpilogue::of(g.epilogue),
    };
    if let Some(ep) = lt_epilogue {
        if direct_output(g.a.dtype(), g.dst.dtype())
            && g.bias.is_none_or(|b| b.dtype() == g.dst.dtype())
            && lt_gemm(dev, stream, &g, ep)?
        {
            return Ok(());
        }
    }
    if g.epilogue.is_empty() && g.aux.is_none() && direct_output(g.a.dtype(), g.dst.dtype()) {
        return cublas_gemm(dev, stream, g.a, g.b, g.bias, g.accumulate, g.dst);
    }
    epilogue::product_then_kernel(dev, stream, &g)
}

/// `g` through cuBLASLt when it is one 2-D GEMM (batch axes of extent 1) whose operands
/// need no copy and whose output has unit column stride; `Ok(false)` otherwise.
fn lt_gemm(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    g: &GemmArgs,
    ep: LtEpilogue,
) -> Result<bool> {
    let r = g.dst.rank();
    if g.dst.shape()[..r - 2].iter().any(|&e| e != 1) {
        return Ok(false);
    }
    // The last two axes of each operand (batch axes of extent 1 move no pointer); no views
    // are made, since this runs at every GEMM launch.
    let last2 = |t: &Tensor| {
        let r = t.rank();
        (
            t.shape()[r - 2],
            t.shape()[r - 1],
            t.strides()[r - 2],
            t.strides()[r - 1],
        )
    };
    let ((m, k, ars, acs), (_, n, brs, bcs), (_, _, drs, dcs)) =
        (last2(g.a), last2(g.b), last2(g.dst));
    if k == 0 {
        return Ok(false);
    }
    // The auxiliary matrix has D's layout to cuBLASLt: unit column stride too (its own
    // leading dimension).
    let aux = match g.aux.filter(|_| ep.has_aux()) {
        Some((x, _)) => {
            let (_, _, xrs, xcs) = last2(x);
            let (Some(Layout::RowMajor { ld }), Some(ptr)) =
                (layout(m, n, xrs, xcs), x.device_ptr())
            else {
                return Ok(false);
            };
            Some(LtAux {
                ptr,
                ld,
                dtype: x.dtype(),
            })
        }
        None => None,
    };
    // C, when it is not D: cuBLASLt reads it with D's layout, so its strides must match.
    let c = g.addend.filter(|c| !same_view(c, g.dst));
    if let Some(c) = c {
        let (_, _, crs, ccs) = last2(c);
        if (crs, ccs) != (drs, dcs) {
            return Ok(false);
        }
    }
    let (Some(la), Some(lb), Some(Layout::RowMajor { ld: ldd })) = (
        layout(m, k, ars, acs),
        layout(k, n, brs, bcs),
        layout(m, n, drs, dcs),
    ) else {
        return Ok(false);
    };
    // Column-major, Dᵀ (n x m) = op(B') op(A'): a row-major matrix is its transpose to
    // cuBLASLt, so a row-major operand is used as stored and a column-major one transposed.
    let operand = |l: Layout, rows: usize, cols: usize| match l {
        Layout::RowMajor { ld } => LtMatrix {
            rows: cols as u64,
            cols: rows as u64,
            ld,
            transposed: false,
        },
        Layout::ColMajor { ld } => LtMatrix {
            rows: rows as u64,
            cols: cols as u64,
            ld,
            transposed: true,
        },
    };
    let ptr = |t: &Tensor| {
        t.device_ptr()
            .ok_or_else(|| err("gemm: an operand is not on the device".into()))
    };
    let problem = LtProblem {
        a: operand(lb, k, n),
        b: operand(la, m, k),
        d: LtMatrix {
            rows: n as u64,
            cols: m as u64,
            ld: ldd,
            transposed: false,
        },
        in_dtype: g.a.dtype(),
        out_dtype: g.dst.dtype(),
        epilogue: ep,
        a_ptr: ptr(g.b)?,
        b_ptr: ptr(g.a)?,
        d_ptr: ptr(g.dst)?,
        c_ptr: c.map(ptr).transpose()?,
        bias_ptr: match g.bias {
            Some(bias) if bias.strides()[0] == 1 || n == 1 => Some(ptr(bias)?),
            Some(_) => return Ok(false),
            None => None,
        },
        aux,
        accumulate: g.accumulate,
    };
    let raw = dev.raw_stream(stream)?;
    dev.shared().bind()?;
    dev.lt().matmul(stream, raw, &problem)
}

/// `dst = a @ b (+ bias)`, or `dst += a @ b` with `accumulate`, on cuBLAS (any batch and
/// strides; shapes checked by [`validate`]; `dst` in the operands' dtype or f32).
fn cublas_gemm(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    accumulate: bool,
    dst: &Tensor,
) -> Result<()> {
    let r = dst.rank();
    let (m, n, k) = (dst.shape()[r - 2], dst.shape()[r - 1], a.shape()[r - 1]);
    // Bias: prefill the output and accumulate onto it.
    let beta: f32 = match bias {
        Some(bias) => {
            let full = bias
                .expand(dst.shape())
                .map_err(|e| err(format!("gemm bias: {e}")))?;
            dev.execute(stream, Kernel::Copy { src: &full, dst })?;
            1.0
        }
        None if accumulate => 1.0,
        None => 0.0,
    };
    if k == 0 {
        // An empty contraction is all zeros (plus the bias or what dst held).
        if beta == 0.0 {
            fill_zero(dev, stream, dst)?;
        }
        return Ok(());
    }
    let (a, la) = matrix(dev, stream, a)?;
    let (b, lb) = matrix(dev, stream, b)?;
    let (c, lc) = match layout(m, n, dst.strides()[r - 2], dst.strides()[r - 1]) {
        Some(l) => (dst.clone(), l),
        None => {
            let c = dev.allocate(stream, dst.dtype(), dst.shape())?;
            if beta != 0.0 {
                dev.execute(stream, Kernel::Copy { src: dst, dst: &c })?;
            }
            let l = layout(m, n, c.strides()[r - 2], c.strides()[r - 1]).expect("contiguous");
            (c, l)
        }
    };
    // Column-major problem: C' (m2 x n2) = op(A') op(B').
    use cublasOperation_t::{CUBLAS_OP_N as N, CUBLAS_OP_T as T};
    let (m2, n2, ldc, x, lx, y, ly) = match lc {
        Layout::RowMajor { ld } => (n, m, ld, &b, lb, &a, la), // Cᵀ = Bᵀ Aᵀ
        Layout::ColMajor { ld } => (m, n, ld, &a, la, &b, lb), // C = A B
    };
    // op(A') must be (m2 x k): for Cᵀ that is Bᵀ, for C it is A.
    let transposed = matches!(lc, Layout::RowMajor { .. });
    let op_ld = |l: Layout, want_transpose_view: bool| -> (cublasOperation_t, i64) {
        match (l, want_transpose_view) {
            (Layout::RowMajor { ld }, true) | (Layout::ColMajor { ld }, false) => (N, ld),
            (Layout::RowMajor { ld }, false) | (Layout::ColMajor { ld }, true) => (T, ld),
        }
    };
    let (opa, lda) = op_ld(lx, transposed);
    let (opb, ldb) = op_ld(ly, transposed);
    let check = |v: i64, what: &str| -> Result<i32> {
        i32::try_from(v)
            .map_err(|_| err(format!("gemm: {what} = {v} exceeds cuBLAS's 32-bit limit")))
    };
    let ops = BlasOps {
        opa,
        opb,
        m: check(m2 as i64, "m")?,
        n: check(n2 as i64, "n")?,
        k: check(k as i64, "k")?,
        lda: check(lda, "lda")?,
        ldb: check(ldb, "ldb")?,
        ldc: check(ldc, "ldc")?,
    };
    strided_batches(dev, stream, &ops, x, y, &c, beta)?;
    if !c.shares_storage(dst) {
        dev.execute(stream, Kernel::Copy { src: &c, dst })?;
    }
    Ok(())
}

/// A column-major cuBLAS problem `C (m x n) = op(X) op(Y)` with its leading dimensions,
/// checked to fit cuBLAS's 32-bit arguments.
struct BlasOps {
    opa: cublasOperation_t,
    opb: cublasOperation_t,
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
}

/// Runs `ops` over every batch of `x`, `y` and `c` (same batch axes, any strides): the
/// last batch axis is cuBLAS's strided batch, the others loop here; `beta` scales what `c`
/// holds.
fn strided_batches(
    dev: &dyn GemmDevice,
    stream: StreamHandle,
    ops: &BlasOps,
    x: &Tensor,
    y: &Tensor,
    c: &Tensor,
    beta: f32,
) -> Result<()> {
    // Bytes per element of each operand: the product may be stored in another dtype
    // (bf16 operands, f32 output) than the operands are read in.
    let (ex, ey, ec) = (
        x.dtype().size_bytes() as u64,
        y.dtype().size_bytes() as u64,
        c.dtype().size_bytes() as u64,
    );
    let nb = c.rank() - 2;
    let (batch, sx, sy, sc) = if nb == 0 {
        (1usize, 0i64, 0i64, 0i64)
    } else {
        (
            c.shape()[nb - 1],
            x.strides()[nb - 1] as i64,
            y.strides()[nb - 1] as i64,
            c.strides()[nb - 1] as i64,
        )
    };
    let outer: Vec<usize> = c.shape()[..nb.saturating_sub(1)].to_vec();
    let n_outer: usize = outer.iter().product();
    let blas = dev.blas(stream)?;
    let alpha = 1.0f32;
    let batch_i = i32::try_from(batch).map_err(|_| {
        err(format!(
            "gemm: batch = {batch} exceeds cuBLAS's 32-bit limit"
        ))
    })?;
    let ptr = |t: &Tensor| t.device_ptr().expect("device tensor");
    for o in 0..n_outer {
        // Offset of outer batch index `o` in each operand.
        let (mut ox, mut oy, mut oc) = (0i64, 0i64, 0i64);
        let mut rem = o;
        for d in (0..outer.len()).rev() {
            let i = (rem % outer[d]) as i64;
            rem /= outer[d];
            ox += i * x.strides()[d] as i64;
            oy += i * y.strides()[d] as i64;
            oc += i * c.strides()[d] as i64;
        }
        let (px, py, pc) = (
            ptr(x) + (ox as u64).wrapping_mul(ex),
            ptr(y) + (oy as u64).wrapping_mul(ey),
            ptr(c) + (oc as u64).wrapping_mul(ec),
        );
        dev.shared().bind()?;
        // SAFETY: pointers, leading dimensions and strides describe the operands' views
        // (checked by the caller); the handle is bound to this stream.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                blas.0,
                ops.opa,
                ops.opb,
                ops.m,
                ops.n,
                ops.k,
                &alpha as *const f32 as *const c_void,
                px as *const c_void,
                data_type(x.dtype()),
                ops.lda,
                sx,
                py as *const c_void,
                data_type(y.dtype()),
                ops.ldb,
                sy,
                &beta as *const f32 as *const c_void,
                pc as *mut c_void,
                data_type(c.dtype()),
                ops.ldc,
                sc,
                batch_i,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::Cublas {
            what: "cublasGemmStridedBatchedEx".into(),
            source: e,
        })?;
    }
    Ok(())
}

/// Whether `x` and `y` are the same view of the same memory.
fn same_view(x: &Tensor, y: &Tensor) -> bool {
    x.device_ptr() == y.device_ptr() && x.shape() == y.shape() && x.strides() == y.strides()
}

/// Writes zeros into `t` (zero bits are 0.0 in every dtype).
fn fill_zero(dev: &dyn GemmDevice, stream: StreamHandle, t: &Tensor) -> Result<()> {
    let target = if t.is_contiguous() {
        t.clone()
    } else {
        dev.allocate(stream, t.dtype(), t.shape())?
    };
    let raw = dev.raw_stream(stream)?;
    // SAFETY: `target` is a contiguous device view of `nbytes` bytes.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            target.device_ptr().expect("device tensor"),
            0,
            target.nbytes(),
            raw.0,
        )
    }
    .map_err(|e| driver_err("cuMemsetD8Async (zeroing a GEMM's output)", e))?;
    if !target.shares_storage(t) {
        dev.execute(
            stream,
            Kernel::Copy {
                src: &target,
                dst: t,
            },
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts() {
        assert_eq!(layout(4, 3, 3, 1), Some(Layout::RowMajor { ld: 3 }));
        assert_eq!(layout(4, 3, 1, 4), Some(Layout::ColMajor { ld: 4 }));
        assert_eq!(layout(4, 3, 6, 1), Some(Layout::RowMajor { ld: 6 }));
        assert_eq!(layout(1, 3, 0, 1), Some(Layout::RowMajor { ld: 3 }));
        assert_eq!(layout(4, 1, 1, 0), Some(Layout::RowMajor { ld: 1 }));
        assert_eq!(layout(4, 3, 6, 2), None);
        assert_eq!(layout(4, 3, 0, 1), None, "broadcast rows need a copy");
    }
}
