//! The tensor-parallel blocks in `fusion!`, one definition for every dtype: the `tp_mlp`
//! lesson's fusions, also included (with `#[path]`) by the layer benchmark and the candle
//! Llama layer.

use fusion::prelude::*;

fusion! {
    /// `ReduceScatter(gelu(AllGather(x) W1) W2)`: the activation's Stream annotation makes
    /// x's DIDx axis the first matmul's Stream axis (rows gathered chunk by chunk) while
    /// W1's column blocks stay local.
    #[allow(dead_code)] // callers use `mlp::call`, which takes options
    pub fn mlp<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        w1: Tensor<T, [d @ DIDx, h, f]>,
        w2: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
        sum(partial, 1)
    }

    /// `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`; both projections read one gather
    /// of the rows.
    #[allow(dead_code)]
    pub fn gated_mlp<T: Float, d, m, h, f>(
        x: Tensor<T, [d @ DIDx, m, h]>,
        wg: Tensor<T, [d @ DIDx, h, f]>,
        wu: Tensor<T, [d @ DIDx, h, f]>,
        wd: Tensor<T, [d @ DIDx, f, h]>,
    ) -> Tensor<T, [d @ DIDx, m, h]> {
        let rows = broadcast(x, [false, true, false, false]);
        let act: Tensor<T, [d @ Stream, d @ DIDx, m, f]> =
            silu(matmul(rows, wg)) * matmul(rows, wu);
        let partial: Tensor<T, [d @ Stream, d @ DIDx, m, h]> = matmul(act, wd);
        sum(partial, 1)
    }
}
