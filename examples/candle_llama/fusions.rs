//! The tensor-parallel parts of a Llama decoder layer as fusions, in the layer's two forms.
//!
//! - Tensor-parallel: every rank holds every token (activations replicated). A decode step
//!   makes one call after attention (`decode_tail`): the attention output's projection +
//!   AllReduce + residual, the RMSNorm, and the whole gated MLP (its gate and up GEMMs of
//!   this rank's FFN columns, SiLU and product, the down GEMM + AllReduce, the residual);
//!   Q, K and V are a local GEMM in candle. Steps of many tokens (`row_parallel`) keep the column-parallel
//!   GEMMs in candle and chunk each row-parallel projection (attention output, down) so
//!   that the AllReduce of one chunk overlaps the next chunk's GEMM.
//! - Sequence-parallel (`qkv`, `out_proj`, `gated_mlp`): each rank holds `m` rows (tokens)
//!   of the layer's input; the fusions gather the rows, project them for this rank's heads
//!   and columns, and reduce-scatter the row-parallel sums back to each rank's rows.
//!
//! Every weight is split into one block per rank.

use fusion::prelude::*;

#[path = "../tp_mlp/blocks.rs"]
mod blocks;

/// The SiLU-gated MLP block `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`, the same
/// fusion the layer benchmark measures.
pub use blocks::gated_mlp;

fusion! {
    /// Row-parallel projection + AllReduce: a `[s, d @ DIDx, m, k]` (`s` chunks of `m`
    /// tokens; this rank's block of the contracted dimension), w `[d @ DIDx, k, n]` (the
    /// matching rows of the weight) -> the sum over ranks, `[s, m, n]` on every rank. With
    /// chunks large enough the AllReduce of one chunk overlaps the next chunk's GEMM.
    #[allow(dead_code)] // called through `row_parallel::executor()`, with output buffers
    pub fn row_parallel<T: Float, s, d, m, k, n>(
        a: Tensor<T, [s, d @ DIDx, m, k]>,
        w: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [s @ Stream, m, n]> {
        let partial: Tensor<T, [s @ Stream, d @ DIDx, m, n]> = matmul(a, w);
        sum(partial, 1)
    }

    /// A tensor-parallel decode step after attention as one call: the attention output's
    /// row-parallel projection + AllReduce + residual, the post-attention RMSNorm, and the
    /// gated MLP + AllReduce + residual. a `[d @ DIDx, m, k]` (this rank's heads), x `[m,
    /// h]` (the layer's input, the same on every rank), wo `[d @ DIDx, k, h]`, norm `[h]`
    /// (the norm's weight times `sqrt(h)`, f32), eps `[h]` (the norm's epsilon in every
    /// element, f32), wgu `[d @ DIDx, h, 2 f]` (this rank's gate and up columns side by side:
    /// one GEMM, faster than two at decode sizes), wd `[d @ DIDx, f, h]` -> the layer's
    /// output, `[m, h]` on every rank. The norm `y * rsqrt(mean(y^2) + eps) * w` is written
    /// as `y * rsqrt(sum(y^2 + eps)) * (sqrt(h) w)`, the same value, in f32.
    #[allow(dead_code)] // called through `decode_tail::executor()`, with output buffers
    pub fn decode_tail<T: Float, d, m, k, h, f>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        x: Tensor<T, [m, h]>,
        wo: Tensor<T, [d @ DIDx, k, h]>,
        norm: Tensor<f32, [h]>,
        eps: Tensor<f32, [h]>,
        wgu: Tensor<T, [d @ DIDx, h, 2 * f]>,
        wd: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [m, h]> {
        let o: Tensor<T, [d @ DIDx, m, h]> = matmul(a, wo);
        let y = x + sum(o, 0);
        let yf = cast(y, f32);
        let e: Tensor<f32, [1, h]> = broadcast(eps, [true, false]);
        let squares: Tensor<f32, [m]> = sum(yf * yf + e, 1);
        // rsqrt after the broadcast, so that it runs in the same kernel as the products.
        let s: Tensor<f32, [m, 1]> = broadcast(squares, [false, true]);
        let w: Tensor<f32, [1, h]> = broadcast(norm, [true, false]);
        let yn: Tensor<T, [1, m, h]> = broadcast(cast(yf * rsqrt(s) * w, T), [true, false, false]);
        let gate_up: Tensor<T, [d @ DIDx, m, 2 * f]> = matmul(yn, wgu);
        let gate = slice(gate_up, 2, 0, f);
        let up = slice(gate_up, 2, f, 2 * f);
        let partial: Tensor<T, [d @ DIDx, m, h]> = matmul(silu(gate) * up, wd);
        y + sum(partial, 0)
    }

    /// Column-parallel QKV projection of the gathered rows: x `[d @ DIDx, m, h]` (this
    /// rank's tokens), w `[d @ DIDx, h, q]` (this rank's heads' Q, K and V columns) ->
    /// every token's projection for this rank's heads, chunk by chunk as the rows arrive.
    #[allow(dead_code)] // called through `qkv::executor()`, with output buffers
    pub fn qkv<T: Float, d, m, h, q>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w: Tensor<T, [d @ DIDx, h, q]>,
    ) -> Tensor<T, [d @ Stream, d @ DIDx, m, q]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    /// Row-parallel attention-output projection + ReduceScatter: a `[d, d @ DIDx, m, f]`
    /// (every token, this rank's heads), w `[d @ DIDx, f, h]` (the matching rows of Wo^T)
    /// -> this rank's tokens of the summed projection.
    #[allow(dead_code)] // called through `out_proj::executor()`, with output buffers
    pub fn out_proj<T: Float, d, m, f, h>(
        a: Tensor<T, [d, d @ DIDx, m, f]>,
        w: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(a, w);
        sum(partial, 1)
    }
}

/// The chunks `row_parallel` splits `tokens` into: 4 where each chunk has enough rows for
/// the lowering to pipeline it (`AUTO_MIN_CHUNK_ROWS`), else 1 (decode: one GEMM and one
/// AllReduce).
pub fn row_chunks(tokens: usize) -> usize {
    let rows = fusion::compiler::lower::AUTO_MIN_CHUNK_ROWS;
    if tokens % 4 == 0 && tokens / 4 >= rows {
        4
    } else {
        1
    }
}
