//! The layer's candle math: the reference's plain forms (RMSNorm, the rotary embedding
//! given its cosines and sines, causal attention with an additive mask and repeated KV
//! heads, each computed in f32 whatever the dtype) and the ranks' grouped attention over
//! the KV cache.

use candle_core::{DType as CDType, Device, Tensor as CTensor, D};

use crate::kernels::causal_softmax;

/// `x / rms(x) * w` over the last axis, computed in f32.
pub fn rms_norm(x: &CTensor, w: &CTensor, eps: f64) -> candle_core::Result<CTensor> {
    let dt = x.dtype();
    let x = x.to_dtype(CDType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&rms)?
        .broadcast_mul(&w.to_dtype(CDType::F32)?)?
        .to_dtype(dt)
}

/// The rotary angles `position * theta^(-2i / head_dim)` of `positions`, in f32 as the
/// reference computes them: `[positions, head_dim / 2]`, row-major.
pub fn rope_angles(positions: std::ops::Range<usize>, head_dim: usize, theta: f64) -> Vec<f32> {
    let half = head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| theta.powf(-(2.0 * i as f64) / head_dim as f64) as f32)
        .collect();
    positions
        .flat_map(|p| inv.iter().map(move |f| p as f32 * f))
        .collect()
}

/// Rotates `x` `[tokens, heads, head_dim]` by the angles whose cosines and sines are `cos`
/// and `sin` (`[tokens, 1, head_dim / 2]`, f32).
pub fn rotate(x: &CTensor, cos: &CTensor, sin: &CTensor) -> candle_core::Result<CTensor> {
    let half = x.dim(D::Minus1)? / 2;
    let dt = x.dtype();
    let x = x.to_dtype(CDType::F32)?;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
    let b = (x1.broadcast_mul(sin)? + x2.broadcast_mul(cos)?)?;
    CTensor::cat(&[a, b], D::Minus1)?.to_dtype(dt)
}

/// Rotary embedding of `x` `[tokens, heads, head_dim]` at positions `start..`, its angles
/// computed on the host (the reference's way).
pub fn rope(x: &CTensor, start: usize, theta: f64) -> candle_core::Result<CTensor> {
    let (t, _, hd) = x.dims3()?;
    let angles = rope_angles(start..start + t, hd, theta);
    let angles = CTensor::from_vec(angles, (t, 1, hd / 2), x.device())?;
    rotate(x, &angles.cos()?, &angles.sin()?)
}

/// The causal mask of `tokens` queries at positions `start..` over `keys` cached keys:
/// 0 where a query sees a key, -inf elsewhere, `[tokens, keys]` f32 (built on the host).
pub fn causal_mask(
    tokens: usize,
    keys: usize,
    start: usize,
    device: &Device,
) -> candle_core::Result<CTensor> {
    let mask: Vec<f32> = (0..tokens)
        .flat_map(|i| {
            (0..keys).map(move |j| {
                if j <= start + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    CTensor::from_vec(mask, (tokens, keys), device)
}

/// Attention of `q` `[tokens, heads, hd]` over `k`, `v` `[keys, kv_heads, hd]` with the
/// additive `mask` `[tokens, keys]` (f32), the plainest way (the reference's): everything
/// in f32, each KV head's keys and values repeated for its `heads / kv_heads` query heads.
/// Returns `[tokens, heads * hd]` in `q`'s dtype.
pub fn attention(
    q: &CTensor,
    k: &CTensor,
    v: &CTensor,
    mask: &CTensor,
) -> candle_core::Result<CTensor> {
    let (t, heads, hd) = q.dims3()?;
    let (keys, kv_heads, _) = k.dims3()?;
    let rep = heads / kv_heads;
    let dt = q.dtype();
    let f = |x: &CTensor| x.to_dtype(CDType::F32);
    // [heads, t, hd] and [heads, keys, hd] (each KV head serves `rep` query heads).
    let q = f(q)?.transpose(0, 1)?.contiguous()?;
    let repeat = |x: &CTensor| -> candle_core::Result<CTensor> {
        f(x)?
            .transpose(0, 1)?
            .unsqueeze(1)?
            .expand((kv_heads, rep, keys, hd))?
            .contiguous()?
            .reshape((heads, keys, hd))
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?;
    let scores = scores.broadcast_add(&mask.unsqueeze(0)?)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, heads * hd))?
        .to_dtype(dt)
}

/// Attention of `q` `[tokens, heads, hd]` (any strides) at `positions` (`[tokens]` `u32`)
/// over `k`, `v` `[kv_heads, keys, hd]` (each head's rows contiguous, as the KV cache holds
/// them), causal (query `i` sees keys `0..=positions[i]`), grouped by KV head: query head
/// `h` reads KV head `h / rep` (`rep = heads / kv_heads`), so the `rep` query heads of a
/// KV head are extra rows of one batched GEMM (`[kv_heads, rep * tokens, hd] x [kv_heads,
/// hd, keys]`) and the keys and values are read in place, never repeated. The GEMMs run in
/// the layer's dtype (accumulating in f32), the softmax in f32 (one op). Returns
/// `[tokens, heads * hd]` in `q`'s dtype.
pub fn grouped_attention(
    q: &CTensor,
    k: &CTensor,
    v: &CTensor,
    positions: &CTensor,
    mark: &mut dyn FnMut(&'static str) -> candle_core::Result<()>,
) -> candle_core::Result<CTensor> {
    let (t, heads, hd) = q.dims3()?;
    let kv_heads = k.dim(0)?;
    let rep = heads / kv_heads;
    // [heads, t, hd] = [kv_heads, rep * t, hd]: head h = g * rep + r is rows r * t.. of g.
    mark("attn q.k")?;
    let q = q
        .transpose(0, 1)?
        .contiguous()?
        .reshape((kv_heads, rep * t, hd))?;
    let scores = q.matmul(&k.t()?)?;
    mark("attn softmax")?;
    let p = causal_softmax(&scores, positions, 1.0 / (hd as f64).sqrt())?;
    mark("attn p.v")?;
    p.matmul(v)?
        .reshape((heads, t, hd))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape((t, heads * hd))
}
