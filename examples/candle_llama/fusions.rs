//! The tensor-parallel parts of a Llama decoder layer as fusions, in the layer's two forms.
//!
//! - Tensor-parallel: every rank holds every token (activations replicated). A decode step
//!   (`row_residual`, `mlp_residual`) makes two calls: the attention output's projection +
//!   AllReduce + residual, and the whole gated MLP (its gate and up GEMMs of this rank's FFN
//!   columns, SiLU and product, the down GEMM + AllReduce, the residual); Q, K and V are a
//!   local GEMM in candle. Steps of many tokens (`row_parallel`) keep the column-parallel
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

    /// Row-parallel projection + AllReduce + the residual, one step's tokens unchunked (a
    /// decode step): a `[d @ DIDx, m, k]` (this rank's block of the contracted dimension),
    /// res `[m, n]` (the residual stream, the same on every rank), w `[d @ DIDx, k, n]` ->
    /// `res` plus the sum over ranks of `a w`, on every rank. One call does what the layer
    /// did with a fusion and candle's add.
    #[allow(dead_code)] // called through `row_residual::executor()`, with output buffers
    pub fn row_residual<T: Float, d, m, k, n>(
        a: Tensor<T, [d @ DIDx, m, k]>,
        res: Tensor<T, [m, n]>,
        w: Tensor<T, [d @ DIDx, k, n]>,
    ) -> Tensor<T, [m, n]> {
        let partial: Tensor<T, [d @ DIDx, m, n]> = matmul(a, w);
        res + sum(partial, 0)
    }

    /// The SiLU-gated MLP of the tensor-parallel form with its residual, one step's tokens
    /// unchunked: hn `[d @ DIDx, m, h]` (the normed activation, the same on every rank),
    /// res `[m, h]`, wg and wu `[d @ DIDx, h, f]` (this rank's FFN columns), wd
    /// `[d @ DIDx, f, h]` (their rows of Wd^T) -> `res + sum_ranks((silu(hn wg) * (hn wu))
    /// wd)`. One call does what the layer did with candle's two GEMMs, SiLU, product and
    /// add and a fusion.
    #[allow(dead_code)] // called through `mlp_residual::executor()`, with output buffers
    pub fn mlp_residual<T: Float, d, m, h, f>(
        hn: Tensor<T, [d @ DIDx, m, h]>,
        res: Tensor<T, [m, h]>,
        wg: Tensor<T, [d @ DIDx, h, f]>,
        wu: Tensor<T, [d @ DIDx, h, f]>,
        wd: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [m, h]> {
        // Both GEMMs first, so that SiLU and the product run as one elementwise kernel.
        let gate: Tensor<T, [d @ DIDx, m, f]> = matmul(hn, wg);
        let up: Tensor<T, [d @ DIDx, m, f]> = matmul(hn, wu);
        let partial: Tensor<T, [d @ DIDx, m, h]> = matmul(silu(gate) * up, wd);
        res + sum(partial, 0)
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
