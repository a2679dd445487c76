use fusion::prelude::*;

fusion! {
    /// Each mistake is in an argument of an op, and the caret is on that argument.
    fn reduce_twice<m, n>(a: Tensor<f32, [m, n]>) -> Tensor<f32, [m]> {
        sum(a, [1, 1])
    }

    fn reduce_a_stream_axis<s, m>(a: Tensor<f32, [s, m]>) -> Tensor<f32, [m]> {
        let b: Tensor<f32, [s @ Stream, m]> = relu(a);
        max(b, [0])
    }

    fn select_out_of_range(a: Tensor<f32, [4, 8]>) -> Tensor<f32, [8]> {
        select(a, 0, 4)
    }

    fn slice_too_long(a: Tensor<f32, [4, 8]>) -> Tensor<f32, [4, 3]> {
        slice(a, 1, 6, 9)
    }

    fn view_of_a_sharded_axis<d, m>(a: Tensor<f32, [d @ DIDx, m]>) -> Tensor<f32, [m]> {
        select(a, 0, 0)
    }

    fn too_few_flags<m>(a: Tensor<f32, [m]>) -> Tensor<f32, [1, 1, m]> {
        broadcast(a, [true, false, false])
    }

    fn contract_a_sharded_axis<d, m>(
        a: Tensor<f32, [m, d]>,
        b: Tensor<f32, [d @ DIDx, m]>,
    ) -> Tensor<f32, [m, m]> {
        matmul(a, b)
    }

    fn weight_of_rank_one<m, k>(x: Tensor<f32, [m, k]>, w: Tensor<f32, [k]>) -> Tensor<f32, [m, k]> {
        linear(x, w)
    }
}

fn main() {}
