//! The tensor-parallel blocks in `fusion!`, stamped per element type with `per_dtype!`
//! (`examples/common`): shared by the `tp_mlp` example and the layer benchmark.

/// Defines `mlp` and `gated_mlp` for element type `$dt`.
macro_rules! tp_blocks_in {
    ($dt:ident) => {
        use fusion::prelude::*;
        fusion! {
            /// `ReduceScatter(gelu(AllGather(x) W1) W2)`: the activation's Stream annotation
            /// makes x's DIDx axis the first matmul's Stream axis (rows gathered chunk by
            /// chunk) while W1's column blocks stay local.
            #[allow(dead_code)] // `main` calls `mlp::call`, which takes options
            pub fn mlp<d, m, h, f>(
                x: Tensor<$dt, [d @ DIDx, m, h]>,
                w1: Tensor<$dt, [d @ DIDx, h, f]>,
                w2: Tensor<$dt, [d @ DIDx, f, h]>,
            ) -> Tensor<$dt, [d @ DIDx, m, h]> {
                let act: Tensor<$dt, [d @ Stream, d @ DIDx, m, f]> =
                    gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w1));
                let partial: Tensor<$dt, [d @ Stream, d @ DIDx, m, h]> = matmul(act, w2);
                sum(partial, 1)
            }

            /// `ReduceScatter((silu(AG(x) Wg) * (AG(x) Wu)) Wd)`; both projections read one
            /// gather of the rows.
            #[allow(dead_code)]
            pub fn gated_mlp<d, m, h, f>(
                x: Tensor<$dt, [d @ DIDx, m, h]>,
                wg: Tensor<$dt, [d @ DIDx, h, f]>,
                wu: Tensor<$dt, [d @ DIDx, h, f]>,
                wd: Tensor<$dt, [d @ DIDx, f, h]>,
            ) -> Tensor<$dt, [d @ DIDx, m, h]> {
                let rows = broadcast(x, [false, true, false, false]);
                let act: Tensor<$dt, [d @ Stream, d @ DIDx, m, f]> =
                    silu(matmul(rows, wg)) * matmul(rows, wu);
                let partial: Tensor<$dt, [d @ Stream, d @ DIDx, m, h]> = matmul(act, wd);
                sum(partial, 1)
            }
        }
    };
}
