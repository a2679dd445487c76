//! The decode step's fused ops, each one candle op (one kernel on CUDA) where candle's own
//! ops take several: the KV-cache write, the rotary embedding, attention's causal softmax
//! and RMSNorm.
//!
//! On CUDA they run on candle's stream, so `--graph` records them with the rest of the
//! step: the cache write, the rotary embedding and the softmax are this example's kernels
//! (`kernels.cu`, compiled once per process through NVRTC), RMSNorm is candle's own
//! `rmsnorm` kernel (the one candle-nn's `rms_norm` launches). On the CPU the rotary
//! embedding, the softmax and RMSNorm compute the same f32 math in plain loops, and the
//! cache is written with candle's `scatter_set`.

use candle_core::{CpuStorage, Layout, Shape, Tensor as CTensor};
use half::bf16;

#[cfg(feature = "candle-cuda")]
#[path = "kernels_cuda.rs"]
mod cuda;

/// Writes `rows` `[tokens, kv_heads, head_dim]` (any strides, the last 1) into rows
/// `positions` (`[tokens]` `u32`, on the device) of every head of `cache` `[kv_heads,
/// capacity, head_dim]`: on CUDA one kernel with a thread per element (candle's
/// `scatter_set` gives a thread each column and loops over the rows), elsewhere
/// `scatter_set`.
pub fn write_rows(cache: &CTensor, rows: &CTensor, positions: &CTensor) -> candle_core::Result<()> {
    if cache.device().is_cuda() {
        return cache.inplace_op3(rows, positions, &KvWrite);
    }
    let (t, kv, hd) = rows.dims3()?;
    let index = positions
        .reshape((1, t, 1))?
        .broadcast_as((kv, t, hd))?
        .contiguous()?;
    cache.scatter_set(&index, &rows.transpose(0, 1)?.contiguous()?, 1)
}

/// `x` `[tokens, heads, head_dim]` (any strides, the last 1) rotated by the angles of
/// `positions` (`[tokens]` `u32`), whose cosines and sines are rows of `table`
/// (`[capacity, head_dim]` f32: `head_dim / 2` cosines, then the sines); computed in f32,
/// returned contiguous in `x`'s dtype. One op: the table lookup, both halves and the
/// dtype conversions in one kernel.
pub fn rope(x: &CTensor, positions: &CTensor, table: &CTensor) -> candle_core::Result<CTensor> {
    x.apply_op3_no_bwd(positions, table, &Rope)
}

/// `x / rms(x) * w` over the last axis of `x` `[rows, n]` (contiguous), accumulated in f32,
/// in `x`'s dtype (`w` `[n]` in the same dtype): one op.
pub fn rms_norm(x: &CTensor, w: &CTensor, eps: f64) -> candle_core::Result<CTensor> {
    let n = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / n.max(1);
    x.reshape((rows, n))?
        .contiguous()?
        .apply_op2_no_bwd(w, &RmsNorm(eps as f32))?
        .reshape(x.shape())
}

/// Softmax over the last axis of `scores` `[.., tokens, keys]` scaled by `scale`, causal
/// by the queries' `positions` (`[tokens]` `u32`): query `i` sees keys `0..=positions[i]`
/// and weighs the rest 0. Computed in f32, returned in the scores' dtype; one op (the
/// mask comes from the positions, never materialized).
pub fn causal_softmax(
    scores: &CTensor,
    positions: &CTensor,
    scale: f64,
) -> candle_core::Result<CTensor> {
    let keys = scores.dim(candle_core::D::Minus1)?;
    let rows = scores.elem_count() / keys.max(1);
    scores
        .reshape((rows, keys))?
        .contiguous()?
        .apply_op2_no_bwd(positions, &CausalSoftmax(scale as f32))?
        .reshape(scores.shape())
}

/// The KV-cache write ([`write_rows`] on CUDA).
struct KvWrite;

impl candle_core::InplaceOp3 for KvWrite {
    fn name(&self) -> &'static str {
        "kv-cache-write"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!("the KV-cache write kernel is CUDA's: the CPU uses scatter_set")
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dl: &Layout,
        src: &candle_core::CudaStorage,
        sl: &Layout,
        pos: &candle_core::CudaStorage,
        pl: &Layout,
    ) -> candle_core::Result<()> {
        cuda::kv_write(dst, dl, (src, sl), (pos, pl))
    }
}

/// The rotary embedding ([`rope`]).
struct Rope;

impl candle_core::CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        pos: &CpuStorage,
        pl: &Layout,
        table: &CpuStorage,
        tl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (t, n, hd) = xl.shape().dims3()?;
        let half = hd / 2;
        let s = xl.stride();
        let (CpuStorage::U32(pos), CpuStorage::F32(table)) = (pos, table) else {
            candle_core::bail!("rope: u32 positions and an f32 table")
        };
        let pos = contiguous(pos, pl, t)?;
        let cap = tl.shape().dims2()?.0;
        let table = contiguous(table, tl, cap * hd)?;
        let x = Values::of(x)?;
        let mut out = vec![0f32; t * n * hd];
        for (i, &p) in pos.iter().enumerate() {
            let p = (p as usize).min(cap - 1) * hd;
            for h in 0..n {
                let from = xl.start_offset() + i * s[0] + h * s[1];
                let to = (i * n + h) * hd;
                for d in 0..half {
                    let (c, sn) = (table[p + d], table[p + half + d]);
                    let (a, b) = (x.get(from + d), x.get(from + half + d));
                    out[to + d] = a * c - b * sn;
                    out[to + half + d] = a * sn + b * c;
                }
            }
        }
        Ok((x.like(out), xl.shape().clone()))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        pos: &candle_core::CudaStorage,
        pl: &Layout,
        table: &candle_core::CudaStorage,
        tl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        cuda::rope((x, xl), (pos, pl), (table, tl))
    }
}

/// Implements candle's `CustomOp2` for `$op` named `$name`: the CPU side is `$cpu`, the
/// CUDA side `cuda::$cuda`, both given the op and the two (storage, layout) operands.
macro_rules! custom_op2 {
    ($op:ty, $name:literal, $cpu:ident, $cuda:ident) => {
        impl candle_core::CustomOp2 for $op {
            fn name(&self) -> &'static str {
                $name
            }

            fn cpu_fwd(
                &self,
                a: &CpuStorage,
                al: &Layout,
                b: &CpuStorage,
                bl: &Layout,
            ) -> candle_core::Result<(CpuStorage, Shape)> {
                $cpu(self.0, (a, al), (b, bl))
            }

            #[cfg(feature = "candle-cuda")]
            fn cuda_fwd(
                &self,
                a: &candle_core::CudaStorage,
                al: &Layout,
                b: &candle_core::CudaStorage,
                bl: &Layout,
            ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
                cuda::$cuda((a, al), (b, bl), self.0)
            }
        }
    };
}

/// RMSNorm with its epsilon ([`rms_norm`]).
struct RmsNorm(f32);

custom_op2!(RmsNorm, "rms-norm", rms_norm_cpu, rms_norm);

/// [`RmsNorm`] on the CPU.
fn rms_norm_cpu(
    eps: f32,
    (x, xl): (&CpuStorage, &Layout),
    (w, wl): (&CpuStorage, &Layout),
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (rows, n) = xl.shape().dims2()?;
    let (x, w) = (Values::of(x)?, Values::of(w)?);
    let (xo, wo) = (xl.start_offset(), wl.start_offset());
    if !xl.is_contiguous() || !wl.is_contiguous() || wl.shape().elem_count() != n {
        candle_core::bail!("rms-norm: contiguous rows and a weight of their width")
    }
    let mut out = vec![0f32; rows * n];
    for r in 0..rows {
        let row = xo + r * n;
        let sq: f32 = (0..n).map(|c| x.get(row + c) * x.get(row + c)).sum();
        let scale = 1.0 / (sq / n as f32 + eps).sqrt();
        for c in 0..n {
            out[r * n + c] = scale * x.get(row + c) * w.get(wo + c);
        }
    }
    Ok((x.like(out), xl.shape().clone()))
}

/// The causal softmax with its scale ([`causal_softmax`]).
struct CausalSoftmax(f32);

custom_op2!(
    CausalSoftmax,
    "causal-softmax",
    causal_softmax_cpu,
    causal_softmax
);

/// [`CausalSoftmax`] on the CPU.
fn causal_softmax_cpu(
    scale: f32,
    (s, sl): (&CpuStorage, &Layout),
    (pos, pl): (&CpuStorage, &Layout),
) -> candle_core::Result<(CpuStorage, Shape)> {
    let (rows, keys) = sl.shape().dims2()?;
    let CpuStorage::U32(pos) = pos else {
        candle_core::bail!("causal-softmax: u32 positions")
    };
    let t = pl.shape().dims1()?;
    let pos = contiguous(pos, pl, t)?;
    let s_all = Values::of(s)?;
    let base = match sl.contiguous_offsets() {
        Some((a, _)) if t > 0 && rows % t == 0 => a,
        _ => candle_core::bail!("causal-softmax: contiguous rows of {t} queries"),
    };
    let mut out = vec![0f32; rows * keys];
    for r in 0..rows {
        let seen = (pos[r % t] as usize + 1).min(keys);
        let x = |j: usize| scale * s_all.get(base + r * keys + j);
        let m = (0..seen).map(x).fold(f32::NEG_INFINITY, f32::max);
        let sum: f32 = (0..seen).map(|j| (x(j) - m).exp()).sum();
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for j in 0..seen {
            out[r * keys + j] = (x(j) - m).exp() * inv;
        }
    }
    Ok((s_all.like(out), sl.shape().clone()))
}

/// A CPU tensor's elements read as f32 (f32 or bf16 storage).
enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

impl<'a> Values<'a> {
    fn of(s: &'a CpuStorage) -> candle_core::Result<Self> {
        match s {
            CpuStorage::F32(v) => Ok(Values::F32(v)),
            CpuStorage::BF16(v) => Ok(Values::Bf16(v)),
            other => candle_core::bail!(
                "f32 or bf16 elements, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    }

    fn get(&self, i: usize) -> f32 {
        match self {
            Values::F32(v) => v[i],
            Values::Bf16(v) => v[i].to_f32(),
        }
    }

    /// `out` as storage of this dtype (bf16 rounded to nearest even).
    fn like(&self, out: Vec<f32>) -> CpuStorage {
        match self {
            Values::F32(_) => CpuStorage::F32(out),
            Values::Bf16(_) => CpuStorage::BF16(out.into_iter().map(bf16::from_f32).collect()),
        }
    }
}

/// The `n` elements of a contiguous CPU tensor.
fn contiguous<'a, T>(v: &'a [T], l: &Layout, n: usize) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) if b - a == n => Ok(&v[a..b]),
        _ => candle_core::bail!("expected {n} contiguous elements, got {:?}", l.shape()),
    }
}
