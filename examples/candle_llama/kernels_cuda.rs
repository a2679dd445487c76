//! The fused ops' CUDA side: `kernels.cu` compiled once per process through NVRTC, and the
//! launches (this example's kernels and candle's `rmsnorm`) on candle's stream.

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda::{kernel_name, kernels, CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Shape, WithDType};
use half::{bf16, f16};

/// The kernels' source.
const SOURCE: &str = include_str!("kernels.cu");
/// The name candle's device keeps the loaded module under.
const MODULE: &str = "candle_llama_step";
/// Threads per block of this example's kernels.
const THREADS: u32 = 256;

/// A storage and its layout.
type Operand<'a> = (&'a CudaStorage, &'a Layout);

/// The kernels' PTX, compiled once (for any GPU: they use nothing arch-specific).
fn ptx() -> candle_core::Result<&'static str> {
    static PTX: OnceLock<Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        compile_ptx_with_opts(SOURCE, CompileOptions::default())
            .map(|p| p.to_src())
            .map_err(|e| format!("NVRTC failed on the step's kernels: {e:?}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// Blocks of [`THREADS`] for `n` work items (the kernels loop over the rest).
fn config(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Contiguous `u32` positions, `t` of them.
fn positions<'a>((pos, pl): Operand<'a>, t: usize) -> candle_core::Result<CudaView<'a, u32>> {
    if pl.shape().dims1()? != t || !pl.is_contiguous() || pos.dtype() != DType::U32 {
        candle_core::bail!("{t} contiguous u32 positions, not {:?}", pl.shape())
    }
    Ok(pos.as_cuda_slice::<u32>()?.slice(pl.start_offset()..))
}

/// The sizes of a `[t, n, hd]` operand and its token and head strides (the last is 1).
struct Rows {
    t: u32,
    n: u32,
    hd: u32,
    cap: u32,
    s_tok: u64,
    s_head: u64,
}

impl Rows {
    fn of(l: &Layout, cap: usize) -> candle_core::Result<Rows> {
        let (t, n, hd) = l.shape().dims3()?;
        let s = l.stride();
        if s[2] != 1 || hd % 2 != 0 {
            candle_core::bail!("rows of an even head size, the last stride 1: {l:?}")
        }
        Ok(Rows {
            t: t as u32,
            n: n as u32,
            hd: hd as u32,
            cap: cap as u32,
            s_tok: s[0] as u64,
            s_head: s[1] as u64,
        })
    }

    fn elems(&self) -> usize {
        self.t as usize * self.n as usize * self.hd as usize
    }

    /// Pushes `t, n, hd, cap, s_tok, s_head` (the kernels' trailing arguments).
    fn push<'a>(&'a self, b: &mut candle_core::cuda::cudarc::driver::LaunchArgs<'a>) {
        b.arg(&self.t);
        b.arg(&self.n);
        b.arg(&self.hd);
        b.arg(&self.cap);
        b.arg(&self.s_tok);
        b.arg(&self.s_head);
    }
}

/// The KV-cache write: `src` `[t, kv, hd]` into rows `pos` of `dst` `[kv, cap, hd]`.
pub fn kv_write(
    dst: &mut CudaStorage,
    dl: &Layout,
    (src, sl): Operand,
    pos: Operand,
) -> candle_core::Result<()> {
    let (kv, cap, hd) = dl.shape().dims3()?;
    let rows = Rows::of(sl, cap)?;
    if (rows.n as usize, rows.hd as usize) != (kv, hd)
        || !dl.is_contiguous()
        || src.dtype() != dst.dtype()
    {
        candle_core::bail!("kv-cache-write: rows {sl:?} into a contiguous cache {dl:?}")
    }
    let pos = positions(pos, rows.t as usize)?;
    let dev = dst.device().clone();
    let src = (src, sl.start_offset());
    match dst.dtype() {
        DType::BF16 => kv_write_as::<bf16>(&dev, dst, dl, src, &pos, &rows, "kv_write_16"),
        DType::F16 => kv_write_as::<f16>(&dev, dst, dl, src, &pos, &rows, "kv_write_16"),
        DType::F32 => kv_write_as::<f32>(&dev, dst, dl, src, &pos, &rows, "kv_write_32"),
        other => candle_core::bail!("kv-cache-write: no kernel for {other:?}"),
    }
}

fn kv_write_as<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    dst: &mut CudaStorage,
    dl: &Layout,
    (src, src_offset): (&CudaStorage, usize),
    pos: &CudaView<'_, u32>,
    rows: &Rows,
    kernel: &str,
) -> candle_core::Result<()> {
    let func = dev.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let src = src.as_cuda_slice::<T>()?.slice(src_offset..);
    let mut dst = dst.as_cuda_slice_mut::<T>()?.slice_mut(dl.start_offset()..);
    let mut b = func.builder();
    b.arg(&mut dst);
    b.arg(&src);
    b.arg(pos);
    rows.push(&mut b);
    // SAFETY: the arguments match `kv_write_*` in `kernels.cu`; every index it forms lies
    // in `src` (its strides), `dst` (its checked shape) or `pos` (`t` elements).
    unsafe { b.launch(config(rows.elems())) }.w()?;
    Ok(())
}

/// The rotary embedding: `x` `[t, n, hd]` by the table rows of `pos` into a new
/// contiguous `[t, n, hd]`.
pub fn rope(
    (x, xl): Operand,
    pos: Operand,
    (table, tl): Operand,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let (cap, width) = tl.shape().dims2()?;
    let rows = Rows::of(xl, cap)?;
    if width != rows.hd as usize || !tl.is_contiguous() || table.dtype() != DType::F32 {
        candle_core::bail!("rope: a contiguous f32 table [capacity, head_dim], not {tl:?}")
    }
    let pos = positions(pos, rows.t as usize)?;
    let table = table.as_cuda_slice::<f32>()?.slice(tl.start_offset()..);
    let dev = x.device().clone();
    let x = (x, xl.start_offset());
    let out = match x.0.dtype() {
        DType::BF16 => rope_as::<bf16>(&dev, x, &pos, &table, &rows, "rope_bf16")?,
        DType::F32 => rope_as::<f32>(&dev, x, &pos, &table, &rows, "rope_f32")?,
        other => candle_core::bail!("rope: no kernel for {other:?}"),
    };
    Ok((out, xl.shape().clone()))
}

fn rope_as<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    (x, x_offset): (&CudaStorage, usize),
    pos: &CudaView<'_, u32>,
    table: &CudaView<'_, f32>,
    rows: &Rows,
    kernel: &str,
) -> candle_core::Result<CudaStorage> {
    let func = dev.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let x = x.as_cuda_slice::<T>()?.slice(x_offset..);
    // SAFETY: the kernel writes every element before anything reads it.
    let mut dst = unsafe { dev.alloc::<T>(rows.elems()) }?;
    let mut b = func.builder();
    b.arg(&mut dst);
    b.arg(&x);
    b.arg(pos);
    b.arg(table);
    rows.push(&mut b);
    // SAFETY: the arguments match `rope_*` in `kernels.cu`; it reads `x` through its
    // strides, `pos` (`t` elements) and `table` rows below `cap`, and writes `dst`.
    unsafe { b.launch(config(rows.elems() / 2)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}

/// RMSNorm of contiguous rows `x` `[rows, n]` by `w` `[n]`: candle's `rmsnorm` kernel,
/// launched as candle-nn launches it (a block per row, 32 threads under 1024 columns).
pub fn rms_norm(
    (x, xl): Operand,
    (w, wl): Operand,
    eps: f32,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let (rows, n) = xl.shape().dims2()?;
    if !xl.is_contiguous() || !wl.is_contiguous() || wl.shape().elem_count() != n {
        candle_core::bail!("rms-norm: contiguous rows and a weight of their width")
    }
    if x.dtype() != w.dtype() {
        candle_core::bail!("rms-norm: a weight of the rows' dtype")
    }
    let dev = x.device().clone();
    let (x, w) = ((x, xl.start_offset()), (w, wl.start_offset()));
    let out = match x.0.dtype() {
        DType::BF16 => rms_norm_as::<bf16>(&dev, x, w, (rows, n), eps)?,
        DType::F16 => rms_norm_as::<f16>(&dev, x, w, (rows, n), eps)?,
        DType::F32 => rms_norm_as::<f32>(&dev, x, w, (rows, n), eps)?,
        other => candle_core::bail!("rms-norm: no kernel for {other:?}"),
    };
    Ok((out, xl.shape().clone()))
}

fn rms_norm_as<T: CudaDType + DeviceRepr + WithDType>(
    dev: &CudaDevice,
    (x, x_offset): (&CudaStorage, usize),
    (w, w_offset): (&CudaStorage, usize),
    (rows, n): (usize, usize),
    eps: f32,
) -> candle_core::Result<CudaStorage> {
    let func = dev.get_or_load_func(&kernel_name::<T>("rmsnorm"), &kernels::REDUCE)?;
    let block: u32 = if n < 1024 { 32 } else { 1024 };
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    let x = x.as_cuda_slice::<T>()?.slice(x_offset..);
    let w = w.as_cuda_slice::<T>()?.slice(w_offset..);
    // SAFETY: the kernel writes every element before anything reads it.
    let mut dst = unsafe { dev.alloc::<T>(rows * n) }?;
    let (cols, block_size) = (n as i32, block as i32);
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&mut dst);
    b.arg(&w);
    b.arg(&cols);
    b.arg(&block_size);
    b.arg(&eps);
    // SAFETY: the arguments match candle's `rmsnorm_*` (src, dst, alpha, n_cols,
    // block_size, eps); a block per row of `n` contiguous elements.
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}

/// The causal softmax of contiguous scores `[rows, keys]` (rows: batches of `t` queries)
/// by the queries' positions.
pub fn causal_softmax(
    (s, sl): Operand,
    pos: Operand,
    scale: f32,
) -> candle_core::Result<(CudaStorage, Shape)> {
    let (rows, keys) = sl.shape().dims2()?;
    let t = pos.1.shape().dims1()?;
    if !sl.is_contiguous() || t == 0 || rows % t != 0 {
        candle_core::bail!("causal-softmax: contiguous rows of {t} queries, not {sl:?}")
    }
    let pos = positions(pos, t)?;
    let dev = s.device().clone();
    let sizes = [rows as u32, t as u32, keys as u32];
    let s = (s, sl.start_offset());
    let out = match s.0.dtype() {
        DType::BF16 => softmax_as::<bf16>(&dev, s, &pos, sizes, scale, "causal_softmax_bf16")?,
        DType::F32 => softmax_as::<f32>(&dev, s, &pos, sizes, scale, "causal_softmax_f32")?,
        other => candle_core::bail!("causal-softmax: no kernel for {other:?}"),
    };
    Ok((out, sl.shape().clone()))
}

fn softmax_as<T: CudaDType + DeviceRepr>(
    dev: &CudaDevice,
    (s, s_offset): (&CudaStorage, usize),
    pos: &CudaView<'_, u32>,
    [rows, t, keys]: [u32; 3],
    scale: f32,
    kernel: &str,
) -> candle_core::Result<CudaStorage> {
    let func = dev.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
    let s = s.as_cuda_slice::<T>()?.slice(s_offset..);
    // SAFETY: the kernel writes every element before anything reads it.
    let mut dst = unsafe { dev.alloc::<T>(rows as usize * keys as usize) }?;
    let cfg = LaunchConfig {
        grid_dim: (rows.clamp(1, 65_535), 1, 1),
        // The kernel's reductions take exactly this many threads (its shared buffer).
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&mut dst);
    b.arg(&s);
    b.arg(pos);
    b.arg(&rows);
    b.arg(&t);
    b.arg(&keys);
    b.arg(&scale);
    // SAFETY: the arguments match `causal_softmax_*` in `kernels.cu`; it reads and writes
    // `rows * keys` contiguous elements and `pos` (`t` elements).
    unsafe { b.launch(cfg) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}
