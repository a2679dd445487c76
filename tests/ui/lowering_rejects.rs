use fusion::prelude::*;

fusion! {
    /// Reshardings lowering cannot do, found before the world size is known.
    fn matmul_moves_a_shard<d, k, n>(
        a: Tensor<f32, [d @ DIDx, d, k]>,
        b: Tensor<f32, [k, n]>,
    ) -> Tensor<f32, [d, d @ DIDx, n]> {
        matmul(a, b)
    }

    fn sum_moves_a_shard<d, m>(a: Tensor<f32, [d @ DIDx, d, m]>) -> Tensor<f32, [d, d @ DIDx]> {
        sum(a, 2)
    }

    fn pipeline_across_meshes<m>(
        a: Tensor<f32, [2 @ DIDx, m], mesh = [0, 1]>,
    ) -> Tensor<f32, [2 @ Stream, m], mesh = [2, 3]> {
        a
    }

    fn meshes_of_two_sizes<h, m>(
        a: Tensor<f32, [h @ DIDx, m], mesh = [0, 1]>,
    ) -> Tensor<f32, [h @ DIDx, m], mesh = [1, 2, 3]> {
        let b: Tensor<f32, [h @ DIDx, m], mesh = [1, 2, 3]> = a;
        b
    }
}

fn main() {}
