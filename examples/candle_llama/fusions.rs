//! The tensor-parallel parts of a Llama decoder layer as fusions, sequence-parallel over
//! the world: each rank holds `m` rows (tokens) of the layer's input and every weight is
//! split into one block per rank.

use fusion::prelude::*;

#[path = "../tp_mlp/blocks.rs"]
mod blocks;

/// The SiLU-gated MLP block `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`, the same
/// fusion the layer benchmark measures.
pub use blocks::gated_mlp;

fusion! {
    /// Column-parallel QKV projection of the gathered rows: x `[d @ DIDx, m, h]` (this
    /// rank's tokens), w `[d @ DIDx, h, q]` (this rank's heads' Q, K and V columns) ->
    /// every token's projection for this rank's heads, chunk by chunk as the rows arrive.
    pub fn qkv<T: Float, d, m, h, q>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w: Tensor<T, [d @ DIDx, h, q]>,
    ) -> Tensor<T, [d @ Stream, d @ DIDx, m, q]> {
        matmul(broadcast(x, [false, true, false, false]), w)
    }

    /// Row-parallel attention-output projection + ReduceScatter: a `[d, d @ DIDx, m, f]`
    /// (every token, this rank's heads), w `[d @ DIDx, f, h]` (the matching rows of Wo^T)
    /// -> this rank's tokens of the summed projection.
    pub fn out_proj<T: Float, d, m, f, h>(
        a: Tensor<T, [d, d @ DIDx, m, f]>,
        w: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(a, w);
        sum(partial, 1)
    }
}
