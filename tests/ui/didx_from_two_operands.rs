use fusion::prelude::*;

fusion! {
    /// Rows gathered by nobody: the matmul takes DIDx axes from `x` and from `w`, and no
    /// annotation makes one of them the Stream axis.
    fn column_parallel<d, m, h, f>(
        x: Tensor<f32, [d @ DIDx, m, h]>,
        w: Tensor<f32, [d @ DIDx, h, f]>,
    ) -> Tensor<f32, [d, d @ DIDx, m, f]> {
        gelu_tanh(matmul(broadcast(x, [false, true, false, false]), w))
    }
}

fn main() {}
